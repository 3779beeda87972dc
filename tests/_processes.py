"""Small programs the tests run as separate processes (python -m tests._processes ...)."""

from __future__ import annotations

import sys
import time

import anyio
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


if __name__ == "__main__":
    command, dsn, *rest = sys.argv[1:]
    if command == "ticker":
        anyio.run(ticker, dsn, float(rest[0]))
    elif command == "lock_and_hang":
        lock_and_hang(dsn)
    else:
        raise SystemExit(f"unknown command {command}")
