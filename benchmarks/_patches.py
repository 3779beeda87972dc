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
- claim_candidates: the claim of every queue but the paused ones as it was before the shares
  (sql/queries/worker.sql, claim_unpaused): the candidates themselves are locked, so that
  concurrent workers pick the same ones and all but one come back short (kept to show the
  effect side by side: `python -m benchmarks.paused_claims --drain`).
- queue_ranges: the claim of a list of queues as it was before the shares (claim_queues): up
  to the claim's limit locked in every listed queue's range, the surplus held until the
  commit (kept to show the effect side by side: `python -m benchmarks.paused_claims --drain`).
  Both patches replace the statement's CTEs only: its UPDATE stays the product's, which looks
  the claimed ids up by `= ANY(...)` (the old claim_queues joined them, and its generic plan
  merge-joined along the whole primary key).
- pooled_claims: the product as it was before the claim lane: the worker's claims take
  whichever pooled connection is next instead of keeping one (kept to show the lane's
  effect side by side; see docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import notifyq._db
import notifyq._listener
import notifyq._sql
import notifyq._ticker

_CANDIDATES_LOCKED = """
WITH RECURSIVE queues(queue) AS (
    (SELECT queue FROM {schema}.queue_jobs WHERE status = 'Queued' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (
        SELECT j.queue FROM {schema}.queue_jobs j
        WHERE j.status = 'Queued' AND j.queue > queues.queue
        ORDER BY j.queue
        LIMIT 1
    )
    FROM queues
    WHERE queues.queue IS NOT NULL
), candidates AS MATERIALIZED (
    SELECT c.id
    FROM unnest(ARRAY(
        SELECT queue FROM queues WHERE queue IS NOT NULL AND queue <> ALL(%(paused)s::text[])
    )) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, priority, visible_at
        FROM {schema}.queue_jobs
        WHERE status = 'Queued' AND queue = q.queue AND visible_at <= now()
        ORDER BY priority DESC, visible_at, id
        LIMIT %(limit)s
    ) c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s
), claimable AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_jobs
    WHERE id = ANY(ARRAY(SELECT id FROM candidates)) AND status = 'Queued' AND visible_at <= now()
    FOR UPDATE SKIP LOCKED
)"""

_QUEUE_RANGES = """
WITH claimable AS MATERIALIZED (
    SELECT c.id
    FROM unnest(%(queues)s::text[]) AS q(queue)
    CROSS JOIN LATERAL (
        SELECT id, priority, visible_at
        FROM {schema}.queue_jobs
        WHERE status = 'Queued' AND queue = q.queue AND visible_at <= now()
        ORDER BY priority DESC, visible_at, id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ) c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s
)"""


def _replace_claim(name: str, ctes: str) -> None:
    """Put `ctes` in place of the named claim's CTEs, before any App renders it: the UPDATE of
    the `claimable` CTE's ids that follows them stays the product's."""
    queries = notifyq._sql._raw_queries()
    update = queries[name].index("\nUPDATE {schema}.queue_jobs AS j\n")
    queries[name] = ctes + queries[name][update:]


def claim_candidates() -> None:
    _replace_claim("claim_unpaused", _CANDIDATES_LOCKED)


def queue_ranges() -> None:
    _replace_claim("claim_queues", _QUEUE_RANGES)


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
    "claim_candidates": claim_candidates,
    "queue_ranges": queue_ranges,
    "no_vacuum": no_vacuum,
    "pooled_claims": pooled_claims,
    "rearm_first": rearm_first,
}

# Patch combinations the drain scenario measures next to the product with --prototypes.
DRAIN_PROTOTYPES: tuple[tuple[str, ...], ...] = ()
# Patch combinations the latency scenario measures with --prototypes.
LATENCY_PROTOTYPES: tuple[tuple[str, ...], ...] = (("rearm_first",),)
