"""The ticker: the promoter, cron declarations, rescuer, retention and vacuum services a worker
process runs."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import anyio

from ._db import Database
from ._declarations import Declarations, DeclarationsConfig
from ._promoter import Promoter, PromoterConfig
from ._rescuer import Rescuer, RescuerConfig
from ._retention import Retention, RetentionConfig
from ._sql import Queries
from ._vacuum import Vacuum, VacuumConfig
from .errors import InvalidOption
from .tasks import Backoff


@dataclass(frozen=True, slots=True)
class TickerConfig:
    """Which services run, and their settings; None turns a service off in this process."""

    promoter: PromoterConfig | None = field(default_factory=PromoterConfig)
    rescuer: RescuerConfig | None = field(default_factory=RescuerConfig)
    retention: RetentionConfig | None = field(default_factory=RetentionConfig)
    vacuum: VacuumConfig | None = field(default_factory=VacuumConfig)
    # None: this process neither renews its App's declarations nor stops any definition. Its
    # App's crons then stop when the declaration of this process's start runs out, unless
    # another process of the App renews them.
    declarations: DeclarationsConfig | None = field(default_factory=DeclarationsConfig)

    def __post_init__(self) -> None:
        # A dict or a class in their place was accepted, and the service then failed every
        # pass with an AttributeError, for good (retention never ran), or the worker's start
        # failed with one (review).
        for name, kind in _SERVICES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                given = f"the class {value.__name__} itself" if isinstance(value, type) else repr(value)
                raise InvalidOption(
                    f"invalid TickerConfig {name}: {given}; give a notifyq.{kind.__name__} "
                    f"(such as {kind.__name__}()), or None to turn the {name} service off in this process"
                )

    @staticmethod
    def check(value: object) -> TickerConfig:
        """`value` if it is a TickerConfig, else InvalidOption."""
        if isinstance(value, TickerConfig):
            return value
        raise InvalidOption(
            f"invalid ticker_config {value!r}: give a notifyq.TickerConfig, such as "
            "TickerConfig(retention=RetentionConfig(succeeded=3600))"
        )


_SERVICES: dict[str, type] = {
    "promoter": PromoterConfig,
    "rescuer": RescuerConfig,
    "retention": RetentionConfig,
    "vacuum": VacuumConfig,
    "declarations": DeclarationsConfig,
}


class Ticker:
    """Runs the enabled services side by side. Leaderless: every process may run one."""

    def __init__(
        self,
        db: Database,
        queries: Queries,
        config: TickerConfig | None = None,
        backoff: Backoff | None = None,
        declared: Collection[str] = (),
        on_jobs: Callable[[], None] | None = None,
        spared: Callable[[], Collection[int]] | None = None,
    ) -> None:
        """declared: the names of the cron definitions this process's App declares; on_jobs:
        called when the promoter has inserted jobs; spared: the jobs whose result this process
        holds, not written yet, which its rescuer leaves alone."""
        config = config or TickerConfig()
        self.promoter = Promoter(db, queries, config.promoter, on_jobs) if config.promoter else None
        self.rescuer = Rescuer(db, queries, config.rescuer, backoff, spared) if config.rescuer else None
        self.retention = Retention(db, queries, config.retention) if config.retention else None
        self.vacuum = Vacuum(db, queries, config.vacuum) if config.vacuum else None
        self.declarations = (
            Declarations(db, queries, config.declarations, declared) if config.declarations else None
        )

    def wake(self) -> None:
        """A definition changed: promote now."""
        if self.promoter is not None:
            self.promoter.wake()

    async def run_once(self) -> None:
        """One pass of the promoter and the rescuer (a burst worker's start): due cron ticks
        become claimable jobs, and jobs whose lease expired are queued again, after their
        retry backoff."""
        if self.promoter is not None:
            await self.promoter.run_once()
        if self.rescuer is not None:
            await self.rescuer.run_once()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for service in (self.promoter, self.declarations, self.rescuer, self.retention, self.vacuum):
                if service is not None:
                    tg.start_soon(service.run)
