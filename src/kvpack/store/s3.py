"""The S3 storage environment: a store under ``s3://bucket/prefix`` on any S3-compatible
server (tested against SeaweedFS on loopback), through boto3.

How the store's guarantees map onto S3:

* a PUT is atomic (readers see the old object or the new one) and durable when it returns;
  objects above ``multipart_threshold`` are uploaded in parts, in parallel, and appear only
  when the upload completes;
* ``create_only`` is ``If-None-Match: *`` and ``write_if`` is ``If-Match: <ETag>`` (or
  ``If-None-Match: *``); the server answers 412 to the loser, so two writers never both win;
* large reads are parallel ranged GETs (``range_bytes`` each);
* leases are small objects ``leases/<random>.json`` naming the manifests they protect and
  their time to live, renewed by a background thread; gc never deletes an object younger
  than ``gc_grace_s`` and keeps every manifest a live lease protects, so neither a
  publication nor a restore in flight loses an object (docs/store.md "gc and leases");
* gc's sweep holds a lease ``leases/gc-<random>.json`` and rewrites the object ``gc.epoch``
  (random bytes: a new ETag) when it takes it, so a publisher can tell whether a sweep ran
  beside its publication (:meth:`S3Env.gc_seen`).

Credentials come from a 0600 credentials file (``--s3-credentials`` or
``KVPACK_S3_CREDENTIALS``) or the usual AWS environment variables; they are never written
to store.json, a receipt or a log. Transport failures become ``StoreError("io")`` with one
line naming the operation; a missing object is :class:`~kvpack.store.env.ObjectMissing`.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from ..errors import StoreError
from .env import GC, PUBLISH, Buffer, GcSeen, Lease, ReadBuffer, ObjectInfo, ObjectMissing, StorageEnv

DEFAULT_GRACE_S = 900.0
LEASE_TTL_S = 120.0
MULTIPART_THRESHOLD = 16 << 20
PART_BYTES = 8 << 20
RANGE_BYTES = 8 << 20
#: a lookup's small reads (S3Env.for_lookup): seconds per connect and per socket read, and
#: attempts (an index entry is 65 bytes: a healthy server answers in milliseconds)
LOOKUP_TIMEOUT_S = 5.0
LOOKUP_ATTEMPTS = 2
#: under a deadline (S3Env.with_deadline: a restore, a save) every request gets a client
#: whose per-attempt read timeout is one of these (seconds), the largest whose attempts,
#: connects and retry backoff fit in what is left of the deadline
DEADLINE_TIMEOUTS_S = (30.0, 16.0, 8.0, 4.0, 2.0, 1.0)
#: connect timeout of those clients, and the longest first-retry backoff botocore sleeps
DEADLINE_CONNECT_S = 1.0
DEADLINE_BACKOFF_S = 2.0
#: what a lease's release may still take once its deadline passed (one 1 s attempt)
RELEASE_GRACE_S = DEADLINE_CONNECT_S + 1.0
#: rewritten (random bytes, so a new ETag) by every gc sweep before it reads the leases
GC_EPOCH = "gc.epoch"
#: name prefix of the leases gc holds while it sweeps (publishers list them)
SWEEP_LEASES = "leases/gc-"


def load_credentials(path: str) -> dict[str, str]:
    """Access key id and secret from a protected (0600) file: JSON
    ``{"access_key_id": .., "secret_access_key": .., "session_token": ..}`` or the AWS INI
    form (``aws_access_key_id = ..`` lines, first profile)."""
    from ..errors import SecurityError
    from ..security.secret_files import read_protected_file

    try:
        text = read_protected_file(path, what="S3 credentials file", max_size=16384).decode("utf-8")
    except SecurityError as exc:
        raise StoreError("key", exc.message) from None
    except UnicodeDecodeError:
        raise StoreError("key", f"S3 credentials file {path!r} is not UTF-8") from None
    out: dict[str, str] = {}
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError:
            raise StoreError("key", f"S3 credentials file {path!r} is not valid JSON") from None
        out = {k: str(v) for k, v in raw.items() if k in ("access_key_id", "secret_access_key", "session_token")}
    else:
        names = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key", "aws_session_token": "session_token"}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() in names and names[key.strip()] not in out:
                out[names[key.strip()]] = value.strip()
    if not out.get("access_key_id") or not out.get("secret_access_key"):
        raise StoreError("key", f"S3 credentials file {path!r} lacks an access key id or secret")
    return out


class _S3Lease(Lease):
    """A lease object, renewed every ttl/3 until released.

    ``lazy``: a lease that protects nothing yet is not written until it does (its first
    :meth:`protect`): gc reads leases only for what they protect, so an empty lease object
    changes nothing for anyone, and a save that finds no parent wrote one PUT for nothing
    (its cut is protected right before its commit, which writes the object then)."""

    def __init__(self, env: "S3Env", purpose: str, protects: Sequence[str], *, prefix: str = "leases/", lazy: bool = False) -> None:
        self.env = env
        self.name = f"{prefix}{secrets.token_hex(12)}.json"
        self.purpose = purpose
        self.protects = list(protects)
        self.renewed = 0.0
        self.failed: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if not (lazy and not self.protects):
            self._start()

    def _start(self) -> None:
        self._write()
        self._thread = threading.Thread(target=self._renew_loop, name="kvpack-s3-lease", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        body = json.dumps({"purpose": self.purpose, "protects": self.protects, "ttl_s": self.env.lease_ttl_s, "pid": os.getpid()}).encode()
        with self._lock:
            self.env.write(self.name, body)
            self.renewed = time.monotonic()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.env.lease_ttl_s / 3):
            try:
                self._write()
            except StoreError as exc:
                self.failed = exc.message

    def protect(self, manifest_ids: Sequence[str]) -> None:
        new = [m for m in manifest_ids if m not in self.protects]
        if new:
            self.protects.extend(new)
            if self._thread is None:
                self._start()  # a lazy lease's first write
            else:
                self._write()

    def check(self) -> None:
        if self._thread is None:
            return  # not written yet: it protects nothing gc could take
        if time.monotonic() - self.renewed > self.env.lease_ttl_s * 0.8:
            raise StoreError("locked", f"lease {self.name} could not be renewed in time ({self.failed or 'stalled'}): gc may have moved on")

    def release(self) -> None:
        self._stop.set()
        if self._thread is None:
            return  # never written
        self._thread.join(timeout=5)
        try:
            self.env.for_release().delete(self.name)
        except StoreError:
            pass  # it expires on its own


class S3Env(StorageEnv):
    """A store under ``s3://bucket/prefix``. ``client`` is a boto3 S3 client."""

    def __init__(self, client: Any, bucket: str, prefix: str, *, endpoint: str | None = None, gc_grace_s: float | None = None) -> None:
        if len(bucket) < 3:
            raise StoreError("usage", "bucket names need at least 3 characters")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.location = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint = endpoint
        self.gc_grace_s = float(os.environ.get("KVPACK_S3_GC_GRACE_S", DEFAULT_GRACE_S)) if gc_grace_s is None else gc_grace_s
        self.lease_ttl_s = float(os.environ.get("KVPACK_S3_LEASE_TTL_S", LEASE_TTL_S))
        self.io_parallelism = 16
        # chunk objects are content-addressed and immutable: a save PUTs with If-None-Match
        # and looks at a stored copy only when the server answers 412, instead of a GET per
        # chunk first (16 fewer requests per 64 MiB save; docs/store.md "Performance")
        self.probe_before_create = False
        self.multipart_threshold = MULTIPART_THRESHOLD
        self.part_bytes = PART_BYTES
        self.range_bytes = RANGE_BYTES
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvpack-s3")
        #: how from_url made the client (for_lookup makes a quick one alike), and that one
        self._client_args: dict[str, Any] | None = None
        self._quick: S3Env | None = None
        self._quick_lock = threading.Lock()
        #: clients of :meth:`with_deadline` views, per (read timeout, attempts)
        self._deadline_clients: dict[tuple[float, int], Any] = {}

    @classmethod
    def from_url(cls, url: str, *, endpoint: str | None = None, credentials_file: str | None = None, gc_grace_s: float | None = None) -> "S3Env":
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise StoreError("usage", f"{url!r}: expected s3://bucket/prefix")
        env = cls(make_client(endpoint=endpoint, credentials_file=credentials_file), bucket, prefix, endpoint=endpoint, gc_grace_s=gc_grace_s)
        env._client_args = {"endpoint": endpoint, "credentials_file": credentials_file}
        return env

    def for_lookup(self) -> "S3Env":
        """This env with a client of short timeouts (``LOOKUP_TIMEOUT_S`` per connect and
        socket read, ``LOOKUP_ATTEMPTS`` attempts) for a lookup's small reads: the default
        client waits 30 s per read and tries 3 times, and a lookup against a hung server (it
        accepts connections and never answers) took 250 s to fall back to recomputing. Made
        once, on first use; an env built around a given client (no ``from_url``) keeps it."""
        if self._client_args is None:
            return self
        with self._quick_lock:
            if self._quick is None:
                quick = copy.copy(self)
                quick.client = make_client(**self._client_args, timeout_s=LOOKUP_TIMEOUT_S, attempts=LOOKUP_ATTEMPTS)
                quick._client_args = None
                self._quick = quick
            return self._quick

    def with_deadline(self, deadline: float) -> "S3Env":
        """This env with every request bounded by ``deadline`` (``time.monotonic()``): a
        request starts only before it, with a client whose timeouts and attempts fit in
        what is left (:func:`deadline_budget`), so a hung server costs the caller the
        deadline and at most ``DEADLINE_CONNECT_S + 1`` s more (a request started just
        before it), never 30 s x 3 per request. Past the deadline a request refuses at once
        (``io``). A view: it shares this env's thread pool and clients, and closing it
        closes nothing."""
        view: Any = copy.copy(self)
        view.__class__ = _DeadlineS3Env
        view._base = self
        view._deadline = deadline
        view._quick = None
        return view

    def for_release(self) -> "S3Env":
        """The env a lease's release deletes through (a deadline view: a short grace past it)."""
        return self

    def _deadline_client(self, timeout_s: float, attempts: int) -> Any:
        """A cached client of ``timeout_s`` per read and ``attempts`` attempts (made like
        the env's own: same endpoint and credentials)."""
        key = (timeout_s, attempts)
        with self._quick_lock:
            if key not in self._deadline_clients:
                args = self._client_args or {}
                client = make_client(**args, timeout_s=timeout_s, attempts=attempts, connect_timeout_s=DEADLINE_CONNECT_S)
                base_events = self.client.meta.events

                def forward(event_name: str, **kwargs: Any) -> Any:
                    # hooks registered on the env's own client ("before-send": request
                    # counters of the tests and bench_store_backends) see these requests too
                    return base_events.emit_until_response(event_name, **kwargs)[1]

                client.meta.events.register("before-send", forward)
                self._deadline_clients[key] = client
            return self._deadline_clients[key]

    def key(self, name: str) -> str:
        return self.prefix + name

    # -- error mapping -------------------------------------------------------------------------
    @contextmanager
    def _call(self, what: str, name: str = "") -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status == 404 or code in ("NoSuchKey", "404", "NotFound"):
                raise ObjectMissing(errno.ENOENT, "no such object", name) from None
            raise StoreError("io", f"s3 {what} {self.location}/{name}: {code or status}") from None
        except NoCredentialsError:
            raise StoreError(
                "key", "no S3 credentials: pass --s3-credentials FILE (0600; or KVPACK_S3_CREDENTIALS), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ) from None
        except BotoCoreError as exc:
            raise StoreError("io", f"s3 {what} {self.location}/{name}: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _range_not_satisfiable(exc: Exception) -> bool:
        """A ranged GET of an existing object that starts at or past its end (HTTP 416)."""
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return False
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return status == 416 or str(exc.response.get("Error", {}).get("Code", "")) == "InvalidRange"

    @staticmethod
    def _precondition_failed(exc: Exception) -> bool:
        from botocore.exceptions import ClientError

        if not isinstance(exc, ClientError):
            return False
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")

    # -- reads -------------------------------------------------------------------------------
    def read(self, name: str) -> bytes:
        with self._call("get", name):
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes=0-{self.range_bytes - 1}")
            except Exception as exc:
                if self._range_not_satisfiable(exc):
                    return b""  # an empty object (a decoder refuses it; a save rewrites it)
                raise
            first = resp["Body"].read()
        total = _total_from_range(resp.get("ContentRange"), len(first))
        if total <= len(first):
            return first
        # a large object: the rest in parallel ranged GETs
        offsets = range(len(first), total, self.range_bytes)
        parts = list(self._pool.map(lambda off: self.read_range(name, off, min(self.range_bytes, total - off)), offsets))
        return b"".join([first, *parts])

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        with self._call("get", name):
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={offset}-{offset + length - 1}")
            except Exception as exc:
                if self._range_not_satisfiable(exc):
                    return b""  # the object ends before offset (or is empty)
                raise
            return resp["Body"].read()

    def read_into(self, name: str, region: memoryview) -> tuple[ReadBuffer, int]:
        with self._call("get", name):
            resp = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
            size = int(resp.get("ContentLength", -1))
            body = resp["Body"]
            if size < 0 or size > len(region):
                data = body.read()
                return data, len(data)
            raw = body._raw_stream  # urllib3 response: readinto avoids a copy
            n = 0
            while n < size:
                got = raw.readinto(region[n:size])
                if not got:
                    break
                n += got
            return region[:n], n

    def stat(self, name: str) -> ObjectInfo | None:
        try:
            with self._call("head", name):
                h = self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except ObjectMissing:
            return None
        return ObjectInfo(name, int(h["ContentLength"]), h["LastModified"].timestamp(), h.get("ETag"))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        with self._call("list", prefix):
            pages = list(paginator.paginate(Bucket=self.bucket, Prefix=self.key(prefix)))
        for page in pages:
            for obj in page.get("Contents", ()):
                yield ObjectInfo(obj["Key"][len(self.prefix) :], int(obj["Size"]), obj["LastModified"].timestamp(), obj.get("ETag"))

    # -- writes ------------------------------------------------------------------------------
    def write(self, name: str, data: Buffer | Iterable[Buffer], *, create_only: bool = False, batch: bool = False) -> bool:
        body = data if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)  # parts: one copy
        body = bytes(body) if not isinstance(body, bytes) else body
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            with self._call("put", name):
                try:
                    if len(body) > self.multipart_threshold:
                        self._multipart(name, body, extra)
                    else:
                        self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=body, **extra)
                except Exception as exc:
                    if create_only and self._precondition_failed(exc):
                        return False
                    raise
        except ObjectMissing:
            raise StoreError("io", f"s3 put {self.location}/{name}: bucket missing") from None
        return True

    def _multipart(self, name: str, body: bytes, extra: dict) -> None:
        key = self.key(name)
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            offsets = list(range(0, len(body), self.part_bytes))

            def part(i_off: tuple[int, int]) -> dict:
                i, off = i_off
                r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=i + 1, Body=body[off : off + self.part_bytes])
                return {"PartNumber": i + 1, "ETag": r["ETag"]}

            parts = list(self._pool.map(part, enumerate(offsets)))
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}, **extra)
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            except Exception:
                pass  # gc's sweep_incomplete removes it later
            raise

    def delete(self, name: str, *, if_version: str | None = None, batch: bool = False) -> bool:
        extra = {"IfMatch": if_version} if if_version is not None else {}
        try:
            with self._call("delete", name):
                try:
                    self.client.delete_object(Bucket=self.bucket, Key=self.key(name), **extra)
                except Exception as exc:
                    if if_version is not None and self._precondition_failed(exc):
                        return False
                    raise
        except ObjectMissing:
            return False
        return True

    def read_versioned(self, name: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        try:
            with self._call("get", name):
                if max_bytes is None:
                    resp = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                    return resp["Body"].read(), resp["ETag"]
                try:
                    resp = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes=0-{max_bytes}")
                except Exception as exc:
                    if not self._range_not_satisfiable(exc):
                        raise
                    resp = self.client.get_object(Bucket=self.bucket, Key=self.key(name))  # an empty object
                return resp["Body"].read(max_bytes + 1), resp["ETag"]  # the whole object's ETag
        except ObjectMissing:
            return None

    def write_if(self, name: str, data: bytes, version: str | None) -> bool:
        extra = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            with self._call("put", name):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=bytes(data), **extra)
                except Exception as exc:
                    if self._precondition_failed(exc):
                        return False
                    raise
        except ObjectMissing:
            return False  # If-Match on an object that is gone
        return True

    # -- leases ------------------------------------------------------------------------------
    @contextmanager
    def lease(self, purpose: str, *, protects: Sequence[str] = ()) -> Iterator[Lease]:
        # a publisher's lease is written when it first protects something (its parent, or
        # its cut right before the commit): one PUT fewer per save (docs/store.md)
        held = _S3Lease(self, purpose, protects, lazy=purpose == PUBLISH)
        try:
            yield held
        finally:
            held.release()

    @contextmanager
    def sweeping(self) -> Iterator[Lease]:
        """The sweep lease first, then a new epoch: a publisher that reads the epoch before
        listing the sweep leases either sees this sweep's lease or a changed epoch, or it
        looked before the lease existed (and then this sweep reads the publisher's lease)."""
        held = _S3Lease(self, GC, (), prefix=SWEEP_LEASES)
        try:
            self.write(GC_EPOCH, secrets.token_hex(16).encode())
            yield held
        finally:
            held.release()

    def gc_seen(self) -> GcSeen:
        info = self.stat(GC_EPOCH)
        now = self.now()
        live = frozenset(i.name for i in self.list(SWEEP_LEASES) if now - i.mtime <= 2 * self.lease_ttl_s)
        return GcSeen(info.version if info is not None else None, live)

    def protected(self) -> set[str]:
        out: set[str] = set()
        now = self.now()
        for info in list(self.list("leases/")):
            if info.name.startswith(SWEEP_LEASES):
                if now - info.mtime > 2 * self.lease_ttl_s:
                    self.delete(info.name)  # a gc that died while sweeping
                continue  # protects nothing
            try:
                ttl, protects = _lease_body(self.read(info.name), self.lease_ttl_s)
            except FileNotFoundError:
                continue  # released meanwhile
            except ValueError:
                # damaged: protects nothing; nobody renews it once it is old
                if now - info.mtime > 2 * self.lease_ttl_s:
                    self.delete(info.name)
                continue
            if now - info.mtime > 2 * ttl:
                self.delete(info.name)  # its holder is gone
                continue
            out.update(protects)
        return out

    def now(self) -> float:
        return time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self) -> None:
        from botocore.exceptions import ClientError

        try:
            with self._call("head-bucket"):
                self.client.head_bucket(Bucket=self.bucket)
        except ObjectMissing:
            with self._call("create-bucket"):
                try:
                    self.client.create_bucket(Bucket=self.bucket)
                except ClientError as exc:
                    if "BucketAlready" not in str(exc.response.get("Error", {}).get("Code", "")):
                        raise

    def sweep_incomplete(self, older_than: float) -> int:
        n = 0
        with self._call("list-uploads"):
            resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        for up in resp.get("Uploads", ()):
            if up["Initiated"].timestamp() < older_than:
                with self._call("abort-upload", up["Key"]):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                n += 1
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def deadline_budget(left: float) -> tuple[float, int]:
    """``(read timeout, attempts)`` for a request with ``left`` seconds of its deadline:
    the largest ``DEADLINE_TIMEOUTS_S`` entry whose worst case (``attempts`` x (connect +
    read) plus the retry backoff) fits; two attempts when they fit, else one; with less
    than the smallest worst case left, one attempt of the smallest timeout (at most
    ``DEADLINE_CONNECT_S + 1`` s)."""
    for attempts in (2, 1):
        for t in DEADLINE_TIMEOUTS_S:
            if attempts * (DEADLINE_CONNECT_S + t) + (attempts - 1) * DEADLINE_BACKOFF_S <= left:
                return t, attempts
    return DEADLINE_TIMEOUTS_S[-1], 1


