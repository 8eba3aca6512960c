"""The pack store (save, find_deepest, restore, verify, repair, gc) on a storage environment:
a directory (:mod:`.posix`) or an S3-compatible bucket (:mod:`.s3`); see packstore.py."""

from .packstore import CutWithdrawn, Hit, Lookup, PackStore, RestoreReport, SaveReport, Unreadable

__all__ = ["CutWithdrawn", "Hit", "Lookup", "PackStore", "RestoreReport", "SaveReport", "Unreadable"]
