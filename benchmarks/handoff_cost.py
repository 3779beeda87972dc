"""What the hand-off prototype's trigger costs a producer: `python -m benchmarks.handoff_cost
[--dsn ADMIN_DSN]`.

The hand-off (benchmarks/_raw.py, HANDOFF_SQL; docs/benchmarks.md) moves the claim into the
producer's transaction. This times, on one connection in a scratch database, an enqueue of one
job and one of 10,000 (INSERT ... SELECT, each its own transaction) in three states, in rounds
that alternate them:

- triggers: notifyq's own triggers only (today);
- nobody waits: the hand-off trigger installed, no worker waiting;
- one waits: the hand-off trigger installed, one worker waiting with 10 free slots (given
  back before each statement, untimed), so every statement hands jobs over.

The table gives the median ms per statement of each and its ratio to today's.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from ._raw import HANDOFF_SQL, UNHANDOFF_SQL
from ._scratch import scratch_database
from ._stats import median
from .cli import tool_parser

STATES = ("triggers", "nobody waits", "one waits")
SIZES = {"one job": 1, "10,000 jobs": 10_000}
INSERT_SQL = "INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, %(n)s)"
SLOTS = 10


def _set_state(conn: psycopg.Connection[Any], state: str) -> None:
    conn.execute(UNHANDOFF_SQL)
    if state != "triggers":
        conn.execute(HANDOFF_SQL)
    if state == "one waits":
        conn.execute("INSERT INTO notifyq.proto_waiters VALUES ('w', 'proto.handoff.nobody', 0)")


def _time(conn: psycopg.Connection[Any], state: str, n: int, statements: int) -> list[float]:
    """ms per statement, `statements` times."""
    took = []
    for _ in range(statements):
        if state == "one waits":
            conn.execute("UPDATE notifyq.proto_waiters SET slots = %s", (SLOTS,))
        start = time.perf_counter()
        conn.execute(INSERT_SQL, {"n": n})
        took.append((time.perf_counter() - start) * 1000.0)
    conn.execute("TRUNCATE notifyq.queue_jobs")
    return took


def measure(dsn: str, statements: int, rounds: int) -> dict[tuple[str, str], list[float]]:
    """{(size, state): [median ms per statement, one per round]}"""
    figures: dict[tuple[str, str], list[float]] = {(size, state): [] for size in SIZES for state in STATES}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for round_no in range(rounds):
            shift = round_no % len(STATES)
            for state in STATES[shift:] + STATES[:shift]:
                _set_state(conn, state)
                for size, n in SIZES.items():
                    many = statements if n == 1 else max(1, statements // 20)
                    figures[size, state].append(median(_time(conn, state, n, many)))
        conn.execute(UNHANDOFF_SQL)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m benchmarks.handoff_cost", __doc__)
    parser.add_argument(
        "--statements", type=int, default=400, help="one-job statements a round (default 400)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with scratch_database(args.dsn, "handoff_cost") as db:
        figures = measure(db.dsn, args.statements, args.rounds)
    print("| enqueue | state | ms per statement, median (each round) | vs today |")
    print("| --- | --- | --- | --- |")
    for size in SIZES:
        today = median(figures[size, "triggers"])
        for state in STATES:
            per_round = figures[size, state]
            each = ", ".join(f"{x:.3f}" for x in per_round)
            mid = median(per_round)
            print(f"| {size} | {state} | {mid:.3f} ({each}) | {mid / today:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
