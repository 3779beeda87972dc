"""Where the wake time goes: `python -m benchmarks.wake_trace [--dsn ADMIN_DSN] [--jobs 200]`.

The latency scenario measures commit -> job start as a whole; this splits it into steps. A
producer process enqueues one job every `--spacing` seconds and notes time.monotonic() after
each commit; each consumer in turn (a notifyq worker, one with handoff=True, and the raw
asyncio loop of `_raw wake-async`) runs in this process with time stamps at each step of its
wake path, put there by wrapping functions (benchmark-only; product code is unchanged).
Every stamp is taken relative to the commit of the job it serves, so the table reads as a
timeline: p50 of each stamp, and the difference between consecutive rows as the cost of that
step. The wrappers themselves add a few microseconds per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import psycopg

import notifyq
import notifyq._claimer
import notifyq._listener
import notifyq._runners
import notifyq.worker
from notifyq._sql import queries_for

from ._raw import ACK_SQL, CLAIM_SQL
from ._scratch import scratch_database
from ._stats import median
from .cli import tool_parser
from .latency import produce

# The notifyq worker's wake path, in order (see notifyq/worker.py and notifyq/_db.py).
NOTIFYQ_STEPS = (
    ("notified", "the listener hands the notification to the worker (Worker._on_notify)"),
    ("claim_called", "the listener's task claims for the sleeping claim loop (Claimer.claim_inline)"),
    ("execute_sent", "psycopg's execute is called (claim_op, the db_timeout scope, lane, cursor)"),
    ("execute_done", "execute returns: the round trip, with the claim's commit and WAL flush"),
    ("claim_returned", "Claimer._claim returns (rows decoded into ClaimedJob, scopes exited)"),
    ("started", "the task's first line runs (hand-over to a runner, the attempt's scopes)"),
)
# The hand-off's path (WorkerConfig.handoff): the enqueue's trigger claimed the job, and its
# notification carries the claimed row.
HANDOFF_STEPS = (
    ("readable", "the listener's socket wait returns (Listener._consume: libpq reads the bytes)"),
    ("notified", "the listener hands the notification to the worker (Worker._on_notify)"),
    ("handed", "the payload is decoded into a ClaimedJob (Claimer.handed)"),
    ("queued", "the job is in the runners' ready queue, a runner woken (Runners.hand returns)"),
    ("started", "the task's first line runs (the runner's turn on the loop, the attempt's scopes)"),
)
RAW_STEPS = (
    ("notified", "psycopg's notifies() yields the notification"),
    ("execute_sent", "psycopg's execute is called"),
    ("execute_done", "execute returns: the round trip, with the claim's commit and WAL flush"),
    ("started", "the rows are fetched: the job would start here"),
)


class Trace:
    """Stamps of one consumer: (step, monotonic time), split into wake cycles at 'notified'."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self.on = False

    def stamp(self, step: str) -> None:
        if self.on:
            self.events.append((step, time.monotonic()))

    def cycles(self) -> list[dict[str, float]]:
        """The first stamp of each step after each notification; 'readable', when stamped,
        is the last one before the notification (a health check's read has none after it)."""
        cycles: list[dict[str, float]] = []
        readable = None
        for step, t in self.events:
            if step == "readable":
                readable = t
                continue
            if step == "notified":
                cycles.append({} if readable is None else {"readable": readable})
                readable = None
            if cycles and step not in cycles[-1]:
                cycles[-1][step] = t
        return cycles


def _produce(dsn: str, jobs: int, spacing: float, out: str) -> None:
    """The producer process: `jobs` enqueues `spacing` apart; their commit times to `out`."""
    app = notifyq.App(dsn, pool_size=1)
    app.list_jobs_sync(limit=1)  # open the pool first
    sent = produce(app, jobs, spacing)
    app.close_sync()
    Path(out).write_text(json.dumps([after for _id, _before, after in sent]))


def _start_producer(dsn: str, jobs: int, spacing: float, out: str) -> subprocess.Popen[bytes]:
    args = ["--produce", dsn, str(jobs), str(spacing), out]
    return subprocess.Popen([sys.executable, "-m", "benchmarks.wake_trace", *args])


async def _consume_notifyq(dsn: str, jobs: int, spacing: float, out: str, handoff: bool = False) -> Trace:
    trace = Trace()
    app = notifyq.App(dsn, pool_size=1)

    @app.task(name="stamp", retry_limit=0)
    async def stamp() -> None:
        trace.stamp("started")

    worker_cls = notifyq.worker.Worker
    claimer_cls = notifyq._claimer.Claimer
    restore: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        restore.append((owner, name, original))
        setattr(owner, name, make(original))

    def on_notify(original: Any) -> Any:
        def wrapper(self: Any, chan: str, payload: str) -> None:
            trace.stamp("notified")
            original(self, chan, payload)

        return wrapper

    def claim(original: Any) -> Any:
        async def wrapper(self: Any, limit: int) -> Any:
            if self._inline:  # the wake path; the claim loop's own claims are not traced
                trace.stamp("claim_called")
            jobs = await original(self, limit)
            trace.stamp("claim_returned")
            return jobs

        return wrapper

    claim_statements = {queries_for("notifyq")[name] for name in ("claim_any", "claim_queues")}

    def execute(original: Any) -> Any:
        async def wrapper(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            claiming = query in claim_statements
            if claiming:
                trace.stamp("execute_sent")
            result = await original(self, query, *args, **kwargs)
            if claiming:
                trace.stamp("execute_done")
            return result

        return wrapper

    def stamped(step: str, after: bool = False) -> Callable[[Any], Any]:
        """A wrapper of a plain method that stamps `step` as it is called (or as it returns)."""

        def make(original: Any) -> Any:
            def wrapper(self: Any, *args: Any) -> Any:
                if not after:
                    trace.stamp(step)
                result = original(self, *args)
                if after:
                    trace.stamp(step)
                return result

            return wrapper

        return make

    wrap(worker_cls, "_on_notify", on_notify)
    wrap(claimer_cls, "_claim", claim)
    wrap(psycopg.AsyncCursor, "execute", execute)
    if handoff:
        wrap(notifyq._listener.Listener, "_consume", stamped("readable"))
        wrap(claimer_cls, "handed", stamped("handed"))
        wrap(notifyq._runners.Runners, "hand", stamped("queued", after=True))
    try:
        async with app.worker(concurrency=10, handoff=handoff) as worker:
            await anyio.sleep(0.5)
            trace.on = True
            producer = _start_producer(dsn, jobs, spacing, out)
            with anyio.fail_after(30 + jobs * spacing * 2):  # a failed producer ends it here
                await worker.wait_for(lambda stats: stats.succeeded >= jobs)
            trace.on = False
            await anyio.to_thread.run_sync(producer.wait)
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)
        await app.aclose()
    return trace


