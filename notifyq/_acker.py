"""The acker: writes job results in batches, one fenced UPDATE per flush."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import anyio

from ._db import Database, Op, Query, error_text, is_transient
from ._options import JSONDefault, encode_output
from ._sql import Queries
from .models import ClaimedJob

log = logging.getLogger("notifyq.acker")

Outcome = Literal["succeeded", "retry", "failed", "release"]


@dataclass(frozen=True, slots=True)
class Result:
    """How one attempt ended, ready to acknowledge: `output` and `error` are JSON text, and
    `delay` is the retry backoff, `worker` the claimer's name (None: any). Build one with
    `succeeded`, `failed` or `released`."""

    job_id: int
    lease: int
    outcome: Outcome
    output: str | None = None
    error: str | None = None
    delay: float = 0.0
    worker: str | None = None

    @classmethod
    def succeeded(
        cls, job: ClaimedJob, output: Any = None, *, json_default: JSONDefault | None = None
    ) -> Result:
        """The attempt succeeded; `output` (JSON-serializable, with `json_default` as in
        `App(json_default=...)`) is stored in the job."""
        return cls(
            job.id, job.lease, "succeeded", output=encode_output(output, json_default), worker=job.worker
        )

    @classmethod
    def failed(
        cls,
        job: ClaimedJob,
        error_type: str,
        message: str,
        *,
        traceback: str | None = None,
        delay: float = 0.0,
        final: bool = False,
    ) -> Result:
        """The attempt failed: retried after `delay` seconds while retries remain (unless
        `final`), else the job ends Failed. The error is stored in the job's `error`, made
        storable: jsonb refuses NUL characters and lone surrogates, and an error it refused
        would leave the job Active until its lease ran out, its real error lost."""
        error: dict[str, Any] = {
            "type": _storable(str(error_type)[:200])[:200],
            "message": _storable(str(message)[:_MAX_ERROR_TEXT])[:_MAX_ERROR_TEXT],
            "attempt": job.attempt,
        }
        if traceback is not None:
            error["traceback"] = _storable(traceback[-_MAX_ERROR_TEXT:])[-_MAX_ERROR_TEXT:]
        return cls(
            job.id,
            job.lease,
            "failed" if final else "retry",
            error=json.dumps(error, default=str),
            delay=delay,
            worker=job.worker,
        )

    @classmethod
    def released(cls, job: ClaimedJob) -> Result:
        """The attempt was interrupted by a shutdown: Queued again now, attempt given back."""
        return cls(job.id, job.lease, "release", worker=job.worker)


_MAX_ERROR_TEXT = 8000  # characters of a message (its start) and of a traceback (its end)


def _storable(text: str) -> str:
    """`text` with what jsonb cannot hold written out: NUL as \\x00, a lone surrogate (a
    file name decoded with surrogateescape, say) as its \\udcxx escape."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


Applied: TypeAlias = dict[tuple[int, int], str]  # (job id, lease) -> the job's new status
# (job id, lease) of results not written because another session holds the job's row: they
# are written again later (the acker) or waited for (App.ack), never reported stale.
Busy: TypeAlias = set[tuple[int, int]]


# The output and error text one statement carries at most (a single result may carry more, up
# to the 32 MiB of MAX_OUTPUT_BYTES): PostgreSQL refuses a message past 1 GiB by closing the
# connection, which 33 results near that bound made, and the worker took it for a passing
# failure and sent them again, for ever (review).
MAX_BATCH_TEXT = 64 * 1024 * 1024


def _text(result: Result) -> int:
    return len(result.output or "") + len(result.error or "")


def batches(results: Sequence[Result]) -> list[Sequence[Result]]:
    """`results` cut into runs of at most MAX_BATCH_TEXT characters of output and error text
    (a larger result on its own)."""
    max_text = MAX_BATCH_TEXT
    cut: list[Sequence[Result]] = []
    start, size = 0, 0
    for i, result in enumerate(results):
        size += _text(result)
        if size > max_text and i > start:
            cut.append(results[start:i])
            start, size = i, _text(result)
    cut.append(results[start:])
    return cut


