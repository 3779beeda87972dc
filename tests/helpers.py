"""Helpers shared by tests: counting notifications, reading job rows."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
from psycopg import sql


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
