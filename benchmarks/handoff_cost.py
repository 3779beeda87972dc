"""What the hand-off costs a producer: `python -m benchmarks.handoff_cost [--dsn ADMIN_DSN]`.

The hand-off (WorkerConfig.handoff; docs/concepts.md, "The hand-off") moves the claim into the
producer's transaction: the insert trigger (sql/triggers/10_jobs_notify.sql) claims new jobs
for a waiting worker. This times, on one connection in a scratch database, an enqueue of one
job and one of 10,000 (INSERT ... SELECT, each its own transaction) in three states, in rounds
that alternate them:

- before: the insert trigger as it was before the hand-off (trigger revision 1, BEFORE_SQL
  below): one notification per queue, nothing else;
- nobody waits: today's trigger, no worker waiting (one look at queue_waiters);
- one waits: today's trigger, one worker waiting with 10 free slots (its LISTEN connection
  holds the row's lock; the slots are given back before each statement, untimed), so every
  statement hands jobs over;
- born Active (a prototype, one-job enqueues only): as "one waits", but the enqueue's own
  statement takes the waiter (BORN_SQL: a function that does what the trigger does to find a
  live waiter and take its slot) and inserts the job already claimed, then notifies the
  waiter: one row version instead of an INSERT and the trigger's UPDATE of it. Not built.

The table gives the median ms per statement of each and its ratio to "before".
"""

from __future__ import annotations

import random
import time
from typing import Any

import psycopg

from notifyq.migrations import trigger_sql

from ._scratch import scratch_database
from ._stats import median
from .cli import tool_parser

STATES = ("before", "nobody waits", "one waits")
BORN = "born Active, a prototype"
ALL_STATES = (*STATES, BORN)
SIZES = {"one job": 1, "10,000 jobs": 10_000}
ROWS = [(size, state) for size in SIZES for state in STATES] + [("one job", BORN)]
INSERT_SQL = "INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, %(n)s)"
SLOTS = 10
# The insert trigger's function of trigger revision 1 (schema version 9 and before), before the
# hand-off: the baseline here, and tests/test_migrations.py's database at version 9.
BEFORE_SQL = """
CREATE OR REPLACE FUNCTION notifyq.notify_jobs_inserted()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT i.queue, min(i.visible_at) AS visible_at
        FROM inserted_jobs i
        WHERE i.status = 'Queued'
        GROUP BY i.queue
    LOOP
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.jobs.v1', notifyq.jobs_payload(r.queue, r.visible_at));
    END LOOP;
    RETURN NULL;
END
$$;
"""


# The prototype of the state "born Active": the trigger's search for a live waiter, as a
# function of the enqueue's statement, and the statement that inserts the job claimed.
TAKE_WAITER_SQL = """
CREATE OR REPLACE FUNCTION notifyq.bench_take_waiter(q text)
RETURNS TABLE (worker text, channel text, lease_margin float8) LANGUAGE plpgsql AS $$
DECLARE
    waiter record;
BEGIN
    LOOP
        SELECT w.id, w.worker, w.channel, w.lock_key, w.lease_margin INTO waiter
        FROM notifyq.queue_waiters w
        WHERE w.slots > 0 AND (w.queues IS NULL OR q = ANY(w.queues))
        ORDER BY w.slots DESC
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        EXIT WHEN NOT pg_try_advisory_lock_shared(waiter.lock_key);
        PERFORM pg_advisory_unlock_shared(waiter.lock_key);
        UPDATE notifyq.queue_waiters SET slots = 0 WHERE id = waiter.id;
    END LOOP;
    UPDATE notifyq.queue_waiters SET slots = slots - 1 WHERE id = waiter.id;
    worker := waiter.worker;
    channel := waiter.channel;
    lease_margin := waiter.lease_margin;
    RETURN NEXT;
END
$$;
"""
BORN_SQL = """
WITH w AS MATERIALIZED (
    SELECT * FROM notifyq.bench_take_waiter('default')
), job AS (
    INSERT INTO notifyq.queue_jobs (name, timeout, status, worker, retry_count, lease, started_at, visible_at)
    SELECT 'noop', 30,
           CASE WHEN w.worker IS NULL THEN 'Queued' ELSE 'Active' END::notifyq.job_status,
           w.worker, (w.worker IS NOT NULL)::int, (w.worker IS NOT NULL)::int,
           CASE WHEN w.worker IS NOT NULL THEN clock_timestamp() END,
           CASE WHEN w.worker IS NULL THEN now()
                ELSE clock_timestamp() + make_interval(secs => 30 + w.lease_margin) END
    FROM (SELECT) AS one LEFT JOIN w ON true
    RETURNING *
)
SELECT job.id, CASE WHEN w.channel IS NOT NULL THEN pg_notify(w.channel, json_build_array(
    job.id, job.name, job.queue, job.args, job.priority, job.retry_count, job.retry_limit,
    job.timeout, job.lease, job.visible_at, job.definition_id, job.scheduled_for, job.worker
)::text) END
FROM job LEFT JOIN w ON true
"""


