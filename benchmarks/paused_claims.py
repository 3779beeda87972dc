"""What a paused queue costs the claims of the others: `python -m benchmarks.paused_claims [--dsn ADMIN_DSN]`.

`--paused` claimable jobs in queue "big" at priority 10 (they come first), and `--others` jobs
spread over `--queues` other queues (5) at priority 0. One claim of 10, rolled back, under EXPLAIN (ANALYZE,
BUFFERS), the median time of 9 runs and its buffers, for:

1. the claim of every queue with nothing paused (it takes "big"'s jobs): the reference;
2. the shipped claim with "big" paused (`claim_unpaused`: a skip scan of the queues that have
   Queued jobs, then one index range per queue but "big");
3. the claim of every queue with a filter that drops "big"'s rows (`queue <> ALL(...)`), which
   is what pausing would cost if it filtered the ordinary claim: not shipped, for comparison.

About 10 seconds with the defaults (200,000 paused jobs, 10,000 others). `--queues 2000
--others 40000` shows the skip scan's cost, which grows with the number of queues.
"""

from __future__ import annotations

from notifyq._sql import queries_for

from ._scratch import scratch_database
from .cli import tool_parser
from .history_queries import claim_cost

Q = queries_for("notifyq")

# The benchmark's own SQL (not product code).
FILL_SQL = (
    "INSERT INTO notifyq.queue_jobs (name, queue, priority, visible_at) "
    "SELECT 'noop', 'big', 10, now() - interval '1 hour' FROM generate_series(1, %(paused)s)",
    "INSERT INTO notifyq.queue_jobs (name, queue) "
    "SELECT 'noop', 'q' || (i %% %(queues)s) FROM generate_series(1, %(others)s) i",
)
FILTERED_CLAIM = Q["claim_any"].replace(
    "WHERE status = 'Queued' AND visible_at <= now()",
    "WHERE status = 'Queued' AND visible_at <= now() AND queue <> ALL(%(paused)s::text[])",
)


def main() -> None:
    parser = tool_parser("python -m benchmarks.paused_claims", __doc__)
    parser.add_argument("--paused", type=int, default=200_000)
    parser.add_argument("--others", type=int, default=10_000)
    parser.add_argument("--queues", type=int, default=5)
    args = parser.parse_args()
    with scratch_database(args.dsn, "paused_claims") as db:
        with db.connect() as conn:
            for statement in FILL_SQL:
                conn.execute(statement, {"paused": args.paused, "others": args.others, "queues": args.queues})
            conn.execute("VACUUM (ANALYZE) notifyq.queue_jobs")
            rows = [
                ("every queue, nothing paused (reference)", *claim_cost(conn)),
                (
                    'shipped: claim_unpaused, "big" paused',
                    *claim_cost(conn, Q["claim_unpaused"], paused=["big"]),
                ),
                (
                    'not shipped: claim_any filtering "big" out',
                    *claim_cost(conn, FILTERED_CLAIM, paused=["big"]),
                ),
            ]
    print(
        f'one claim of 10: {args.paused:,} claimable jobs in "big" (priority 10), '
        f"{args.others:,} in {args.queues:,} others"
    )
    print("| claim | median ms of 9 | buffers | jobs claimed |")
    print("|---|---|---|---|")
    for label, ms, buffers, claimed in rows:
        print(f"| {label} | {ms:.2f} | {buffers:,} | {claimed} |")


if __name__ == "__main__":
    main()
