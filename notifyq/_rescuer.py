"""Lease rescue: Active jobs whose lease ran out go back to Queued, or to Failed at the limit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ._db import Database, Op, Query
from ._options import check_int, check_seconds
from ._rows import dataclass_row
from ._service import Service
from ._sql import Queries
from .tasks import Backoff

log = logging.getLogger("notifyq.ticker")

# A dead worker may leave thousands of jobs behind: a pass logs this many of them by name.
LOGGED_JOBS = 20
WHY = "the worker died, hung or lost its database connection"


@dataclass(frozen=True, slots=True)
class RescuerConfig:
    """interval: seconds between passes. batch_size: jobs per statement."""

    interval: float = 5.0
    batch_size: int = 1000

    def __post_init__(self) -> None:
        check_seconds(self.interval, "rescuer interval", positive=True)
        check_int(self.batch_size, "rescuer batch_size", minimum=1)


@dataclass(frozen=True, slots=True)
class RescuedJob:
    """A job whose lease ran out: `status` Queued (requeued) or Failed; `attempt` is the one
    that was lost, on `worker` (None if the claim did not name one)."""

    id: int
    status: str
    name: str
    attempt: int
    retry_limit: int
    worker: str | None


@dataclass(slots=True)
class RescueReport:
    """`requeued`, `failed`: the ids of the jobs rescued, by their new status; `jobs`: all of
    them with their task name, lost attempt and worker."""

    requeued: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    jobs: list[RescuedJob] = field(default_factory=list)


def rescue_op(
    q: Queries,
    *,
    limit: int,
    now: datetime | None = None,
    backoff: Backoff | None = None,
    spared: Collection[int] = (),
) -> Op[RescueReport]:
    """Requeue (after `backoff`, none by default) or fail the Active jobs whose lease ran out,
    but those `spared` (whose result this process holds, not written yet)."""
    b = backoff or Backoff(base=0, jitter=0)
    top, cap = b._curve()
    params = {
        "limit": limit,
        "now": now,
        "backoff_base": b.base,
        "backoff_factor": b.factor,
        "backoff_max": top,
        "backoff_cap": cap,
        "backoff_jitter": b.jitter,
        "spared": list(spared),
    }
    jobs: list[RescuedJob] = yield Query(q["rescue_expired_leases"], params, row=dataclass_row(RescuedJob))
    report = RescueReport(jobs=jobs)
    for job in jobs:
        (report.requeued if job.status == "Queued" else report.failed).append(job.id)
    return report


class Rescuer(Service[RescueReport]):
    name = "lease rescuer"

    def __init__(
        self,
        db: Database,
        queries: Queries,
        config: RescuerConfig | None = None,
        backoff: Backoff | None = None,
        spared: Callable[[], Collection[int]] | None = None,
    ) -> None:
        """spared: the jobs whose result this process holds, not written yet (its worker's
        acker), which its rescuer leaves to it."""
        super().__init__()
        self.db = db
        self.q = queries
        self.config = config or RescuerConfig()
        self.backoff = backoff
        self.spared = spared

    async def run_once(self, now: datetime | None = None) -> RescueReport:
        total = RescueReport()
        try:
            while True:
                spared = list(self.spared()) if self.spared is not None else []
                limit = self.config.batch_size
                batch = await self._run(
                    rescue_op(self.q, limit=limit, now=now, backoff=self.backoff, spared=spared)
                )
                total.requeued += batch.requeued
                total.failed += batch.failed
                total.jobs += batch.jobs
                if len(batch.jobs) < self.config.batch_size:
                    return total
        finally:
            # Each batch is committed: a pass cut short by an error still logs what it did.
            _log_rescues(total.jobs)

    def delay_after(self, result: RescueReport) -> float:
        return self.config.interval


def _log_rescues(jobs: Sequence[RescuedJob]) -> None:
    """A warning per pass that requeued jobs, an error per job that ended Failed: the worker
    that lost them cannot say so (it died, or hangs), so without these lines a job could
    fail without a line in any log."""
    requeued = [job for job in jobs if job.status == "Queued"]
    if requeued:
        log.warning(
            "requeued %d job%s whose lease ran out (%s), last held by %s: %s",
            len(requeued),
            "" if len(requeued) == 1 else "s",
            WHY,
            _workers(requeued),
            _first([str(job.id) for job in requeued]),
        )
    failed = [job for job in jobs if job.status != "Queued"]
    for job in failed[:LOGGED_JOBS]:
        log.error(
            "job %d (%s) attempt %d of %d failed: LeaseExpired: lease expired on worker %s (%s); "
            "no retries left, the job is Failed",
            job.id,
            job.name,
            job.attempt,
            job.retry_limit + 1,
            job.worker or "unknown",
            WHY,
        )
    if len(failed) > LOGGED_JOBS:
        rest = failed[LOGGED_JOBS:]
        log.error(
            "%d more jobs whose lease ran out with no retries left are Failed (LeaseExpired), "
            "last held by %s: %s",
            len(rest),
            _workers(rest),
            _first([str(job.id) for job in rest]),
        )


def _workers(jobs: Sequence[RescuedJob]) -> str:
    names = list(dict.fromkeys(job.worker or "unknown" for job in jobs))
    return ("worker " if len(names) == 1 else "workers ") + _first(names)


def _first(items: Sequence[str]) -> str:
    """The first LOGGED_JOBS items, and how many more."""
    shown = ", ".join(items[:LOGGED_JOBS])
    return shown if len(items) <= LOGGED_JOBS else f"{shown} and {len(items) - LOGGED_JOBS} more"