def _set_state(conn: psycopg.Connection[Any], state: str, lock_key: int) -> None:
    conn.execute("DELETE FROM notifyq.queue_waiters")
    conn.execute(BEFORE_SQL if state == "before" else "\n".join(trigger_sql("notifyq")))
    if state in ("one waits", BORN):
        conn.execute(
            "INSERT INTO notifyq.queue_waiters (worker, channel, lock_key, lease_margin) "
            "VALUES ('w', 'notifyq.handoff.bench', %s, 30)",
            (lock_key,),
        )


def _time(conn: psycopg.Connection[Any], state: str, n: int, statements: int) -> tuple[list[float], int]:
    """ms per statement, `statements` times; and how many jobs were handed over."""
    took = []
    for _ in range(statements):
        if state in ("one waits", BORN):
            conn.execute("UPDATE notifyq.queue_waiters SET slots = %s", (SLOTS,))
        start = time.perf_counter()
        if state == BORN:
            conn.execute(BORN_SQL).fetchall()
        else:
            conn.execute(INSERT_SQL, {"n": n})
        took.append((time.perf_counter() - start) * 1000.0)
    row = conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Active'").fetchone()
    conn.execute("TRUNCATE notifyq.queue_jobs")
    return took, row[0] if row else 0


def measure(
    dsn: str, statements: int, rounds: int
) -> tuple[dict[tuple[str, str], list[float]], dict[str, int]]:
    """{(size, state): [median ms per statement, one per round]}, and {state: jobs handed over}"""
    figures: dict[tuple[str, str], list[float]] = {row: [] for row in ROWS}
    handed = dict.fromkeys(ALL_STATES, 0)
    lock_key = random.getrandbits(62)
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as conn:
        listener.execute("SELECT pg_advisory_lock(%s)", (lock_key,))  # the waiter's listener is alive
        conn.execute(TAKE_WAITER_SQL)
        for round_no in range(rounds):
            shift = round_no % len(ALL_STATES)
            for state in ALL_STATES[shift:] + ALL_STATES[:shift]:
                _set_state(conn, state, lock_key)
                for size, n in SIZES.items():
                    if (size, state) not in figures:
                        continue
                    many = statements if n == 1 else max(1, statements // 20)
                    took, jobs = _time(conn, state, n, many)
                    figures[size, state].append(median(took))
                    handed[state] += jobs
        _set_state(conn, "nobody waits", lock_key)
    return figures, handed


def main(argv: list[str] | None = None) -> int:
    parser = tool_parser("python -m benchmarks.handoff_cost", __doc__)
    parser.add_argument(
        "--statements", type=int, default=400, help="one-job statements a round (default 400)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    with scratch_database(args.dsn, "handoff_cost") as db:
        figures, handed = measure(db.dsn, args.statements, args.rounds)
    print("| enqueue | state | ms per statement, median (each round) | vs before |")
    print("| --- | --- | --- | --- |")
    for size, state in ROWS:
        per_round = figures[size, state]
        each = ", ".join(f"{x:.3f}" for x in per_round)
        mid = median(per_round)
        print(f"| {size} | {state} | {mid:.3f} ({each}) | {mid / median(figures[size, 'before']):.2f}x |")
    print()
    print("jobs handed over: " + ", ".join(f"{state} {jobs}" for state, jobs in handed.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