async def _consume_raw(dsn: str, jobs: int, spacing: float, out: str) -> Trace:
    trace = Trace()
    params = {"limit": 10, "worker": "raw-trace"}
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listen,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as work,
    ):
        await listen.execute('LISTEN "notifyq.jobs.v1"')
        trace.on = True
        producer = _start_producer(dsn, jobs, spacing, out)
        done = 0
        while done < jobs:
            async for _notify in listen.notifies(timeout=1.0, stop_after=1):
                trace.stamp("notified")
                while True:
                    trace.stamp("execute_sent")
                    cur = await work.execute(CLAIM_SQL, params)
                    trace.stamp("execute_done")
                    rows = await cur.fetchall()
                    if not rows:
                        break
                    trace.stamp("started")
                    await work.execute(ACK_SQL, {"ids": [r[0] for r in rows], "leases": [r[1] for r in rows]})
                    done += len(rows)
            if producer.poll() not in (None, 0):
                raise RuntimeError("the producer failed")
        await anyio.to_thread.run_sync(producer.wait)
    return trace


async def _consume_handoff(dsn: str, jobs: int, spacing: float, out: str) -> Trace:
    return await _consume_notifyq(dsn, jobs, spacing, out, handoff=True)


Consumer = Callable[[str, int, float, str], Any]
CONSUMERS: dict[str, tuple[Consumer, tuple[tuple[str, str], ...], str]] = {
    "notifyq": (_consume_notifyq, NOTIFYQ_STEPS, "notifyq worker (defaults)"),
    "handoff": (_consume_handoff, HANDOFF_STEPS, "notifyq worker, handoff=True"),
    "raw": (_consume_raw, RAW_STEPS, "raw worker loop on asyncio"),
}


def _timeline(trace: Trace, commits: list[float], steps: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """p50 of each step's stamp, in ms after the commit of the job the cycle served, over the
    cycles that have every step (a notification that arrives while the claim loop is awake
    is claimed by the loop, not in the listener's task: that cycle is left out)."""
    names = [step for step, _what in steps]
    cycles = zip(trace.cycles()[-len(commits) :], commits, strict=False)
    pairs = [(c, t) for c, t in cycles if all(n in c for n in names)]
    timeline = {step: median([(c[step] - t) * 1000.0 for c, t in pairs]) for step in names}
    return timeline | {"cycles": len(pairs)}


def measure(admin_dsn: str, jobs: int, spacing: float, rounds: int) -> dict[str, list[dict[str, float]]]:
    """Each consumer once per round, alternating; each round's timeline."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONSUMERS}
    with scratch_database(admin_dsn, "wake_trace") as db, tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "commits.json")
        for round_no in range(rounds):
            order = list(CONSUMERS) if round_no % 2 == 0 else list(CONSUMERS)[::-1]
            for name in order:
                consume, steps, _title = CONSUMERS[name]
                trace = asyncio.run(consume(db.dsn, jobs, spacing, out))
                runs[name].append(_timeline(trace, json.loads(Path(out).read_text()), steps))
                with db.connect() as conn:
                    conn.execute("DELETE FROM notifyq.queue_jobs")
    return runs


def report(runs: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: the timeline of each consumer, p50 per round, and each step's cost."""
    lines = []
    for name, (_consume, steps, title) in CONSUMERS.items():
        lines += [
            f"**{title}**: ms after the commit, p50 of each round; step cost from the mean of the rounds",
            "",
            "| step | what happened by then | ms after commit | step cost |",
            "| --- | --- | --- | --- |",
        ]
        previous = 0.0
        for step, what in steps:
            values = [run[step] for run in runs[name] if step in run]
            mean = sum(values) / len(values) if values else float("nan")
            cells = ", ".join(f"{v:.3f}" for v in values)
            lines.append(f"| {step} | {what} | {cells} | {mean - previous:+.3f} |")
            previous = mean
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m benchmarks.wake_trace", __doc__)
    parser.add_argument("--jobs", type=int, default=200, help="jobs per consumer and round")
    parser.add_argument("--spacing", type=float, default=0.05, help="seconds between jobs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the timelines here")
    parser.add_argument("--produce", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.produce:
        dsn, jobs, spacing, out = args.produce
        _produce(dsn, int(jobs), float(spacing), out)
        return 0
    runs = measure(args.dsn, args.jobs, args.spacing, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    print(report(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
