"""Storage tier on S3: a sealed session bundle kept as an object in an S3-compatible bucket
(the ``s3`` kind of storage destination beside the ``ssh`` one in :mod:`.storage_tier`).

The same two-phase protocol and the same destination interface as the SSH tier
(:mod:`.transfer` drives both), mapped onto S3 so that every step is safe to re-run:

* ``prepare``: create (or find) the multipart upload of ``<prefix>session-bundles/<id>.bundle``,
  with the bundle's byte count and SHA-256 as object metadata;
* ``lookup``: committed (the final object exists, with the recorded size and SHA-256) /
  uploaded or prepared with the bytes of its *contiguous* uploaded parts (the resume
  offset: parts are durable once S3 acknowledged them) / absent;
* ``upload``: parts of ``part_bytes`` from the resume offset (which is always a part
  boundary); a crashed uploader resumes from the parts S3 holds (``ListParts``);
* ``commit``: if the final object exists with the recorded size and SHA-256, done (idempotent
  re-run); otherwise complete the multipart upload (``If-None-Match: *``), then read the
  object back and check its SHA-256 before answering ``committed`` (a mismatch deletes it);
* ``delete``: remove the final object and abort any upload of it;
* ``fetch``: GET the object (the source re-checks size and SHA-256).

The destination string is ``s3://bucket/prefix``; the endpoint and the credentials come from
the node config (``s3_endpoint``, ``s3_credentials_file``) or the usual environment (never
from the destination string or a journal).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Optional

from ..errors import MigrationError, StoreError
from . import failpoints
from . import machine as M

BUNDLE_PREFIX = "session-bundles/"
PART_BYTES = 8 << 20  # >= the 5 MiB S3 minimum for every part but the last


def parse_destination(destination: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of an ``s3://bucket/prefix`` destination."""
    if not destination.startswith("s3://"):
        raise MigrationError("usage", "an S3 storage destination is s3://bucket/prefix")
    bucket, _, prefix = destination[len("s3://") :].partition("/")
    if len(bucket) < 3 or not all(c.isalnum() or c in "-." for c in bucket):
        raise MigrationError("usage", f"bucket name {bucket!r} is not valid (3+ characters of [a-z0-9.-])")
    if ".." in prefix.split("/"):
        raise MigrationError("usage", "the S3 prefix must not contain '..'")
    return bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""


