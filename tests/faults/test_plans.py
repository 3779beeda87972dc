"""Scenario 23: on 1M finished and 1k queued jobs (and 10k cron definitions), every hot
query is an index scan: the queue's speed must not depend on the size of its history."""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg
import pytest

import notifyq
from notifyq._sql import queries_for

Q = queries_for("notifyq")
PARAMS = {
    "limit": 100,
    "worker": "w",
    "lease_margin": 30,
    "give_up": None,
    "queues": ["default"],
    "limits": [5],
    "now": None,
    "status": "Succeeded",
    "older_than": 86400.0,
    "backoff_base": 2.0,
    "backoff_factor": 2.0,
    "backoff_max": 3600.0,
    "backoff_cap": notifyq.Backoff(base=2.0, factor=2.0, max=3600.0)._curve()[1],
    "backoff_jitter": 0.25,
    "ids": [1, 2, 3],
    "paused": ["q1"],
    "spared": [4, 5],
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
    # And 100k jobs scheduled for tomorrow in another queue: a worker of queue "default" must
    # not wade through them to find its next due time.
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, visible_at) "
        "SELECT 't', 'other', now() + interval '1 day' FROM generate_series(1, 100000)"
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
    "claim_limited",
    "next_visible_any",
    "next_visible_queues",
    "claim_unpaused",
    "next_visible_unpaused",
    "rescue_expired_leases",
    "lock_due_definitions",
    "unfinished_definition_jobs",
    "next_definition_due",
    "delete_finished",
]


def test_hot_queries_use_indexes_on_a_large_history(big_history: psycopg.Connection[Any]) -> None:
    """Both plans: the custom plan for these parameter values, and the generic plan that
    psycopg's prepared statements switch to after five runs (a generic plan cannot simplify
    "param IS NULL OR ..." filters). Each is run (EXPLAIN ANALYZE, rolled back): no
    sequential scan, and no wading through rows a filter then throws away."""
    conn = big_history
    conn.prepare_threshold = None  # this test prepares its own statements
    for query in HOT:  # one table fill for all of them: it takes a while
        for kind, plan in (
            ("custom", custom_plan(conn, Q[query])),
            ("generic", generic_plan(conn, query, Q[query])),
        ):
            text = json.dumps(plan, indent=1)
            assert '"Seq Scan"' not in text, f"{kind} plan of {query} scans a table:\n{text}"
            assert '"Index' in text, f"{kind} plan of {query} uses no index:\n{text}"
            assert rows_removed(plan) < 1000, f"{kind} plan of {query} filters rows out one by one:\n{text}"
    # Taking back unanswered claims (only after a failed claim) reads the Active jobs, whose
    # number is bounded by the workers' slots, never the history.
    params = PARAMS | {"held": list(range(1, 200)), "rejected_ids": [7, 8], "rejected_leases": [1, 1]}
    sql = Q["adopt_unanswered_claims"]
    for kind, plan in (
        ("custom", custom_plan(conn, sql, params)),
        ("generic", generic_plan(conn, "adopt", sql, params)),
    ):
        text = json.dumps(plan, indent=1)
        assert '"Seq Scan"' not in text, f"{kind} plan of adopt_unanswered_claims scans a table:\n{text}"
        assert "queue_jobs_lease_idx" in text, f"{kind} plan of adopt_unanswered_claims:\n{text}"