class _DeadlineS3Env(S3Env):
    """:meth:`S3Env.with_deadline`'s view: ``client`` is chosen per request from what is
    left of the deadline, and refuses (``io``) once it passed."""

    _base: S3Env
    _deadline: float

    @property
    def client(self) -> Any:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise StoreError("io", f"s3 {self.location}: the operation's deadline passed (the server answered too slowly or not at all)")
        if self._base._client_args is None:
            return self._base.client  # an env around a given client: its own timeouts
        return self._base._deadline_client(*deadline_budget(left))

    @client.setter
    def client(self, value: Any) -> None:
        pass  # set by copy.copy / __init__ of the base: the view never keeps one

    def with_deadline(self, deadline: float) -> "S3Env":
        return self._base.with_deadline(min(deadline, self._deadline))

    def for_lookup(self) -> "S3Env":
        return self  # already bounded

    def for_release(self) -> "S3Env":
        return self._base.with_deadline(max(self._deadline, time.monotonic() + RELEASE_GRACE_S))

    def close(self) -> None:
        pass  # the base env owns the pool and the clients


def _lease_body(data: bytes, default_ttl: float) -> tuple[float, list[str]]:
    """``(ttl_s, protects)`` of a lease object; ValueError if it is not what _S3Lease writes
    (a JSON object, ``ttl_s`` a positive finite number, ``protects`` a list of strings)."""
    import math

    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("not JSON") from None
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    ttl = raw.get("ttl_s", default_ttl)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        raise ValueError("ttl_s is not a positive number")
    protects = raw.get("protects", [])
    if not isinstance(protects, list) or not all(isinstance(m, str) for m in protects):
        raise ValueError("protects is not a list of manifest ids")
    return float(ttl), protects


