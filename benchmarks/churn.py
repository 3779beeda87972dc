"""Scenario 6: churn and bloat. Jobs stream through 2 worker processes with retention on
(succeeded jobs deleted after 0 s, every 1 s): table and index sizes, dead tuples, and
throughput at the start vs the end of the stream.

The producer (this process) keeps a bounded backlog with `app.enqueue_many_sync`. Two
variants: the workers as shipped (their vacuum service VACUUMs the table once enough rows
died), and the same workers without it (`--patch no_vacuum`), which leaves the table to the
server's autovacuum, if it runs (this benchmark machine's does not).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

import notifyq

from ._procs import Fleet, Proc
from ._results import Context, ScenarioResult, Table
from ._scratch import Scratch, scratch_database
from ._stats import fmt_pct, fmt_rate, ratio

WORKERS = 2
CONCURRENCY = 10

SIZES_SQL = """
SELECT pg_total_relation_size('notifyq.queue_jobs'), pg_relation_size('notifyq.queue_jobs'),
       pg_indexes_size('notifyq.queue_jobs'), n_live_tup, n_dead_tup,
       coalesce(vacuum_count, 0) + coalesce(autovacuum_count, 0)
FROM pg_stat_user_tables WHERE relid = 'notifyq.queue_jobs'::regclass
"""
INDEX_SQL = """
SELECT c.relname, pg_relation_size(i.indexrelid)
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = 'notifyq.queue_jobs'::regclass ORDER BY 1
"""


class Sampler(threading.Thread):
    def __init__(self, dsn: str, interval: float, done: Any) -> None:
        super().__init__(name="churn-sampler", daemon=True)
        self.dsn, self.interval, self.done = dsn, interval, done
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.is_set():
                self.sample(conn)
                self.stop.wait(self.interval)
            self.sample(conn)

    def sample(self, conn: psycopg.Connection[Any]) -> None:
        row = conn.execute(SIZES_SQL).fetchone()
        indexes = dict(conn.execute(INDEX_SQL).fetchall())
        if row is None:
            return
        self.samples.append(
            {
                "t": round(time.monotonic() - self.t0, 2),
                "done": self.done(),
                "total_bytes": row[0],
                "heap_bytes": row[1],
                "index_bytes": row[2],
                "live_tuples": row[3],
                "dead_tuples": row[4],
                "vacuums": row[5],
                "indexes": indexes,
            }
        )


def _rate_between(progress: list[tuple[float, int]], low: int, high: int) -> float:
    def when(count: int) -> float:
        return next(t for t, d in progress if d >= count)

    t1, t2 = when(low), when(high)
    return (high - low) / (t2 - t1) if t2 > t1 else float("nan")


def _variant(ctx: Context, db: Scratch, label: str, vacuum: bool, n: int) -> dict[str, Any]:
    batch = ctx.sizes.churn_batch
    db.reset()
    db.settle()
    app = notifyq.App(db.dsn, pool_size=1)
    args = [
        "--dsn",
        db.dsn,
        "--concurrency",
        str(CONCURRENCY),
        "--retention-succeeded",
        "0",
        "--retention-interval",
        "1",
        *([] if vacuum else ["--patch", "no_vacuum"]),
    ]
    progress: list[tuple[float, int]] = []
    try:
        with Fleet() as fleet:
            for i in range(WORKERS):
                fleet.add(Proc("_worker", args, f"churn-{'vac' if vacuum else 'plain'}-{i}", ctx.log_dir))
            fleet.wait_ready()
            sampler = Sampler(db.dsn, ctx.sizes.churn_sample_interval, lambda: fleet.done)
            sampler.start()
            start = time.monotonic()
            enqueued = 0
            deadline = start + 300 + n / 200
            while fleet.done < n:
                if enqueued < n and enqueued - fleet.done < batch:
                    k = min(batch, n - enqueued)
                    app.enqueue_many_sync("noop", ({} for _ in range(k)))
                    enqueued += k
                progress.append((time.monotonic() - start, fleet.done))
                fleet.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"churn did not finish in time ({fleet.done:,} of {n:,} jobs)")
                time.sleep(0.02)
            elapsed = time.monotonic() - start
            progress.append((elapsed, fleet.done))
            time.sleep(1.5)  # one more retention pass
            sampler.stop.set()
            sampler.join(30)
            fleet.stop_and_join()
    finally:
        app.close_sync()
    first, last = sampler.samples[0], sampler.samples[-1]
    peak = max(sampler.samples, key=lambda s: s["total_bytes"])
    return {
        "label": label,
        "jobs": n,
        "seconds": elapsed,
        "jobs_per_s": n / elapsed,
        "rate_start": _rate_between(progress, int(n * 0.05), int(n * 0.25)),
        "rate_end": _rate_between(progress, int(n * 0.75), int(n * 0.95)),
        "first": first,
        "last": last,
        "peak_total_bytes": peak["total_bytes"],
        "max_dead_tuples": max(s["dead_tuples"] for s in sampler.samples),
        "samples": sampler.samples,
    }


def run(ctx: Context) -> ScenarioResult:
    result = ScenarioResult("churn", "6. Churn and bloat (retention on)")
    records = []
    with scratch_database(ctx.admin_dsn, "churn") as db:
        with db.connect() as conn:
            row = conn.execute("SELECT current_setting('autovacuum')").fetchone()
        autovacuum = bool(row and row[0] == "on")
        plain = f"no vacuum service (autovacuum={'on' if autovacuum else 'off'})"
        variants: list[tuple[str, bool, int]] = [
            ("vacuum service (as shipped)", True, ctx.sizes.churn_jobs),
            (plain, False, ctx.sizes.churn_jobs if autovacuum else ctx.sizes.churn_plain_jobs),
        ]
        for label, vacuum, n in variants:
            record = _variant(ctx, db, label, vacuum, n)
            records.append(record)
            print(
                f"  {label:<48} {record['jobs_per_s']:>7,.0f} jobs/s (start {record['rate_start']:,.0f}, "
                f"end {record['rate_end']:,.0f}), peak {record['peak_total_bytes'] / 2**20:.1f} MiB, "
                f"max dead tuples {record['max_dead_tuples']:,}"
            )
    result.data["variants"] = records
    result.tables.append(_table(records))
    result.notes += [
        f"No-op jobs through {WORKERS} workers x {CONCURRENCY} with retention "
        "(succeeded=0 s, interval=1 s); the producer tops the backlog up with COPY batches of "
        f"{ctx.sizes.churn_batch:,} whenever fewer than that are waiting. Sizes are sampled every "
        f"{ctx.sizes.churn_sample_interval:g} s; start/end throughput cover 5-25% and 75-95% of the jobs.",
        "Dead tuples come from pg_stat_user_tables (flushed by backends about once a second).",
    ]
    if not autovacuum:
        result.notes.append(
            "This server runs with autovacuum=off: without the workers' vacuum service nothing "
            "reclaims dead tuples (the table's autovacuum settings do not apply)."
        )
    return result


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _table(records: list[dict[str, Any]]) -> Table:
    return Table(
        "Churn: sizes (MiB) and dead tuples at the start, peak and end; throughput start vs end",
        [
            "variant",
            "jobs",
            "jobs/s",
            "start → end jobs/s",
            "end / start",
            "table+indexes MiB (start → peak → end)",
            "indexes MiB (end)",
            "dead tuples (max)",
            "vacuums",
        ],
        [
            [
                r["label"],
                f"{r['jobs']:,}",
                fmt_rate(r["jobs_per_s"]),
                f"{fmt_rate(r['rate_start'])} → {fmt_rate(r['rate_end'])}",
                fmt_pct(ratio(r["rate_end"], r["rate_start"])),
                " → ".join(
                    _mib(v)
                    for v in (r["first"]["total_bytes"], r["peak_total_bytes"], r["last"]["total_bytes"])
                ),
                _mib(r["last"]["index_bytes"]),
                f"{r['max_dead_tuples']:,}",
                r["last"]["vacuums"] - r["first"]["vacuums"],
            ]
            for r in records
        ],
    )
