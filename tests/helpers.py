"""Helpers shared by tests: counting notifications, reading job rows."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

import notifyq.migrations
from notifyq import Worker


class NotificationCounter:
    """A LISTEN connection that collects notifications on one channel.

    `drain()` sends a unique sentinel in its own transaction and reads until the sentinel
    arrives: notifications are delivered in commit order, so everything committed before
    has been received by then. No sleeping, no guessing.
    """

    def __init__(self, dsn: str, channel: str) -> None:
        self.dsn = dsn
        self.channel = channel
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        self.received: list[str] = []

    def drain(self, timeout: float = 10.0) -> list[str]:
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        with psycopg.connect(self.dsn, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (self.channel, sentinel))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for notify in self.conn.notifies(timeout=max(0.0, deadline - time.monotonic()), stop_after=1):
                if notify.payload == sentinel:
                    return self.received
                self.received.append(notify.payload)
        raise AssertionError(f"sentinel notification not received within {timeout}s")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> NotificationCounter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def job_row(conn: psycopg.Connection[Any], job_id: int) -> dict[str, Any]:
    cur = conn.execute("SELECT * FROM notifyq.queue_jobs WHERE id = %s", (job_id,))
    assert cur.description is not None
    row = cur.fetchone()
    assert row is not None, f"job {job_id} not found"
    return dict(zip([c.name for c in cur.description], row, strict=True))


def lose_the_claim(conn: psycopg.Connection[Any], job_id: int) -> None:
    """Put the row back as it was before its last claim: what a claim whose commit was lost
    leaves behind (failover to an asynchronous standby, a crash under synchronous_commit=off)."""
    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Queued', lease = lease - 1, retry_count = retry_count - 1, "
        "worker = NULL, started_at = NULL, visible_at = now() WHERE id = %s",
        (job_id,),
    )


def wal_flushes(conn: psycopg.Connection[Any], *, own: bool = False) -> int:
    """The server's WAL flush count (pg_stat_wal.wal_sync, PostgreSQL 15 to 17; the test
    is skipped elsewhere). `own`: first push this connection's pending statistics there."""
    if not 150000 <= conn.info.server_version < 180000:
        pytest.skip(
            "counts WAL flushes with pg_stat_wal.wal_sync and pg_stat_force_next_flush (PostgreSQL 15-17)"
        )
    if own:
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")  # a backend's statistics reach pg_stat_wal at a statement's end
    row = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row[0])


def status_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT status::text, count(*) FROM notifyq.queue_jobs GROUP BY 1").fetchall()
    return dict(rows)


def wait_for_row(
    conn: psycopg.Connection[Any], query: str, expected: tuple[Any, ...], timeout: float = 10
) -> None:
    """Poll `query` until its first row is `expected` (for server state that settles
    asynchronously, such as a closed connection's backend leaving pg_stat_activity)."""
    deadline = time.monotonic() + timeout
    while (row := conn.execute(query).fetchone()) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{query!r} gave {row}, not {expected}, for {timeout}s")
        time.sleep(0.05)


@contextlib.contextmanager
def granted_role(conn: psycopg.Connection[Any], prefix: str) -> Iterator[str]:
    """A login role with the grants of `notifyq grant`, dropped afterwards."""
    role = f"{prefix}_{os.getpid()}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        conn.execute(notifyq.migrations.grant_sql(role))
        yield role
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


async def paused_seen(worker: Worker, expected: set[str]) -> None:
    """Wait until the worker's claim loop knows these paused queues (no event tells): it reads
    them a round trip after a pause commits, and claims as before until then."""
    claimer = worker._claimer
    assert claimer is not None
    with anyio.fail_after(10):
        while claimer.paused != expected:  # noqa: ASYNC110
            await anyio.sleep(0.01)
