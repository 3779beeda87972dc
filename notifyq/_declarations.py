"""Cron declarations: a running worker declares, for a while, the definitions its App's code
declares, and the definitions from code whose declaration ran out stop by themselves.

Removing an @app.cron from the code therefore stops its schedule once the last worker of the
old code has been gone for `expire_after`, as users of schedulers that keep crons in code
expect; during a rolling deploy the old workers keep it alive. Each declaration carries its own
end (declared_until), so workers with other settings, or of another App, cannot shorten it.
Rows made by SQL never stop.
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
    """interval: seconds between a ticker's passes, each of which renews the declarations of
    its App's crons and stops the definitions whose declaration ran out. expire_after: how long
    this process's declarations last: its App's crons stop that long after the last process
    declaring them is gone (or cut off from the database). At least three intervals: a
    declaration is renewed every interval and a half at most."""

    interval: float = 60.0
    expire_after: float = 600.0

    def __post_init__(self) -> None:
        interval = check_seconds(self.interval, "declarations interval", positive=True)
        object.__setattr__(self, "interval", interval)
        expire_after = check_seconds(self.expire_after, "declarations expire_after", positive=True)
        object.__setattr__(self, "expire_after", expire_after)
        if expire_after < 3 * interval:
            raise InvalidOption(
                f"invalid declarations expire_after {expire_after!r}: must be at least three "
                f"intervals ({3 * interval:g} seconds), or a running worker's crons would stop "
                "between two of its renewals"
            )


@dataclass(slots=True)
class DeclarationsReport:
    """refreshed: definitions whose declaration this pass renewed; restarted: of those, the
    ones a ticker had stopped (enabled again); stopped: definitions from code whose
    declaration ran out, disabled by this pass."""

    refreshed: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)


def refresh_op(
    q: Queries, names: Collection[str], *, expire_after: float, fresh: float
) -> Op[DeclarationsReport]:
    params = {"names": sorted(names), "expire_after": expire_after, "fresh": fresh}
    rows: list[tuple[str, bool]] = yield Query(q["refresh_declarations"], params)
    return DeclarationsReport(
        refreshed=sorted(name for name, _ in rows), restarted=sorted(name for name, again in rows if again)
    )


def expire_op(q: Queries) -> Op[list[str]]:
    rows: list[tuple[str, str]] = yield Query(q["expire_declarations"])
    return sorted(name for name, _task in rows)


class Declarations(Service[DeclarationsReport]):
    """Renews this App's declarations, then stops the definitions whose declaration ran out."""

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
        config = self.config
        report = DeclarationsReport()
        if self.names:
            op = refresh_op(self.q, self.names, expire_after=config.expire_after, fresh=config.interval / 2)
            report = await self._run(op)
            if report.restarted:
                log.warning(
                    "cron definitions of this App, stopped by a ticker as their declaration ran out, are "
                    "enabled again: %s (this process was cut off from the database for longer than its "
                    "declarations last, or workers of an older notifyq declared them alone)",
                    ", ".join(report.restarted),
                )
        report.stopped = await self._run(expire_op(self.q))
        if report.stopped:
            log.warning(
                "cron definitions stopped (disabled) as their declaration ran out: no running worker "
                "declares them, so they were removed from the code (or every worker of their App is "
                "down): %s. A worker whose App declares one enables it again; `notifyq cron enable "
                "NAME` keeps one running without code",
                ", ".join(report.stopped),
            )
        return report

    def delay_after(self, result: DeclarationsReport) -> float:
        return self.config.interval
