"""Where a store lives: a directory path or ``s3://bucket/prefix``; creating and opening one.

Every CLI verb that takes a store takes either form (``--endpoint URL`` for S3; credentials
come from the usual AWS environment variables or a 0600 credentials file, never from
store.json, a command line or a log). ``init`` refuses before it writes anything it cannot
finish: a root key file that breaks its contract, an existing store, a bad chunk size; and
if a step fails after the first write, what it wrote is removed again, so a refused ``init``
leaves no partial store behind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from ..durable import REAL_OPS, FileOps
from ..errors import FormatError, KvpackError, SecurityError, StoreError
from ..format import constants as C
from ..rootkey import create_root_key, load_root_key
from .env import ObjectMissing, StorageEnv
from .packstore import DEFAULT_CHUNK_BYTES, STORE_FORMAT, STORE_VERSION, PackStore

S3_SCHEME = "s3://"
#: store.json's root_key_file value for stores whose key never lives beside them (S3)
EXTERNAL_KEY = "external"


def is_s3(location: str) -> bool:
    return location.startswith(S3_SCHEME)


def make_env(location: str | StorageEnv, *, ops: FileOps = REAL_OPS, endpoint: str | None = None, credentials_file: str | None = None) -> StorageEnv:
    """The storage environment for a location string (or the env itself)."""
    if isinstance(location, StorageEnv):
        return location
    if is_s3(location):
        from .s3 import S3Env

        return S3Env.from_url(location, endpoint=endpoint, credentials_file=credentials_file)
    return _posix(location, ops)


def _posix(path: str, ops: FileOps) -> StorageEnv:
    from .posix import PosixEnv

    return PosixEnv(path, ops=ops)


def key_check(root: bytes) -> str:
    """A value in store.json that tells a wrong root key from a damaged store (like restic's
    "wrong password"): HMAC-SHA256(root, label), 128 bits; it reveals nothing about the root."""
    return hmac.new(root, b"kvpack store key check v1", hashlib.sha256).hexdigest()[:32]


def _load_key(path: str) -> bytes:
    try:
        return load_root_key(path)
    except SecurityError as exc:
        raise StoreError("key", exc.message) from None


#: object prefixes only a store writes: a location holding any of them has a store in it
STORE_PREFIXES = ("index/", "packs/", "logits/", "chunks/")


def holds_store_objects(env: StorageEnv) -> bool:
    """Whether the location holds objects of a store (whatever store.json says)."""
    for prefix in STORE_PREFIXES:
        try:
            for _info in env.list(prefix):
                return True
        except ObjectMissing:
            return False  # no bucket
    return False


def _lost_config(env: StorageEnv) -> str:
    return (
        f"{env.location} holds store objects but no store.json (lost or deleted): restore store.json "
        "from a backup (it holds no secret); 'kvpack store init' refuses to create a new store over them"
    )


def _read_config(env: StorageEnv) -> dict:
    try:
        config = json.loads(env.read("store.json"))
    except ObjectMissing:
        if holds_store_objects(env):
            raise StoreError("corrupt", _lost_config(env)) from None
        raise StoreError("no_store", f"{env.location} is not a kvpack store (no store.json); run 'kvpack store init'") from None
    except ValueError as exc:
        raise StoreError("corrupt", f"{env.location}/store.json unreadable: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != STORE_FORMAT or config.get("version") != STORE_VERSION:
        raise StoreError("corrupt", f"{env.location}/store.json: unknown store format/version")
    _check_config_fields(env, config)
    return config


def _check_config_fields(env: StorageEnv, config: dict) -> None:
    """The fields PackStore reads, with their types and ranges: a hand-edited or damaged
    store.json is one ``corrupt`` line naming the field (before: a missing ``tenant`` was a
    KeyError, printed as an internal error)."""

    def bad(field: str, want: str) -> StoreError:
        return StoreError("corrupt", f"{env.location}/store.json: {field!r} is missing or not {want} (got {config.get(field)!r:.60})")

    if not isinstance(config.get("tenant"), str) or not config["tenant"]:
        raise bad("tenant", "a non-empty string")
    epoch = config.get("key_epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 1 <= epoch < 1 << 64:
        raise bad("key_epoch", "an integer from 1 to 2**64-1")
    if not isinstance(config.get("encrypted"), bool):
        raise bad("encrypted", "true or false")
    chunk = config.get("chunk_bytes", DEFAULT_CHUNK_BYTES)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= C.MAX_CHUNK_PLAINTEXT:
        raise bad("chunk_bytes", "an integer from 1 to 4 MiB")


def open_store(
    location: str | StorageEnv,
    *,
    root_key_file: str | None = None,
    ops: FileOps = REAL_OPS,
    endpoint: str | None = None,
    credentials_file: str | None = None,
) -> PackStore:
    env = make_env(location, ops=ops, endpoint=endpoint, credentials_file=credentials_file)
    try:
        config = _read_config(env)
        key_path = root_key_file or os.environ.get("KVPACK_ROOT_KEY_FILE") or config.get("root_key_file") or "root.key"
        if key_path == EXTERNAL_KEY:
            raise StoreError("key", f"{env.location} keeps its root key outside the store: pass --root-key-file (or set KVPACK_ROOT_KEY_FILE)")
        if not os.path.isabs(key_path):
            if is_s3(env.location):
                raise StoreError("key", "an S3 store needs an absolute --root-key-file")
            key_path = os.path.join(env.location, key_path)
        root = _load_key(key_path)
        expected = config.get("key_check")
        if isinstance(expected, str) and not hmac.compare_digest(expected, key_check(root)):
            raise StoreError("wrong_key", f"the root key {key_path!r} does not open {env.location} (store.json's key check differs)")
        store = PackStore(env, config, root)
        if not isinstance(expected, str):
            _check_key_by_packs(store, key_path)
        return store
    except BaseException:
        if not isinstance(location, StorageEnv):
            env.close()
        raise


#: index entries whose packs a store without a key check in store.json is tried on
KEY_PROBE_CUTS = 3


def _check_key_by_packs(store: PackStore, key_path: str) -> None:
    """A store.json without a key check (written before kvpack recorded one) cannot tell a
    wrong root key from damage: under a wrong key every pack fails authentication, and
    healing would quarantine every cut. Refuse ``wrong_key`` when none of the first
    :data:`KEY_PROBE_CUTS` indexed cuts' packs authenticates under this key (an empty store
    opens)."""
    from ..format.pack import decode_pack

    tried = 0
    for info in store.env.list("index/"):
        if tried >= KEY_PROBE_CUTS:
            break
        try:
            mid = store._read_index(bytes.fromhex(info.name.rpartition("/")[2]))
            data = store.env.read(f"packs/{mid.hex()}.kvpkp") if mid is not None else None
        except (ValueError, StoreError, ObjectMissing):
            continue  # malformed or incomplete: says nothing about the key
        if data is None:
            continue
        tried += 1
        try:
            decode_pack(data, store.keys)
            return  # one pack authenticates: the key is right
        except FormatError as exc:
            if exc.category != "authentication":
                return  # damage of another kind (the key may well be right)
    if tried:
        raise StoreError(
            "wrong_key",
            f"the root key {key_path!r} authenticates none of the {tried} cut(s) of {store.path} tried "
            "(store.json has no key check: written before kvpack recorded one)",
        )


def init_store(
    location: str | StorageEnv,
    *,
    tenant: str = "default",
    encrypted: bool = False,
    root_key_file: str | None = None,
    key_epoch: int = 1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ops: FileOps = REAL_OPS,
    endpoint: str | None = None,
    credentials_file: str | None = None,
) -> PackStore:
    if not 1 <= chunk_bytes <= C.MAX_CHUNK_PLAINTEXT:
        raise StoreError("usage", "chunk size must be 1..4 MiB")
    if not tenant:
        raise StoreError("usage", "tenant name must not be empty")
    env = make_env(location, ops=ops, endpoint=endpoint, credentials_file=credentials_file)
    remote = is_s3(env.location)
    if env.exists("store.json"):
        raise StoreError("usage", f"{env.location} already holds a store")
    if holds_store_objects(env):
        # a store whose store.json is gone: a new one over it (another chunk size, plain
        # where it was encrypted, a fresh key check) would silently mix with its objects
        raise StoreError("usage", _lost_config(env))
    if root_key_file is None and remote:
        raise StoreError("usage", "an S3 store keeps its root key outside the bucket: pass --root-key-file (created 0600 if missing)")
    key_path = os.path.abspath(root_key_file) if root_key_file else os.path.join(env.location, "root.key")
    key_ref = EXTERNAL_KEY if remote else (key_path if root_key_file else "root.key")
    # refuse a bad existing key before anything is written
    key_exists = os.path.lexists(key_path)
    root = _load_key(key_path) if key_exists else None
    dir_existed = remote or os.path.exists(env.location)
    config = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        "tenant": tenant,
        "key_epoch": key_epoch,
        "encrypted": encrypted,
        "chunk_bytes": chunk_bytes,
        "root_key_file": key_ref,
    }
    wrote_config = False
    try:
        env.setup()
        if root is None:
            root = create_root_key(key_path)
        config["key_check"] = key_check(root)
        if not env.write("store.json", json.dumps(config, indent=2, sort_keys=True).encode() + b"\n", create_only=True):
            raise StoreError("usage", f"{env.location} already holds a store (created concurrently)")
        wrote_config = True
        return open_store(env, root_key_file=key_path if remote or root_key_file else None)
    except BaseException as exc:
        _undo_init(env, key_path if not key_exists else None, dir_existed, wrote_config=wrote_config)
        if isinstance(exc, KvpackError):
            raise
        if isinstance(exc, OSError):
            raise StoreError("io", f"init {env.location}: {exc.strerror or exc}") from None
        raise


def _undo_init(env: StorageEnv, created_key: str | None, dir_existed: bool, *, wrote_config: bool) -> None:
    """Remove what a refused init wrote (best effort; the refusal itself is what matters)."""
    try:
        if wrote_config:
            env.delete("store.json")
        env.destroy_empty()
        if created_key:
            try:
                os.unlink(created_key)
            except FileNotFoundError:
                pass
        if not dir_existed:
            try:
                os.rmdir(env.location)
            except OSError:
                pass
    except OSError:
        pass


def open_or_init(location: str, *, root_key_file: str | None = None, endpoint: str | None = None, credentials_file: str | None = None) -> PackStore:
    """Open the store at ``location`` (a directory or ``s3://bucket/prefix``), or create it
    if nothing is there (``kvpack generate`` and the node daemons' ``--store``). A location
    holding store objects without store.json is opened, which refuses it (never re-created)."""
    env = make_env(location, endpoint=endpoint, credentials_file=credentials_file)
    try:
        if env.exists("store.json") or holds_store_objects(env):
            return open_store(env, root_key_file=root_key_file)
        return init_store(env, root_key_file=root_key_file)
    except BaseException:
        env.close()
        raise


def store_kwargs(args: Any) -> dict:
    """The opening arguments a CLI verb passes on (``--root-key-file``, ``--endpoint``,
    ``--s3-credentials``)."""
    return {
        "root_key_file": getattr(args, "root_key_file", None),
        "endpoint": getattr(args, "endpoint", None),
        "credentials_file": getattr(args, "s3_credentials", None),
    }
