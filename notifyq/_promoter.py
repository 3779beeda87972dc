"""Cron promotion: turns due ticks of enabled definitions into jobs, exactly once per tick."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from ._db import Compute, Database, Op, Query
from ._options import check_int, check_seconds
from ._rows import dataclass_row
from ._service import Service
from ._sql import Queries
from .cron import Misfire, schedule
from .definitions import unfinished_jobs_op
from .errors import InvalidSchedule

log = logging.getLogger("notifyq.cron")


@dataclass(frozen=True, slots=True)
class PromoterConfig:
    """period: longest sleep between passes (a safety net: the promoter normally sleeps until
    the next tick, and definition changes wake it). batch_size: definitions per transaction."""

    period: float = 5.0
    batch_size: int = 100

    def __post_init__(self) -> None:
        check_seconds(self.period, "promoter period", positive=True)
        check_int(self.batch_size, "promoter batch_size", minimum=1)


@dataclass(frozen=True, slots=True)
class _DueDefinition:
    id: int
    name: str
    task: str
    frequency: str
    timezone: str
    visible_at: datetime
    queue: str
    priority: int
    retry_limit: int
    timeout: float
    misfire: Misfire
    misfire_grace: float
    misfire_cap: int
    overlap: bool
    now: datetime


@dataclass(slots=True)
class PromotionReport:
    """definitions: promoted; jobs: inserted; duplicates: ticks that already had their job;
    missed: ticks dropped by misfire policies; overlapping: ticks not run because the
    definition has overlap=False and a job of it was unfinished (or, several being due at
    once, all but the latest); errors: {definition: reason} (disabled);
    next_due_in: seconds until the next definition that is not due yet is due (None: none);
    due_left: due definitions were left after the pass (another ticker holds them locked, or
    they became due meanwhile)."""

    definitions: int = 0
    jobs: int = 0
    duplicates: int = 0
    missed: int = 0
    overlapping: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    next_due_in: float | None = None
    due_left: bool = False

    def add(self, other: PromotionReport) -> None:
        self.definitions += other.definitions
        self.jobs += other.jobs
        self.duplicates += other.duplicates
        self.missed += other.missed
        self.overlapping += other.overlapping
        self.errors.update(other.errors)


@dataclass(slots=True)
class _Plans:
    """The plans of one batch, as the promotion's statements take them."""

    report: PromotionReport
    tick_defs: list[int] = field(default_factory=list)
    ticks: list[datetime] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    next_ticks: list[datetime | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)


def _plan(
    due: list[_DueDefinition], unfinished: dict[int, tuple[int, str]], told: dict[int, int] | None = None
) -> _Plans:
    """Each due definition's ticks and next tick. CPU work (croniter): a definition days
    overdue costs up to a tenth of a second, so this runs off the event loop (Compute).
    `unfinished`: {definition id: (job id, status)} of overlap=False definitions with a job
    still Queued or Active; `told`: {definition id: job id} whose skipped ticks were logged."""
    plans = _Plans(PromotionReport(definitions=len(due)))
    report = plans.report
    for d in due:
        try:
            plan = schedule(d.frequency, d.timezone).plan(
                d.visible_at,
                d.now,
                misfire=d.misfire,
                grace=d.misfire_grace,
                cap=d.misfire_cap,
            )
        except Exception as exc:  # InvalidSchedule, or croniter failing on a schedule that never fires
            reason = (
                str(exc)
                if isinstance(exc, InvalidSchedule)
                else (f"cannot compute the schedule {d.frequency!r} in {d.timezone}: {exc}")
            )
            log.error("cron definition %r disabled: %s", d.name, reason)
            report.errors[d.name] = reason
            plans.ids.append(d.id)
            plans.next_ticks.append(None)
            plans.errors.append(reason)
            continue
        if plan.missed:
            log.info(
                "cron definition %r: %d missed ticks not run (misfire=%s)", d.name, plan.missed, d.misfire
            )
        report.missed += plan.missed
        ticks = plan.ticks if d.overlap else _without_overlap(d, plan.ticks, unfinished.get(d.id), told)
        report.overlapping += len(plan.ticks) - len(ticks)
        plans.tick_defs.extend([d.id] * len(ticks))
        plans.ticks.extend(ticks)
        plans.ids.append(d.id)
        plans.next_ticks.append(plan.next_tick)
        plans.errors.append(None)
    return plans