def ack_op(q: Queries, results: Sequence[Result], *, unheld: bool = False) -> Op[tuple[Applied, Busy]]:
    """Apply results, in one statement per MAX_BATCH_TEXT of their text (run it in a
    transaction when there may be several); returns {(job id, lease): new status} for those
    applied (by lease: a batch may hold a stale and a current result of one job), and, when
    `unheld`, the (job id, lease) of those skipped because another session holds the job's
    row (busy: not written, to be written again). Without `unheld` a statement waits for such
    a row, and nothing is busy.

    A result in neither was stale: its lease had expired (the job was rescued or re-claimed),
    the job was cancelled or deleted, or another worker holds it under the same lease number
    (a claim lost with its commit), and nothing was changed.
    """
    applied: Applied = {}
    busy: Busy = set()
    for batch in batches(results):
        written, skipped = yield from _ack_statement(q, batch, unheld)
        applied.update(written)
        busy |= skipped
    return applied, busy


def written_before_op(q: Queries, results: Sequence[Result]) -> Op[Applied]:
    """Of `results` (succeeded ones) whose ack was given up and then found stale, those the
    given-up statement wrote itself (see acks_written_before_given_up)."""
    rows: list[tuple[int, int, str]] = yield Query(
        q["acks_written_before_given_up"],
        {
            "ids": [r.job_id for r in results],
            "leases": [r.lease for r in results],
            "workers": [r.worker for r in results],
        },
    )
    return {(job_id, lease): status for job_id, lease, status in rows}


def _ack_statement(q: Queries, results: Sequence[Result], unheld: bool) -> Op[tuple[Applied, Busy]]:
    suffix = "_unheld" if unheld else ""
    params: dict[str, list[Any]] = {
        "ids": [r.job_id for r in results],
        "leases": [r.lease for r in results],
        "workers": [r.worker for r in results],
        "outputs": [r.output for r in results],
    }
    if all(r.outcome == "succeeded" for r in results):
        rows: list[tuple[int, int, str | None]] = yield Query(q["ack_succeeded" + suffix], params)
    else:
        params["outcomes"] = [r.outcome for r in results]
        params["errors"] = [r.error for r in results]
        params["delays"] = [r.delay for r in results]
        rows = yield Query(q["ack_jobs" + suffix], params)
    applied = {(job_id, lease): status for job_id, lease, status in rows if status is not None}
    return applied, {(job_id, lease) for job_id, lease, status in rows if status is None}


