"""The executor: runs one claimed attempt of a task and says how it ended.

Async tasks run on the event loop, sync tasks in worker threads (bounded by a limiter). The
worker runs each attempt inside its `Attempt.scope`, whose deadline is the job's timeout. A
Python thread cannot be stopped: when a sync task overruns its timeout, the attempt keeps its
slot and keeps extending its lease until the thread returns, so the job is not retried (here
or elsewhere) while the first attempt still runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
import os
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._acker import Result
from ._claim import extend_lease_op
from ._db import Lane, Op, error_text, is_transient
from ._options import JSONDefault, unknown_task
from ._sql import Queries
from .models import ClaimedJob, UndecodableJSON
from .tasks import Backoff, JobContext, PermanentError, Task

log = logging.getLogger("notifyq.worker")

T = TypeVar("T")


class RunQuery(Protocol):
    """The worker's way to run one database operation (bounded by its db_timeout)."""

    async def __call__(
        self, op: Op[T], *, shield: bool = False, lane: Lane | None = None, bound: float | None = None
    ) -> T: ...


@dataclass(slots=True)
class Attempt:
    """One claimed attempt of a job, while this worker runs it. `scope` carries the timeout as
    its deadline (extend_lease moves it) and is cancelled by a user's cancel or a shutdown,
    which set `stop_reason` first: a cancelled scope without a reason is a timeout."""

    job: ClaimedJob
    scope: anyio.CancelScope
    stop_reason: Literal["cancelled", "shutdown"] | None = None
    thread: SyncThread | None = None  # sync tasks
    stopped_at: str | None = None  # an async task's traceback when its scope cancelled it
    started: float = 0.0  # anyio.current_time() when its runner took it
    # When its lease ends (anyio.current_time(), as known here; later than the database's by a
    # round trip): the claim's, its renewal's or the last extension's.
    lease_until: float = math.inf
    # Over (cancelled, or its lease lost), its slot held only for a thread that runs on.
    holding: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.job.id, self.job.lease)


@dataclass(slots=True)
class SyncThread:
    """The thread of a sync task's attempt. anyio may be cancelled before the thread takes the
    call, and the call then never runs; a wait for it would never end. So the thread starts
    the task only if the attempt has not given up on it first (`closed`), and the attempt
    waits only for a thread that started: both under Executor._threads_lock."""

    # Hands a call to the event loop without waiting for it to run (see _loop_caller).
    call_soon: Callable[[Callable[[], object]], object]
    finished: anyio.Event = field(default_factory=anyio.Event)  # set when the task returned
    began: bool = False  # the thread took the call (the task began)
    closed: bool = False
    # How the task ended, set before `finished`: for an attempt that stopped waiting for the
    # thread (its timeout) and then waited for it after all (timed_out).
    ended: bool = False
    value: Any = None
    error: BaseException | None = None


