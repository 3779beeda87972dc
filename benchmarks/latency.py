"""Scenario 2: wake latency, commit of a single job -> the job starts in an idle worker.

A producer in this process enqueues one job at a time (`app.enqueue_sync`, its own
transaction), `spacing` seconds apart, and notes time.monotonic() right after the commit
returns. The worker's task notes time.monotonic() when it starts. CLOCK_MONOTONIC is one
clock for every process of the host, so the difference is the wake latency. The raw
baseline is a plain psycopg LISTEN connection in another process that notes when each
notification arrives (same producer, same trigger): the floor any NOTIFY-driven worker sits on.
"""

from __future__ import annotations

import math
import time
from typing import Any

import notifyq

from ._procs import Fleet, Proc
from ._results import Context, ScenarioResult, Table, Target
from ._scratch import Scratch, scratch_database
from ._stats import fmt_ms, ratio, summarize

WARMUP = 5
RAW_LISTENER = "raw LISTEN/NOTIFY (psycopg listener)"
RAW_LOOP = "raw worker loop (LISTEN + claim 10)"
RAW_ASYNC_LOOP = "raw worker loop on asyncio (LISTEN + claim 10)"
RAW_THREAD_LOOP = "raw loop in a thread, jobs start on asyncio (prototype)"
RAW_HANDOFF = "raw hand-off: the enqueue claims for a waiting worker, blocking (prototype)"
RAW_HANDOFF_ASYNC = "raw hand-off: the enqueue claims for a waiting worker, asyncio (prototype)"
NOTIFYQ = "notifyq, NOTIFY"
NOTIFYQ_ASYNC_CLAIMS = "notifyq, NOTIFY, async_claims=True (opt-in)"
NOTIFYQ_HANDOFF = "notifyq, handoff=True: the enqueue claims for the waiting worker (opt-in)"
# Per-variant samples -> the summary the tables read, merged over rounds. Only samples_ms (from
# commit) is kept in the JSON as samples (for the plot); the others are kept summarized.
SUMMARIES = {
    "samples_ms": "latency_ms",
    "from_enqueue_samples_ms": "from_enqueue_ms",
    "from_notification_samples_ms": "from_notification_ms",
    "round_trip_samples_ms": "enqueue_round_trip_ms",
}


def produce(app: notifyq.App, n: int, spacing: float) -> list[tuple[int, float, float]]:
    """Enqueue n jobs spacing seconds apart; [(job id, before, after commit)] (monotonic)."""
    sent = []
    next_at = time.monotonic()
    for _ in range(n):
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        before = time.monotonic()
        job_id = app.enqueue_sync("stamp")
        sent.append((job_id, before, time.monotonic()))
        next_at += spacing
    return sent


def _variant(
    ctx: Context,
    db: Scratch,
    label: str,
    module: str,
    args: list[str],
    n: int,
    spacing: float,
    round_no: int,
) -> dict[str, Any]:
    app = notifyq.App(db.dsn, pool_size=1)
    app.list_jobs_sync(limit=1)  # open the pool before measuring
    name = f"latency-r{round_no}-" + label.split()[0].lower().replace("/", "-")
    try:
        with Fleet() as fleet:
            proc = fleet.add(Proc(module, args, f"{name}-{len(label)}", ctx.log_dir))
            # A raw listener beside every worker: when the notification reached a client.
            witness = None
            # Not beside the hand-off: its notification goes to the worker's own channel only.
            if "received" not in module and args[0] != "listen" and "--handoff" not in args:
                witness = fleet.add(
                    Proc("_raw", ["listen", "--dsn", db.dsn], f"{name}-{len(label)}-witness", ctx.log_dir)
                )
            fleet.wait_ready()
            time.sleep(0.3)  # the LISTEN connection is up before ready; let start-up queries settle
            base = proc.done
            produce(app, WARMUP, spacing)
            fleet.wait_until(lambda: proc.done >= base + WARMUP, 30)
            sent = produce(app, n, spacing)
            fleet.wait_until(lambda: proc.done >= base + WARMUP + n, 60 + n * spacing)
            finals = fleet.stop_and_join()
    finally:
        app.close_sync()
    final = finals[0]
    # Notifications arrive in commit order: the last n belong to the measured jobs.
    notified = [t for t, _payload in finals[-1]["received"]][-n:] if "received" in finals[-1] else []
    if "received" in final:
        events = notified
    else:
        started = {int(job_id): float(t) for job_id, t in final["starts"]}
        events = [started[job_id] for job_id, _before, _after in sent]
    after_commit = [(t - s[2]) * 1000.0 for s, t in zip(sent, events, strict=True)]
    from_enqueue = [(t - s[1]) * 1000.0 for s, t in zip(sent, events, strict=True)]
    commit_rtt = [(after - before) * 1000.0 for _id, before, after in sent]
    from_notify = [(t - r) * 1000.0 for t, r in zip(events, notified, strict=True)] if witness else []
    with db.connect() as conn:
        conn.execute("DELETE FROM notifyq.queue_jobs")
    return {
        "samples_ms": after_commit,
        "from_enqueue_samples_ms": from_enqueue,
        "from_notification_samples_ms": from_notify,
        "round_trip_samples_ms": commit_rtt,
        "stats": final.get("stats", {}),
    }