class S3Destination:
    """The destination interface of :mod:`.transfer` for one S3 bucket prefix."""

    def __init__(
        self, destination: str, *, endpoint: str | None = None, credentials_file: str | None = None, part_bytes: int = PART_BYTES, client: Any = None
    ) -> None:
        from ..store.s3 import make_client

        self.bucket, self.prefix = parse_destination(destination)
        self.part_bytes = max(5 << 20, part_bytes)
        try:
            self.client = client if client is not None else make_client(endpoint=endpoint, credentials_file=credentials_file)
        except StoreError as exc:
            raise MigrationError("usage", f"S3 destination: {exc.message}") from None

    def key(self, tid: str) -> str:
        return f"{self.prefix}{BUNDLE_PREFIX}{tid}.bundle"

    # -- S3 calls with one error contract ---------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kw)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404 or code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound"):
                raise FileNotFoundError(what) from None
            if status == 412 or code == "PreconditionFailed":
                raise FileExistsError(what) from None
            raise MigrationError("transport", f"s3 {what}: {code or status}") from None
        except BotoCoreError as exc:
            raise MigrationError("transport", f"s3 {what}: {type(exc).__name__}") from None

    def _head(self, tid: str) -> dict | None:
        try:
            return self._call("head", self.client.head_object, Bucket=self.bucket, Key=self.key(tid))
        except FileNotFoundError:
            return None

    def _upload_id(self, tid: str) -> str | None:
        resp = self._call("list-uploads", self.client.list_multipart_uploads, Bucket=self.bucket, Prefix=self.key(tid))
        ups = [u for u in resp.get("Uploads", ()) if u["Key"] == self.key(tid)]
        return sorted(ups, key=lambda u: u["Initiated"])[-1]["UploadId"] if ups else None

    def _parts(self, tid: str, upload: str) -> list[dict]:
        parts: list[dict] = []
        marker = 0
        while True:
            resp = self._call("list-parts", self.client.list_parts, Bucket=self.bucket, Key=self.key(tid), UploadId=upload, PartNumberMarker=marker)
            parts.extend(resp.get("Parts", ()))
            if not resp.get("IsTruncated"):
                return sorted(parts, key=lambda p: p["PartNumber"])
            marker = int(resp["NextPartNumberMarker"])

    def _contiguous(self, parts: list[dict], size: int) -> tuple[list[dict], int]:
        """The parts 1..n that are whole (and the bytes they hold): the resume offset."""
        good, total = [], 0
        for i, p in enumerate(parts, start=1):
            want = min(self.part_bytes, size - total)
            if p["PartNumber"] != i or int(p["Size"]) != want:
                break
            good.append(p)
            total += want
        return good, total

    def _committed(self, tid: str, rec: M.TransferRecord) -> bool:
        head = self._head(tid)
        if head is None:
            return False
        meta = head.get("Metadata", {})
        if int(head["ContentLength"]) != int(rec.bytes) or meta.get("sha256") != rec.sha256:
            raise MigrationError("integrity", f"S3 holds {tid} with other bytes")
        return True

    # -- destination interface -------------------------------------------------------------------------
    def lookup(self, rec: M.TransferRecord) -> tuple[Optional[M.Status], int]:
        tid = rec.id
        if self._committed(tid, rec):
            return M.COMMITTED, int(rec.bytes)
        upload = self._upload_id(tid)
        if upload is None:
            return None, 0
        _good, received = self._contiguous(self._parts(tid, upload), int(rec.bytes))
        if received == int(rec.bytes):
            return M.UPLOADED, received
        return M.PREPARED, received

    def prepare(self, rec: M.TransferRecord, identity: Optional[dict[str, Optional[str]]] = None) -> M.Status:
        tid = rec.id
        if self._committed(tid, rec):
            return M.COMMITTED
        if self._upload_id(tid) is None:
            meta = {"sha256": str(rec.sha256), "bytes": str(int(rec.bytes))}
            self._call("create-upload", self.client.create_multipart_upload, Bucket=self.bucket, Key=self.key(tid), Metadata=meta)
        return M.PREPARED

    def upload(self, rec: M.TransferRecord, path: str, offset: int, progress: Optional[Callable[[int], None]] = None) -> None:
        tid, size = rec.id, int(rec.bytes)
        upload = self._upload_id(tid)
        if upload is None:
            raise MigrationError("transport", "upload: no multipart upload prepared at the destination")
        if offset % self.part_bytes and offset != size:
            raise MigrationError("transport", f"upload: resume offset {offset} is not a part boundary")
        kill_at = failpoints.byte_threshold("source.upload")
        sent = offset
        with open(path, "rb") as fh:
            fh.seek(offset)
            number = offset // self.part_bytes + 1
            while sent < size:
                block = fh.read(min(self.part_bytes, size - sent))
                if not block:
                    raise MigrationError("integrity", "upload: the sealed payload is shorter than its record")
                self._call("upload-part", self.client.upload_part, Bucket=self.bucket, Key=self.key(tid), UploadId=upload, PartNumber=number, Body=block)
                sent += len(block)
                number += 1
                if progress:
                    progress(sent)
                if kill_at is not None and sent >= kill_at:
                    failpoints.die()

    def commit(self, rec: M.TransferRecord) -> M.Status:
        tid, size = rec.id, int(rec.bytes)
        if self._committed(tid, rec):
            return M.COMMITTED  # an idempotent re-run
        upload = self._upload_id(tid)
        if upload is None:
            raise MigrationError("transport", "commit: nothing uploaded")
        good, received = self._contiguous(self._parts(tid, upload), size)
        if received != size:
            raise MigrationError("transport", f"commit: {received} of {size} bytes uploaded")
        parts = [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in good]
        try:
            self._call(
                "complete-upload",
                self.client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=self.key(tid),
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except FileExistsError:
            pass  # completed by an earlier run whose reply was lost: checked below
        failpoints.hit("source.after_remote_commit")
        if hashlib.sha256(self.fetch_raw(rec)).hexdigest() != rec.sha256:
            self.delete(rec)
            raise MigrationError("integrity", "commit: the object S3 assembled differs in SHA-256 from the record")
        if not self._committed(tid, rec):
            raise MigrationError("transport", "commit: the object is not visible after completion")
        return M.COMMITTED

    def delete(self, rec: M.TransferRecord) -> None:
        tid = rec.id
        self._call("delete", self.client.delete_object, Bucket=self.bucket, Key=self.key(tid))
        while True:
            upload = self._upload_id(tid)
            if upload is None:
                return
            try:
                self._call("abort-upload", self.client.abort_multipart_upload, Bucket=self.bucket, Key=self.key(tid), UploadId=upload)
            except FileNotFoundError:
                return

    def fetch_raw(self, rec: M.TransferRecord) -> bytes:
        try:
            resp = self._call("get", self.client.get_object, Bucket=self.bucket, Key=self.key(rec.id))
        except FileNotFoundError:
            raise MigrationError("not_found", f"S3 holds no bundle for {rec.id}") from None
        return resp["Body"].read()

    def fetch(self, rec: M.TransferRecord) -> bytes:
        data = self.fetch_raw(rec)
        if len(data) != rec.bytes or hashlib.sha256(data).hexdigest() != rec.sha256:
            raise MigrationError("integrity", "fetched bundle differs in size or SHA-256 from the record")
        return data

    def close(self) -> None:
        pass
