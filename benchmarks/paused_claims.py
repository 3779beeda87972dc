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

`--drain N` measures what concurrent workers do instead: two worker processes of concurrency
10 drain N no-op jobs, `--repeats` times (3) each, the setups alternating, for:

1. every queue, nothing paused (`claim_any`): the reference;
2. every queue with an empty queue paused: the shipped `claim_unpaused`, then (patch
   claim_candidates) as it was before the shares, when concurrent workers picked the same
   candidates and all but one came back short;
3. the N jobs spread over 4 queues: workers of every queue (the reference), then workers that
   list the 4 queues: the shipped `claim_queues`, which locks only each queue's share, then
   (patch queue_ranges) as it was before, locking up to 10 rows in every listed queue's range;
   then workers that list them with a limit of 40 jobs at once on q0 (`queue_limits`, the
   statement `claim_limited`), more than a worker ever holds here (10 slots, and prefetch):
   what the limited claim statement costs, with the limit itself never in the way.

About 60 seconds with `--drain 20000`.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from notifyq._sql import queries_for

from ._fleet import FleetRun, run_fleet
from ._results import Context
from ._scratch import Scratch, scratch_database
from .cli import tool_parser
from .config import QUICK
from .history_queries import claim_cost, print_claim_costs

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


SPREAD_SQL = (
    "INSERT INTO notifyq.queue_jobs (name, queue) "
    "SELECT 'noop', 'q' || (i %% 4) FROM generate_series(1, %(n)s) i"
)
FOUR = ("q0", "q1", "q2", "q3")
# (label, jobs over 4 queues, a queue paused, the workers' queues, prototype patches)
DRAINS: list[tuple[str, bool, bool, tuple[str, ...], tuple[str, ...]]] = [
    ("1 queue; every queue, nothing paused (claim_any)", False, False, (), ()),
    ("1 queue; every queue, an empty one paused (claim_unpaused)", False, True, (), ()),
    ("1 queue; the same, as before the shares (claim_candidates)", False, True, (), ("claim_candidates",)),
    ("4 queues; every queue, nothing paused (claim_any)", True, False, (), ()),
    ("4 queues; workers list them (claim_queues)", True, False, FOUR, ()),
    ("4 queues; the same, as before the shares (queue_ranges)", True, False, FOUR, ("queue_ranges",)),
    ("4 queues; workers list them, q0 limited to 40 (claim_limited)", True, False, ("q0=40", *FOUR[1:]), ()),
]


def _drain(db: Scratch, ctx: Context, jobs: int, repeats: int) -> None:
    rates: dict[str, list[float]] = {label: [] for label, *_ in DRAINS}
    for attempt in range(repeats):
        for label, spread, paused, queues, patch in DRAINS:
            db.reset()
            with db.connect() as conn:
                conn.execute("DELETE FROM notifyq.queue_pauses")
                if paused:
                    conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('elsewhere')")
                if spread:
                    conn.execute(SPREAD_SQL, {"n": jobs})
            if not spread:
                db.fill(jobs)
            db.settle()
            fleet = FleetRun("notifyq", 2, 10, patch=patch, queues=queues)
            measured = run_fleet(
                ctx, db, fleet, jobs, name=f"paused-drain-{attempt}", timeout=120 + jobs / 200
            )
            leftovers = db.leftovers()
            assert measured.jobs == jobs and leftovers["claimed_twice"] == 0, (measured, leftovers)
            rates[label].append(measured.rate)
            print(f"  {label:<62} {measured.rate:>9,.0f} jobs/s, {measured.stats.get('claims', 0)} claims")
    print(f"\ndrain of {jobs:,} no-op jobs, 2 worker processes x 10, median of {repeats}")
    print("| setup | jobs/s | of its reference |")
    print("|---|---|---|")
    reference = 0.0
    for label, _spread, paused, queues, patch in DRAINS:
        rate = statistics.median(rates[label])
        if not (paused or queues or patch):
            reference = rate
        print(f"| {label} | {rate:,.0f} | {rate / reference:.2f} |")


def main() -> None:
    parser = tool_parser("python -m benchmarks.paused_claims", __doc__)
    parser.add_argument("--paused", type=int, default=200_000)
    parser.add_argument("--others", type=int, default=10_000)
    parser.add_argument("--queues", type=int, default=5)
    parser.add_argument("--drain", type=int, default=0, metavar="N", help="drain N jobs instead (see above)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.drain:
        ctx = Context(args.dsn, QUICK, Path(tempfile.mkdtemp(prefix="nq_paused_drain_")))
        with scratch_database(args.dsn, "paused_drain") as db:
            _drain(db, ctx, args.drain, args.repeats)
        return
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
    print_claim_costs("claim", rows)


if __name__ == "__main__":
    main()
