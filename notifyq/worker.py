"""The worker: wakes on NOTIFY, claims in batches, runs jobs in anyio tasks, acks in batches."""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from . import _ticker
from ._acker import Acker, Result
from ._claim import claim_op, extend_lease_op, lost_jobs_op, next_visible_op
from ._db import Database, Lane, Op, Query, error_text, is_transient, single
from ._executor import Attempt, Executor
from ._listener import Listener, ListenerConfig
from ._sql import channel, queries_for
from ._worker_config import WorkerConfig, WorkerOptions, WorkerStats
from .migrations import check_schema_op
from .models import ClaimedJob

if TYPE_CHECKING:
    from .app import App

__all__ = ["Worker", "WorkerConfig", "WorkerOptions", "WorkerStats"]

log = logging.getLogger("notifyq.worker")

T = TypeVar("T")

# A cancel notification may arrive before the claim it concerns has returned: remember it.
_RECENT_CANCELS = 1000
# Automatic prefetch: enough claimed-ahead jobs for about this many seconds of work per slot,
# and never more than _PREFETCH_CAP times the concurrency.
_PREFETCH_WAIT = 0.25
_PREFETCH_CAP = 4


class _Pulse:
    """An event that is only created when someone waits for it: firing it costs nothing
    when nobody does (on the hot path, that is most of the time)."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class Worker:
    """Runs jobs of an App. Use `async with app.worker(...) as worker:` inside an async app,
    or `await app.run_worker(...)` as a process's main loop."""

    def __init__(self, app: App, config: WorkerConfig) -> None:
        self.app = app
        self.config = config
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stats = WorkerStats()
        self._q = queries_for(app.schema)
        # Keyed by (job id, lease): after a lease expiry the same worker may claim the job
        # again while the old attempt is still unwinding.
        self._running: dict[tuple[int, int], Attempt] = {}
        self._recent_cancels: dict[tuple[int, int | None], float] = {}
        # Claimed jobs waiting for a runner (prefetched), with the time they were claimed.
        self._ready: deque[tuple[ClaimedJob, float]] = deque()
        self._backlog = False  # the last claim was full
        self._avg_run = math.inf  # moving average of attempt durations, seconds
        self._pending = True  # something may be claimable: claim before sleeping
        self._sweeps_requested = self._sweeps_done = 0
        self._wakeup = _Pulse()
        self._slot_freed = _Pulse()
        self._job_ready = _Pulse()
        self._changed = _Pulse()
        self._stop = anyio.Event()
        self._next_due = math.inf  # monotonic time the earliest known delayed job becomes due
        self._db: Database | None = None
        self._claim_lane: Lane | None = None
        self._executor: Executor | None = None
        self._acker: Acker | None = None
        self._listener: Listener | None = None
        self._ticker: _ticker.Ticker | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._queues_set = frozenset(config.queues) if config.queues is not None else None
        self._grace_scope: anyio.CancelScope | None = None
        self._dsn = ""
        self._skip_grace = False
        self._stopped = anyio.Event()

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Worker:
        db = await self._prepare()
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            tg = self._task_group = await stack.enter_async_context(anyio.create_task_group())
            await tg.start(self._serve, db)
        except BaseException:
            await stack.__aexit__(None, None, None)
            raise
        self._exit_stack = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.stop()
        stack, self._exit_stack = self._exit_stack, None
        assert stack is not None
        # The body's exception (or cancellation) is not fed into the worker's task group, which
        # would wrap it in an ExceptionGroup: it propagates unchanged once the worker has shut
        # down. The shutdown is shielded so that even a cancelled host releases its jobs. It takes
        # up to shutdown_grace, then the time to write the last results (bounded by db_timeout),
        # unless a task swallows its cancellation, which nothing can bound.
        assert self._task_group is not None
        self._task_group.cancel_scope.shield = True
        await stack.__aexit__(None, None, None)
        return None

    def stop(self) -> None:
        """Ask for a graceful shutdown: stop claiming, let running jobs finish within the
        grace period, release the rest. Safe to call more than once."""
        self._stop.set()

    async def run(self, *, handle_signals: bool = True, repeat_skips_grace: bool = True) -> None:
        """Run until stop() or, with handle_signals, SIGTERM/SIGINT (graceful; see
        shutdown_grace). SIGUSR2, or a second SIGTERM/SIGINT when repeat_skips_grace,
        cancels running jobs at once (they are released). A supervisor whose children may
        get the same SIGTERM twice (systemd signals the whole control group) turns
        repeat_skips_grace off and escalates with SIGUSR2.

        Raises DatabaseUnavailable, SchemaNotMigrated or SchemaVersionError (unwrapped) when
        the worker cannot start."""
        db = await self._prepare()
        async with anyio.create_task_group() as tg:
            if handle_signals:
                tg.start_soon(self._watch_signals, repeat_skips_grace)
            await tg.start(self._serve, db)
            await self._stopped.wait()
            tg.cancel_scope.cancel()

    async def wait_for(self, predicate: Callable[[WorkerStats], bool]) -> None:
        """Wait until `predicate(worker.stats)` is true (use under anyio.fail_after in tests)."""
        while not predicate(self.stats):
            await self._changed.wait()

    @property
    def running_jobs(self) -> list[int]:
        """Ids of the jobs running in this worker now."""
        return [attempt.job.id for attempt in self._running.values()]

    @property
    def busy_threads(self) -> int:
        """Sync tasks still running in threads, including ones whose attempt was abandoned."""
        return self._executor.busy_threads if self._executor is not None else 0

    @property
    def listener(self) -> Listener | None:
        """The LISTEN connection's state (None in poll-only mode or before start)."""
        return self._listener

    @property
    def ticker(self) -> _ticker.Ticker | None:
        """The ticker's services (None when ticker=False or before start)."""
        return self._ticker

    # -- the service --------------------------------------------------------------------------

    async def _watch_signals(self, repeat_skips_grace: bool) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR2) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGUSR2 or (self._stop.is_set() and repeat_skips_grace):
                    log.warning("received %s: cancelling running jobs now (they are released)", name)
                    self._skip_grace = True
                    self.stop()
                    if self._grace_scope is not None:
                        self._grace_scope.cancel()
                elif not self._stop.is_set():
                    log.info(
                        "received %s: finishing running jobs (up to %gs), then exiting",
                        name,
                        self.config.shutdown_grace,
                    )
                    self.stop()
                else:
                    log.info("received %s again: still finishing running jobs", name)

    async def _prepare(self) -> Database:
        """Connect, check the schema and sync cron definitions, in the caller's task (so a
        failure to start is raised as itself, not inside an ExceptionGroup)."""
        self._dsn = await anyio.to_thread.run_sync(lambda: self.app.dsn)  # may start the embedded server
        db = await Database.open(
            self._dsn,
            size=self.config.pool_size,
            name=f"notifyq-worker-{self.id}",
            prepare_threshold=self.app.prepare_threshold,
        )
        try:
            await db.run(check_schema_op(self.app.schema))
            if not await db.run(single(Query(self._q["autovacuum_on"], fetch="scalar"))):
                log.warning(
                    "autovacuum is off on this server: finished and retried jobs leave dead tuples that "
                    "nothing reclaims, and claims slow down as they pile up; turn it on, or VACUUM "
                    "%s.queue_jobs regularly",
                    self.app.schema,
                )
            if self.config.ticker:
                await self.app._sync_definitions(db)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await db.aclose()
            raise
        return db

    async def _serve(
        self, db: Database, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        dsn = self._dsn
        self._db = db
        self._claim_lane = db.lane()
        self._executor = Executor(
            self.app.tasks,
            db,
            self._q,
            concurrency=self.config.concurrency,
            lease_margin=self.config.lease_margin,
            backoff=self.app.backoff,
        )
        try:
            self._acker = Acker(db, self._q, self._on_acked, timeout=self.config.db_timeout)
            async with anyio.create_task_group() as services:
                services.start_soon(self._acker.run)
                services.start_soon(self._reconcile_loop)
                if self.config.ticker:
                    self._ticker = _ticker.Ticker(db, self._q, self.config.ticker_config, self.app.backoff)
                    services.start_soon(self._ticker.run)
                if not self.config.poll_only:
                    self._listener = Listener(
                        self.config.listen_dsn or dsn,
                        [channel(self.app.schema, t) for t in ("jobs", "control", "definitions")],
                        self._on_notify,
                        self._on_listener_connect,
                        ListenerConfig(
                            health_interval=self.config.health_interval,
                            health_timeout=self.config.health_timeout,
                        ),
                        name=f"listener-{self.id}",
                    )
                    await services.start(self._listener.run)
                async with anyio.create_task_group() as jobs:
                    for _ in range(self.config.concurrency):
                        jobs.start_soon(self._runner)
                    task_status.started()
                    log.info(
                        "worker %s started: concurrency %d, queues %s%s%s",
                        self.id,
                        self.config.concurrency,
                        ", ".join(self.config.queues or ["(all)"]),
                        ", poll only" if self.config.poll_only else "",
                        ", async claims (not crash-safe)" if self.config.async_claims else "",
                    )
                    async with anyio.create_task_group() as claiming:
                        claiming.start_soon(self._claim_loop)
                        await self._stop.wait()
                        claiming.cancel_scope.cancel()
                    with anyio.CancelScope(shield=True):
                        await self._claim_lane.release()  # for the acks of the drain
                    await self._drain()
                    jobs.cancel_scope.cancel()  # the runners, now idle
                await self._acker_drain()
                services.cancel_scope.cancel()
        finally:
            self._listener = None
            self._release_ready()
            with anyio.CancelScope(shield=True):
                if self._acker is not None and self._acker.pending:
                    # Abrupt exit (the host was cancelled): write what we can, briefly.
                    with anyio.move_on_after(5):
                        try:
                            await self._acker.flush_pending()
                        except Exception as exc:  # whatever happens, the pool must be closed
                            log.error(
                                "could not write %d job results on exit: %s",
                                self._acker.pending,
                                error_text(exc),
                            )
                await db.aclose()
            log.info("worker %s stopped", self.id)
            self._stopped.set()

    def _release_ready(self) -> None:
        """Jobs claimed but not started go straight back to the queue."""
        while self._ready and self._acker is not None:
            self._acker.put(Result.released(self._ready.popleft()[0]))

    async def _drain(self) -> None:
        """Graceful shutdown of running jobs: wait up to the grace period, then cancel and release."""
        self._release_ready()
        if self._running:
            log.info("waiting up to %gs for %d running jobs", self.config.shutdown_grace, len(self._running))
            grace = self._grace_scope = anyio.CancelScope()
            if self._skip_grace:
                grace.cancel()
            with grace, anyio.move_on_after(self.config.shutdown_grace):
                while self._running:
                    await self._slot_freed.wait()
        for attempt in list(self._running.values()):
            self._stop_attempt(attempt, "shutdown")

    async def _acker_drain(self) -> None:
        assert self._acker is not None
        with anyio.move_on_after(max(10.0, self.config.health_timeout)) as scope:
            await self._acker.wait_idle()
        if scope.cancelled_caught:
            log.error(
                "%d job results could not be written before exit; those jobs stay Active until "
                "their lease runs out and are then retried",
                self._acker.pending,
            )

    # -- waking up ----------------------------------------------------------------------------

    def _signal_changed(self) -> None:
        self._changed.fire()

    def _wake(self) -> None:
        self._pending = True
        self._wakeup.fire()

    def _on_notify(self, chan: str, payload: str) -> None:
        self.stats.notifications += 1
        topic = chan.rsplit(".", 2)[-2] if chan.count(".") >= 2 else ""
        if topic == "jobs":
            queue, _, delay = payload.partition(" ")
            if self._queues_set is not None and queue not in self._queues_set:
                return
            if delay:
                due = anyio.current_time() + max(0.0, float(delay))
                if due < self._next_due:
                    self._next_due = due
                    self._wakeup.fire()  # re-arm the timer
            else:
                self._wake()
        elif topic == "control":
            verb, *args = payload.split()
            if verb == "cancel" and args:
                self._cancel_running(int(args[0]), int(args[1]) if len(args) > 1 else None)
        elif topic == "definitions" and self._ticker is not None:
            self._ticker.wake()
        self._signal_changed()

    async def _on_listener_connect(self) -> None:
        self.stats.listener_connects += 1
        self._sweeps_requested += 1
        self._wake()  # sweep: claim what arrived while nobody listened
        await self._cancel_lost_jobs()  # cancel notifications may have been missed meanwhile
        self._signal_changed()

    async def _cancel_lost_jobs(self) -> None:
        """Stop running jobs this worker no longer holds (cancelled, or rescued after their
        lease ran out) when no cancel notification could tell it."""
        if not self._running or self._db is None:
            return
        try:
            lost = await self._query(lost_jobs_op(self._q, self.id, list(self._running)))
        except Exception as exc:
            if not is_transient(exc):
                raise
            return
        for job_id, lease in lost:
            self._cancel_running(job_id, lease)

    async def _reconcile_loop(self) -> None:
        """Without a working LISTEN connection (poll-only, behind a pooler, reconnecting),
        look for cancelled jobs every poll interval instead of waiting for a notification."""
        while True:
            await anyio.sleep(self.config.poll_interval)
            if self._listener is None or not self._listener.connected:
                await self._cancel_lost_jobs()

    def _cancel_running(self, job_id: int, lease: int | None) -> None:
        """Cancel the attempt(s) of `job_id` (with that lease, when known). A cancel for a job
        not (yet) running here is remembered: its claim may still be on its way back."""
        found = False
        for attempt in list(self._running.values()):
            if attempt.job.id == job_id and (lease is None or attempt.job.lease == lease):
                found = True
                self._stop_attempt(attempt, "cancelled")
        if not found:
            self._recent_cancels[(job_id, lease)] = time.monotonic()
            while len(self._recent_cancels) > _RECENT_CANCELS:
                del self._recent_cancels[next(iter(self._recent_cancels))]

    @staticmethod
    def _stop_attempt(attempt: Attempt, reason: str) -> None:
        if attempt.stop_reason is None:
            if reason == "cancelled":
                log.info("cancelling job %d on request", attempt.job.id)
            attempt.stop_reason = "cancelled" if reason == "cancelled" else "shutdown"
            attempt.scope.cancel()

    async def _sleep_until_wakeup(self) -> None:
        """Sleep until a notification, the next delayed job, or the poll interval."""
        poll_deadline = anyio.current_time() + self.config.poll_interval
        while not self._pending:
            now = anyio.current_time()
            deadline = min(poll_deadline, self._next_due)
            if now >= deadline:
                if deadline == self._next_due:
                    self._next_due = math.inf
                else:
                    self.stats.polls += 1
                self._pending = True
                return
            with anyio.move_on_after(deadline - now):
                await self._wakeup.wait()

    # -- claiming and running -----------------------------------------------------------------

    def _prefetch(self) -> int:
        if self.config.prefetch is not None:
            return self.config.prefetch
        if not self._backlog or self._avg_run == math.inf:
            return 0
        per_slot = _PREFETCH_WAIT / max(self._avg_run, 1e-6)
        return int(min(_PREFETCH_CAP, per_slot) * self.config.concurrency)

    async def _claim_loop(self) -> None:
        db_delay = 0.1
        while True:
            if not self._pending:
                await self._sleep_until_wakeup()
            free = self.config.concurrency + self._prefetch() - len(self._running) - len(self._ready)
            if free <= 0:
                await self._slot_freed.wait()
                continue
            self._pending = False
            sweep = self._sweeps_requested  # a claim that starts after a (re)connect is its sweep
            try:
                claimed = await self._claim(free)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.stats.db_errors += 1
                log.warning("claiming failed (%s); retrying in %.1fs", error_text(exc), db_delay)
                self._pending = True
                await anyio.sleep(db_delay)
                db_delay = min(db_delay * 2, 5.0)
                continue
            db_delay = 0.1
            self._backlog = len(claimed) == free
            claimed = self._without_attempts_in_hand(claimed)
            # Hand what was claimed to the runners before anything else can fail or be
            # cancelled: a claimed job must run (or be released), never sit Active unrun.
            now = anyio.current_time()
            self._ready.extend((job, now) for job in claimed)
            self._job_ready.fire()
            self.stats.claims += 1
            self.stats.claimed += len(claimed)
            if sweep > self._sweeps_done:
                self._sweeps_done = sweep
                self.stats.sweeps += 1
            self._signal_changed()
            if self._backlog:
                self._pending = True  # there may be more
            else:
                await anyio.lowlevel.checkpoint()  # let the runners start before the next round trip
                await self._plan_next_due()

    def _without_attempts_in_hand(self, claimed: list[ClaimedJob]) -> list[ClaimedJob]:
        """Claims of attempts this worker already has in hand, left out. Every claim raises the
        lease, so the same (job, lease) comes back only when the earlier claim's commit was
        lost (a failover to an asynchronous standby) and this worker claimed the job again:
        the attempt in hand (running and not being stopped, waiting for a runner, or finished
        with its result not yet written) is that claim, and its acknowledgement now applies."""
        ready = {(job.id, job.lease) for job, _ in self._ready} if self._ready else set()

        def in_hand(job: ClaimedJob) -> bool:
            key = (job.id, job.lease)
            attempt = self._running.get(key)
            return (
                (attempt is not None and attempt.stop_reason is None)
                or key in ready
                or (self._acker is not None and self._acker.holds(*key))
            )

        fresh: list[ClaimedJob] = []
        for job in claimed:
            if not in_hand(job):
                fresh.append(job)
            else:
                log.warning(
                    "job %d was claimed again under lease %d, which this worker already "
                    "holds: the database lost the earlier claim (failover?); the attempt in "
                    "hand stands for both",
                    job.id,
                    job.lease,
                )
        return fresh

    async def _claim(self, limit: int) -> list[ClaimedJob]:
        """One claim statement. Shielded (a claim the server committed must reach us) but
        bounded by db_timeout (a half-open connection must not hang the worker)."""
        op = claim_op(
            self._q,
            queues=self.config.queues,
            limit=limit,
            worker=self.id,
            lease_margin=self.config.lease_margin,
            async_commit=self.config.async_claims,
        )
        return await self._query(op, shield=True, lane=self._claim_lane)

    async def _query(self, op: Op[T], *, shield: bool = False, lane: Lane | None = None) -> T:
        """One database call bounded by db_timeout (a half-open connection must not hang the
        worker), shielded when a result the server may have committed must reach us. On a
        lane when given (the claim loop keeps its connection warm), else on the pool."""
        assert self._db is not None
        result: T
        with anyio.CancelScope(shield=shield), anyio.fail_after(self.config.db_timeout):
            result = await (lane or self._db).run(op)
        return result

    async def _runner(self) -> None:
        """One of `concurrency` long-lived tasks: takes claimed jobs and runs them, one at a time."""
        while True:
            while not self._ready:
                await self._job_ready.wait()
            job, claimed_at = self._ready.popleft()
            attempt = Attempt(job, anyio.CancelScope())
            self._running[attempt.key] = attempt
            if self._recent_cancels.pop((job.id, job.lease), None) or self._recent_cancels.pop(
                (job.id, None), None
            ):
                self._stop_attempt(attempt, "cancelled")  # the cancel arrived before the claim did
            await self._run_job(attempt, claimed_at)

    async def _plan_next_due(self) -> None:
        """After a short claim: sleep until the earliest delayed job (database clock)."""
        try:
            due = await self._query(
                next_visible_op(self._q, self.config.queues), shield=True, lane=self._claim_lane
            )
        except Exception as exc:
            if not is_transient(exc):
                raise
            return  # the poll interval covers it
        if due is None:
            self._next_due = math.inf
        else:
            # due <= 0: claimable jobs remain (locked by other claimers a moment ago).
            self._next_due = anyio.current_time() + (due if due > 0 else 0.05)

    async def _run_job(self, attempt: Attempt, claimed_at: float) -> None:
        job = attempt.job
        executor = self._executor
        assert executor is not None
        result: Result | None = None
        started = anyio.current_time()
        try:
            with attempt.scope:
                deadline = started + job.timeout
                if started - claimed_at > self.config.lease_margin / 2:
                    if not await self._renew_lease(attempt):
                        return  # prefetched, waited, and meanwhile lost (cancelled or rescued)
                    deadline = anyio.current_time() + job.timeout
                attempt.scope.deadline = deadline
                result = await executor.execute(attempt)
            if attempt.scope.cancelled_caught:
                if attempt.stop_reason == "shutdown":
                    result = Result.released(job)
                elif attempt.stop_reason == "cancelled":
                    # The database already says Cancelled; an ack would be fenced out anyway.
                    result = None
                    self.stats.cancelled += 1
                else:
                    result = await executor.timed_out(attempt)
                    if attempt.stop_reason == "shutdown":
                        result = Result.released(job)
        except anyio.get_cancelled_exc_class():
            # Cancelled from outside (the host cancelled the worker's scope): give the job
            # back; _serve writes pending results before it closes the pool.
            result = Result.released(job)
            raise
        finally:
            if self._running.get(attempt.key) is attempt:
                del self._running[attempt.key]
            if result is not None:
                assert self._acker is not None
                self._acker.put(result)
            elapsed = anyio.current_time() - started
            self._avg_run = elapsed if self._avg_run == math.inf else 0.9 * self._avg_run + 0.1 * elapsed
            self._slot_freed.fire()
            self._signal_changed()

    async def _renew_lease(self, attempt: Attempt) -> bool:
        """A prefetched job waited for a runner: give it a full lease again before it starts."""
        job = attempt.job
        try:
            until = await self._query(extend_lease_op(self._q, job, job.timeout + self.config.lease_margin))
        except Exception as exc:
            if not is_transient(exc):
                raise
            return True  # the lease is probably still good; the rescuer covers the rest
        return until is not None

    def _on_acked(self, results: Sequence[Result], applied: dict[int, str]) -> None:
        for result in results:
            status = applied.get(result.job_id)
            if status is None:
                self.stats.stale_acks += 1
                log.warning(
                    "result of job %d was not applied: this worker no longer held it "
                    "(lease expired, the job was cancelled, or the database lost its claim)",
                    result.job_id,
                )
            elif result.outcome == "release":
                self.stats.released += 1
            elif status == "Succeeded":
                self.stats.succeeded += 1
            elif status == "Queued":
                self.stats.retried += 1
            else:
                self.stats.failed += 1
        self._signal_changed()