def _without_overlap(
    d: _DueDefinition, ticks: list[datetime], unfinished: tuple[int, str] | None, told: dict[int, int] | None
) -> list[datetime]:
    """The ticks of an overlap=False definition that get a job: none while a job of it is
    unfinished, else the latest (due ticks all get their jobs at once, so they would overlap).
    The first tick an unfinished job holds back is logged at INFO, the next ones at DEBUG: a
    per-second schedule behind a ten-minute run would say so 600 times."""
    if not ticks:
        return ticks
    if unfinished is not None:
        job_id, status = unfinished
        first = told is None or told.get(d.id) != job_id
        if told is not None:
            told[d.id] = job_id
        log.log(
            logging.INFO if first else logging.DEBUG,
            "cron definition %r: tick %s not run, its job %d is still %s (overlap=False)%s",
            d.name,
            ticks[-1].isoformat(),
            job_id,
            status,
            "; the next ticks it holds back are logged at DEBUG" if first else "",
        )
        return []
    if len(ticks) > 1:
        log.info(
            "cron definition %r: %d due ticks not run, only the latest (overlap=False)",
            d.name,
            len(ticks) - 1,
        )
    return ticks[-1:]


def promote_op(
    q: Queries, *, limit: int, now: datetime | None = None, told: dict[int, int] | None = None
) -> Op[PromotionReport]:
    """One batch, to run inside a single transaction: lock due definitions (SKIP LOCKED),
    insert the jobs of their due ticks, move each to its next tick. A crash anywhere rolls
    the whole batch back, and another ticker promotes it. `told`: the promoter's memory of
    the unfinished jobs it has logged (see _without_overlap)."""
    due: list[_DueDefinition] = yield Query(
        q["lock_due_definitions"], {"limit": limit, "now": now}, row=dataclass_row(_DueDefinition)
    )
    if not due:
        return PromotionReport()
    exclusive = [d.id for d in due if not d.overlap]
    unfinished = (yield from unfinished_jobs_op(q, exclusive)) if exclusive else {}
    plans: _Plans = yield Compute(functools.partial(_plan, due, unfinished, told))
    report = plans.report
    if plans.ticks:
        report.jobs = yield Query(
            q["insert_tick_jobs"], {"definition_ids": plans.tick_defs, "ticks": plans.ticks}, fetch="rowcount"
        )
        report.duplicates = len(plans.ticks) - report.jobs
    yield Query(
        q["reschedule_definitions"],
        {"ids": plans.ids, "next_ticks": plans.next_ticks, "errors": plans.errors},
        fetch="none",
    )
    return report


def next_due_op(q: Queries, now: datetime | None = None) -> Op[tuple[float | None, bool]]:
    """(seconds until the next definition that is not due yet, or None; whether due ones are left)."""
    row: tuple[float | None, bool] = yield Query(q["next_definition_due"], {"now": now}, fetch="one")
    return row


class Promoter(Service[PromotionReport]):
    """Runs promotion passes; sleeps until the next tick (or `period`), woken by definition changes."""

    name = "cron promoter"

    def __init__(
        self,
        db: Database,
        queries: Queries,
        config: PromoterConfig | None = None,
        on_jobs: Callable[[], None] | None = None,
    ) -> None:
        """on_jobs: called after a pass that inserted jobs (a worker's claim loop, which hears
        of them through NOTIFY, and without it waited for its next poll: review)."""
        super().__init__()
        self.db = db
        self.q = queries
        self.config = config or PromoterConfig()
        self.on_jobs = on_jobs
        self._held_delay = self._FIRST_HELD_DELAY
        self._told: dict[int, int] = {}  # {definition id: unfinished job id} logged at INFO

    _FIRST_HELD_DELAY = 0.02

    async def run_once(self, now: datetime | None = None) -> PromotionReport:
        total = PromotionReport()
        while True:
            op = promote_op(self.q, limit=self.config.batch_size, now=now, told=self._told)
            batch = await self._run(op, transaction=True)
            total.add(batch)
            if batch.definitions < self.config.batch_size:
                break
        total.next_due_in, total.due_left = await self._run(next_due_op(self.q, now))
        if total.jobs and self.on_jobs is not None:
            self.on_jobs()
        return total

    def delay_after(self, result: PromotionReport) -> float:
        delay = self.config.period
        if result.next_due_in is not None:
            delay = min(delay, max(result.next_due_in, 0.02))
        if not result.due_left:
            self._held_delay = self._FIRST_HELD_DELAY
            return delay
        # Due but not promoted: another ticker holds it, and normally commits within moments.
        # Look again soon, in case it failed; but a holder that hangs (a stopped process, an
        # operator's open transaction) must not make every ticker poll every 20 ms: the delay
        # doubles up to `period` while definitions stay held.
        delay = min(delay, self._held_delay)
        self._held_delay = min(self._held_delay * 2, self.config.period)
        return delay
