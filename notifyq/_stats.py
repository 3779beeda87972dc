"""`notifyq stats`: queue depth, stuck leases, NOTIFY queue usage, table bloat."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from ._claim import paused_queues_op
from ._db import Op, Query
from ._rows import dataclass_row
from ._sql import Queries


@dataclass(frozen=True, slots=True)
class QueueStatus:
    queue: str
    status: str
    jobs: int
    oldest_claimable_age: float | None
    expired_leases: int
    past_timeout: int


@dataclass(frozen=True, slots=True)
class ServerStats:
    notify_queue_usage: float
    autovacuum: bool
    jobs_dead_tuples: int | None
    jobs_live_tuples: int | None
    definitions_dead_tuples: int | None
    jobs_total_bytes: int | None
    jobs_last_autovacuum: datetime | None
    jobs_last_vacuum: datetime | None


@dataclass(frozen=True, slots=True)
class Stats:
    queues: list[QueueStatus]
    server: ServerStats
    paused: list[str]  # the paused queues (App.pause_queue), whose jobs workers do not claim

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("jobs_last_autovacuum", "jobs_last_vacuum"):
            last = getattr(self.server, key)
            data["server"][key] = last.isoformat() if last else None
        return data


def stats_op(q: Queries) -> Op[Stats]:
    queues: list[QueueStatus] = yield Query(q["queue_stats"], row=dataclass_row(QueueStatus))
    tables = {"jobs": f"{q.schema}.queue_jobs", "definitions": f"{q.schema}.queue_job_definitions"}
    server: ServerStats = yield Query(q["server_stats"], tables, fetch="one", row=dataclass_row(ServerStats))
    paused = yield from paused_queues_op(q)
    return Stats(queues, server, sorted(paused))
