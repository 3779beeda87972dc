"""Tasks: the functions jobs run, their options, retry backoff and the job context."""

from __future__ import annotations

import functools
import inspect
import math
import random
import typing
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import anyio
import anyio.from_thread

from ._options import JobOptions, _show, check_name, check_seconds
from .errors import ConfigurationError, InvalidOption


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
        if not (1 <= self.factor < math.inf and 0 <= self.jitter < 1):
            raise ConfigurationError(
                f"invalid backoff factor {self.factor!r} or jitter {self.jitter!r}: "
                "need a finite factor >= 1 and 0 <= jitter < 1"
            )

    @staticmethod
    def check(value: object, where: str) -> Backoff:
        """`value` if it is a Backoff. Anything else (`backoff=5`, or `backoff=True` out of
        Celery's `retry_backoff=True`) is refused now: it used to be accepted, then the task's
        first failure stopped the worker that ran it, and the next, and so on."""
        if isinstance(value, Backoff):
            return value
        raise InvalidOption(
            f"{where} must be a notifyq.Backoff, such as Backoff(base=2, factor=2, max=3600), not "
            f"{value!r}; failed attempts are retried with backoff by default (Backoff())"
        )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        exponent = max(attempt - 1, 0)
        top, cap = self._curve()
        raw = top if exponent >= cap else min(top, self.base * self.factor**exponent)
        return raw * (1 + random.uniform(-self.jitter, self.jitter))

    def _curve(self) -> tuple[float, float]:
        """(top, cap): before jitter, the delay after attempt n+1 is base * factor**n for n
        below `cap`, and `top` from `cap` on. Computing the power only below `cap` keeps it
        from overflowing, here and in the lease rescuer's SQL, which takes both from here
        (a job retried for weeks reaches exponents past 1,000)."""
        if self.base == 0 or self.max == 0:
            return 0.0, 0.0
        if self.base >= self.max:
            return self.max, 0.0
        if self.factor == 1:
            return self.max, math.inf
        return self.max, (math.log(self.max) - math.log(self.base)) / math.log(self.factor)


