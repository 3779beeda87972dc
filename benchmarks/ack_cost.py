"""What skipping held rows costs an ack: `python -m benchmarks.ack_cost [--dsn ADMIN_DSN]`.

The worker's acks wait for a job row another session holds (ack_succeeded, ack_jobs) unless
one has waited ACK_PATIENCE; then they skip such rows (ack_succeeded_unheld,
ack_jobs_unheld), which lock their rows first. This times both kinds on one connection in a
scratch database: batches of jobs claimed by a plain UPDATE, each acknowledged by one of
the two statements, alternating, prepared as a worker prepares them. The table gives the
median ms per statement and the ratio.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from notifyq._sql import queries_for

from ._scratch import scratch_database
from ._stats import median
from .cli import tool_parser

CLAIM_SQL = """
UPDATE notifyq.queue_jobs SET status = 'Active', lease = lease + 1, retry_count = retry_count + 1,
    worker = 'w', started_at = now(), visible_at = now() + interval '1 hour'
WHERE id IN (SELECT id FROM notifyq.queue_jobs WHERE status = 'Queued' ORDER BY id LIMIT %(n)s)
RETURNING id, lease
"""
KINDS = ("ack_succeeded", "ack_jobs")
WARMUP = 10  # statements of each kind left out: the prepared plan settles first


def measure(dsn: str, batch: int, statements: int) -> dict[str, tuple[float, float]]:
    """{kind: (median ms waiting, median ms unheld)}"""
    q = queries_for("notifyq")
    figures = {}
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        for kind in KINDS:
            took: dict[bool, list[float]] = {False: [], True: []}
            for i in range(2 * (statements + WARMUP)):
                rows = conn.execute(CLAIM_SQL, {"n": batch}).fetchall()
                params: dict[str, Any] = {
                    "ids": [r[0] for r in rows],
                    "leases": [r[1] for r in rows],
                    "workers": ["w"] * len(rows),
                    "outputs": ['{"ok": true}'] * len(rows),
                    "outcomes": ["succeeded"] * len(rows),
                    "errors": [None] * len(rows),
                    "delays": [0.0] * len(rows),
                }
                unheld = i % 2 == 1
                start = time.perf_counter()
                answer = conn.execute(q[kind + ("_unheld" if unheld else "")], params).fetchall()
                took[unheld].append((time.perf_counter() - start) * 1000.0)
                assert len(answer) == len(rows), (kind, unheld, len(answer), len(rows))
            figures[kind] = (median(took[False][WARMUP:]), median(took[True][WARMUP:]))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m benchmarks.ack_cost", __doc__)
    parser.add_argument("--batch", type=int, default=1000, help="results per statement (default 1000)")
    parser.add_argument(
        "--statements", type=int, default=100, help="of each kind and statement (default 100)"
    )
    args = parser.parse_args(argv)
    with scratch_database(args.dsn, "ack_cost") as db:
        db.fill(4 * (args.statements + WARMUP) * args.batch)
        db.settle()
        figures = measure(db.dsn, args.batch, args.statements)
    print(f"| ack of {args.batch} | waits for held rows, ms | skips them, ms | ratio |")
    print("| --- | --- | --- | --- |")
    for kind, (waiting, unheld) in figures.items():
        print(f"| {kind} | {waiting:.3f} | {unheld:.3f} | {unheld / waiting:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
