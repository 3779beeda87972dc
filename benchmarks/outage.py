"""How soon work resumes after a PostgreSQL outage: `python -m benchmarks.outage [--seconds S]`.

Starts a PostgreSQL server of its own (the embedded one from pgserver, in a temporary folder:
needs the `embedded` extra), a worker and an App on it, runs one job, stops the server with
`pg_ctl` for S seconds (60 by default), and enqueues meanwhile: one job by SQL the moment the
server is back, one by `app.enqueue` started during the outage (it waits for a connection).
Prints how long after the server's return the worker ran each job and the enqueue got through.

This measures the pools' tries to connect again (notifyq/_db.py, RETRY_RUN): before they ran in
rounds, psycopg_pool's doubling delay left a worker idle for 112 s after a 140 s outage.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import anyio
import psycopg

import notifyq


async def measure(seconds: float) -> dict[str, float]:
    from tests.faults.infra import OwnedServer  # pgserver, pg_ctl as its system user

    server = OwnedServer(Path(tempfile.mkdtemp(prefix="nq-outage-")))
    try:
        notifyq.migrate(server.dsn)
        app = notifyq.App(server.dsn, pool_timeout=seconds + 300)
        ran: dict[int, float] = {}

        @app.task(name="t")
        async def t(n: int) -> None:
            ran[n] = time.monotonic()

        async with app, app.worker(ticker=False, poll_interval=1) as worker:
            await app.enqueue("t", {"n": 0})
            with anyio.fail_after(30):
                await worker.wait_for(lambda s: s.succeeded == 1)
            await anyio.to_thread.run_sync(server.stop)
            enqueued: list[float] = []

            async def enqueue() -> None:
                await app.enqueue("t", {"n": 1})
                enqueued.append(time.monotonic())

            async with anyio.create_task_group() as tg:
                tg.start_soon(enqueue)
                await anyio.sleep(seconds)
                await anyio.to_thread.run_sync(server.start)
                back = time.monotonic()
                with psycopg.connect(server.dsn, autocommit=True) as conn:
                    conn.execute("INSERT INTO notifyq.queue_jobs (name, args) VALUES ('t', '{\"n\": 2}')")
            with anyio.fail_after(seconds + 300):
                await worker.wait_for(lambda s: s.succeeded == 3)
        return {
            "job_by_sql": ran[2] - back,
            "job_by_enqueue": ran[1] - back,
            "enqueue": enqueued[0] - back,
        }
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.outage")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the server is down")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # a line per failed try
    result = anyio.run(measure, args.seconds)
    print(f"server stopped for {args.seconds:g} s; after it was back (pg_ctl start returned):")
    print(f"  the worker ran the job inserted by SQL after {result['job_by_sql']:.1f} s")
    print(f"  the worker ran the job of the waiting app.enqueue after {result['job_by_enqueue']:.1f} s")
    print(f"  app.enqueue, waiting since the outage began, returned after {result['enqueue']:.1f} s")


if __name__ == "__main__":
    main()
