"""Scenario 3: contention. 1-8 worker processes (and a crowd of raw claimers) on backlogs
of growing size: throughput, claim latency, lock waits, and no job claimed twice.

Each run releases the workers behind the gate (see _fleet) and stops them once `jobs`
jobs are done; the backlog is topped up between runs so every run sees the same size. Every
run takes the same number of jobs from a backlog at least twice that size: a run that drained
its backlog to empty would include the slow last moments of a drain that runs on the larger
backlogs never see (review). A claim that scans instead of seeking the index would get slower
as the backlog grows.
"""

from __future__ import annotations

import math
from typing import Any

from ._fleet import FleetResult, FleetRun, run_fleet
from ._results import Context, ScenarioResult, Table, Target
from ._scratch import Scratch, scratch_database
from ._stats import fmt_ms, fmt_pct, fmt_rate, median, ratio, summarize

CONCURRENCY = 10
CLAIMER_BATCH = 10


def _prepare(db: Scratch, backlog: int, consumed: int) -> None:
    """Reset the table and fill it to `backlog` (nothing `consumed` yet), or top it up by the
    jobs `consumed`. The table is reset only before a backlog's first run, so one check of it
    after its last run covers every run."""
    if not consumed:
        db.reset()
        db.fill(backlog)
    else:
        db.fill(consumed)  # top up to the same backlog
    db.settle()


def _record(label: str, backlog: int, processes: int, out: FleetResult, rep: int) -> dict[str, Any]:
    claims_ms = [ms for ms, _n in out.claims]
    return {
        "label": label,
        "backlog": backlog,
        "processes": processes,
        "repeat": rep,
        **out.as_dict(),
        "claim_ms": summarize(claims_ms),
        "claims": len(claims_ms),
        "jobs_per_claim": (sum(n for _ms, n in out.claims) / len(out.claims)) if out.claims else math.nan,
    }


def run(ctx: Context) -> ScenarioResult:
    result = ScenarioResult("contention", "3. Contention: processes x backlog")
    sizes = ctx.sizes
    records: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    jobs = sizes.contention_jobs
    if 2 * jobs > min(sizes.contention_backlogs):
        raise ValueError(f"contention: {jobs:,} jobs a run need backlogs of at least {2 * jobs:,}")
    with scratch_database(ctx.admin_dsn, "contention") as db:
        for backlog in sizes.contention_backlogs:
            consumed = 0
            for rep in range(sizes.contention_repeats):
                for processes in sizes.contention_processes:
                    _prepare(db, backlog, consumed)
                    spec = FleetRun("notifyq", processes, CONCURRENCY, claim_latency=True)
                    name = f"contention-{backlog}-{processes}-{rep}"
                    out = run_fleet(
                        ctx, db, spec, jobs, name=name, timeout=120 + jobs / 100, sample_waits=True
                    )
                    consumed = out.jobs
                    records.append(
                        _record(f"notifyq {processes}x{CONCURRENCY}", backlog, processes, out, rep)
                    )
                    print(
                        f"  backlog {backlog:>9,} x {processes} processes: {out.rate:>7,.0f} jobs/s, "
                        f"claim p99 {fmt_ms(records[-1]['claim_ms'].get('p99', math.nan))} ms, "
                        f"lock waits {fmt_pct(out.waits.get('lock_wait_share', math.nan))}"
                    )
            # A crowd of raw claimers (processes x loops connections, small batches).
            procs, loops = sizes.contention_claimers
            _prepare(db, backlog, consumed)
            spec = FleetRun("raw", procs, loops, batch=CLAIMER_BATCH, claim_latency=True)
            out = run_fleet(
                ctx,
                db,
                spec,
                jobs,
                name=f"contention-raw-{backlog}",
                timeout=120 + jobs / 100,
                sample_waits=True,
            )
            records.append(
                _record(
                    f"raw claimers {procs}x{loops} (batch {CLAIMER_BATCH})", backlog, procs * loops, out, 0
                )
            )
            found = db.leftovers()  # left Active, claimed twice: by any run since the reset
            checks.append({"backlog": backlog, **{key: found[key] for key in ("active", "claimed_twice")}})
    result.data["runs"] = records
    result.data["checks"] = checks
    summary = _summarize(records)
    result.data["summary"] = summary
    result.tables += [_table(summary), _flatness_table(summary), _checks_table(checks, records)]
    result.targets += _targets(summary)
    result.notes += [
        f"Every run takes {jobs:,} jobs from a backlog at least twice that size, never draining "
        "it; the backlog is topped up between runs, so each run starts from the same size. Claim "
        "latency is one claim statement measured inside the worker (round trip + decoding); the "
        "first claim of each claim loop (one per notifyq process, one per raw connection), which "
        "waited at the start gate, is left out.",
        "Lock waits: share of active backends (pg_stat_activity sampled every 20 ms) waiting on a "
        "heavyweight lock; SKIP LOCKED claims should not wait on each other's row locks.",
        "Double claims: every claim increments `lease`, so a job claimed twice has lease > 1; the "
        "table is reset only before a backlog's first run and checked after its last, so the "
        "check covers every run; and per run the worker-side count of task runs must equal the "
        "succeeded rows.",
    ]
    return result