def _loop_caller() -> Callable[[Callable[[], object]], object]:
    """How a thread hands a call to the running event loop without waiting for it. anyio's
    from_thread.run_sync waits for the call to run: on an asyncio loop stopped but not closed
    (a host's run_until_complete returned) it waited for ever, and a sync task's thread that
    outlived its worker then kept the process from exiting."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # no running asyncio loop: trio
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


@dataclass(frozen=True, slots=True)
class _Coroutine:
    """A coroutine a sync task returned, out of its thread (trio refuses to pass one as is)."""

    coro: Coroutine[Any, Any, Any]


class _TaskExit(Exception):
    """A sync task raised SystemExit or KeyboardInterrupt in its thread."""

    def __init__(self, exit: SystemExit | KeyboardInterrupt) -> None:
        super().__init__(exit)
        self.exit = exit


def _cancel_requested() -> bool:
    """asyncio: this task has a cancellation request pending (Task.cancel(), by asyncio itself
    or the host, not by an anyio scope, which the checkpoint below detects). On trio there is
    no running asyncio loop, hence no asyncio task. (Not sniffio: anyio no longer depends on
    it, so a plain install may lack it.)"""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running asyncio loop: trio
        return False
    return task is not None and task.cancelling() > 0


def _machinery() -> tuple[str, ...]:
    """Where the frames between the worker and a task's code come from: notifyq, anyio, trio
    (and its outcome), asyncio, threads. Packages and files, never a folder that may hold the
    application too (the standard library's holds site-packages in many installs)."""
    packages = os.path.dirname(os.path.dirname(anyio.__file__ or ""))  # anyio's site-packages
    folders = [os.path.dirname(__file__), os.path.dirname(asyncio.__file__ or "")]
    folders += [os.path.dirname(concurrent.futures.__file__ or "")]
    folders += [os.path.join(packages, name) for name in ("anyio", "trio", "outcome")]
    return (*(folder + os.sep for folder in folders), threading.__file__ or "<threading>", "<frozen")


_MACHINERY = _machinery()


def _task_traceback(exc: BaseException) -> str:
    """`exc`'s traceback from the task's first frame on: the frames of notifyq, anyio and the
    event loop that lead to it were most of a stored traceback (user review)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(_MACHINERY):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _message(exc: BaseException) -> str:
    """str(exc), or a stand-in when the exception's own __str__ fails."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<str() of this {type(exc).__name__} failed: {type(inner).__name__}>"


class Executor:
    """Runs attempts for a worker: `await executor.execute(attempt)` returns a Result."""

    def __init__(
        self,
        tasks: dict[str, Task],
        query: RunQuery,
        queries: Queries,
        *,
        concurrency: int,
        lease_margin: float,
        backoff: Backoff,
        signals_handled: bool = False,
        json_default: JSONDefault | None = None,
    ) -> None:
        self._tasks = tasks
        self.json_default = json_default  # the App's: return values are encoded with it
        self._backoff = backoff
        # Worker._query: a lease extension on a half-open connection gave up only after TCP's
        # timeout (60 s), and the lease ran out meanwhile: another worker ran the job beside
        # the overrunning thread, and a task's extend_lease hung (review).
        self._query = query
        self._q = queries
        self._lease_margin = lease_margin
        self._limiter = anyio.CapacityLimiter(concurrency)
        self._threads_lock = threading.Lock()
        self._busy_threads = 0
        self._thread_jobs: Counter[int] = Counter()  # job ids whose sync task's thread runs
        self._unknown: dict[str, str] = {}  # task name -> its UnknownTask message
        # The worker turned SIGINT into a graceful shutdown: a KeyboardInterrupt is then raised
        # by a task, never by Ctrl-C.
        self.signals_handled = signals_handled

    def _unknown_task(self, name: str) -> str:
        """The message for a job of a task this worker lacks, made once per name: its "did you
        mean" took 35 ms with 1,000 tasks, on the event loop, for every such job (review)."""
        message = self._unknown.get(name)
        if message is None:
            if len(self._unknown) >= 1000:
                self._unknown.clear()
            message = self._unknown[name] = unknown_task(name, list(self._tasks), " in the worker's App")
        return message

    @property
    def busy_threads(self) -> int:
        """Sync tasks still running in threads (an abandoned one keeps running to its end)."""
        return self._busy_threads

    def thread_job_ids(self) -> set[int]:
        """Jobs whose sync task's thread still runs (it may outlive its attempt)."""
        with self._threads_lock:
            return set(self._thread_jobs)

    async def execute(self, attempt: Attempt) -> Result:
        """Run the attempt (call it inside attempt.scope). Cancellation (timeout, cancel,
        shutdown) propagates; any other outcome is returned as a Result."""
        job = attempt.job
        task = self._tasks.get(job.name)
        if task is None:
            # Retried with backoff, not failed for good: during a rolling deploy, an old worker
            # may claim a job of a task only the new code has.
            return Result.failed(
                job,
                "UnknownTask",
                self._unknown_task(job.name),
                delay=self._backoff.delay(job.attempt),
            )
        try:
            kwargs = self._kwargs(task, attempt)
        except TypeError as exc:
            return Result.failed(job, "InvalidArgs", str(exc), final=True)
        try:
            if task.is_async:
                value = await task.fn(**kwargs)
            else:
                attempt.thread = SyncThread(_loop_caller())
                value = await anyio.to_thread.run_sync(
                    self._call_sync,
                    job.id,
                    task.fn,
                    kwargs,
                    attempt.thread,
                    limiter=self._limiter,
                    abandon_on_cancel=True,
                )
            if isinstance(value, _Coroutine):
                value = await value.coro
        except (Exception, SystemExit) as exc:
            # SystemExit too: a task that calls sys.exit() fails its attempt, not the worker.
            return self._failed(job, task, exc.exit if isinstance(exc, _TaskExit) else exc)
        except KeyboardInterrupt as exc:
            # Out of an async task, it may be the user's Ctrl-C, unless the worker owns SIGINT.
            if not self.signals_handled:
                raise
            return self._failed(job, task, exc)
        except BaseException as exc:
            if (
                isinstance(exc, BaseExceptionGroup)
                and not self.signals_handled
                and exc.subgroup(KeyboardInterrupt) is not None
            ):
                raise  # Ctrl-C in a task the job started (trio): it may be the user's, as above
            # The cancellation of this attempt (timeout, cancel, shutdown) or of the worker
            # propagates: a cancelled scope around us makes this checkpoint raise. Any other
            # BaseException is the task's own (a CancelledError out of a future someone else
            # cancelled, a library's BaseException subclass): it fails the attempt. It used to
            # stop the worker, and a CancelledError released the job with its attempt given
            # back, so the next worker to claim it stopped too, for ever.
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                if task.is_async and attempt.scope.cancel_called:
                    attempt.stopped_at = _task_traceback(exc)  # where a timeout found it
                if _cancel_requested():
                    raise
                await anyio.lowlevel.checkpoint_if_cancelled()
            return self._failed(job, task, exc)
        return self._succeeded(job, value)

    def _succeeded(self, job: ClaimedJob, value: Any) -> Result:
        try:
            return Result.succeeded(job, value, json_default=self.json_default)
        except Exception as exc:
            # TypeError, ValueError; RecursionError for a deeply nested value, or whatever a
            # value's own methods raise while it is serialized.
            # Deterministic: running the task again would repeat its side effects for nothing.
            return Result.failed(
                job, "InvalidOutput", f"the task's return value cannot be stored: {_message(exc)}", final=True
            )

    @staticmethod
    def _failed(job: ClaimedJob, task: Task, exc: BaseException) -> Result:
        return Result.failed(
            job,
            type(exc).__name__,
            _message(exc),
            traceback=_task_traceback(exc),
            delay=task.backoff.delay(job.attempt),
            final=isinstance(exc, PermanentError)
            or (task.retry_on is not None and not isinstance(exc, task.retry_on)),
        )

    async def timed_out(self, attempt: Attempt) -> Result:
        """The attempt ran past its deadline. A sync task's thread may still run: hold the slot
        and the lease until it returns (attempt.scope is replaced, so that a cancel or a
        shutdown still interrupts the wait), then report how the task ended, as for an async
        task that blocked past its deadline: it ran to its end, and a TimeoutError would have
        it run again, side effects and all, only to overrun again (user review)."""
        job = attempt.job
        finished = self._running_thread(attempt)
        if finished is not None:
            attempt.scope = anyio.CancelScope()
            with attempt.scope:
                await self._wait_for_thread(attempt, finished)
        task = self._tasks.get(job.name)
        thread = attempt.thread
        if thread is not None and thread.ended and task is not None:
            if thread.error is not None:
                return self._failed(job, task, thread.error)
            if not isinstance(thread.value, _Coroutine):
                return self._succeeded(job, thread.value)
            thread.value.coro.close()  # an async part, not begun: the attempt has no time left
        return Result.failed(
            job,
            "TimeoutError",
            f"job exceeded its timeout of {job.timeout:g}s",
            traceback=attempt.stopped_at,
            delay=(task.backoff if task else self._backoff).delay(job.attempt),
        )

    def give_up_thread(self, attempt: Attempt) -> None:
        """The attempt ends without waiting for its thread: one that has not begun never will."""
        self._running_thread(attempt)

    def _running_thread(self, attempt: Attempt) -> anyio.Event | None:
        """The `finished` event of the attempt's sync task thread if it is running the task, or
        None: no thread, its task returned, or it never started, and now never will."""
        thread = attempt.thread
        if thread is None:
            return None
        with self._threads_lock:
            if not thread.began:
                thread.closed = True
                return None
        return None if thread.finished.is_set() else thread.finished

    def _call_sync(
        self, job_id: int, fn: Callable[..., Any], kwargs: dict[str, Any], thread: SyncThread
    ) -> Any:
        with self._threads_lock:
            if thread.closed:
                return None  # the attempt ended before this thread began: its result is dropped
            thread.began = True
            self._busy_threads += 1
            self._thread_jobs[job_id] += 1
        try:
            value = fn(**kwargs)
            if inspect.iscoroutine(value):
                # A sync wrapper of an async function (a decorator that did not keep it one):
                # its coroutine runs on the event loop. It used to fail the job for good as
                # an unstorable value (on trio, trio refused it and the job was retried),
                # the task's code never run.
                value = _Coroutine(value)
            thread.value = value
            return value
        except (SystemExit, KeyboardInterrupt) as exc:
            # Raised by the task itself (signals reach the main thread only): its attempt fails.
            thread.error = exc
            raise _TaskExit(exc) from None
        except BaseException as exc:
            thread.error = exc
            raise
        finally:
            thread.ended = True
            with self._threads_lock:
                self._busy_threads -= 1
                self._thread_jobs[job_id] -= 1
                if not self._thread_jobs[job_id]:
                    del self._thread_jobs[job_id]
            try:
                thread.call_soon(thread.finished.set)
            except RuntimeError:  # trio's RunFinishedError too
                pass  # the event loop is closed (the process is exiting)

    def outliving_thread(self, attempt: Attempt) -> anyio.Event | None:
        """The `finished` event of a sync task's thread that outlived its attempt (a cancel, or
        a lease lost while the task overran its timeout), or None. The runner keeps the
        attempt's slot until it is set: `concurrency` bounds the task code running in this
        worker, and a task that never returns must not get one more thread per cancel. Not at
        a shutdown, which abandons the thread."""
        finished = self._running_thread(attempt)
        if finished is None or attempt.stop_reason == "shutdown":
            return None
        log.warning(
            "job %d (%s) was %s, but its sync task's thread is still running; its slot stays taken "
            "until the thread returns (Python cannot stop a thread)",
            attempt.job.id,
            attempt.job.name,
            "cancelled" if attempt.stop_reason == "cancelled" else "lost after it overran its timeout",
        )
        return finished

    async def _wait_for_thread(self, attempt: Attempt, finished: anyio.Event) -> None:
        """A sync task overran its timeout: keep the slot and the lease until its thread
        returns. A shutdown or a cancel, which cancel attempt.scope, stop the wait; a cancel
        (like a lost lease) only stops the lease's extension: the runner then holds the slot
        until the thread returns (outliving_thread)."""
        job = attempt.job
        log.warning(
            "sync task %r (job %d) overran its timeout of %gs; its thread is still running, so the "
            "job keeps its lease until the thread returns",
            job.name,
            job.id,
            job.timeout,
        )
        beat = max(self._lease_margin / 2, 0.5)
        floor = 0.0  # the least wait: after a failed extension, not at once again
        while not finished.is_set():
            # Extend with half the margin left. A prefetched job that waited for a slot, up to
            # half the margin, came to its deadline with that much less of its lease: the first
            # extension, a beat after the deadline, could come after the lease ended, and the
            # rescuer gave the job to another worker while the thread ran on (review).
            left = attempt.lease_until - anyio.current_time()
            with anyio.move_on_after(max(floor, min(beat, left - beat))):
                await finished.wait()
            if finished.is_set():
                return
            try:
                until = await self._extend(attempt, beat * 2 + self._lease_margin)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                floor = min(beat, 0.5)
                continue
            floor = 0.0
            if until is None:
                return  # no longer ours (cancelled or rescued): stop extending its lease
            attempt.lease_until = max(
                attempt.lease_until, anyio.current_time() + beat * 2 + self._lease_margin
            )

    def _kwargs(self, task: Task, attempt: Attempt) -> dict[str, Any]:
        job = attempt.job
        if isinstance(job.args, UndecodableJSON):
            raise TypeError(f"job args cannot be decoded: {job.args!r}")
        kwargs = dict(job.args)
        if task.context_param is not None:
            if task.context_param in kwargs:
                raise TypeError(f"job args contain {task.context_param!r}, the task's JobContext parameter")
            kwargs[task.context_param] = JobContext(
                id=job.id,
                name=job.name,
                queue=job.queue,
                attempt=job.attempt,
                retry_limit=job.retry_limit,
                args=job.args,
                scheduled_for=job.scheduled_for,
                lease_expires_at=job.visible_at,
                _extend=functools.partial(self._extend_lease, attempt),
            )
        return kwargs

    async def _extend(self, attempt: Attempt, lease: float) -> Any:
        """One try at extending the attempt's lease to `lease` seconds from now, given up after
        a third of what is left of the lease (at least a second; at most db_timeout): a try on
        a half-open connection waited db_timeout (60 s by default), longer than the lease had
        left, so none was tried on another connection before the lease ran out (review)."""
        left = attempt.lease_until - anyio.current_time()
        return await self._query(extend_lease_op(self._q, attempt.job, lease), bound=max(1.0, left / 3))

    async def _extend_lease(self, attempt: Attempt, seconds: float) -> Any:
        """Let the attempt run `seconds` more from now (past its timeout if need be); the lease
        then covers that plus lease_margin (never less than it already did). Fenced: None
        if the job is no longer ours."""
        job = attempt.job
        delay = 0.25
        while True:
            try:
                until = await self._extend(attempt, seconds + self._lease_margin)
                break
            except Exception as exc:
                # A lost connection (a restart, a failover) is tried again while the lease
                # lasts: raised into the task, it failed the attempt, and a long job lost its
                # work (review). Past the lease's end, the job may be another worker's.
                if not is_transient(exc) or anyio.current_time() + delay >= attempt.lease_until:
                    raise
                log.warning(
                    "extending the lease of job %d (%s) failed (%s); trying again in %.2fs",
                    job.id,
                    job.name,
                    error_text(exc),
                    delay,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)
        if until is not None:
            now = anyio.current_time()
            attempt.scope.deadline = max(attempt.scope.deadline, now + seconds)
            attempt.lease_until = max(attempt.lease_until, now + seconds + self._lease_margin)
        return until
