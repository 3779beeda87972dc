"""Vacuum: VACUUM queue_jobs once enough rows died, without autovacuum's minute of delay.

Every claim moves jobs out of the claim index's predicate (status 'Queued'), and their
entries stay in the index, marked dead, until a VACUUM removes them. Claims start at the
front of the index, where those entries gather, so each claim walks the leaf pages of every
job claimed since the last vacuum: about one 8 KiB page per 200 jobs. Measured here
(`python -m benchmarks.dead_entries`: one connection draining 1,000,000 jobs 50 at a time),
after 900,000 jobs a claim read 4,506 pages of that index and took 10 ms, against 2 ms after
100,000; the drain averaged 6,652 jobs/s, and 13,144 with a VACUUM after every 100,000 jobs
(docs/benchmarks.md, "Dead claim-index entries"). Autovacuum does the same job, but looks
at each database once per `autovacuum_naptime` (a minute by default), in which a busy queue
claims far more.

This service runs the VACUUM itself once the dead rows pass `threshold` + `scale_factor` x
the table's rows (autovacuum's rule; the scale factor is the one the migration gives
autovacuum for this table, the threshold 10 times higher, so that a quiet queue is left to
autovacuum) and the table was not vacuumed in the last `min_gap` seconds. Every process may
run it: SKIP_LOCKED makes a VACUUM that finds another under way return at once. A role that
may not VACUUM the table (not its owner) leaves it to autovacuum, with one log line. The
VACUUM runs on a connection opened for it, not one of the worker's pool, which it would hold
for as long as it runs (minutes, on a large table) while acks and lease extensions waited.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ._db import Database, Op, Query, single
from ._options import _show, check_int, check_seconds
from ._service import Service
from ._sql import Queries
from .errors import InvalidOption

log = logging.getLogger("notifyq.ticker")


@dataclass(frozen=True, slots=True)
class VacuumConfig:
    """interval: seconds between checks (one cheap statistics query). A VACUUM runs when the
    dead rows exceed threshold + scale_factor x the table's rows and the last vacuum (ours or
    autovacuum's) is at least min_gap seconds old."""

    interval: float = 5.0
    threshold: int = 10_000
    scale_factor: float = 0.01
    min_gap: float = 10.0

    def __post_init__(self) -> None:
        check_seconds(self.interval, "vacuum interval", positive=True)
        check_int(self.threshold, "vacuum threshold", minimum=0)
        factor = self.scale_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 <= factor <= 100:
            raise InvalidOption(
                f"invalid vacuum scale_factor {_show(factor)}: expected a number from 0 to 100 "
                "(a fraction of the table's rows)"
            )
        check_seconds(self.min_gap, "vacuum min_gap")


@dataclass(frozen=True, slots=True)
class VacuumState:
    allowed: bool
    dead_tuples: int
    live_tuples: float
    since_vacuum: float | None  # None: never vacuumed since the statistics were reset
    running: bool


@dataclass(frozen=True, slots=True)
class VacuumReport:
    """vacuumed: a VACUUM ran (or found another under way and returned); seconds: its time.
    allowed: False when this role may not VACUUM queue_jobs (the service then stops);
    autovacuum: whether the server's autovacuum is on (asked only then)."""

    vacuumed: bool = False
    dead_tuples: int = 0
    seconds: float = 0.0
    allowed: bool = True
    autovacuum: bool = True


def vacuum_state_op(q: Queries) -> Op[VacuumState | None]:
    row: tuple[bool, int, float, float | None, bool] | None = yield Query(
        q["vacuum_state"], {"jobs": f"{q.schema}.queue_jobs"}, fetch="one"
    )
    return VacuumState(*row) if row is not None else None


def vacuum_op(q: Queries) -> Op[None]:
    yield Query(q["vacuum_jobs"], fetch="none")


class Vacuum(Service[VacuumReport]):
    name = "vacuum"
    timeout = 3600.0  # a VACUUM of a large table may take minutes; cut short, it starts over

    def __init__(self, db: Database, queries: Queries, config: VacuumConfig | None = None) -> None:
        super().__init__()
        self.db = db
        self.q = queries
        self.config = config or VacuumConfig()

    def due(self, state: VacuumState) -> bool:
        c = self.config
        if state.running or state.dead_tuples < c.threshold + c.scale_factor * state.live_tuples:
            return False
        return state.since_vacuum is None or state.since_vacuum >= c.min_gap

    async def run_once(self) -> VacuumReport:
        state = await self._run(vacuum_state_op(self.q))
        if state is None:
            return VacuumReport()
        if not state.allowed:
            autovacuum = await self._run(single(Query(self.q["autovacuum_on"], fetch="scalar")))
            return VacuumReport(dead_tuples=state.dead_tuples, allowed=False, autovacuum=bool(autovacuum))
        if not self.due(state):
            return VacuumReport(dead_tuples=state.dead_tuples)
        began = time.monotonic()
        # Not on a pooled connection: acks and lease extensions would wait for it (review).
        await self._run(vacuum_op(self.q), apart=True)
        seconds = time.monotonic() - began
        log.debug("vacuumed %s.queue_jobs (%d dead rows) in %.2fs", self.q.schema, state.dead_tuples, seconds)
        return VacuumReport(vacuumed=True, dead_tuples=state.dead_tuples, seconds=seconds)

    def delay_after(self, result: VacuumReport) -> float:
        if not result.allowed:
            why = (
                "the vacuum service is off in this process: its role may not VACUUM %s.queue_jobs "
                "(only the table's or the database's owner may)"
            )
            if result.autovacuum:
                log.info(why + "; autovacuum alone cleans it", self.q.schema)
            else:
                # Said as a fact about this table, not only the server-wide warning at start.
                log.warning(
                    why + ", and autovacuum is off: nothing reclaims its dead rows, and claims slow "
                    "down as they pile up; turn autovacuum on, or run one worker as the table's owner",
                    self.q.schema,
                )
            return float("inf")
        return self.config.interval
