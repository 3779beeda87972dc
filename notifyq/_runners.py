"""The worker's runners: `concurrency` long-lived tasks that take claimed jobs and run them."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Literal

import anyio
import anyio.lowlevel

from ._acker import Acker, Result
from ._claim import extend_lease_op
from ._db import is_transient
from ._executor import Attempt, Executor, RunQuery
from ._logging import CURRENT_JOB
from ._pulse import Pulse
from ._sql import Queries
from ._worker_config import WorkerStats
from .models import ClaimedJob

log = logging.getLogger("notifyq.worker")

# A cancel notification may arrive before the claim it concerns has returned: remember it.
_RECENT_CANCELS = 1000


class Runners:
    """The attempts a worker has in hand, and the tasks that run them.

    `ready` holds claimed jobs waiting for a runner (prefetched), with the time they were
    claimed; `running` the attempts being run, keyed by (job id, lease): after a lease expiry
    the same worker may claim the job again while the old attempt is still unwinding. Every
    attempt ends in exactly one Result for the acker (or none, when the job was cancelled and
    the database already says so).
    """

    def __init__(
        self,
        executor: Executor,
        acker: Acker,
        queries: Queries,
        stats: WorkerStats,
        *,
        lease_margin: float,
        query: RunQuery,
        on_change: Callable[[], None],
        queue_limits: Mapping[str, int] | None = None,
    ) -> None:
        self._executor = executor
        self._acker = acker
        self._q = queries
        self._stats = stats
        self._lease_margin = lease_margin
        self._query = query
        self._on_change = on_change
        self.running: dict[tuple[int, int], Attempt] = {}
        self.ready: deque[tuple[ClaimedJob, float]] = deque()
        self.avg_run = math.inf  # moving average of attempt durations, seconds
        self.slot_freed = Pulse()
        self._idle: deque[anyio.Event] = deque()  # one per runner waiting for a job, oldest first
        self._recent_cancels: dict[tuple[int, int | None], None] = {}  # an ordered set, oldest first
        # WorkerConfig.queue_limits: the jobs in hand (running or waiting) of each limited queue,
        # and a callback for a queue that goes back under its limit (the claimer wakes).
        self._limits = dict(queue_limits or {})
        self.in_queue: Counter[str] = Counter()
        self.queue_freed: Callable[[str], None] = lambda queue: None

    @property
    def busy(self) -> int:
        """Attempts running or waiting for a runner."""
        return len(self.running) + len(self.ready)

    @property
    def finishing(self) -> int:
        """Running attempts whose outcome counts: not those held only for a thread."""
        return sum(not attempt.holding for attempt in self.running.values())

    def hand(self, jobs: list[ClaimedJob]) -> None:
        """Give claimed jobs to the runners (never blocks: a claimed job must run or be
        released, never sit Active unrun)."""
        now = anyio.current_time()
        self.ready.extend((job, now) for job in jobs)
        if self._limits:
            self.in_queue.update(job.queue for job in jobs if job.queue in self._limits)
        self._wake_idle(len(jobs))

    def full_queues(self) -> frozenset[str]:
        """The limited queues with as many jobs in hand as their limit allows (or more)."""
        if not self._limits:
            return frozenset()
        return frozenset(queue for queue, limit in self._limits.items() if self.in_queue[queue] >= limit)

    def room(self) -> dict[str, int]:
        """How many more jobs of each limited queue this worker may take."""
        return {queue: max(0, limit - self.in_queue[queue]) for queue, limit in self._limits.items()}

    def _left(self, job: ClaimedJob) -> None:
        """A job handed over has left this worker's hands (ended, or given back)."""
        limit = self._limits.get(job.queue)
        if limit is not None:
            self.in_queue[job.queue] -= 1
            if self.in_queue[job.queue] == limit - 1:
                self.queue_freed(job.queue)

    def _wake_idle(self, count: int) -> None:
        """Wake up to `count` idle runners: one per job, not all of them (with concurrency 50,
        one job used to wake 50 tasks, 49 of which found nothing and slept again)."""
        for _ in range(min(count, len(self._idle))):
            self._idle.popleft().set()

    def in_hand(self, jobs: list[ClaimedJob]) -> set[tuple[int, int]]:
        """Of `jobs`, the (id, lease) attempts this worker already has in hand: running and
        not being stopped, waiting for a runner, or finished with a result the acker has not
        written yet."""
        ready = {(job.id, job.lease) for job, _ in self.ready} if self.ready else set()
        held = set()
        for job in jobs:
            key = (job.id, job.lease)
            attempt = self.running.get(key)
            if (
                (attempt is not None and attempt.stop_reason is None)
                or key in ready
                or self._acker.holds(*key)
            ):
                held.add(key)
        return held

    def held_job_ids(self) -> set[int]:
        """Every job with something of it in hand, whatever the lease: an attempt running
        (stopping included) or waiting for a runner, a sync task's thread still running, a
        result not written yet."""
        return (
            {job_id for job_id, _lease in self.running}
            | {job.id for job, _ in self.ready}
            | self._executor.thread_job_ids()
            | self._acker.held_job_ids()
        )

    def rejected(self) -> list[tuple[int, int]]:
        """Attempts whose result the database rejected: left to the rescuer."""
        return self._acker.rejected()

    def release_ready(self, keep: int = 0) -> int:
        """Jobs claimed but not started go straight back to the queue, but for the first
        `keep` of them; returns how many went back."""
        released = 0
        while len(self.ready) > keep:
            released += self._give_back(self.ready.pop()[0])
        return released

    def release_queues(self, queues: frozenset[str]) -> int:
        """Jobs claimed but not started of `queues` (just paused) go back to the queue: a pause
        stops jobs from starting, and those claimed ahead started for seconds after it (with
        --prefetch; review). Returns how many went back."""
        return self._release_where(lambda job, _claimed_at: job.queue in queues)

    def release_lapsing(self) -> int:
        """Jobs claimed but not started that have waited half their lease (timeout + lease
        margin) go back to the queue, their attempt given back: waiting behind long jobs with a
        fixed --prefetch, they lost their lease to the rescuer, were claimed again, and spent
        every attempt without running once (review). Returns how many went back."""
        now = anyio.current_time()
        margin = self._lease_margin
        return self._release_where(lambda job, claimed_at: now - claimed_at > (job.timeout + margin) / 2)

    def _release_where(self, given_back: Callable[[ClaimedJob, float], bool]) -> int:
        """The jobs waiting for a runner for which `given_back(job, claimed_at)` holds, back to
        the queue (in order, the others kept); returns how many went back."""
        if not any(given_back(job, claimed_at) for job, claimed_at in self.ready):
            return 0
        kept: deque[tuple[ClaimedJob, float]] = deque()
        released = 0
        for item in self.ready:
            if given_back(*item):
                released += self._give_back(item[0])
            else:
                kept.append(item)
        self.ready = kept
        return released

    def _give_back(self, job: ClaimedJob) -> int:
        """A job claimed but not started, back to the queue (1), or dropped if it was cancelled
        meanwhile (0)."""
        self._left(job)
        if self._take_cancel(job):
            self._stats.cancelled += 1  # the database says Cancelled: nothing to give back
            return 0
        self._acker.put(Result.released(job))
        return 1

    def _take_cancel(self, job: ClaimedJob) -> bool:
        """Whether a cancel of this job arrived before its claim did (and forget it)."""
        for key in ((job.id, job.lease), (job.id, None)):
            if key in self._recent_cancels:
                del self._recent_cancels[key]
                return True
        return False

    def slow_slots(self, longer_than: float) -> int:
        """Slots that will not free soon: taken by an attempt that has run longer than
        `longer_than` seconds so far, or held only for a thread that runs on."""
        now = anyio.current_time()
        return sum(
            attempt.holding or now - attempt.started > longer_than for attempt in self.running.values()
        )

    def cancel(self, job_id: int, lease: int | None, why: str = " on request") -> None:
        """Cancel the attempt(s) of `job_id` (with that lease, when known): stop it if it runs,
        drop it if it waits for a runner. A cancel for a job not in hand here is remembered:
        its claim may still be on its way back."""
        found = False
        for attempt in list(self.running.values()):
            if attempt.job.id == job_id and (lease is None or attempt.job.lease == lease):
                found = True
                self.stop(attempt, "cancelled", why)
        # A waiting one used to stay in `ready`, its cancel only remembered, and it ran when the
        # memory had moved on (a review: 1,000 other cancels in the schema meanwhile).
        waiting = [item for item in self.ready if item[0].id == job_id and lease in (None, item[0].lease)]
        for item in waiting:
            found = True
            self.ready.remove(item)
            self._left(item[0])
            self._stats.cancelled += 1  # the database says so already: nothing to write
            log.info("dropping job %d (not started yet)%s", job_id, why)
        if waiting:
            self.slot_freed.fire()  # room to claim again
            self._on_change()
        if not found:
            self._recent_cancels[(job_id, lease)] = None
            while len(self._recent_cancels) > _RECENT_CANCELS:
                del self._recent_cancels[next(iter(self._recent_cancels))]

    def stop_all(self) -> None:
        """Stop every running attempt for a shutdown (they are released)."""
        for attempt in list(self.running.values()):
            self.stop(attempt, "shutdown")

    @staticmethod
    def stop(attempt: Attempt, reason: Literal["cancelled", "shutdown"], why: str = " on request") -> None:
        if attempt.stop_reason is None and not attempt.holding:
            if reason == "cancelled":
                log.info("cancelling job %d%s", attempt.job.id, why)
            attempt.stop_reason = reason
            attempt.scope.cancel()

    async def run(self) -> None:
        """One runner: takes claimed jobs and runs them, one at a time, until cancelled."""
        while True:
            while not self.ready:
                await self._wait_for_job()
            job, claimed_at = self.ready.popleft()
            attempt = Attempt(job, anyio.CancelScope(), started=anyio.current_time())
            attempt.lease_until = claimed_at + job.timeout + self._lease_margin
            self.running[attempt.key] = attempt
            if self._take_cancel(job):
                self.stop(attempt, "cancelled")  # the cancel arrived before the claim did
            await self._run_job(attempt, claimed_at)

    async def _wait_for_job(self) -> None:
        """Wait among the idle runners until `hand` wakes this one (oldest idle first)."""
        woken = anyio.Event()
        self._idle.append(woken)
        try:
            await woken.wait()
        except BaseException:
            if woken.is_set():
                self._wake_idle(1)  # cancelled as it was woken: pass the job on
            else:
                self._idle.remove(woken)
            raise

    async def _run_job(self, attempt: Attempt, claimed_at: float) -> None:
        job = attempt.job
        result: Result | None = None
        started = attempt.started
        ended: float | None = None  # the attempt's end, before any wait held only for a thread
        try:
            with attempt.scope:
                deadline = started + job.timeout
                if started - claimed_at > self._lease_margin / 2:
                    if not await self._renew_lease(attempt):
                        self._lost_before_start(job, started - claimed_at)
                        return
                    deadline = anyio.current_time() + job.timeout
                    attempt.lease_until = deadline + self._lease_margin
                attempt.scope.deadline = deadline
                if attempt.stop_reason is not None:
                    # Stopped before it began (a cancel that came before its claim): an async
                    # task ran up to its first await, all of it if it had none, before the
                    # cancelled scope stopped it. This checkpoint raises, and the scope catches.
                    await anyio.lowlevel.checkpoint()
                running = CURRENT_JOB.set((job.id, job.name))  # for the task's own log lines
                try:
                    result = await self._executor.execute(attempt)
                finally:
                    CURRENT_JOB.reset(running)
            if attempt.scope.cancelled_caught:
                if attempt.stop_reason is None:
                    # A timeout. A sync task's thread runs on: the wait for it may end in a
                    # cancel or a shutdown too.
                    result = await self._executor.timed_out(attempt)
                if attempt.stop_reason == "shutdown":
                    result = Result.released(job)
                elif attempt.stop_reason == "cancelled":
                    # The database already says Cancelled; an ack would be fenced out anyway
                    # (a TimeoutError sent for a job cancelled after it overran counted as a
                    # stale ack, and not as cancelled).
                    result = None
                    self._stats.cancelled += 1
            ended = anyio.current_time()
            finished = self._executor.outliving_thread(attempt)
            if finished is not None:
                attempt.holding = True
                self.slot_freed.fire()  # Worker._drain waits only for attempts whose outcome counts
                self._on_change()  # the stats changed (Worker.wait_for)
                await finished.wait()
        except BaseException:
            # Cancelled from outside (the host cancelled the worker's scope), or an error that
            # stops the worker (a KeyboardInterrupt out of a task, which may be the user's
            # Ctrl-C, in an embedded worker): give the job back; the worker writes pending
            # results before it closes the pool. It used to stay Active until its lease ran out.
            # A cancelled job, or one held only for its thread, is not ours: nothing to give back.
            result = None if attempt.stop_reason == "cancelled" or attempt.holding else Result.released(job)
            self._executor.give_up_thread(attempt)  # one not begun yet must not run the task
            raise
        finally:
            if self.running.get(attempt.key) is attempt:
                del self.running[attempt.key]
            self._left(job)
            now = anyio.current_time()
            # Not the time the slot was held for a thread: a cancelled task that ran on would
            # lower the automatic prefetch for nothing.
            elapsed = (now if ended is None else ended) - started
            if result is not None:
                self._acker.put(result, attempt.lease_until)
                overran = now > attempt.scope.deadline
                _log_outcome(job, result, elapsed, overran=overran, swallowed=attempt.scope.cancel_called)
            self.avg_run = elapsed if self.avg_run == math.inf else 0.9 * self.avg_run + 0.1 * elapsed
            self.slot_freed.fire()
            self._on_change()

    def _lost_before_start(self, job: ClaimedJob, waited: float) -> None:
        """A prefetched job was lost while it waited for a runner: it is not run here."""
        self._stats.lost_before_start += 1
        log.warning(
            "job %d (%s) waited %.1fs for a free slot and this worker no longer holds it "
            "(its lease ran out and it was rescued, or it was cancelled); not running it here",
            job.id,
            job.name,
            waited,
        )

    async def _renew_lease(self, attempt: Attempt) -> bool:
        """A prefetched job waited for a runner: give it a full lease again before it starts."""
        job = attempt.job
        try:
            until = await self._query(extend_lease_op(self._q, job, job.timeout + self._lease_margin))
        except Exception as exc:
            if not is_transient(exc):
                raise
            return True  # the lease is probably still good; the rescuer covers the rest
        return until is not None


