"""The filesystem pack store (save, find_deepest, restore, verify, gc); see packstore.py."""

from .packstore import Hit, PackStore, RestoreReport, SaveReport

__all__ = ["Hit", "PackStore", "RestoreReport", "SaveReport"]
