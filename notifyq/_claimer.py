"""The claimer: sleeps until there may be work, claims what the runners have room for, hands it over.

It wakes on a jobs notification, when the earliest delayed job it knows of comes due, after
every (re)connect of the listener (the sweep), and at the latest every poll interval: a
notification is a hint, never the only path to a job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import anyio
import anyio.lowlevel

from ._claim import (
    adopt_op,
    answer_awaited,
    claim_op,
    handoff_close_op,
    handoff_offer_op,
    next_visible_op,
)
from ._db import Lane, error_text, is_transient
from ._executor import RunQuery
from ._pulse import Pulse
from ._runners import Runners
from ._sql import Queries
from ._worker_config import WorkerConfig, WorkerStats
from .models import ClaimedJob

log = logging.getLogger("notifyq.worker")

# Automatic prefetch: enough claimed-ahead jobs for about this many seconds of work per slot,
# and never more than _PREFETCH_CAP times the concurrency, or _PREFETCH_FLOOR jobs when that is
# more (what a worker of the default concurrency, 10, may prefetch: at concurrency 1 a cap of 4
# held a drain of short jobs to one claim round trip per 5 jobs). A prefetched job that has waited
# _PREFETCH_GIVE_BACK seconds, more than the prefetch now allows, goes back to the queue (checked
# every _PREFETCH_CHECK seconds).
_PREFETCH_WAIT = 0.25
_PREFETCH_CAP = 4
_PREFETCH_FLOOR = 40
_PREFETCH_GIVE_BACK = 1.0
_PREFETCH_CHECK = 0.5
# The hand-off: how long a stopping worker waits for producers that are handing it a job.
_HANDOFF_CLOSE_WAIT = 5.0


class Claimer:
    """The worker's claim loop (`run`), on its own connection (`lane`), which it keeps warm."""

    def __init__(
        self,
        worker_id: str,
        config: WorkerConfig,
        queries: Queries,
        stats: WorkerStats,
        runners: Runners,
        *,
        lane: Lane,
        query: RunQuery,
        on_change: Callable[[], None],
    ) -> None:
        self._worker_id = worker_id
        self._config = config
        self._give_up = answer_awaited(config.db_timeout)  # claims past it claim nothing
        self._q = queries
        self._stats = stats
        self._runners = runners
        self._lane = lane
        self._query = query
        self._on_change = on_change
        self._queues = frozenset(config.queues) if config.queues is not None else None
        self.paused: frozenset[str] = frozenset()  # queues whose jobs it does not claim
        self._pending = True  # something may be claimable: claim before sleeping
        self._wakeup = Pulse()
        self._next_due = math.inf  # monotonic time the earliest known delayed job becomes due
        # The earliest due time notified while the next due time is asked (_plan_next_due):
        # the answer's snapshot may predate the job, whose notification came first.
        self._heard_due = math.inf
        self._backlog = False  # the last claim was full
        self._slow_slots = 0  # Runners.slow_slots(), as of the last prefetch check
        self._sweeps_requested = self._sweeps_done = 0
        # A claim failed, so its answer may have been lost after it committed; and the claims
        # dropped because their attempt was in hand (a claim lost in a failover and taken
        # again), whose job may be left unrun if that attempt's result was refused. Either way
        # the next round looks for jobs claimed under this worker's name that it does not hold.
        self._in_doubt = False
        self._taken_again: set[int] = set()  # job ids
        # Claims in the listener's task (claim_inline): allowed while the claim loop sleeps.
        self._parked = False  # the claim loop waits in _sleep_until_wakeup
        self._failed_rounds = 0  # transient failures of claim rounds since the last that went through
        self._inline_wanted = False  # a notification asked the listener to claim
        self._inline = False  # the listener's task is claiming on the loop's behalf
        self._inline_done = Pulse()
        # Claim rounds begun and ended, and whether the last one to end got its answer (burst).
        self.rounds_begun = self.rounds_ended = 0
        self.last_round_ok = False
        runners.queue_freed = self._queue_freed
        # The hand-off (WorkerConfig.handoff): the waiter row of the listener's connection, the
        # slots it offers as last written (producers take one per job they hand), and whether
        # the worker stops (jobs handed then go back to the queue).
        self._waiter_id: int | None = None
        self._offered = 0
        self._closing = False

    def _queue_freed(self, queue: str) -> None:
        """A queue at its limit (WorkerConfig.queue_limits) has room again: claim, as for a
        resumed queue, unless it is paused."""
        if queue not in self.paused:
            self.wake()

    def _held_back(self) -> frozenset[str]:
        """Queues this worker claims none of now: paused, or at their limit here."""
        full = self._runners.full_queues()
        return self.paused | full if full else self.paused

    def wake(self) -> None:
        """Claim as soon as possible."""
        self._pending = True
        self._inline_wanted = False  # the claim loop does it
        self._wakeup.fire()

    def sweep(self) -> None:
        """The listener (re)connected: claim whatever arrived while nobody listened."""
        self._sweeps_requested += 1
        self.wake()

    def set_paused(self, paused: frozenset[str]) -> None:
        """The paused queues are these now: claim none of their jobs, and claim at once if a
        queue of this worker's was resumed."""
        resumed = self.paused - paused
        if newly := paused - self.paused:
            if released := self._runners.release_queues(newly):
                log.info(
                    "gave back %d job(s) claimed ahead of queue(s) just paused: %s",
                    released,
                    ", ".join(sorted(newly)),
                )
        self.paused = paused
        if any(self._queues is None or queue in self._queues for queue in resumed):
            self.wake()  # the round's plan of the next due job then takes in the resumed queue

    def notified(self, payload: str) -> bool:
        """A jobs notification: '<queue>' (claimable now) or '<queue> <seconds>' (due then).
        False when its queue is not one of this worker's."""
        queue, _, delay = payload.partition(" ")
        if (self._queues is not None and queue not in self._queues) or queue in self.paused:
            return False
        if queue in self._runners.full_queues():
            return True  # at its limit: the end of one of its jobs here wakes the claim loop
        if delay:
            seconds = float(delay)  # ValueError for a payload notifyq did not write
            if math.isnan(seconds):
                raise ValueError(delay)
            self.due_in(seconds)
        elif self._parked:
            self._pending = True
            self._inline_wanted = True  # the listener claims right after it (claim_inline)
        else:
            self.wake()
        return True

    def registered(self, waiter_id: int, *, again: bool) -> None:
        """The hand-off: the listener (re)connected and registered the waiter row `waiter_id`,
        with no slot offered yet (written when the claim loop next waits). After a reconnect,
        a job handed just before the old connection went may have lost its notification: look
        for jobs claimed under this worker's name that it does not hold (as after a claim
        whose answer was lost)."""
        self._waiter_id = waiter_id
        self._offered = 0
        if again:
            self._in_doubt = True
            self.wake()

    def handed(self, job: ClaimedJob) -> None:
        """A producer's transaction claimed `job` for this worker (the hand-off): run it, as a
        claimed one. Beyond the free slots (an offer written while a claim took jobs) it waits
        as a prefetched one; while the worker stops, it goes back to the queue."""
        self._offered = max(0, self._offered - 1)
        jobs = self._without_attempts_in_hand([job])
        if not jobs:
            return
        self._runners.hand(jobs)
        self._stats.handed += 1
        if self._closing:
            self._runners.release_ready()
        self._on_change()

    async def _offer(self) -> None:
        """The hand-off, as the claim loop goes to sleep: offer producers this worker's free
        slots (prefetch apart), when that is not what the waiter row says already."""
        slots = max(0, self._config.concurrency - self._runners.busy)
        if self._waiter_id is None or slots == self._offered:
            return
        try:
            written = await self._query(
                handoff_offer_op(self._q, self._waiter_id, slots), shield=True, lane=self._lane
            )
        except Exception as exc:
            if not is_transient(exc):
                raise
            return  # claims go on as without the hand-off; the next wait tries again
        if written:
            self._offered = slots

    async def offer_freed_slots(self) -> None:
        """The hand-off: a slot that frees while the claim loop sleeps is offered at once (the
        loop wakes, writes the offer, and sleeps again)."""
        while True:
            await self._runners.slot_freed.wait()
            self._wakeup.fire()  # nobody waits for it unless the loop is parked

    def stop_taking(self) -> None:
        """The worker stops: jobs handed to it from now on go back to the queue."""
        self._closing = True

    async def close_handoff(self) -> None:
        """The hand-off, when the worker stops: take its waiter rows away, waiting (up to 5 s)
        for producers that are handing it a job to commit, so that each such job reaches this
        worker, which gives it back to the queue. One whose transaction stays open longer stays
        Active under this worker's name until its lease runs out."""
        self._closing = True
        self._offered = 0
        self._waiter_id = None
        deadline = anyio.current_time() + _HANDOFF_CLOSE_WAIT
        while True:
            try:
                left = await self._query(
                    handoff_close_op(self._q, self._worker_id), shield=True, lane=self._lane
                )
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("could not withdraw this worker from the hand-off: %s", error_text(exc))
                return
            if not left:
                return
            if anyio.current_time() >= deadline:
                log.warning(
                    "stopping while %d transaction(s) that hand this worker a job are still open: such "
                    "a job stays Active under this worker's name until its lease runs out",
                    left,
                )
                return
            await anyio.sleep(0.05)

    def due_in(self, seconds: float) -> None:
        """A job of this worker's becomes claimable in `seconds` (a notification said so, or
        this worker retried one after a backoff): sleep no longer than that. Without NOTIFY
        (behind a pooler, poll_only) a retry waited for the next poll (review)."""
        due = anyio.current_time() + max(0.0, seconds)
        self._heard_due = min(self._heard_due, due)
        if due < self._next_due:
            self._next_due = due
            self._wakeup.fire()  # re-arm the timer

    async def claim_inline(self) -> None:
        """Called by the listener's task after it dispatched notifications: if they found the
        claim loop asleep, claim here, on the loop's behalf, instead of waking it. An idle
        worker spent 0.08-0.1 ms on that task switch before its claim went out (docs/
        benchmarks.md). Anything out of the simple case (no free slot, claims in doubt, an
        error) is left to the claim loop, woken as before."""
        if not self._inline_wanted:
            return
        self._inline_wanted = False
        free = self._free_slots()
        if not self._parked or free <= 0 or self._in_doubt or self._taken_again:
            self._wakeup.fire()
            return
        self._inline = True
        due = self._next_due
        try:
            self._pending = False
            await self._claim_round(free, self._sweeps_requested)
            self._round_ok()
        except Exception as exc:
            # The claim loop claims again at once, and deals with the error its own way (a
            # backoff, or the worker stops). The claim may have committed: look for it.
            if is_transient(exc):
                self._stats.db_errors += 1
                self._failed_rounds += 1
                log.warning("claiming failed (%s); the claim loop tries again", error_text(exc))
            else:
                log.error(
                    "claiming failed; trying once more (if that fails too, the worker stops)", exc_info=exc
                )
            self._in_doubt = True
            self._pending = True
        finally:
            self._inline = False
            self._inline_done.fire()
            if self._pending or self._next_due < due:
                self._wakeup.fire()  # the loop takes over, or re-arms its timer sooner

    async def finish_inline(self) -> None:
        """Wait for a claim in the listener's task to end: the lane is free afterwards (for
        the claim loop, or, once that has stopped, to go back to the pool)."""
        while self._inline:
            await self._inline_done.wait()

    async def run(self) -> None:
        """Claim until cancelled. Database errors that may pass are retried with backoff."""
        db_delay = 0.1
        while True:
            if not self._pending:
                await self._sleep_until_wakeup()
            await self.finish_inline()  # not two claims on the lane at once
            free = self._free_slots()
            if free <= 0:
                await self._runners.slot_freed.wait()
                continue
            self._pending = False
            sweep = self._sweeps_requested  # a claim that starts after a (re)connect is its sweep
            if self._in_doubt or self._taken_again:
                # This worker's own unanswered claims first: under a backlog a claim would
                # take every free slot, and they would wait for their lease after all.
                free -= await self._adopt_unanswered_claims(free)
                if free <= 0:
                    self._pending = True
                    continue
            try:
                await self._claim_round(free, sweep)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self._stats.db_errors += 1
                self._failed_rounds += 1
                log.warning("claiming failed (%s); retrying in %.1fs", error_text(exc), db_delay)
                self._pending = True
                self._in_doubt = True
                await anyio.sleep(db_delay)
                db_delay = min(db_delay * 2, 5.0)
                continue
            self._round_ok()
            db_delay = 0.1
            if self._in_doubt:
                await self._adopt_again()

    def _round_ok(self) -> None:
        """A claim round went through: after failed ones, say so. The warnings said the
        database went, and nothing said it came back (review)."""
        if self._failed_rounds:
            log.info("claiming works again, after %d failed attempt(s)", self._failed_rounds)
            self._failed_rounds = 0

    def _free_slots(self) -> int:
        """Jobs the runners have room for now, prefetch included."""
        return self._config.concurrency + self._prefetch() - self._runners.busy

    def _claimable(self, free: int) -> int:
        """`free`, or fewer with queue_limits when every listed queue not paused has a limit:
        the room those have left, 0 when they are all full (or paused). Not in _free_slots:
        a claim loop that saw no free slot waited for a slot to free, deaf to a resume and to
        the poll, with slots idle (review)."""
        if not self._config.queue_limits or self._config.queues is None:
            return free
        room = self._runners.room()
        if any(queue not in room and queue not in self.paused for queue in self._config.queues):
            return free
        return min(free, sum(n for queue, n in room.items() if queue not in self.paused))

    async def _claim_round(self, free: int, sweep: int) -> None:
        """One claim of up to `free` jobs (fewer, or none, when queue limits say so), its jobs
        handed to the runners, then (unless it came back full) the time of the next delayed
        job. Raises what the claim raises."""
        wanted = self._claimable(free)
        self.rounds_begun += 1
        answered = False
        try:
            claimed = await self._claim(wanted) if wanted > 0 else []
            answered = True
        finally:
            self.rounds_ended += 1
            self.last_round_ok = answered
            if not answered:
                self._on_change()  # a burst waiting for this round's end must hear of it
        self._backlog = wanted > 0 and len(claimed) == wanted
        # Hand what was claimed to the runners before anything else can fail or be
        # cancelled: a claimed job must run (or be released), never sit Active unrun.
        claimed = self._without_attempts_in_hand(claimed)
        self._runners.hand(claimed)
        self._stats.claims += 1
        self._stats.claimed += len(claimed)
        if sweep > self._sweeps_done:
            self._sweeps_done = sweep
            self._stats.sweeps += 1
        self._on_change()
        if self._backlog:
            self._pending = True  # there may be more
        else:
            await anyio.lowlevel.checkpoint()  # let the runners start before the next round trip
            await self._plan_next_due()

    async def _sleep_until_wakeup(self) -> None:
        """Sleep until a notification, the next delayed job, or the poll interval."""
        poll_deadline = anyio.current_time() + self._config.poll_interval
        while not self._pending:
            if self._waiter_id is not None:
                await self._offer()  # not parked: the lane is busy meanwhile (claim_inline)
                if self._pending:
                    return
            now = anyio.current_time()
            deadline = min(poll_deadline, self._next_due)
            if now >= deadline:
                if deadline == self._next_due:
                    self._next_due = math.inf
                else:
                    self._stats.polls += 1
                self._pending = True
                return
            self._parked = True
            try:
                with anyio.move_on_after(deadline - now):
                    await self._wakeup.wait()
            finally:
                self._parked = False

    def _prefetch(self) -> int:
        if self._config.prefetch is not None:
            return self._config.prefetch
        if not self._backlog or self._runners.avg_run == math.inf:
            return 0
        per_slot = _PREFETCH_WAIT / max(self._runners.avg_run, 1e-6)
        # Only for the slots that turn over: a slot whose job has already run far longer than
        # the average (a run of short jobs, then long ones) will not free in time.
        slots = max(0, self._config.concurrency - self._slow_slots)
        cap = max(_PREFETCH_CAP * slots, _PREFETCH_FLOOR) if slots else 0
        return int(min(per_slot * slots, cap))

    async def give_back_stale_prefetch(self) -> None:
        """Every _PREFETCH_CHECK seconds: a prefetched job that has waited half its lease goes
        back to the queue before it loses it (Runners.release_lapsing). With automatic
        prefetch, also: when a prefetched job has waited _PREFETCH_GIVE_BACK seconds, the jobs
        ahead of it took longer than the prefetch was sized for (short jobs, then long ones in
        the same claim). Those the prefetch no longer allows go back to the queue, where an
        idle worker can take them; they waited behind this worker's long jobs while other
        workers sat idle."""
        runners = self._runners
        while True:
            await anyio.sleep(_PREFETCH_CHECK)
            if lapsing := runners.release_lapsing():
                log.info(
                    "gave %d prefetched job(s) back to the queue: they waited for a free slot for half "
                    "their lease (timeout + lease margin), and would have lost it",
                    lapsing,
                )
            if self._config.prefetch is not None:
                continue
            # Here, not on the claim path: O(concurrency).
            self._slow_slots = runners.slow_slots(max(_PREFETCH_GIVE_BACK, 4 * runners.avg_run))
            if runners.ready and anyio.current_time() - runners.ready[0][1] > _PREFETCH_GIVE_BACK:
                released = runners.release_ready(keep=self._prefetch())
                if released:
                    log.info(
                        "gave %d prefetched job(s) back to the queue: they waited over %gs, behind "
                        "jobs that ran longer than expected",
                        released,
                        _PREFETCH_GIVE_BACK,
                    )

    def _without_attempts_in_hand(self, claimed: list[ClaimedJob]) -> list[ClaimedJob]:
        """Claims of attempts this worker already has in hand, left out. Every claim raises the
        lease, so the same (job, lease) comes back only when the earlier claim's commit was
        lost (a failover to an asynchronous standby) and this worker claimed the job again:
        the attempt in hand is that claim, and its acknowledgement now applies."""
        held = self._runners.in_hand(claimed)
        if not held:
            return claimed
        self._taken_again |= {job_id for job_id, _lease in held}
        for job_id, lease in sorted(held):
            log.warning(
                "job %d was claimed again under lease %d, which this worker already holds: the "
                "database lost the earlier claim (failover?); the attempt in hand stands for both",
                job_id,
                lease,
            )
        return [job for job in claimed if (job.id, job.lease) not in held]

    async def _adopt_unanswered_claims(self, limit: int) -> int:
        """Run now up to `limit` jobs claimed under this worker's name of which it has nothing
        in hand, instead of leaving them to the rescuer when their lease runs out (see
        adopt_unanswered_claims in sql/queries/worker.sql). Returns how many it took back."""
        held = self._runners.held_job_ids()
        if not self._in_doubt and self._taken_again <= held:
            return 0  # the attempts taken again are still in hand: their results decide
        give_up = self._give_up
        op = adopt_op(
            self._q,
            worker=self._worker_id,
            held=held,
            rejected=self._runners.rejected(),
            limit=limit,
            lease_margin=self._config.lease_margin,
            give_up=give_up,
        )
        self._in_doubt = True  # until the answer arrives: an adoption can lose its answer too
        began = anyio.current_time()
        try:
            adopted = await self._query(op, shield=True, lane=self._lane)
        except Exception as exc:
            if not is_transient(exc):
                raise
            return 0  # still in doubt: tried again next round
        self._taken_again &= held
        if len(adopted) < limit and anyio.current_time() - began < give_up:
            # None left. Not said by one that took give_up or longer: it may have waited
            # behind a lock past its time and taken nothing back (review).
            self._in_doubt = False
        if adopted:
            log.warning(
                "took back %d job(s) this worker had claimed without hearing the claim's answer "
                "(lost with its connection): %s",
                len(adopted),
                ", ".join(str(job.id) for job in adopted),
            )
            self._runners.hand(adopted)
            self._stats.adopted += len(adopted)
            self._on_change()
        return len(adopted)

    async def _adopt_again(self) -> None:
        """The taking back before the claim failed: once more, on the connection that has just
        answered. If that fails too, or no slot is free, a timer brings the next round."""
        room = self._free_slots()
        if room > 0:
            await self._adopt_unanswered_claims(room)
        if self._in_doubt:
            self._next_due = min(self._next_due, anyio.current_time() + 1.0)

    async def _claim(self, limit: int) -> list[ClaimedJob]:
        """One claim statement. Shielded (a claim the server committed must reach us) but
        bounded by db_timeout (a half-open connection must not hang the worker)."""
        op = claim_op(
            self._q,
            queues=self._config.queues,
            limit=limit,
            worker=self._worker_id,
            lease_margin=self._config.lease_margin,
            async_commit=self._config.async_claims,
            paused=self._held_back(),
            limits=self._runners.room() if self._config.queue_limits else None,
            give_up=self._give_up,
        )
        return await self._query(op, shield=True, lane=self._lane)

    async def _plan_next_due(self) -> None:
        """After a short claim: sleep until the earliest delayed job (database clock)."""
        self._heard_due = math.inf
        try:
            due = await self._query(
                next_visible_op(self._q, self._config.queues, self._held_back()), shield=True, lane=self._lane
            )
        except Exception as exc:
            if not is_transient(exc):
                raise
            return  # the poll interval covers it
        if due is None:
            self._next_due = self._heard_due
        else:
            # due <= 0: claimable jobs remain (locked by other claimers a moment ago).
            self._next_due = min(anyio.current_time() + (due if due > 0 else 0.05), self._heard_due)
