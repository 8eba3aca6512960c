"""Command groups of the ``kvpack`` CLI, one module each; every module defines ``register(sub)``.

Modules here must keep their top-level imports light (stdlib and kvpack.errors): heavy
dependencies (torch, transformers) are imported inside the command function.
"""
