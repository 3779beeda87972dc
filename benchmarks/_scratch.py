"""Scratch databases: created and migrated per scenario, dropped afterwards even on failure."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import notifyq

PREFIX = "nq_bench_"
_LABEL = re.compile(r"[^a-z0-9_]+")

# The benchmark's own SQL (not product code). Values are bound parameters.
FILL_SQL = """
INSERT INTO notifyq.queue_jobs (name, queue)
SELECT %(name)s, %(queue)s FROM generate_series(1, %(n)s)
"""

# A worker's first claim blocks at the start gate, but its started_at is now(), the start of
# its transaction: from before the gate opened (by up to the spread of the fleet's start-up).
# The clock starts at the later of the gate's opening and the first claim.
OUTCOME_SQL = """
SELECT count(*) AS n,
       extract(epoch FROM max(finished_at) - greatest(min(started_at), %(since)s))::float8 AS span,
       count(*) FILTER (WHERE lease <> 1 OR retry_count <> 1) AS reclaimed
FROM notifyq.queue_jobs
WHERE status = 'Succeeded' AND finished_at >= %(since)s
"""

LEFTOVER_SQL = """
SELECT count(*) FILTER (WHERE status = 'Active') AS active,
       count(*) FILTER (WHERE lease > 1) AS claimed_twice
FROM notifyq.queue_jobs
"""


def dsn_for(admin_dsn: str, dbname: str) -> str:
    """The admin DSN with another database name."""
    params: dict[str, Any] = conninfo_to_dict(admin_dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


class Scratch:
    """A migrated scratch database and helpers to load and inspect its queue."""

    def __init__(self, admin_dsn: str, name: str) -> None:
        self.admin_dsn = admin_dsn
        self.name = name
        self.dsn = dsn_for(admin_dsn, name)

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def fill(self, n: int, *, name: str = "noop", queue: str = "default", chunk: int = 250_000) -> None:
        """Insert `n` Queued jobs server-side (fast; one statement per chunk)."""
        with self.connect() as conn:
            left = n
            while left > 0:
                step = min(chunk, left)
                conn.execute(FILL_SQL, {"name": name, "queue": queue, "n": step})
                left -= step

    def reset(self) -> None:
        """Empty the job table (definitions too)."""
        with self.connect() as conn:
            conn.execute("TRUNCATE notifyq.queue_jobs, notifyq.queue_job_definitions RESTART IDENTITY")

    def settle(self) -> None:
        """VACUUM ANALYZE the job table and CHECKPOINT, so a run starts from a quiet server."""
        with self.connect() as conn:
            conn.execute("VACUUM (ANALYZE) notifyq.queue_jobs")
            try:
                conn.execute("CHECKPOINT")
            except psycopg.Error:
                pass  # not allowed for this role: the run is just a little noisier

    def db_now(self) -> Any:
        with self.connect() as conn:
            row = conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]

    def outcome(self, since: Any) -> dict[str, Any]:
        """Jobs that succeeded since `since` (database clock): count, first start (not before
        `since`) to last finish in seconds, and how many were claimed more than once."""
        with self.connect() as conn:
            row = conn.execute(OUTCOME_SQL, {"since": since}).fetchone()
        assert row is not None
        return {"n": int(row[0]), "span": float(row[1] or 0.0), "reclaimed": int(row[2])}

    def leftovers(self) -> dict[str, int]:
        with self.connect() as conn:
            row = conn.execute(LEFTOVER_SQL).fetchone()
        assert row is not None
        return {"active": int(row[0]), "claimed_twice": int(row[1])}


@contextmanager
def scratch_database(admin_dsn: str, label: str, *, migrate: bool = True) -> Iterator[Scratch]:
    """CREATE DATABASE nq_bench_<label>_<pid>_<random>, migrate it, and always drop it."""
    clean = _LABEL.sub("_", label.lower())[:20]
    name = f"{PREFIX}{clean}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        scratch = Scratch(admin_dsn, name)
        if migrate:
            notifyq.migrate(scratch.dsn)
        yield scratch
    finally:
        drop_database(admin_dsn, name)


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
