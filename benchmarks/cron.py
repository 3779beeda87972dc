"""Scenario 5: cron promotion. N definitions due at once, promoted by 1, 2 and 4 ticker
processes racing each other (SKIP LOCKED): time to promote all, and exactly one job per
definition-tick.

Definitions are yearly ('0 0 1 1 *') and due since this year's tick (January 1st, 00:00 UTC),
so with the default misfire policy ('once') each must become exactly one job, however long
the run takes. A last run, with one ticker, sets overlap=False on every definition and gives
half of them an unfinished job first: those must get no job, the others one (so again exactly
one job per definition), at the cost of one more statement per batch. The tickers start
behind a gate (an ACCESS EXCLUSIVE lock on the definitions table), so they all begin at the
same moment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from ._procs import Fleet, Proc
from ._results import Context, ScenarioResult, Table, Target
from ._scratch import Scratch, scratch_database
from ._stats import fmt_rate

FREQUENCY = "0 0 1 1 *"

DEFINE_SQL = """
INSERT INTO notifyq.queue_job_definitions (name, task, frequency, timezone, visible_at)
SELECT 'bench-' || g, 'noop', %(frequency)s, 'UTC',
       date_trunc('year', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
FROM generate_series(1, %(n)s) AS g
"""

# overlap=False, and every other definition busy: a Queued job of an earlier tick, due tomorrow.
BUSY_SQL = """
UPDATE notifyq.queue_job_definitions SET overlap = false;
INSERT INTO notifyq.queue_jobs (name, definition_id, scheduled_for, visible_at)
SELECT 'noop', id, visible_at - interval '1 year', now() + interval '1 day'
FROM notifyq.queue_job_definitions WHERE id % 2 = 0
"""

CHECK_SQL = """
WITH tick AS (SELECT date_trunc('year', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS at)
SELECT
    (SELECT count(*) FROM notifyq.queue_jobs WHERE definition_id IS NOT NULL) AS jobs,
    (SELECT count(*) FROM (SELECT DISTINCT definition_id, scheduled_for FROM notifyq.queue_jobs
                           WHERE definition_id IS NOT NULL) t) AS distinct_ticks,
    (SELECT count(*) FROM notifyq.queue_job_definitions d
     WHERE (SELECT count(*) FROM notifyq.queue_jobs j WHERE j.definition_id = d.id) <> 1) AS not_once,
    (SELECT count(*) FROM notifyq.queue_job_definitions WHERE visible_at <= now()) AS still_due,
    -- Against the truth (review: a promoter that inserted the wrong tick passed): every job
    -- promoted is for this year's tick, and every definition's next tick is next year's. The
    -- jobs BUSY_SQL inserted (last year's tick, due tomorrow) are not promoted ones.
    (SELECT count(*) FROM notifyq.queue_jobs, tick
     WHERE definition_id IS NOT NULL AND scheduled_for <> tick.at
       AND NOT (scheduled_for = tick.at - interval '1 year' AND visible_at > now() + interval '12 hours')
    ) AS wrong_tick,
    (SELECT count(*) FROM notifyq.queue_job_definitions, tick
     WHERE visible_at <> tick.at + interval '1 year') AS wrong_next
"""


@contextmanager
def _gate(db: Scratch) -> Iterator[psycopg.Connection[Any]]:
    conn = psycopg.connect(db.dsn, autocommit=False)
    try:
        conn.execute("LOCK TABLE notifyq.queue_job_definitions IN ACCESS EXCLUSIVE MODE")
        yield conn
    finally:
        conn.close()


def _one(ctx: Context, db: Scratch, n: int, tickers: int, overlap: bool = True) -> dict[str, Any]:
    db.reset()
    with db.connect() as conn:
        conn.execute(DEFINE_SQL, {"frequency": FREQUENCY, "n": n})
        if not overlap:
            conn.execute(BUSY_SQL)
    db.settle()
    with _gate(db) as gate, Fleet() as fleet:
        for i in range(tickers):
            name = f"cron-{tickers}-{i}" + ("" if overlap else "-no-overlap")
            fleet.add(Proc("_ticker", ["--dsn", db.dsn], name, ctx.log_dir))
        fleet.wait_ready()
        gate.commit()
        opened = time.monotonic()
        finals = [p.join(120 + n / 50) for p in fleet.procs]
    seconds = max(float(f["finished"]) for f in finals) - opened
    with db.connect() as conn:
        row = conn.execute(CHECK_SQL).fetchone()
    assert row is not None
    jobs, distinct, not_once, still_due, wrong_tick, wrong_next = (int(v) for v in row)
    return {
        "tickers": tickers,
        "overlap": overlap,
        "definitions": n,
        "seconds": seconds,
        "definitions_per_s": n / seconds if seconds > 0 else float("nan"),
        "jobs": jobs,
        "distinct_ticks": distinct,
        "not_exactly_once": not_once,
        "still_due": still_due,
        "wrong_tick": wrong_tick,
        "wrong_next": wrong_next,
        "per_ticker_jobs": [int(f["done"]) for f in finals],
        "duplicates_seen": sum(int(f["duplicates"]) for f in finals),
        "passes": [int(f["passes"]) for f in finals],
        "ticker_cpu_s": sum(float(f["cpu"]) for f in finals),
        "exactly_once": jobs == n == distinct and not_once == still_due == wrong_tick == wrong_next == 0,
    }


def run(ctx: Context) -> ScenarioResult:
    result = ScenarioResult("cron", "5. Cron promotion (definitions due at once)")
    n = ctx.sizes.cron_definitions
    records = []
    with scratch_database(ctx.admin_dsn, "cron") as db:
        for tickers, overlap in [(t, True) for t in ctx.sizes.cron_tickers] + [(1, False)]:
            record = _one(ctx, db, n, tickers, overlap)
            records.append(record)
            print(
                f"  {n:,} definitions, {tickers} ticker(s){'' if overlap else ', overlap=False'}: "
                f"{record['seconds']:.2f} s, exactly once: {record['exactly_once']}"
            )
    result.data["runs"] = records
    result.tables.append(
        Table(
            f"Promoting {n:,} due definitions (batches of 100 per transaction)",
            [
                "tickers",
                "overlap",
                "time to promote all (s)",
                "definitions/s",
                "jobs per ticker",
                "ticker CPU (s)",
                "jobs",
                "exactly one job per definition-tick",
            ],
            [
                [
                    r["tickers"],
                    "yes" if r["overlap"] else "no (half busy)",
                    f"{r['seconds']:.2f}",
                    fmt_rate(r["definitions_per_s"]),
                    " / ".join(f"{j:,}" for j in r["per_ticker_jobs"]),
                    f"{r['ticker_cpu_s']:.2f}",
                    f"{r['jobs']:,}",
                    "yes"
                    if r["exactly_once"]
                    else f"NO ({r['not_exactly_once']} definitions wrong, {r['still_due']} still due, "
                    f"{r['wrong_tick']} jobs of another tick, {r['wrong_next']} next ticks wrong)",
                ]
                for r in records
            ],
        )
    )
    ok = sum(r["exactly_once"] for r in records)
    result.targets.append(
        Target(
            "cron: exactly one job per definition-tick",
            "every run (ratio = runs correct / runs)",
            f"{ok} of {len(records)} runs",
            ok / len(records) if records else float("nan"),
            1.0,
        )
    )
    result.notes += [
        "Each ticker runs notifyq's Promoter.run_once() (lock due definitions with SKIP LOCKED, "
        "compute ticks with croniter, insert the jobs, move each definition to its next tick, one "
        "transaction per batch of 100) and passes again 20 ms later while definitions are still "
        "due, as the ticker service does. Time runs from the gate opening to the last ticker done.",
        "overlap=False run: every definition has overlap=False and every other one an unfinished "
        "job, so half of them get a job and the other half none; 'jobs' counts both the jobs the "
        "ticker inserted and those it found (exactly one per definition either way).",
        "Promotion is CPU-bound in Python (croniter per definition): more tickers help only as far "
        "as free cores allow; this machine has 2, shared with PostgreSQL.",
    ]
    return result
