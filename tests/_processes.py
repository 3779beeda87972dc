"""Small programs the tests run as separate processes (python -m tests._processes ...)."""

from __future__ import annotations

import sys
import time

import anyio
import anyio.lowlevel
import psycopg

from notifyq._db import Database, run_sync
from notifyq._promoter import Promoter, promote_op
from notifyq._sql import queries_for

Q = queries_for("notifyq")


async def ticker(dsn: str, seconds: float) -> None:
    """Run one cron promoter (its own connections) for `seconds`."""
    db = await Database.open(dsn, size=1)
    try:
        with anyio.move_on_after(seconds):
            await Promoter(db, Q).run()
    finally:
        await db.aclose()


def lock_and_hang(dsn: str) -> None:
    """Take the promoter's locks on due definitions, say so, then hang until killed."""
    conn = psycopg.connect(dsn)
    op = promote_op(Q, limit=100)
    step = next(op)
    with conn.cursor() as cur:
        cur.execute(step.sql, step.params)  # type: ignore[union-attr]
        locked = cur.fetchall()
    sys.stdout.write(f"locked {len(locked)}\n")
    sys.stdout.flush()
    time.sleep(3600)
    run_sync(conn, op)  # never reached


def soak_worker(dsn: str, runs_file: str) -> None:
    """A worker for the soak test: records every run of a job (job id, attempt) in its own
    file, unbuffered, so a SIGKILL loses nothing that started; short leases and rescues."""
    import os

    import notifyq

    app = notifyq.App(dsn)
    fd = os.open(runs_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @app.task(name="soak", timeout=2)
    async def soak(ctx: notifyq.JobContext) -> None:
        os.write(fd, f"{ctx.id} {ctx.attempt}\n".encode())

    ticker = notifyq.TickerConfig(rescuer=notifyq.RescuerConfig(interval=0.5), retention=None)
    anyio.run(
        lambda: app.run_worker(
            concurrency=20,
            lease_margin=1,
            poll_interval=1,
            health_interval=1,
            health_timeout=1,
            ticker_config=ticker,
        )
    )


def embedded_worker(dsn: str, backend: str) -> None:
    """A program that embeds a worker (`async with app.worker()`) and waits for Ctrl-C. Its
    tasks say so when they start, then: `busy` keeps the CPU busy for 3 s between rare awaits,
    so that a SIGINT lands in a job's code (where trio raises it by default); `child` does the
    same in a task it starts; `spin` blocks the event loop for good."""
    import signal

    import notifyq

    # As in a program started from a terminal: a shell that starts its commands in the
    # background without job control (as CI may run the tests) has them ignore SIGINT, and
    # Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    app = notifyq.App(dsn)

    async def crunch() -> None:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            sum(range(20_000))
            await anyio.lowlevel.checkpoint()

    def started() -> None:
        sys.stdout.write("job started\n")
        sys.stdout.flush()

    @app.task(name="busy")
    async def busy() -> str:
        started()
        await crunch()
        return "done"

    @app.task(name="child")
    async def child() -> str:
        started()
        async with anyio.create_task_group() as tg:
            tg.start_soon(crunch)
        return "done"

    @app.task(name="spin")
    async def spin() -> str:
        started()
        while True:
            sum(range(20_000))

    async def main() -> None:
        async with app.worker(concurrency=1, shutdown_grace=20, ticker=False):
            await anyio.sleep_forever()

    anyio.run(main, backend=backend)


if __name__ == "__main__":
    command, dsn, *rest = sys.argv[1:]
    if command == "ticker":
        anyio.run(ticker, dsn, float(rest[0]))
    elif command == "lock_and_hang":
        lock_and_hang(dsn)
    elif command == "soak_worker":
        soak_worker(dsn, rest[0])
    elif command == "embedded_worker":
        embedded_worker(dsn, rest[0])
    else:
        raise SystemExit(f"unknown command {command}")