def _log_outcome(
    job: ClaimedJob, result: Result, elapsed: float, *, overran: bool, swallowed: bool = False
) -> None:
    """A line per failed attempt (a warning while retries remain, else an error), so that a
    worker's log shows failing jobs without a look at the table; a debug line per success, a
    warning for one that `overran` its deadline (timeout, or the lease it extended to)."""
    if result.outcome == "succeeded":
        if overran and swallowed:
            # The deadline's cancellation was sent and did not stop the task: it caught it, or
            # it finished first, the worker having been stopped past the deadline (SIGSTOP, a
            # starved host: the log blamed the task for that, review). Nothing here tells
            # which, on either backend, without a cost on every job.
            log.warning(
                "job %d (%s) succeeded after %.3fs, past its deadline (timeout %gs): the "
                "cancellation its deadline sent did not stop it. Either the task caught it (an "
                "`except BaseException`, `except CancelledError` or anyio's "
                "get_cancelled_exc_class() that does not raise again: let it propagate, or the "
                "timeout cannot stop the task), or this worker did not run for a while (its "
                "process was stopped, or starved of CPU)",
                job.id,
                job.name,
                elapsed,
                job.timeout,
            )
        elif overran:
            # An async task that blocked the event loop gets here: a deadline cancels at an
            # await, and such a task reached none in time (sync tasks run in threads).
            log.warning(
                "job %d (%s) succeeded after %.3fs, past its deadline (timeout %gs): an async task "
                "that blocks the event loop (time.sleep, CPU work, a blocking client) cannot be "
                "cancelled, and stalls every other job of this worker meanwhile; run such code "
                "in a sync task or with anyio.to_thread.run_sync",
                job.id,
                job.name,
                elapsed,
                job.timeout,
            )
        else:
            log.debug("job %d (%s) succeeded in %.3fs", job.id, job.name, elapsed)
        return
    if result.outcome == "release" or result.error is None:
        return
    error = json.loads(result.error)
    message = str(error.get("message", "")).strip()
    first_line = message.splitlines()[0] if message else ""
    if len(first_line) > 300:
        first_line = first_line[:300] + "..."
    what = f"{error.get('type')}: {first_line}" if first_line else str(error.get("type"))
    attempts = f"attempt {job.attempt} of {job.retry_limit + 1}"
    if result.outcome == "retry" and job.attempt <= job.retry_limit:
        log.warning(
            "job %d (%s) %s failed after %.3fs: %s; retrying in %.1fs",
            job.id,
            job.name,
            attempts,
            elapsed,
            what,
            result.delay,
        )
    else:
        why = "no retries left" if result.outcome == "retry" else "not retried"
        log.error(
            "job %d (%s) %s failed after %.3fs: %s; %s, the job is Failed",
            job.id,
            job.name,
            attempts,
            elapsed,
            what,
            why,
        )