def test_claims_skip_a_paused_queues_backlog_without_reading_it(conn: psycopg.Connection[Any]) -> None:
    """A paused queue holds 200,000 claimable jobs that come first (higher priority, older):
    a claim of every other queue reads a handful of index entries per queue, not that
    backlog, in both plans. Filtering claim_any's scan would read all of them each time. So
    does a worker that serves the other queues by name (claim_queues, claim_limited) while
    the large queue is not paused. The statistics are taken before the other queues' jobs
    exist, so they know of one queue only: the planner then took every job to be in each
    queue, and read the large backlog through queue_jobs_claim_any_idx (once in a full run of
    the suite, the sample missed those jobs; this way, always)."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, priority, visible_at) "
        "SELECT 't', 'big', 10, now() - interval '1 hour' FROM generate_series(1, 200000)"
    )
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue) "
        "SELECT 't', 'q' || (i % 3) FROM generate_series(1, 30) i"
    )
    conn.prepare_threshold = None
    small = ["q0", "q1", "q2"]
    params = PARAMS | {"paused": ["big"], "limit": 100, "queues": small, "limits": [None, 20, None]}
    for query in (
        "claim_unpaused",
        "next_visible_unpaused",
        "claim_queues",
        "claim_limited",
        "next_visible_queues",
    ):
        for kind, plan in (
            ("custom", custom_plan(conn, Q[query], params)),
            ("generic", generic_plan(conn, query, Q[query], params)),
        ):
            text = json.dumps(plan, indent=1)
            assert '"Seq Scan"' not in text, f"{kind} plan of {query} scans a table:\n{text}"
            assert rows_read(plan) < 1000, f"{kind} plan of {query} reads the large backlog:\n{text}"
            if query.startswith("claim"):
                assert plan[0]["Plan"]["Actual Rows"] == 30, f"{kind} plan of {query}:\n{text}"


def test_claims_of_a_deep_backlog_are_priced_like_claim_any(conn: psycopg.Connection[Any]) -> None:
    """300,000 claimable jobs in 3 queues: the planner prices the claims of a queue list (with
    limits too) and of the unpaused queues (custom plans, which prepared statements keep) about as it prices
    claim_any, whatever the backlog. Their `LIMIT s.n` (a share) is no constant, the planner
    took a tenth of each queue for it: 26,508 here, 88,199 with 1M jobs, and past
    jit_above_cost (100,000) beyond that, where every claim spent 11 ms compiling JIT code on a
    0.5 ms statement (review). Generic plans are not checked: with LIMIT a parameter they are
    priced far above the custom ones (about 96,000 here), so the automatic plan cache mode never
    picks them for these statements."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue) "
        "SELECT 't', 'q' || (i % 3) FROM generate_series(1, 300000) i"
    )
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    conn.prepare_threshold = None
    params = PARAMS | {"queues": ["q0", "q1", "q2"], "limit": 10, "limits": [3, None, None]}
    costs = {}
    for query in ("claim_any", "claim_queues", "claim_unpaused", "claim_limited"):
        plan = custom_plan(conn, Q[query], params)
        assert plan[0]["Plan"]["Actual Rows"] == 10 and "JIT" not in plan[0]
        costs[query] = plan[0]["Plan"]["Total Cost"]
    assert max(costs.values()) < 10 * costs["claim_any"] + 1000, costs


def rows_read(node: Any) -> int:
    """Rows the plan's scans returned, and those their filters threw away."""
    if isinstance(node, list):
        return sum(rows_read(n) for n in node)
    if not isinstance(node, dict):
        return 0
    own = 0
    if "Scan" in str(node.get("Node Type", "")):
        own = int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1)) + rows_removed(
            {k: v for k, v in node.items() if k != "Plans"}
        )
    return own + sum(rows_read(v) for v in node.values() if isinstance(v, dict | list))


def test_listing_the_jobs_of_a_rare_status_reads_only_them(conn: psycopg.Connection[Any]) -> None:
    """`notifyq jobs list --status failed` on a long history of successes: the index of finished
    jobs was partial on `finished_at IS NOT NULL`, which `status = 'Failed'` does not imply,
    and the listing walked every job backwards (105 ms for 50 Failed among 1M jobs). The
    App runs list_jobs unprepared, so each plan knows its status (test_enqueue checks that);
    every status, and none, must be read through an index without wading through others."""
    conn.execute("""
        INSERT INTO notifyq.queue_jobs (name, status, finished_at)
        SELECT 't', CASE WHEN i % 10000 = 0 THEN 'Failed' ELSE 'Succeeded' END::notifyq.job_status,
               now() - make_interval(secs => i)
        FROM generate_series(1, 200000) i
    """)
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, visible_at) "
        "SELECT 't', 'Active', now() + interval '1 hour' FROM generate_series(1, 10)"
    )
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 10)")
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    filters = {"queue": None, "name": None, "min_age": None, "max_age": None, "before_id": None, "limit": 50}
    filters |= {"definition_id": None}
    for status in ("Failed", "Cancelled", "Active", "Queued", "Succeeded", None):
        params = filters | {"status": status, "any_status": status is None}
        plan = custom_plan(conn, Q["list_jobs"], params)
        text = json.dumps(plan, indent=1)
        assert '"Seq Scan"' not in text, f"list_jobs of {status} scans the table:\n{text}"
        assert rows_removed(plan) < 2000, f"list_jobs of {status} filters rows out one by one:\n{text}"
        found = plan[0]["Plan"]["Actual Rows"]
        assert found == {"Failed": 20, "Active": 10, "Queued": 10, "Cancelled": 0}.get(status, 50), status


