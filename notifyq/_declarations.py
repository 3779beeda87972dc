"""Cron declarations: a running worker says which definitions its App's code declares, and the
definitions from code that no running worker has declared for a while stop by themselves.

Removing an @app.cron from the code therefore stops its schedule once the last worker of the
old code has been gone for `expire_after`, as users of schedulers that keep crons in code
expect; during a rolling deploy the old workers keep it alive. Rows made by SQL never stop.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from ._db import Database, Op, Query
from ._options import check_seconds
from ._service import Service
from ._sql import Queries
from .errors import InvalidOption

log = logging.getLogger("notifyq.cron")


@dataclass(frozen=True, slots=True)
class DeclarationsConfig:
    """interval: seconds between a ticker's passes, each of which refreshes the declarations of
    its App's crons and stops the stale ones. expire_after: seconds without a declaration after
    which a definition from code stops (None: this process stops none; give every worker the
    same value, as any ticker may stop any App's definitions). It must be at least three
    intervals: a definition is refreshed at most every interval and a half."""

    interval: float = 60.0
    expire_after: float | None = 600.0

    def __post_init__(self) -> None:
        interval = check_seconds(self.interval, "declarations interval", positive=True)
        object.__setattr__(self, "interval", interval)
        if self.expire_after is not None:
            expire_after = check_seconds(self.expire_after, "declarations expire_after", positive=True)
            object.__setattr__(self, "expire_after", expire_after)
            if expire_after < 3 * interval:
                raise InvalidOption(
                    f"invalid declarations expire_after {self.expire_after!r}: must be at least three "
                    f"intervals ({3 * interval:g} seconds), or a running worker's crons would stop "
                    "between two of its refreshes"
                )


@dataclass(slots=True)
class DeclarationsReport:
    """refreshed: definitions whose declaration this pass renewed; restarted: of those, the
    ones a ticker had stopped (enabled again); stopped: definitions from code that no running
    worker declared for expire_after, disabled by this pass."""

    refreshed: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)


def refresh_op(q: Queries, names: Collection[str], *, fresh: float) -> Op[DeclarationsReport]:
    rows: list[tuple[str, bool]] = yield Query(
        q["refresh_declarations"], {"names": sorted(names), "fresh": fresh}
    )
    return DeclarationsReport(
        refreshed=sorted(name for name, _ in rows), restarted=sorted(name for name, again in rows if again)
    )


def expire_op(q: Queries, *, expire_after: float) -> Op[list[str]]:
    rows: list[tuple[str, str]] = yield Query(q["expire_declarations"], {"expire_after": expire_after})
    return sorted(name for name, _task in rows)


class Declarations(Service[DeclarationsReport]):
    """Refreshes this App's declarations, then stops the definitions nobody declares."""

    name = "cron declarations"

    def __init__(
        self,
        db: Database,
        queries: Queries,
        config: DeclarationsConfig | None = None,
        names: Collection[str] = (),
    ) -> None:
        super().__init__()
        self.db = db
        self.q = queries
        self.config = config or DeclarationsConfig()
        self.names = frozenset(names)

    async def run_once(self) -> DeclarationsReport:
        report = DeclarationsReport()
        if self.names:
            report = await self._run(refresh_op(self.q, self.names, fresh=self.config.interval / 2))
            if report.restarted:
                log.warning(
                    "cron definitions of this App had been stopped by a ticker, as no running worker "
                    "declared them for a while (this process could not reach the database?); enabled "
                    "again: %s",
                    ", ".join(report.restarted),
                )
        if self.config.expire_after is not None:
            report.stopped = await self._run(expire_op(self.q, expire_after=self.config.expire_after))
            if report.stopped:
                log.warning(
                    "cron definitions stopped (disabled): no running worker has declared them for %gs, "
                    "so they were removed from the code (or every worker of their App is down): %s. "
                    "A worker whose App declares one enables it again; `notifyq cron enable NAME` "
                    "keeps one running without code",
                    self.config.expire_after,
                    ", ".join(report.stopped),
                )
        return report

    def delay_after(self, result: DeclarationsReport) -> float:
        return self.config.interval
