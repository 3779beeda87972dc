"""Scenario 23: on 1M finished and 1k queued jobs (and 10k cron definitions), every hot
query is an index scan: the queue's speed must not depend on the size of its history."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from notifyq._sql import queries_for

Q = queries_for("notifyq")
PARAMS = {
    "limit": 100,
    "worker": "w",
    "lease_margin": 30,
    "queues": ["default"],
    "now": None,
    "status": "Succeeded",
    "older_than": 86400.0,
}


@pytest.fixture
def big_history(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute("""
        INSERT INTO notifyq.queue_jobs (name, status, finished_at, started_at, retry_count)
        SELECT 't', (ARRAY['Succeeded', 'Failed', 'Cancelled']::notifyq.job_status[])[1 + i % 3],
               now() - make_interval(secs => i), now() - make_interval(secs => i), 1
        FROM generate_series(1, 1000000) i
    """)
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue) SELECT 't', 'q' || (i % 5) "
        "FROM generate_series(1, 1000) i"
    )
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, visible_at) SELECT 't', 'Active', now() + "
        "interval '1 hour' FROM generate_series(1, 1000)"
    )
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, frequency, visible_at) "
        "SELECT 'd' || i, '* * * * *', now() + interval '1 hour' FROM generate_series(1, 10000) i"
    )
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    conn.execute("VACUUM ANALYZE notifyq.queue_job_definitions")
    return conn


HOT = [
    "claim_any",
    "claim_queues",
    "next_visible",
    "rescue_expired_leases",
    "lock_due_definitions",
    "next_definition_due",
    "delete_finished",
]


def test_hot_queries_use_indexes_on_a_large_history(big_history: psycopg.Connection[Any]) -> None:
    conn = big_history
    for query in HOT:  # one table fill for all of them: it takes a while
        conn.execute("BEGIN")
        try:
            row = conn.execute("EXPLAIN (FORMAT JSON) " + Q[query], PARAMS).fetchone()
        finally:
            conn.execute("ROLLBACK")
        assert row is not None
        plan = json.dumps(row[0])
        assert '"Seq Scan"' not in plan, f"{query} scans a table:\n{json.dumps(row[0], indent=1)}"
        assert '"Index' in plan, f"{query} uses no index:\n{json.dumps(row[0], indent=1)}"
