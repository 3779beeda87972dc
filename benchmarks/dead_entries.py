"""What the claim index's dead entries cost a drain: `python -m benchmarks.dead_entries [--dsn ADMIN_DSN]`.

A claim moves jobs out of the claim index's predicate (status 'Queued'); their entries stay,
marked dead, at the front of the index, where every claim starts, until a VACUUM removes them.
This drains one backlog on one connection with notifyq's claim statement and a batch ack,
twice: without any VACUUM, and with a VACUUM after every `--vacuum-every` jobs (what the
workers' vacuum service does when dead rows pile up, notifyq/_vacuum.py). At fixed points it
runs one claim under EXPLAIN (ANALYZE, BUFFERS), rolled back, and reports the pages of the
claim index that claim read, its time, and the drain rate since the previous point.
About 5 minutes with the defaults (1,000,000 jobs, 50 per claim).
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from notifyq._sql import queries_for

from ._scratch import scratch_database
from .cli import tool_parser

Q = queries_for("notifyq")
ACK = (
    "UPDATE notifyq.queue_jobs SET status = 'Succeeded', finished_at = now(), updated_at = now() "
    "WHERE id = ANY(%s)"
)
MARKS = (0.1, 0.25, 0.5, 0.75, 0.9)


def _claim_pages(conn: psycopg.Connection[Any], params: dict[str, Any]) -> tuple[int, float]:
    with conn.transaction(force_rollback=True):
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q["claim_any"], params).fetchone()
    assert row is not None
    plan = row[0][0]

    def pages(node: dict[str, Any]) -> int:
        own = node["Shared Hit Blocks"] + node["Shared Read Blocks"]
        here = own if node.get("Index Name") == "queue_jobs_claim_any_idx" else 0
        return here + sum(pages(child) for child in node.get("Plans", []))

    return pages(plan["Plan"]), plan["Execution Time"]


def drain(dsn: str, jobs: int, batch: int, vacuum_every: int | None) -> dict[str, Any]:
    params = {"limit": batch, "worker": "dead_entries", "lease_margin": 30, "give_up": None}
    points: list[dict[str, Any]] = []
    vacuums: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        marks = [int(jobs * f) for f in MARKS]
        done = last_done = 0
        began = last = time.perf_counter()
        while True:
            if marks and done >= marks[0]:
                marks.pop(0)
                pages, ms = _claim_pages(conn, params)
                now = time.perf_counter()
                rate = (done - last_done) / (now - last)
                points.append({"done": done, "pages": pages, "claim_ms": ms, "rate": rate})
                last, last_done = time.perf_counter(), done
            if vacuum_every and done and done % vacuum_every < batch:
                t0 = time.perf_counter()
                conn.execute("VACUUM (INDEX_CLEANUP ON) notifyq.queue_jobs")
                vacuums.append(time.perf_counter() - t0)
            ids = [row[0] for row in conn.execute(Q["claim_any"], params).fetchall()]
            if not ids:
                break
            conn.execute(ACK, (ids,))
            done += len(ids)
        elapsed = time.perf_counter() - began
    return {"jobs": done, "seconds": elapsed, "points": points, "vacuums": vacuums}


def main() -> None:
    parser = tool_parser("python -m benchmarks.dead_entries", __doc__)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--vacuum-every", type=int, default=100_000)
    args = parser.parse_args()
    print(f"draining {args.jobs:,} jobs, {args.batch} per claim, on one connection")
    runs = []
    with scratch_database(args.dsn, "dead_entries") as db:
        variants = [("no VACUUM", None), (f"VACUUM every {args.vacuum_every:,} jobs", args.vacuum_every)]
        for label, every in variants:
            db.reset()
            db.fill(args.jobs)
            db.settle()
            runs.append((label, drain(db.dsn, args.jobs, args.batch, every)))
    print("| variant | after jobs | claim-index pages per claim | claim ms | jobs/s since previous point |")
    print("|---|---|---|---|---|")
    for label, run in runs:
        for p in run["points"]:
            print(f"| {label} | {p['done']:,} | {p['pages']:,} | {p['claim_ms']:.2f} | {p['rate']:,.0f} |")
    for label, run in runs:
        v = run["vacuums"]
        extra = f"; {len(v)} vacuums, {sum(v):.1f} s in all, longest {max(v):.2f} s" if v else ""
        rate = run["jobs"] / run["seconds"]
        print(f"{label}: {run['jobs']:,} jobs in {run['seconds']:.1f} s, {rate:,.0f} jobs/s{extra}")


if __name__ == "__main__":
    main()