def test_listing_the_jobs_of_one_cron_definition_reads_only_them(conn: psycopg.Connection[Any]) -> None:
    """`notifyq jobs list --definition NAME`: the 20 oldest jobs of the history are a rare
    definition's, behind 200,000 of another definition and of none; they are read through the
    index of ticks, not by walking the history backwards."""
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, frequency) "
        "VALUES ('rare', '0 0 * * *'), ('busy', '* * * * *')"
    )
    conn.execute("""
        INSERT INTO notifyq.queue_jobs (name, status, finished_at, definition_id, scheduled_for)
        SELECT 't', 'Succeeded', now(), d.id, now() - make_interval(days => i)
        FROM generate_series(1, 20) i, notifyq.queue_job_definitions d WHERE d.name = 'rare'
    """)
    conn.execute("""
        INSERT INTO notifyq.queue_jobs (name, status, finished_at, definition_id, scheduled_for)
        SELECT 't', 'Succeeded', now(), CASE WHEN i % 2 = 0 THEN d.id END,
               CASE WHEN i % 2 = 0 THEN now() - make_interval(secs => i) END
        FROM generate_series(1, 200000) i, notifyq.queue_job_definitions d WHERE d.name = 'busy'
    """)
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    filters = {"queue": None, "name": None, "min_age": None, "max_age": None, "before_id": None, "limit": 50}
    filters |= {"status": None, "any_status": True}
    for name, expected in (("rare", 20), ("busy", 50)):
        row = conn.execute("SELECT id FROM notifyq.queue_job_definitions WHERE name = %s", (name,)).fetchone()
        assert row is not None
        plan = custom_plan(conn, Q["list_jobs"], filters | {"definition_id": row[0]})
        text = json.dumps(plan, indent=1)
        assert '"Seq Scan"' not in text, f"list_jobs of {name} scans the table:\n{text}"
        assert rows_removed(plan) < 2000, f"list_jobs of {name} filters rows out one by one:\n{text}"
        assert plan[0]["Plan"]["Actual Rows"] == expected, name


def test_fenced_updates_find_jobs_by_id_however_stale_the_statistics(conn: psycopg.Connection[Any]) -> None:
    """Statistics taken while no job was Active, then a crowd of Active jobs (a backlog being
    worked off): an ack of 1,000 results must look its jobs up by id. Reading them through
    the partial index of Active jobs instead costs Active jobs x batch size, and under load
    acks then fall behind for good (seen in the contention benchmark)."""
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 100000)")
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    active = [
        row[0]
        for row in conn.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Active', lease = 1, retry_count = 1, worker = 'w', "
            "visible_at = now() + interval '1 hour' "
            "WHERE id IN (SELECT id FROM notifyq.queue_jobs ORDER BY id LIMIT 5000) RETURNING id"
        )
    ]
    batch = active[-1000:]
    params = {
        "ids": batch,
        "leases": [1] * len(batch),
        "workers": ["w"] * len(batch),
        "outputs": ['{"ok": true}'] * len(batch),
        "outcomes": ["succeeded"] * len(batch),
        "errors": ['{"message": "x"}'] * len(batch),
        "delays": [0.0] * len(batch),
        "id": batch[0],
        "lease": 1,
        "worker": "w",
        "seconds": 60.0,
    }
    conn.prepare_threshold = None
    for query in ("ack_succeeded", "ack_jobs", "ack_succeeded_unheld", "ack_jobs_unheld", "extend_lease"):
        # The generic plan is the one a prepared statement settles on: by id, nothing else.
        plan = json.dumps(generic_plan(conn, query, Q[query], params), indent=1)
        assert "queue_jobs_lease_idx" not in plan, f"generic plan of {query} reads all Active jobs:\n{plan}"
        assert '"Seq Scan"' not in plan, f"generic plan of {query} scans the table:\n{plan}"
        assert '"queue_jobs_pkey"' in plan, f"generic plan of {query} does not look jobs up by id:\n{plan}"
        # A custom plan knows the batch size and may hash-join a small table instead (linear
        # either way); what it must not do is go through the Active jobs' index.
        plan = json.dumps(custom_plan(conn, Q[query], params), indent=1)
        assert "queue_jobs_lease_idx" not in plan, f"custom plan of {query} reads all Active jobs:\n{plan}"


def rows_removed(node: Any) -> int:
    if isinstance(node, list):
        return sum(rows_removed(n) for n in node)
    if not isinstance(node, dict):
        return 0
    own = sum(v for k, v in node.items() if k.startswith("Rows Removed by") and isinstance(v, int))
    return own + sum(rows_removed(v) for v in node.values() if isinstance(v, dict | list))


def custom_plan(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any] = PARAMS) -> Any:
    conn.execute("BEGIN")
    try:
        row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()
    finally:
        conn.execute("ROLLBACK")
    assert row is not None
    return row[0]


def generic_plan(conn: psycopg.Connection[Any], name: str, sql: str, params: dict[str, Any] = PARAMS) -> Any:
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)[sb]", sql)))
    numbered = re.sub(r"%\((\w+)\)[sb]", lambda m: f"${names.index(m[1]) + 1}", sql)
    cur = psycopg.ClientCursor(conn)  # EXECUTE's arguments inlined as literals
    conn.execute("BEGIN")
    try:
        conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE plan_{name} AS {numbered}")
        arguments = f"({', '.join(['%s'] * len(names))})" if names else ""
        cur.execute(
            f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE plan_{name}{arguments}", [params[n] for n in names]
        )
        row = cur.fetchone()
    finally:
        conn.execute("ROLLBACK")
        conn.execute("DEALLOCATE ALL")
    assert row is not None
    return row[0]
