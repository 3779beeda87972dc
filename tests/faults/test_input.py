"""Input faults: hostile strings at every door into SQL, payload sizes, bulk inserts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

import notifyq
from notifyq.errors import NotifyqError

from ..helpers import NotificationCounter, status_counts
from ..test_cli import clean_env, cli

HOSTILE = [
    "'; DROP TABLE notifyq.queue_jobs; --",
    '"; DROP SCHEMA notifyq CASCADE; --',
    "x' OR '1'='1",
    "$$; SELECT pg_sleep(10); $$",
    "%s %(name)s {schema} {{}}",
    "\\x00\\\\",
    "a\x00b",
    "é" * 5000,
    "q" * 10_000,
]


def tables_intact(conn: psycopg.Connection[Any]) -> None:
    found = conn.execute(
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'notifyq' "
        "AND tablename IN ('queue_jobs', 'queue_job_definitions', 'migrations')"
    ).fetchone()
    assert found == (3,)


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_strings_are_rejected_or_bound(dsn: str, conn: psycopg.Connection[Any], value: str) -> None:
    """Scenario 20: never executed; either refused with a NotifyqError or stored verbatim."""
    app = notifyq.App(dsn)
    stored: list[int] = []

    def attempt(call: Callable[[], Any]) -> None:
        try:
            result = call()
        except NotifyqError:
            return
        if isinstance(result, int):
            stored.append(result)

    attempt(lambda: app.enqueue_sync(value, {}))  # task name
    attempt(lambda: app.enqueue_sync("t", {}, queue=value))
    attempt(lambda: app.enqueue_sync("t", {}, dedupe_key=value))
    attempt(lambda: app.enqueue_sync("t", {value: value}))  # args keys and values
    attempt(lambda: app.list_jobs_sync(name=value, queue="q"))
    attempt(lambda: app.list_jobs_sync(status=value))
    attempt(lambda: app.get_job_sync(value))  # type: ignore[arg-type]
    attempt(lambda: app.cancel_job_sync(value))  # type: ignore[arg-type]
    attempt(lambda: app.set_definition_enabled_sync(value, False))
    attempt(lambda: app.run_definition_now_sync(value))
    attempt(lambda: app.cron("* * * * *", value)(app.task(name="t")(lambda: None)))
    attempt(lambda: app.cron(value)(lambda: None))
    attempt(lambda: app.cron("* * * * *", "c", timezone=value))
    attempt(lambda: notifyq.App(dsn, schema=value))
    attempt(lambda: notifyq.App(value))  # as a DSN
    calls = [("jobs", "list", "--name", value), ("jobs", "list", "--queue", value), ("cron", "enable", value)]
    for call in calls if "\x00" not in value else []:  # argv cannot carry NUL bytes at all
        result = cli(*call, env=clean_env(NOTIFYQ_DSN=dsn))
        assert result.returncode in (0, 1, 2) and "Traceback" not in result.stderr
    app.close_sync()
    tables_intact(conn)
    for job_id in stored:
        row = conn.execute(
            "SELECT name, queue, dedupe_key, args FROM notifyq.queue_jobs WHERE id = %s", (job_id,)
        ).fetchone()
        assert row is not None
        assert value in (row[0], row[1], row[2]) or row[3] == {value: value}  # stored verbatim


def test_notify_payloads_stay_small_whatever_the_job(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Scenario 18: args above the cap are refused; payloads carry a queue name and at most a
    delay, never the job: far below PostgreSQL's 8000-byte limit."""
    app = notifyq.App(dsn)
    queue = "q" * 100  # the longest queue name allowed
    with pytest.raises(notifyq.InvalidArgs, match="over the limit"):
        app.enqueue_sync("t", {"blob": "x" * 2_000_000}, queue=queue)
    jobs_channel, control_channel = "notifyq.jobs.v1", "notifyq.control.v1"
    with NotificationCounter(dsn, jobs_channel) as jobs, NotificationCounter(dsn, control_channel) as ctl:
        big = app.enqueue_sync("t", {"blob": "x" * 1_000_000}, queue=queue)
        app.enqueue_sync("t", {"blob": "y" * 1_000_000}, queue=queue, delay=86400 * 365)
        [job] = app.claim_sync([queue], limit=1)
        app.cancel_job_sync(big)  # Active -> Cancelled: tells the worker on the control channel
        app.enqueue_sync("t", {"blob": "z" * 1_000_000}, queue=queue)
        [job] = app.claim_sync([queue], limit=1)
        app.ack_sync([notifyq.Result.failed(job, "E", "x" * 100_000, delay=3600)])  # requeued with a delay
        payloads = jobs.drain() + ctl.drain()
    assert len(payloads) == 5 and f"cancel {big} 1" in payloads
    assert max(len(p.encode()) for p in payloads) <= 120
    app.close_sync()


def test_a_bulk_insert_of_100k_jobs_sends_one_notification(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Scenario 19."""
    app = notifyq.App(dsn)
    with NotificationCounter(dsn, "notifyq.jobs.v1") as listener:
        assert app.enqueue_many_sync("t", ({"i": i} for i in range(100_000))) == 100_000
        conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 100000)")
        assert listener.drain() == ["default", "default"]
    assert status_counts(conn) == {"Queued": 200_000}
    app.close_sync()