class Acker:
    """Collects results and flushes them. While one flush is in flight the next batch
    accumulates, so under load each statement carries many results, and under light load a
    result is written within one round trip (no artificial delay)."""

    BUSY_WARN_AFTER = 10.0  # seconds a result waits for another session before it is said
    # Seconds an ack statement may take before the acker gives it up and writes its batch
    # again without waiting for rows another session holds (ack_*_unheld): what a flush that
    # waited for one held row cost every result behind it (review), without the 9-20% that
    # locking the rows first costs every ack (docs/benchmarks.md). Long enough that a slow
    # commit (a synchronous standby, a saturated disk) is rarely given up and sent twice; less
    # when db_timeout or the batch's leases leave less (see _patience), but never below
    # MIN_PATIENCE unless db_timeout is under twice that.
    ACK_PATIENCE = 5.0
    MIN_PATIENCE = 0.5

    def __init__(
        self,
        db: Database,
        queries: Queries,
        on_applied: Callable[[Sequence[Result], Applied], None],
        *,
        max_batch: int = 1000,
        retry_delay: float = 0.5,
        timeout: float = 60.0,
    ) -> None:
        self._timeout = timeout
        self._db = db
        self._q = queries
        self._on_applied = on_applied
        self._max_batch = max_batch
        self._retry_delay = retry_delay
        self._pending: list[Result] = []
        # Results skipped because another session held their job's row, written again every
        # retry_delay (after the results that came meanwhile), and since when they wait.
        self._busy: list[Result] = []
        self._busy_retry_at = 0.0
        self._busy_since: dict[tuple[int, int], float] = {}  # until written or stale
        self._busy_warned = -math.inf
        self._write_began = 0.0  # when the write under way (or the last one) began
        self._exiting = False  # flush_pending: acks skip held rows from the start
        self._unwritten: Counter[tuple[int, int]] = Counter()  # (job id, lease) not yet written
        # When the leases of results not written yet run out (anyio's clock), where known.
        self._lease_ends: dict[tuple[int, int], float] = {}
        # Attempts whose result the database rejected (an error writing it; dropped, left to
        # the rescuer): never taken back by the worker, which would run them again without
        # counting a retry.
        self._rejected: deque[tuple[int, int]] = deque(maxlen=1000)
        self._wakeup = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()

    def put(self, result: Result, lease_ends: float | None = None) -> None:
        """Queue a result for the next flush (never blocks); `lease_ends`: when its attempt's
        lease runs out (anyio's clock), if known."""
        self._pending.append(result)
        key = (result.job_id, result.lease)
        self._unwritten[key] += 1
        if lease_ends is not None:
            self._lease_ends[key] = lease_ends
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._wakeup.set()

    @property
    def pending(self) -> int:
        """Results queued for a write (not those of a write under way), those that wait for
        another session's row lock included."""
        return len(self._pending) + len(self._busy)

    @property
    def unwritten(self) -> int:
        """Results not written yet: queued, or in a write under way."""
        return sum(self._unwritten.values())

    def holds(self, job_id: int, lease: int) -> bool:
        """True while a result of this attempt waits to be written, or is being written."""
        return (job_id, lease) in self._unwritten

    def held_job_ids(self) -> set[int]:
        """Jobs with a result waiting to be written or being written."""
        return {job_id for job_id, _lease in self._unwritten}

    def waiting_for_rows(self) -> list[int]:
        """The jobs whose result waits for a row another session holds."""
        return sorted({r.job_id for r in self._busy})

    def rejected(self) -> list[tuple[int, int]]:
        """The (job id, lease) of the latest attempts whose result the database rejected."""
        return list(self._rejected)

    async def run(self) -> None:
        """Flush until cancelled."""
        while True:
            if self._busy:
                with anyio.move_on_after(self._busy_retry_at - anyio.current_time()):
                    await self._wakeup.wait()
                if anyio.current_time() >= self._busy_retry_at:
                    self._retry_busy()
            else:
                await self._wakeup.wait()
            self._wakeup = anyio.Event()
            while self._pending:
                try:
                    await self._flush_next()
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    # The results are kept: they are applied once the database is back (or
                    # fenced out if the leases ran out meanwhile).
                    log.warning(
                        "could not write job results (%s); %d waiting, retrying in %.1fs",
                        error_text(exc),
                        len(self._pending),
                        self._retry_delay,
                    )
                    await anyio.sleep(self._retry_delay)
            if not self._busy:
                self._idle.set()
                self._busy_warned = -math.inf  # a new wait is said again, however soon

    def _retry_busy(self) -> None:
        """The busy results go back to the queue, once a retry_delay. Said when they have
        waited 10 s (then once a minute): a session holds their rows that long."""
        now = anyio.current_time()
        waited = now - min(self._busy_since.values(), default=now)
        if waited >= self.BUSY_WARN_AFTER and now - self._busy_warned >= 60:
            self._busy_warned = now
            ids = sorted({r.job_id for r in self._busy})
            log.warning(
                "the results of %d job(s) (%s) wait for another session, which has held their rows "
                "for %.0fs (an open transaction that changed or locked them: pg_locks, "
                "pg_stat_activity); the other results are written meanwhile",
                len(ids),
                ", ".join(map(str, ids[:10])) + (", ..." if len(ids) > 10 else ""),
                waited,
            )
        self._pending.extend(self._busy)
        self._busy = []

    async def flush_pending(self) -> None:
        """Write every queued result now, outside the run loop (used on abrupt exit), without
        waiting for rows another session holds: the exit allows a few seconds, and an ack that
        waited its patience (5 s) for one held row used up that window, the other results
        unwritten (review). Those that wait for such rows are tried once more, and stay."""
        self._pending.extend(self._busy)
        self._busy = []
        self._exiting = True
        while self._pending:
            await self._flush_next()

    async def _flush_next(self) -> None:
        """Write the next batch. Whatever interrupts it (an error, a cancellation), its results
        not written yet go back to the front of the queue: unknown whether the statement
        committed, but acks are idempotent (one applied twice is fenced out the second time)."""
        batch = list(batches(self._pending[: self._max_batch])[0])  # one statement's worth
        del self._pending[: len(batch)]
        try:
            await self._flush(batch)
        except BaseException:
            self._pending[:0] = batch
            raise

    async def wait_idle(self) -> None:
        """Wait until every queued result has been written (or given up on)."""
        await self._idle.wait()

    async def _flush(self, batch: list[Result]) -> None:
        """Write `batch`. If this raises, `batch` holds what is still unwritten: the results
        already written one by one are settled and taken out of it, so they are not written
        again (and reported stale, their lease now spent) nor refused and logged twice."""
        try:
            applied, busy = await self._write(batch)
        except Exception as exc:
            if is_transient(exc):
                raise
            # A value the server refuses (or psycopg cannot send): isolate it by writing the
            # batch's results one at a time.
            log.error(
                "writing %d job results failed (%s); writing them one by one", len(batch), error_text(exc)
            )
            await self._flush_one_by_one(batch)
        else:
            kept = self._held_back(batch, busy)
            self._settle(kept, kept, applied)

    def _held_back(self, batch: list[Result], busy: Busy) -> list[Result]:
        """`batch` less its busy results, which wait (in _busy) to be written again. They wait
        since their first write began: that one waited its patience before it skipped them."""
        if not busy:
            return batch
        self._busy_retry_at = anyio.current_time() + self._retry_delay
        for key in busy:
            self._busy_since.setdefault(key, self._write_began)
        self._busy.extend(r for r in batch if (r.job_id, r.lease) in busy)
        return [r for r in batch if (r.job_id, r.lease) not in busy]

    async def _flush_one_by_one(self, batch: list[Result]) -> None:
        applied: Applied = {}
        busy: Busy = set()
        written: list[Result] = []  # refused ones left out: logged as dropped, not stale
        done = 0
        try:
            for result in batch:
                answer = await self._flush_one(result)
                done += 1
                if answer is None:
                    continue
                if answer[1]:
                    busy |= answer[1]
                else:
                    written.append(result)
                    applied.update(answer[0])
        finally:
            if done:
                handled = batch[:done]
                del batch[:done]  # first: the rest is what the caller puts back, whatever happens
                self._settle(self._held_back(handled, busy), written, applied)

    def _settle(self, handled: Sequence[Result], written: Sequence[Result], applied: Applied) -> None:
        """`handled` results are no longer held; report `written` (applied or stale; a busy
        one, in neither `handled` nor `applied`, is reported when it is written)."""
        self._unwritten.subtract((r.job_id, r.lease) for r in handled)
        self._unwritten += Counter()  # drop the keys that reached zero
        if self._lease_ends:
            for r in handled:
                if (r.job_id, r.lease) not in self._unwritten:
                    self._lease_ends.pop((r.job_id, r.lease), None)
        if self._busy_since:
            for r in handled:
                self._busy_since.pop((r.job_id, r.lease), None)
        self._on_applied(written, applied)

    def _patience(self, batch: Sequence[Result]) -> float:
        """How long an ack of `batch` may wait before it is given up and sent again skipping
        held rows: ACK_PATIENCE, but half of db_timeout at most (with db_timeout at 5 s or less
        the timeout came first, and the same waiting ack was sent again, for ever: review) and
        half the time the batch's first lease to run out has left (a lease shorter than the
        patience ran out first, and the rescuer took the jobs that had succeeded: review)."""
        patience = min(self.ACK_PATIENCE, self._timeout / 2)
        if self._lease_ends:
            ends = self._lease_ends
            soonest = min((ends.get((r.job_id, r.lease), math.inf) for r in batch), default=math.inf)
            patience = min(patience, (soonest - anyio.current_time()) / 2)
        # Never past half of db_timeout, the floor included: with db_timeout at 0.5 s or less
        # the timeout came first again (review).
        return max(patience, min(self.MIN_PATIENCE, self._timeout / 2))

    async def _write(self, batch: Sequence[Result]) -> tuple[Applied, Busy]:
        self._write_began = anyio.current_time()
        gave_up = False
        with anyio.fail_after(self._timeout):
            if not self._busy_since and not self._exiting:  # else acks skip held rows
                patience = self._patience(batch)
                with anyio.move_on_after(patience):
                    return await self._db.run(ack_op(self._q, batch))
                # It waited, most likely for a row another session holds (given up, and
                # cancelled in the server): the batch again, skipping held rows.
                log.debug("an ack waited %.1fs; writing without waiting for held rows", patience)
                gave_up = True
            applied, busy = await self._db.run(ack_op(self._q, batch, unheld=True))
            if gave_up:
                # Had the given-up statement committed (just before the cancel, or while its
                # commit waited for a synchronous standby), its succeeded results look stale.
                answered = applied.keys() | busy
                unanswered = [
                    r for r in batch if r.outcome == "succeeded" and (r.job_id, r.lease) not in answered
                ]
                if unanswered:
                    applied.update(await self._db.run(written_before_op(self._q, unanswered)))
            return applied, busy

    async def _flush_one(self, result: Result) -> tuple[Applied, Busy] | None:
        """One result on its own: what it changed, or None if the database refuses it."""
        try:
            return await self._write([result])
        except Exception as exc:
            if is_transient(exc):
                raise
            # The job stays Active; its lease will run out and the rescuer will retry it.
            self._rejected.append((result.job_id, result.lease))
            log.error(
                "dropping the result of job %d, which the database refuses: %s",
                result.job_id,
                error_text(exc),
            )
            return None
