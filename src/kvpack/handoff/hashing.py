"""Where the handoff core's hashing runs: on an executor its driver passes in.

Why it exists: the sender and receiver state machines hash every payload twice (the segment
digest and the running payload digest). On large payloads the two passes can run at once on
helper threads (hashlib releases the GIL), but *threads are the driver's business*: a pure
core that started its own pool leaked threads into every importer and hung forked children
that inherited a pool without its threads (fixed once in 9d28fc6, removed for good here).
So the core takes a :class:`concurrent.futures.Executor` as a parameter; the default,
:data:`INLINE`, runs each call at once on the calling thread.

What it must never do: create a thread, a pool or any process-wide state. A daemon or a
benchmark that wants parallel hashing owns a ``ThreadPoolExecutor`` and passes it in.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

_T = TypeVar("_T")


class InlineExecutor(Executor):
    """Runs every submitted call immediately, on the submitting thread; the returned future
    is already done (its result or its exception). Stateless: one shared instance serves."""

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # the caller sees it through the future, like a pool
            future.set_exception(exc)
        else:
            future.set_result(result)
        return future


#: The default executor of the handoff core: no threads.
INLINE = InlineExecutor()

__all__ = ["INLINE", "InlineExecutor"]
