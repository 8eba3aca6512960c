"""kvpack's security layer: who (mTLS + pins), what (key files for the HMAC seal), when (replay ledger).

One job per module:

* :mod:`.tls` — TLS 1.3 mutual-auth contexts, exact ALPN, leaf pinning, verified channels
  (blocking and asyncio);
* :mod:`.secret_files` — the key-file contract (regular, no symlink, 0600-style mode, same inode
  between lstat and open, bounded size) and HMAC key parsing;
* :mod:`.ledger` — the durable replay ledger (C.9) and its degraded latch;
* :mod:`.probe` — the bind-time ledger-volume probe;
* :mod:`.config` — receiver (C.15) and producer config loaders;
* :mod:`.enroll` — cluster CA, node keys and certificates, pins, pairwise HMAC keys, configs.

Submodules are imported on demand so that importing :mod:`kvpack.security` stays cheap.
"""
