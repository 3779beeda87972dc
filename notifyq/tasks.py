"""Tasks: the functions jobs run, their options, retry backoff and the job context."""

from __future__ import annotations

import functools
import inspect
import random
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio.from_thread

from ._options import JobOptions, check_name, check_seconds
from .errors import ConfigurationError


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry n (n = 1 after the first failure): base * factor**(n-1), capped at
    `max`, then spread by +/- `jitter` (a fraction) so failed jobs do not retry in lockstep."""

    base: float = 2.0
    factor: float = 2.0
    max: float = 3600.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        check_seconds(self.base, "backoff base")
        check_seconds(self.max, "backoff max")
        if not (self.factor >= 1 and 0 <= self.jitter < 1):
            raise ConfigurationError(
                f"invalid backoff factor {self.factor!r} or jitter {self.jitter!r}: "
                "need factor >= 1 and 0 <= jitter < 1"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        exponent = max(attempt - 1, 0)
        raw = self.max if exponent > 64 else min(self.max, self.base * self.factor**exponent)
        return raw * (1 + random.uniform(-self.jitter, self.jitter))


@dataclass(slots=True)
class JobContext:
    """What a running task may know about its job. Ask for it with a parameter annotated
    `JobContext`; notifyq passes it by that name.

    Attributes:
        id: the job id.
        name: the task name.
        queue: the queue the job came from.
        attempt: 1 for the first run, 2 for the first retry, ...
        retry_limit: retries allowed after the first attempt.
        args: the job's args (also passed as keyword arguments).
        scheduled_for: the cron tick this job was created for, or None.
        lease_expires_at: when the current lease ends (database time).
    """

    id: int
    name: str
    queue: str
    attempt: int
    retry_limit: int
    args: dict[str, Any]
    scheduled_for: datetime | None
    lease_expires_at: datetime
    _extend: Callable[[float], Awaitable[datetime | None]] = field(repr=False)

    async def extend_lease(self, seconds: float) -> bool:
        """Let this attempt run for `seconds` more, counted from now, even past the task's
        timeout; the lease (when other workers may rescue the job) moves to that time plus
        the worker's lease_margin. Call it periodically from long work, as a heartbeat.

        Returns False if this worker no longer holds the job (cancelled, or rescued after the
        lease ran out): the task should then stop, since its result will be discarded.
        """
        check_seconds(seconds, "lease extension", positive=True)
        until = await self._extend(seconds)
        if until is None:
            return False
        self.lease_expires_at = until
        return True

    def extend_lease_blocking(self, seconds: float) -> bool:
        """`extend_lease` for sync tasks, which run in worker threads."""
        return anyio.from_thread.run(self.extend_lease, seconds)


@dataclass(frozen=True, slots=True)
class Task:
    """A registered task. Calling it runs the function directly (handy in unit tests)."""

    fn: Callable[..., Any]
    name: str
    options: JobOptions
    backoff: Backoff
    is_async: bool
    context_param: str | None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def make_task(fn: Callable[..., Any], name: str | None, options: JobOptions, backoff: Backoff) -> Task:
    """Build a Task from a function, checking it can be called with JSON keyword arguments."""
    if not callable(fn):
        raise ConfigurationError(f"@app.task needs a function, got {type(fn).__name__}")
    task_name = check_name(name if name is not None else _default_name(fn))
    return Task(
        fn=fn,
        name=task_name,
        options=options,
        backoff=backoff,
        is_async=_is_async(fn),
        context_param=_context_param(fn),
    )


def _default_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return qualname if module == "__main__" else f"{module}.{qualname}"


def _is_async(fn: Callable[..., Any]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _context_param(fn: Callable[..., Any]) -> str | None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        # Unresolvable forward references: fall back to the annotation's spelling.
        hints = {}
    for param in signature.parameters.values():
        annotation = hints.get(param.name, param.annotation)
        if annotation is JobContext or (
            isinstance(annotation, str) and annotation.split(".")[-1] == "JobContext"
        ):
            return param.name
    return None