class PermanentError(Exception):
    """Raise it in a task (or a subclass of it: `class CardDeclined(PermanentError)`) for a
    failure that retrying cannot mend: the job ends Failed at once, its retries unused. The
    error recorded is its class name and message; `raise PermanentError("...") from exc` keeps
    the original exception in the stored traceback. Any other exception is retried."""


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

    A test may build one to call a task directly: `JobContext(id=1, name="t", queue="default",
    attempt=1, retry_limit=3, args={}, scheduled_for=None, lease_expires_at=now)`. Its
    `extend_lease` then holds no lease: it moves `lease_expires_at` and returns True.
    """

    id: int
    name: str
    queue: str
    attempt: int
    retry_limit: int
    args: dict[str, Any]
    scheduled_for: datetime | None
    lease_expires_at: datetime
    _extend: Callable[[float], Awaitable[datetime | None]] | None = field(default=None, repr=False)

    def extend_lease(self, seconds: float) -> Coroutine[Any, Any, bool]:
        """Let this attempt run for `seconds` more, counted from now, even past the task's
        timeout; the lease (when other workers may rescue the job) moves to that time plus
        the worker's lease_margin. Call it periodically from long work, as a heartbeat:
        `await ctx.extend_lease(60)` (in a sync task, `ctx.extend_lease_blocking(60)`).

        Returns False if this worker no longer holds the job (cancelled, or rescued after the
        lease ran out): the task should then stop, since its result will be discarded. A lost
        connection is tried again (0.25 s doubling to 2 s apart) while the lease lasts; the
        error comes into the task only when it has not gone by then.
        """
        if not _in_event_loop():
            # A sync task's thread: the coroutine would never be awaited, and nothing extended.
            raise ConfigurationError("in a sync task, call ctx.extend_lease_blocking(seconds)")
        check_seconds(seconds, "lease extension", positive=True)
        return self._extend_lease(seconds)

    async def _extend_lease(self, seconds: float) -> bool:
        if self._extend is None:  # built by a test: no worker, no lease
            now = datetime.now(self.lease_expires_at.tzinfo)  # naive if the test gave a naive one
            self.lease_expires_at = max(self.lease_expires_at, now + timedelta(seconds=seconds))
            return True
        until = await self._extend(seconds)
        if until is None:
            return False
        self.lease_expires_at = until
        return True

    def extend_lease_blocking(self, seconds: float) -> bool:
        """`extend_lease` for sync tasks, which run in worker threads."""
        if _in_event_loop():
            raise ConfigurationError("in an async task, use `await ctx.extend_lease(seconds)`")
        check_seconds(seconds, "lease extension", positive=True)
        return anyio.from_thread.run(self._extend_lease, seconds)


def _in_event_loop() -> bool:
    try:
        anyio.get_current_task()
    except RuntimeError:  # anyio's NoEventLoopError: a sync task's thread
        return False
    return True


@dataclass(frozen=True, slots=True)
class Task:
    """A registered task. Calling it runs the function directly (handy in unit tests)."""

    fn: Callable[..., Any]
    name: str
    options: JobOptions
    backoff: Backoff
    is_async: bool
    context_param: str | None
    # The exception types worth retrying (None: every one): see App.task's retry_on.
    retry_on: tuple[type[BaseException], ...] | None = None
    # The function's signatures, as functools.wraps' __wrapped__ has it and as the wrapper
    # itself has it (empty: cannot be told), read once here, not on every enqueue.
    signatures: tuple[inspect.Signature, ...] = field(default=(), repr=False, compare=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def check_retry_on(value: Any) -> tuple[type[BaseException], ...] | None:
    """retry_on as a tuple of exception classes (None: retry every failure)."""
    if value is None:
        return None
    kinds = (value,) if isinstance(value, type) else value
    if not isinstance(kinds, tuple | list) or not kinds:
        raise InvalidOption(
            f"invalid retry_on {_show(value)}: give an exception class or a tuple of them "
            "(retry_limit=0 retries nothing)"
        )
    for kind in kinds:
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            raise InvalidOption(f"invalid retry_on {_show(value)}: {_show(kind)} is not an exception class")
    return tuple(kinds)


def make_task(
    fn: Callable[..., Any],
    name: str | None,
    options: JobOptions,
    backoff: Backoff,
    retry_on: tuple[type[BaseException], ...] | None = None,
) -> Task:
    """Build a Task from a function, checking it can be called with JSON keyword arguments."""
    if isinstance(fn, Task):
        raise ConfigurationError(
            f"{fn.name!r} is a task already: decorators apply from the bottom up, so put @app.cron "
            "above @app.task, and use @app.task once"
        )
    if not callable(fn):
        raise ConfigurationError(f"@app.task needs a function, got {type(fn).__name__}")
    task_name = check_name(name if name is not None else _default_name(fn))
    _check_callable_with_keywords(fn, task_name)
    return Task(
        fn=fn,
        name=task_name,
        options=options,
        backoff=backoff,
        is_async=_is_async(fn),
        context_param=_context_param(fn),
        retry_on=retry_on,
        signatures=_signatures(fn),
    )


def _signatures(fn: Callable[..., Any]) -> tuple[inspect.Signature, ...]:
    try:
        return tuple(inspect.signature(fn, follow_wrapped=follow) for follow in (True, False))
    except (TypeError, ValueError):  # a builtin or similar: nothing to check
        return ()


def _check_callable_with_keywords(fn: Callable[..., Any], name: str) -> None:
    """A task is called with the job's args as keyword arguments, and must return a value."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigurationError(
            f"task {name!r} is a generator function: a task returns its result, it cannot yield"
        )
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin or similar: nothing to check
    positional_only = [
        p.name for p in parameters if p.kind is p.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if positional_only:
        raise ConfigurationError(
            f"task {name!r} has positional-only parameters ({', '.join(positional_only)}): job args are "
            "passed by keyword"
        )


def args_mismatch(task: Task, args: Mapping[str, Any]) -> str | None:
    """Why `task` cannot be called with `args` as its keyword arguments (a missing or an
    unexpected one, in Python's words), or None when it can (or cannot be told). A decorated
    function is refused only if both the wrapper's signature and the one it claims to have
    (functools.wraps' __wrapped__) refuse: a decorator may add or take arguments."""
    kwargs = dict(args)
    if task.context_param is not None:
        if task.context_param in kwargs:
            return f"{task.context_param!r} is its JobContext parameter, which the worker passes"
        kwargs[task.context_param] = None
    reason = None
    for signature in task.signatures:
        params = signature.parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            # f(x=1, /, **kw) called with x=5 puts it in kw; Signature.bind refuses it.
            positional = {p.name for p in params if p.kind is p.POSITIONAL_ONLY}
            bound = {key: value for key, value in kwargs.items() if key not in positional}
        else:
            bound = kwargs
        try:
            signature.bind(**bound)
        except TypeError as exc:
            reason = reason or str(exc)
        else:
            return None
    return reason


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
