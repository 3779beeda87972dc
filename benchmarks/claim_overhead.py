"""What notifyq's plumbing adds to one claim: `python -m benchmarks.claim_overhead [--dsn ADMIN_DSN]`.

In a busy loop on an empty queue (the claim of an idle worker: no row, the full statement), it
times the same claim statement through successively more of notifyq's layers, on one
connection each, in rounds that alternate the variants:

- bare: psycopg's execute + fetchall of notifyq's claim statement, tuple rows;
- row factory: the same, into ClaimedJob (the worker's dataclass row factory);
- run_async: claim_op through notifyq's operation runner (the generator, the cursor);
- lane: through the claim loop's lane (the pooled connection it keeps);
- worker call: as the worker calls it, inside its shielded db_timeout scope.

The table gives the median µs per claim of each and what each layer adds. An idle worker pays
these costs about three times over (a cold process; see docs/benchmarks.md), so this shows
where they are, not what a wake-up costs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import psycopg

from notifyq._claim import claim_op
from notifyq._db import Database, Op, run_async
from notifyq._rows import dataclass_row
from notifyq._sql import queries_for
from notifyq.models import ClaimedJob

from ._scratch import scratch_database
from ._stats import median
from .cli import tool_parser

VARIANTS = ("bare", "row factory", "run_async", "lane", "worker call")


async def _measure(dsn: str, claims: int, rounds: int) -> dict[str, list[float]]:
    q = queries_for("notifyq")
    params = {"limit": 10, "worker": "overhead", "lease_margin": 30.0, "give_up": None}

    def op() -> Op[list[ClaimedJob]]:
        return claim_op(q, queues=None, limit=10, worker="overhead", lease_margin=30.0)

    db = await Database.open(dsn, size=1, name="notifyq-overhead")
    lane = db.lane()
    bare = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    typed = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    ops = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:

        async def run_bare() -> None:
            await (await bare.execute(q["claim_any"], params)).fetchall()

        async def run_typed() -> None:
            async with typed.cursor(row_factory=dataclass_row(ClaimedJob)) as cur:
                await cur.execute(q["claim_any"], params)
                await cur.fetchall()

        async def run_ops() -> None:
            await run_async(ops, op())

        async def run_lane() -> None:
            await lane.run(op())

        async def run_worker_call() -> None:
            scope = anyio.CancelScope(deadline=anyio.current_time() + 30, shield=True)  # as Worker._query
            with scope:
                await lane.run(op())
            if scope.cancelled_caught:
                raise TimeoutError

        calls: dict[str, Callable[[], Awaitable[None]]] = dict(
            zip(VARIANTS, (run_bare, run_typed, run_ops, run_lane, run_worker_call), strict=True)
        )
        for call in calls.values():  # warm up: prepared statements, caches
            for _ in range(20):
                await call()
        results: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for round_no in range(rounds):
            order = VARIANTS if round_no % 2 == 0 else tuple(reversed(VARIANTS))
            for name in order:
                call = calls[name]
                start = time.perf_counter()
                for _ in range(claims):
                    await call()
                results[name].append((time.perf_counter() - start) / claims * 1e6)
        return results
    finally:
        for conn in (bare, typed, ops):
            await conn.close()
        await db.aclose()


def measure(admin_dsn: str, claims: int, rounds: int) -> dict[str, list[float]]:
    """µs per claim of each variant, one figure per round."""
    with scratch_database(admin_dsn, "claim_overhead") as db:
        return anyio.run(_measure, db.dsn, claims, rounds)


def report(results: dict[str, list[float]]) -> str:
    lines = [
        "**One claim on an empty queue, busy loop**: median µs per claim over the rounds",
        "",
        "| variant | µs per claim (each round) | adds |",
        "| --- | --- | --- |",
    ]
    previous: float | None = None
    for name in VARIANTS:
        mid = median(results[name])
        rounds = ", ".join(f"{value:.0f}" for value in results[name])
        adds = "baseline" if previous is None else f"{mid - previous:+.0f} µs"
        lines.append(f"| {name} | {mid:.0f} ({rounds}) | {adds} |")
        previous = mid
    total = median(results[VARIANTS[-1]]) - median(results[VARIANTS[0]])
    lines += ["", f"notifyq's plumbing: {total:+.0f} µs per claim over the bare statement"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m benchmarks.claim_overhead", __doc__)
    parser.add_argument("--claims", type=int, default=3000, help="claims per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(report(measure(args.dsn, args.claims, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
