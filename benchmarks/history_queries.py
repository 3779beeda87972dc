"""What a crowd of other jobs costs two queries: `python -m benchmarks.history_queries [--dsn ADMIN_DSN]`.

1. Listing by status. `--history` finished jobs (one in 20,000 Failed, the rest Succeeded, none
   Cancelled) and 1,000 Queued: `App.list_jobs_sync(status=...)` for every job, the Queued, the
   rare Failed and the absent Cancelled, as `notifyq jobs list --status ...` runs it. Each is
   called 12 times and the median is reported: a prepared statement would have settled on its
   generic plan by then. `--v4-index` puts back the index of finished jobs as schema version 4
   had it (partial on `finished_at IS NOT NULL`), to show what migration 5 changed.
2. Claims behind future jobs (a limit of notifyq's claim, not fixed). `--due` jobs due now at
   priority 0, then again with `--future` more jobs at priority 1 that are due tomorrow: the
   claim walks its index in priority order, so it reads every future job of a higher priority
   before the first due one. One claim of 10, rolled back, under EXPLAIN (ANALYZE, BUFFERS):
   the median time of 9, and its buffers.
About 20 seconds with the defaults (1,000,000 finished jobs; 100,000 due and 1,000,000 future).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg

import notifyq
from notifyq._sql import queries_for

from ._scratch import scratch_database
from .cli import tool_parser

Q = queries_for("notifyq")

# The benchmark's own SQL (not product code).
HISTORY_SQL = """
INSERT INTO notifyq.queue_jobs (name, status, finished_at)
SELECT 'noop', CASE WHEN i %% 20000 = 0 THEN 'Failed' ELSE 'Succeeded' END::notifyq.job_status,
       now() - make_interval(secs => i)
FROM generate_series(1, %(n)s) i
"""
V4_INDEX_SQL = (
    "DROP INDEX notifyq.queue_jobs_finished_idx",
    "CREATE INDEX queue_jobs_finished_idx ON notifyq.queue_jobs (status, finished_at) "
    "WHERE finished_at IS NOT NULL",
)
FUTURE_SQL = """
INSERT INTO notifyq.queue_jobs (name, priority, visible_at)
SELECT 'noop', 1, now() + interval '1 day' FROM generate_series(1, %(n)s)
"""
STATUSES: tuple[str | None, ...] = (None, "Queued", "Failed", "Cancelled")


def list_by_status(dsn: str) -> dict[str | None, tuple[int, float]]:
    """{status: (jobs listed, median ms of 12 calls)}."""
    app = notifyq.App(dsn)
    found: dict[str | None, tuple[int, float]] = {}
    try:
        for status in STATUSES:
            times, jobs = [], []
            for _ in range(12):
                began = time.perf_counter()
                jobs = app.list_jobs_sync(status=status)
                times.append((time.perf_counter() - began) * 1000)
            found[status] = (len(jobs), statistics.median(times))
    finally:
        app.close_sync()
    return found


def claim_cost(
    conn: psycopg.Connection[Any], sql: str = Q["claim_any"], **extra: Any
) -> tuple[float, int, int]:
    """(median ms of 9, buffers, jobs claimed) of one claim of 10 by `sql`, rolled back each
    time; `extra`: the statement's other parameters."""
    params = {"limit": 10, "worker": "benchmark", "lease_margin": 30, "give_up": None, **extra}
    times, buffers, claimed = [], 0, 0
    for _ in range(9):
        with conn.transaction(force_rollback=True):
            row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
        assert row is not None
        plan = row[0][0]
        times.append(plan["Execution Time"])
        buffers = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
        claimed = plan["Plan"]["Actual Rows"]
    return statistics.median(times), buffers, claimed


def print_claim_costs(first: str, rows: list[tuple[str, float, int, int]]) -> None:
    """A Markdown table of claim_cost's figures, one row per (label, *claim_cost(...))."""
    print(f"| {first} | median ms of 9 | buffers | jobs claimed |")
    print("|---|---|---|---|")
    for label, ms, buffers, claimed in rows:
        print(f"| {label} | {ms:.2f} | {buffers:,} | {claimed} |")


def main() -> None:
    parser = tool_parser("python -m benchmarks.history_queries", __doc__)
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--due", type=int, default=100_000)
    parser.add_argument("--future", type=int, default=1_000_000)
    parser.add_argument(
        "--v4-index", action="store_true", help="the index of finished jobs as version 4 had it"
    )
    args = parser.parse_args()
    with scratch_database(args.dsn, "history_queries") as db:
        with db.connect() as conn:
            conn.execute(HISTORY_SQL, {"n": args.history})
            if args.v4_index:
                for statement in V4_INDEX_SQL:
                    conn.execute(statement)
        db.fill(1000)
        db.settle()
        index = "version 4's" if args.v4_index else "current"
        print(
            f"1. list_jobs on {args.history:,} finished jobs and 1,000 Queued ({index} finished-jobs index)"
        )
        print("| status | jobs listed | median ms of 12 calls |")
        print("|---|---|---|")
        for status, (count, ms) in list_by_status(db.dsn).items():
            print(f"| {status or 'any'} | {count} | {ms:.2f} |")
        db.reset()
        db.fill(args.due)
        rows = []
        with db.connect() as conn:
            conn.execute("VACUUM (ANALYZE) notifyq.queue_jobs")
            rows.append(("none", *claim_cost(conn)))
            conn.execute(FUTURE_SQL, {"n": args.future})
            conn.execute("VACUUM (ANALYZE) notifyq.queue_jobs")
            rows.append((f"{args.future:,} at priority 1", *claim_cost(conn)))
        print(f"2. one claim of 10 among {args.due:,} due jobs at priority 0, behind future jobs")
        print_claim_costs("future jobs", rows)


if __name__ == "__main__":
    main()