def _total_from_range(content_range: str | None, got: int) -> int:
    """The object size from a ``Content-Range: bytes a-b/total`` header."""
    if content_range and "/" in content_range:
        total = content_range.rpartition("/")[2]
        if total.isdigit():
            return int(total)
    return got


def check_endpoint(endpoint: str) -> None:
    """Refuse (``usage``) an endpoint that is not ``http(s)://host[:port]``: boto3 raises a
    bare ValueError for some (the CLI printed it as an internal error) and takes others as
    a host name it later fails to reach."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(endpoint)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or out of range
        ok = False
    if not ok:
        raise StoreError("usage", f"S3 endpoint {endpoint!r} is not an http(s)://host[:port] URL (--endpoint or KVPACK_S3_ENDPOINT)")


def make_client(
    *, endpoint: str | None = None, credentials_file: str | None = None, timeout_s: float = 30.0, attempts: int = 3, connect_timeout_s: float | None = None
) -> Any:
    """A boto3 S3 client: path-style addressing, ``attempts`` attempts per request in all,
    ``timeout_s`` per socket read (and at most 10 s per connect), no extra checksums
    (kvpack verifies SHA-256 digests itself). Credentials from the file, else the
    AWS environment variables (boto3's own chain)."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint or os.environ.get("KVPACK_S3_ENDPOINT") or None
    if endpoint is not None:
        check_endpoint(endpoint)
    credentials_file = credentials_file or os.environ.get("KVPACK_S3_CREDENTIALS") or None
    creds: dict[str, str] = load_credentials(credentials_file) if credentials_file else {}
    config = Config(
        s3={"addressing_style": "path"},
        # total attempts, the first included: botocore reads "max_attempts" as retries after
        # the first, so attempts=3 made 4 and the readiness probe's attempts=1 made 2
        retries={"total_max_attempts": attempts, "mode": "standard"},
        connect_timeout=min(10.0, timeout_s) if connect_timeout_s is None else connect_timeout_s,
        read_timeout=timeout_s,
        max_pool_connections=32,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        aws_access_key_id=creds.get("access_key_id"),
        aws_secret_access_key=creds.get("secret_access_key"),
        aws_session_token=creds.get("session_token"),
        config=config,
    )
