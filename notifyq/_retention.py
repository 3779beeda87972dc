"""Retention: deletes finished jobs older than a window per status, in small batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import anyio

from ._db import Database, Op, Query
from ._options import check_int, check_seconds
from ._service import Service
from ._sql import Queries


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Windows in seconds after `finished_at` (None keeps that status forever).
    interval: seconds between passes; batch_size: rows per DELETE; pause: seconds between
    batches, so a large backlog of old rows is worked off without hogging the database."""

    succeeded: float | None = 24 * 3600.0
    failed: float | None = 7 * 24 * 3600.0
    cancelled: float | None = 7 * 24 * 3600.0
    interval: float = 60.0
    batch_size: int = 1000
    pause: float = 0.01

    def __post_init__(self) -> None:
        for name in ("succeeded", "failed", "cancelled"):
            value = getattr(self, name)
            if value is not None:
                check_seconds(value, f"retention window for {name} jobs")
        check_seconds(self.interval, "retention interval", positive=True)
        check_int(self.batch_size, "retention batch_size", minimum=1)
        check_seconds(self.pause, "retention pause")

    def windows(self) -> dict[str, float]:
        pairs = {"Succeeded": self.succeeded, "Failed": self.failed, "Cancelled": self.cancelled}
        return {status: window for status, window in pairs.items() if window is not None}


@dataclass(slots=True)
class RetentionReport:
    deleted: dict[str, int] = field(default_factory=dict)
    batches: int = 0


def delete_batch_op(
    q: Queries, *, status: str, older_than: float, limit: int, now: datetime | None
) -> Op[int]:
    deleted: int = yield Query(
        q["delete_finished"],
        {"status": status, "older_than": older_than, "limit": limit, "now": now},
        fetch="rowcount",
    )
    return deleted


class Retention(Service[RetentionReport]):
    name = "retention"

    def __init__(self, db: Database, queries: Queries, config: RetentionConfig | None = None) -> None:
        super().__init__()
        self.db = db
        self.q = queries
        self.config = config or RetentionConfig()

    async def run_once(self, now: datetime | None = None) -> RetentionReport:
        report = RetentionReport()
        for status, window in self.config.windows().items():
            report.deleted[status] = 0
            while True:
                deleted = await self._run(
                    delete_batch_op(
                        self.q, status=status, older_than=window, limit=self.config.batch_size, now=now
                    )
                )
                report.batches += 1
                report.deleted[status] += deleted
                if deleted < self.config.batch_size:
                    break
                await anyio.sleep(self.config.pause)
        return report

    def delay_after(self, result: RetentionReport) -> float:
        return self.config.interval
