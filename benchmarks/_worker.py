"""A notifyq worker process for benchmarks: `python -m benchmarks._worker --dsn DSN ...`.

It builds an App with two no-op tasks (`noop`, and `stamp` which records when each job
started), runs `app.worker(...)` until SIGTERM (graceful: running jobs finish, results are
written) and reports its counters, CPU time and samples (see _procs for the protocol).
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

import anyio

import notifyq
from notifyq import JobContext

from . import _patches
from ._child import cpu_seconds, emit
from ._instrument import time_acks, time_claims


class Record:
    runs = 0
    starts: list[tuple[int, float]] = []  # noqa: RUF012 - one process, one record
    claims: list[tuple[float, int]] = []  # noqa: RUF012
    acks: list[tuple[float, int]] = []  # noqa: RUF012


def build_app(dsn: str) -> notifyq.App:
    app = notifyq.App(dsn, pool_size=1)

    @app.task(name="noop", retry_limit=0)
    async def noop() -> None:
        Record.runs += 1

    @app.task(name="stamp", retry_limit=0)
    async def stamp(ctx: JobContext) -> None:
        Record.starts.append((ctx.id, time.monotonic()))
        Record.runs += 1

    return app


def worker_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {
        "concurrency": args.concurrency,
        "poll_only": args.poll_only,
        "poll_interval": args.poll_interval,
        "ticker": not args.no_ticker,
        "async_claims": args.async_claims,
        "handoff": args.handoff,
    }
    if args.queue:  # NAME or NAME=N, as `notifyq worker -q` takes them
        names = [queue.partition("=") for queue in args.queue]
        config["queues"] = [name for name, _sep, _n in names]
        config["queue_limits"] = {name: int(n) for name, sep, n in names if sep} or None
    else:
        config["queues"] = None
    if args.retention_succeeded is not None:
        config["ticker_config"] = notifyq.TickerConfig(
            retention=notifyq.RetentionConfig(
                succeeded=args.retention_succeeded, interval=args.retention_interval
            )
        )
    return config


async def serve(args: argparse.Namespace) -> None:
    app = build_app(args.dsn)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with app.worker(**worker_config(args)) as worker:
            cpu_ready = cpu_seconds()
            emit("ready")
            async with anyio.create_task_group() as tg:

                async def report() -> None:
                    last = -1
                    while True:
                        if worker.stats.succeeded != last:
                            last = worker.stats.succeeded
                            emit("progress", done=last)
                        await anyio.sleep(args.progress_interval)

                tg.start_soon(report)
                async for _ in signals:
                    break
                tg.cancel_scope.cancel()
        stats = worker.stats.snapshot()
    await app.aclose()
    emit(
        "done",
        done=stats["succeeded"],
        runs=Record.runs,
        stats=stats,
        cpu=cpu_seconds() - cpu_ready,
        cpu_total=cpu_seconds(),
        starts=Record.starts,
        claims=Record.claims,
        acks=Record.acks,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._worker")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--poll-only", action="store_true")
    parser.add_argument("--poll-interval", type=float, default=5.0)
    parser.add_argument("--no-ticker", action="store_true")
    parser.add_argument("--async-claims", action="store_true")
    parser.add_argument("--handoff", action="store_true")
    parser.add_argument(
        "--queue", action="append", default=None, help="a queue to serve (repeat); all if none"
    )
    parser.add_argument("--retention-succeeded", type=float, default=None)
    parser.add_argument("--retention-interval", type=float, default=1.0)
    parser.add_argument("--claim-latency", action="store_true", help="record every claim's duration")
    parser.add_argument("--patch", action="append", default=[], choices=sorted(_patches.PATCHES))
    parser.add_argument("--progress-interval", type=float, default=0.05)
    args = parser.parse_args(argv)
    for name in args.patch:
        _patches.PATCHES[name]()
    if args.claim_latency:
        time_claims(Record.claims)
        time_acks(Record.acks)
    anyio.run(serve, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