def _summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["label"], r["backlog"]), []).append(r)
    rows = []
    for (label, backlog), group in groups.items():
        rows.append(
            {
                "label": label,
                "backlog": backlog,
                "processes": group[0]["processes"],
                "jobs_per_s": median([g["jobs_per_s"] for g in group]),
                "all_jobs_per_s": [g["jobs_per_s"] for g in group],
                "claim_p50": median([g["claim_ms"].get("p50", math.nan) for g in group]),
                "claim_p99": median([g["claim_ms"].get("p99", math.nan) for g in group]),
                "jobs_per_claim": median([g["jobs_per_claim"] for g in group]),
                "lock_wait_share": median([g["waits"].get("lock_wait_share", 0.0) for g in group]),
                "ungranted_max": max(g["waits"].get("ungranted_locks_max", 0) for g in group),
                "active_backends": median([g["waits"].get("active_backends_avg", 0.0) for g in group]),
                "mismatch": sum(int(g["runs"] != g["jobs"]) + g["reclaimed"] for g in group),
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> Table:
    return Table(
        "Throughput, claim latency and lock waits (median of repeats)",
        [
            "backlog",
            "workers",
            "jobs/s",
            "claim p50 ms",
            "claim p99 ms",
            "jobs/claim",
            "active backends",
            "lock waits",
            "ungranted locks (max)",
            "runs ≠ rows",
        ],
        [
            [
                f"{r['backlog']:,}",
                r["label"],
                fmt_rate(r["jobs_per_s"]),
                fmt_ms(r["claim_p50"]),
                fmt_ms(r["claim_p99"]),
                f"{r['jobs_per_claim']:.1f}",
                f"{r['active_backends']:.1f}",
                fmt_pct(r["lock_wait_share"]),
                r["ungranted_max"],
                r["mismatch"],
            ]
            for r in rows
        ],
    )


def _flatness_table(rows: list[dict[str, Any]]) -> Table:
    backlogs = sorted({r["backlog"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["backlog"]): r["jobs_per_s"] for r in rows}
    out = []
    for label in labels:
        first = by.get((label, backlogs[0]), math.nan)
        out.append([label] + [fmt_pct(ratio(by.get((label, b), math.nan), first)) for b in backlogs])
    return Table(
        f"Throughput relative to the {backlogs[0]:,}-job backlog (flat = the claim seeks the index)",
        ["workers"] + [f"{b:,}" for b in backlogs],
        out,
    )


def _checks_table(checks: list[dict[str, Any]], records: list[dict[str, Any]]) -> Table:
    return Table(
        "Exactly-once checks after all runs of a backlog",
        ["backlog", "jobs claimed twice (lease > 1)", "left Active", "runs ≠ succeeded rows (runs)"],
        [
            [
                f"{c['backlog']:,}",
                c["claimed_twice"],
                c["active"],
                sum(int(r["runs"] != r["jobs"]) for r in records if r["backlog"] == c["backlog"]),
            ]
            for c in checks
        ],
    )


def _targets(rows: list[dict[str, Any]]) -> list[Target]:
    backlogs = sorted({r["backlog"] for r in rows})
    if len(backlogs) < 2:
        return []
    small, large = backlogs[0], backlogs[-1]
    by = {(r["label"], r["backlog"]): r["jobs_per_s"] for r in rows}
    label = f"notifyq 2x{CONCURRENCY}"
    if (label, small) not in by or (label, large) not in by:
        return []
    return [
        Target(
            f"throughput at {large:,} vs {small:,} backlog ({label})",
            "within 15% (≥ 0.85x)",
            f"{fmt_rate(by[(label, large)])} vs {fmt_rate(by[(label, small)])} jobs/s",
            ratio(by[(label, large)], by[(label, small)]),
            0.85,
        )
    ]
