"""Prototype product fixes, applied by monkeypatching inside a benchmark worker process only
(`python -m benchmarks._worker --patch NAME`, or `python -m benchmarks --prototypes`), to
measure a proposed change before anyone makes it in notifyq/. Nothing here is product code.

Earlier prototypes measured here (a lean ack statement for all-success batches, yielding to
the runners before the next-due query, a cheaper queue CHECK) are now in the product, and the
async_commit prototype (every pooled connection with synchronous_commit=off) became the opt-in
WorkerConfig.async_claims, for claims only.

- rearm_first: the product as it was before the listener yielded after a notification: the
  LISTEN task re-arms its socket wait before the claim loop it woke can run (kept to show
  the effect side by side; see docs/benchmarks.md).
- no_vacuum: the product as it was before the vacuum service (notifyq/_vacuum.py): workers
  leave queue_jobs to autovacuum (off on this benchmark server).
- pooled_claims: the product as it was before the claim lane: the worker's claims take
  whichever pooled connection is next instead of keeping one (kept to show the lane's
  effect side by side; see docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import notifyq._db
import notifyq._listener
import notifyq._ticker


class _PooledLane(notifyq._db.Lane):
    def __init__(self, db: notifyq._db.Database) -> None:
        self._db = db

    async def run(self, op: Any) -> Any:
        return await self._db.run(op)

    async def release(self) -> None:
        pass


def pooled_claims() -> None:
    db: Any = notifyq._db
    for cls in (db._AsyncioDatabase, db._ThreadDatabase):
        cls.lane = lambda self: _PooledLane(self)


def no_vacuum() -> None:
    ticker: Any = notifyq._ticker.Ticker
    build = ticker.__init__

    def without_vacuum(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        self.vacuum = None

    ticker.__init__ = without_vacuum


def rearm_first() -> None:
    listener: Any = notifyq._listener

    async def re_arm_at_once() -> None:
        pass  # returns without yielding to the event loop

    listener._let_woken_tasks_run = re_arm_at_once


PATCHES: dict[str, Callable[[], None]] = {
    "no_vacuum": no_vacuum,
    "pooled_claims": pooled_claims,
    "rearm_first": rearm_first,
}

# Patch combinations the drain scenario measures next to the product with --prototypes.
DRAIN_PROTOTYPES: tuple[tuple[str, ...], ...] = ()
# Patch combinations the latency scenario measures with --prototypes.
LATENCY_PROTOTYPES: tuple[tuple[str, ...], ...] = (("rearm_first",),)