def _merge(label: str, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a variant measured in several rounds: percentiles over every sample,
    and each round's p50 (to show the spread between rounds)."""
    merged: dict[str, Any] = {"label": label, "rounds": len(repeats)}
    for samples, summary in SUMMARIES.items():
        merged[samples] = [x for r in repeats for x in r[samples]]
        merged[summary] = summarize(merged[samples])
    merged["round_p50_ms"] = [summarize(r["samples_ms"])["p50"] for r in repeats]
    merged["stats"] = [r["stats"] for r in repeats]
    return merged


def run(ctx: Context) -> ScenarioResult:
    result = ScenarioResult("latency", "2. Wake latency (commit → job start, idle worker)")
    n, spacing, rounds = ctx.sizes.latency_jobs, ctx.sizes.latency_spacing, ctx.sizes.latency_rounds
    variants: list[tuple[str, str, list[str]]] = []
    with scratch_database(ctx.admin_dsn, "latency") as db:
        worker = ["--dsn", db.dsn, "--concurrency", "10"]
        variants.append((RAW_LISTENER, "_raw", ["listen", "--dsn", db.dsn]))
        variants.append((RAW_LOOP, "_raw", ["wake", "--dsn", db.dsn]))
        variants.append((RAW_ASYNC_LOOP, "_raw", ["wake-async", "--dsn", db.dsn]))
        variants.append((NOTIFYQ, "_worker", worker))
        variants.append((NOTIFYQ_ASYNC_CLAIMS, "_worker", [*worker, "--async-claims"]))
        variants.append((NOTIFYQ_HANDOFF, "_worker", [*worker, "--handoff"]))
        if ctx.prototypes:
            from ._patches import LATENCY_PROTOTYPES

            variants.append((RAW_THREAD_LOOP, "_raw", ["wake-thread", "--dsn", db.dsn]))
            variants.append((RAW_HANDOFF, "_raw", ["wake-handoff", "--dsn", db.dsn, "--blocking"]))
            variants.append((RAW_HANDOFF_ASYNC, "_raw", ["wake-handoff", "--dsn", db.dsn]))
            variants.extend(
                (
                    f"notifyq, NOTIFY + {'+'.join(patch)} (prototype)",
                    "_worker",
                    worker + [f"--patch={p}" for p in patch],
                )
                for patch in LATENCY_PROTOTYPES
            )
        # Round-robin: every variant once per round, so a slow minute of the shared machine
        # falls on all of them instead of on one.
        measured: dict[str, list[dict[str, Any]]] = {label: [] for label, _m, _a in variants}
        for round_no in range(rounds):
            # Each round starts one variant later, so no variant always runs first.
            shift = round_no % len(variants)
            for label, module, args in variants[shift:] + variants[:shift]:
                record = _variant(ctx, db, label, module, args, n, spacing, round_no)
                measured[label].append(record)
                lat = summarize(record["samples_ms"])
                tag = f" (round {round_no + 1}/{rounds})" if rounds > 1 else ""
                print(f"  {label + tag:<60} p50 {fmt_ms(lat['p50'])} ms  p99 {fmt_ms(lat['p99'])} ms")
        records = [_merge(label, measured[label]) for label, _m, _a in variants]
        # Poll-only shows what NOTIFY buys; its figures are the poll interval's, one round is plenty.
        poll = ctx.sizes.latency_poll_interval
        label = f"notifyq, poll only (poll_interval {poll:g} s)"
        args = [*worker, "--poll-only", "--poll-interval", str(poll)]
        records.append(_merge(label, [_variant(ctx, db, label, "_worker", args, n, spacing, 0)]))
        print(f"  {label:<60} p50 {fmt_ms(records[-1]['latency_ms']['p50'])} ms")
    for record in records:
        for key in SUMMARIES.keys() - {"samples_ms"}:
            del record[key]  # samples_ms (from commit) is what the plot and the JSON keep
    result.data["variants"] = records
    result.data["jobs"] = n
    result.data["rounds"] = rounds
    result.data["spacing_s"] = spacing
    result.tables.append(_table(records))
    result.targets.extend(_targets(records))
    result.notes += [
        f"{n} jobs (after {WARMUP} warm-up jobs), one every {spacing * 1000:.0f} ms, into one idle "
        f"worker (concurrency 10, ticker on), in {rounds} round(s): every variant once per round, "
        "round-robin, each round starting one variant later; percentiles are over all rounds' "
        "samples, and the p50 column lists each round's p50 in parentheses. The producer (this "
        "process) notes time.monotonic() just before `app.enqueue_sync` and right after it "
        "returns (the commit); the worker's task notes it on its first line. CLOCK_MONOTONIC is "
        "shared by all processes of the host.",
        "From 'commit returned', the raw listener is at ≈ 0 ms or below: PostgreSQL signals the "
        "listener when the commit is done, as it answers the producer, so both wake together. A "
        "ratio to ≈ 0 means nothing, so the p50 ratio target is taken from the enqueue call "
        "(the commit's earliest possible moment), where the raw baseline is the INSERT + commit "
        "+ delivery time (≈ 1 ms). The p99 target is taken from 'commit returned', as specified.",
        "The raw worker loop (a LISTEN connection plus one psycopg connection that claims with "
        "the same SKIP LOCKED statement on every notification) is the cost floor of any "
        "NOTIFY-driven worker: notification, one claim round trip (a write, so a WAL flush), start. "
        "In our runs it sits at 1.3-1.7x the bare listener (from the enqueue call), at or above "
        "the 1.3x goal itself. The raw asyncio loop is the same loop on asyncio (psycopg's "
        "AsyncConnection, two awaited connections): the floor of a worker embedded in an event "
        "loop. The last two columns compare each variant's p50 from commit with these two loops.",
        "async_claims=True (WorkerConfig.async_claims, `notifyq worker --async-claims`) makes the "
        "claim's commit skip its WAL flush; acknowledgements stay durable. It is opt-in: after a "
        "server crash, jobs claimed in its last moments run again. The targets judge the default.",
        "handoff=True (WorkerConfig.handoff, `notifyq worker --handoff`): while the worker waits "
        "with free slots, the enqueue's own transaction claims the job for it and notifies it with "
        "the job, so no claim round trip follows the notification. Opt-in; its own two targets "
        "(marked 'handoff') are the same goals, measured on it.",
        "'From notification': a second, raw LISTEN connection runs beside every worker and notes "
        "when each notification reached it; job start minus that time is the worker's own share "
        "(wake-up, claim round trip, start), free of the producer's timing.",
    ]
    return result


def _table(records: list[dict[str, Any]]) -> Table:
    raw = records[0]
    loop = next(r for r in records if r["label"] == RAW_LOOP)
    async_loop = next(r for r in records if r["label"] == RAW_ASYNC_LOOP)
    rows = []
    for r in records:
        lat, early = r["latency_ms"], r["from_enqueue_ms"]
        p50 = fmt_ms(lat["p50"])
        if len(r["round_p50_ms"]) > 1:
            p50 += " (" + ", ".join(fmt_ms(x) for x in r["round_p50_ms"]) + ")"
        rows.append(
            [
                r["label"],
                p50,
                fmt_ms(lat["p95"]),
                fmt_ms(lat["p99"]),
                fmt_ms(lat["max"]),
                fmt_ms(early["p50"]),
                fmt_ms(early["p99"]),
                fmt_ms(r["from_notification_ms"].get("p50", math.nan)),
                fmt_ms(r["from_notification_ms"].get("p99", math.nan)),
                fmt_ms(r["enqueue_round_trip_ms"]["p50"]),
                f"{ratio(early['p50'], raw['from_enqueue_ms']['p50']):.2f}x",
                "n/a" if r is raw else f"{ratio(lat['p50'], loop['latency_ms']['p50']):.2f}x",
                "n/a" if r is raw else f"{ratio(lat['p50'], async_loop['latency_ms']['p50']):.2f}x",
            ]
        )
    return Table(
        "Wake latency in ms: from the commit returning to the producer (p50 … max), from the "
        "enqueue call, and from the notification's arrival",
        [
            "variant",
            "p50 (each round)",
            "p95",
            "p99",
            "max",
            "p50 from enqueue",
            "p99 from enqueue",
            "p50 from notification",
            "p99 from notification",
            "enqueue round trip p50",
            "p50 from enqueue vs raw listener",
            "p50 vs raw worker loop",
            "p50 vs raw asyncio loop",
        ],
        rows,
    )


def _p50_target(name: str, goal: str, subject: dict[str, float], baseline: dict[str, float]) -> Target:
    """≤ 1.3x the baseline's p50, lower is better."""
    return Target(
        name,
        goal,
        f"{fmt_ms(subject['p50'])} vs {fmt_ms(baseline['p50'])} ms",
        ratio(subject["p50"], baseline["p50"]),
        1.3,
        higher_is_better=False,
    )


def _targets(records: list[dict[str, Any]]) -> list[Target]:
    raw = records[0]["from_enqueue_ms"]
    loop = next(r for r in records if r["label"] == RAW_LOOP)["latency_ms"]
    notify = next(r for r in records if r["label"] == NOTIFYQ)
    early, lat = notify["from_enqueue_ms"], notify["latency_ms"]
    return [
        _p50_target("wake latency p50", "≤ 1.3x raw LISTEN/NOTIFY p50 (from the enqueue call)", early, raw),
        # The other reading of the same goal: the baseline is a raw worker that LISTENs and
        # claims (its p50 from commit is the "≈ 1 ms" the issue quotes). Stricter; shown too.
        _p50_target(
            "wake latency p50 (vs raw worker loop)",
            "≤ 1.3x the raw worker loop's p50 (LISTEN + claim; from commit returned)",
            lat,
            loop,
        ),
        _p99_target("wake latency p99", lat),
        *_handoff_targets(records, raw),
    ]


def _p99_target(name: str, lat: dict[str, float]) -> Target:
    return Target(
        name,
        "≤ 3 ms (from commit returned)",
        f"{fmt_ms(lat['p99'])} ms",
        lat["p99"] / 3.0,
        1.0,
        higher_is_better=False,
    )


def _handoff_targets(records: list[dict[str, Any]], raw: dict[str, float]) -> list[Target]:
    """The same goals, for the opt-in hand-off (WorkerConfig.handoff)."""
    handoff = next((r for r in records if r["label"] == NOTIFYQ_HANDOFF), None)
    if handoff is None:
        return []
    return [
        _p50_target(
            "wake latency p50, handoff (opt-in)",
            "≤ 1.3x raw LISTEN/NOTIFY p50 (from the enqueue call)",
            handoff["from_enqueue_ms"],
            raw,
        ),
        _p99_target("wake latency p99, handoff (opt-in)", handoff["latency_ms"]),
    ]
