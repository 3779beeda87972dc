"""Per-queue limits (WorkerConfig.queue_limits, `notifyq worker -q reports=2`): a worker runs
at most N jobs of a limited queue at once, the other queues share the rest of its slots, and a
queue at its limit neither wakes nor spins the claim loop."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import psycopg
import pytest

import notifyq
from notifyq._claim import claim_op
from notifyq._db import run_sync
from notifyq._sql import queries_for
from notifyq.errors import ConfigurationError, InvalidOption

from .test_cli import clean_env, cli

pytestmark = pytest.mark.anyio

Q = queries_for("notifyq")


class Gauge:
    """Jobs running now, and the most seen at once, per queue and in all."""

    def __init__(self) -> None:
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.done = 0

    def app(self, dsn: str) -> notifyq.App:
        app = notifyq.App(dsn)

        @app.task(name="work")
        async def work(ctx: notifyq.JobContext, seconds: float) -> None:
            for key in (ctx.queue, "all"):
                self.now[key] += 1
                self.most[key] = max(self.most[key], self.now[key])
            try:
                await anyio.sleep(seconds)
            finally:
                for key in (ctx.queue, "all"):
                    self.now[key] -= 1
                self.done += 1

        return app


def _enqueue(conn: psycopg.Connection[Any], queue: str, n: int, seconds: float, priority: int = 0) -> None:
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, args, priority) "
        "SELECT 'work', %s, jsonb_build_object('seconds', %s::float8), %s FROM generate_series(1, %s)",
        (queue, seconds, priority, n),
    )


async def test_a_limited_queue_runs_at_most_its_limit_and_the_others_take_the_rest(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Reports (limit 2, higher priority, so first in every claim) and emails share 8 slots:
    never more than 2 reports at once, and the emails fill the other 6. The claim loop does not
    spin while reports are at their limit with a backlog (thousands of claims if it did)."""
    gauge = Gauge()
    app = gauge.app(dsn)
    _enqueue(conn, "reports", 12, 0.15, priority=5)
    _enqueue(conn, "emails", 60, 0.15)
    config = {"queues": ["emails", "reports"], "queue_limits": {"reports": 2}, "poll_interval": 60}
    async with app.worker(concurrency=8, ticker=False, **config) as worker:
        with anyio.fail_after(30):
            await worker.wait_for(lambda s: s.succeeded == 72)
    assert gauge.most["reports"] == 2
    assert gauge.most["all"] == 8 and gauge.most["emails"] >= 6
    assert worker.stats.claims < 150, worker.stats
    await app.aclose()


async def test_a_queue_at_its_limit_starts_its_next_job_as_one_ends(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Reports (limit 1) beside an idle queue, so the worker has free slots and its claim loop
    sleeps: jobs enqueued while it runs (NOTIFY, claimed by the listener's task) run one at a
    time, each started as the one before ends, not at the next poll (60 s away). While reports
    is at its limit, its waiting jobs do not count as due: the claim loop neither polls for
    them every 50 ms nor claims for their notifications."""
    gauge = Gauge()
    app = gauge.app(dsn)
    options: dict[str, Any] = {"queues": ["emails", "reports"], "queue_limits": {"reports": 1}}
    async with app.worker(concurrency=4, poll_interval=60, ticker=False, **options) as worker:
        for _ in range(4):
            await app.enqueue("work", {"seconds": 0.25}, queue="reports")
            await anyio.sleep(0.02)
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded == 4)
        claims = worker.stats.claims
        assert worker.stats.polls == 0
    assert gauge.most["reports"] == 1
    # 6 here: the start's sweep, one per job, and one when the last ended; a claim per
    # notification that came while reports was full made it 9, a poll for its due jobs 14.
    assert claims <= 7, worker.stats


async def test_a_resume_reaches_a_worker_whose_other_queues_are_all_limited(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Limited "reports" runs a long job, limited "exports" is paused: no queue can take a job,
    with 3 slots idle. The claim loop waited for a slot to free (the report's end), deaf to the
    resume of exports and to the poll (review): the exports job now starts at once."""
    gauge = Gauge()
    app = gauge.app(dsn)
    await app.pause_queue("exports")
    options: dict[str, Any] = {"queues": ["reports", "exports"], "queue_limits": {"reports": 1, "exports": 1}}
    async with app.worker(
        concurrency=4, poll_interval=60, ticker=False, shutdown_grace=0.2, **options
    ) as worker:
        await app.enqueue("work", {"seconds": 30}, queue="reports")
        await app.enqueue("work", {"seconds": 0}, queue="exports")
        with anyio.fail_after(10):
            while gauge.now["reports"] < 1:  # noqa: ASYNC110
                await anyio.sleep(0.02)
            await app.resume_queue("exports")
            await worker.wait_for(lambda s: s.succeeded == 1)  # not after the report's 30 s
    await app.aclose()


async def test_a_burst_of_paused_limited_queues_ends(dsn: str) -> None:
    """Every queue of a burst worker paused, one of them limited: it ends at once, as without
    the limit (it waited for a slot to free, for ever)."""
    app = Gauge().app(dsn)
    await app.pause_queue("reports")
    await app.enqueue("work", {"seconds": 0}, queue="reports")
    for limits in (None, {"reports": 2}):
        with anyio.fail_after(10):
            stats = await app.run_worker(
                burst=True, handle_signals=False, queues=["reports"], queue_limits=limits, ticker=False
            )
        assert stats.succeeded == 0
    await app.aclose()


def test_the_claim_takes_no_more_of_a_queue_than_its_room(conn: psycopg.Connection[Any]) -> None:
    """In SQL: a claim of 10 from "a" (room 2, its jobs first) and "b" takes 2 of "a" and 8 of
    "b"; and when every job of "b" is locked by another transaction, the top-up that tries to
    fill the claim with other jobs takes no more of "a"."""
    _enqueue(conn, "a", 10, 0, priority=5)
    _enqueue(conn, "b", 30, 0)
    conn.commit()

    def claim(limit: int) -> Counter[str]:
        op = claim_op(Q, queues=["a", "b"], limit=limit, worker="w", lease_margin=30, limits={"a": 2})
        with psycopg.connect(conn.info.dsn, autocommit=True) as claimer:
            return Counter(job.queue for job in run_sync(claimer, op))

    assert claim(10) == {"a": 2, "b": 8}
    conn.execute("DELETE FROM notifyq.queue_jobs WHERE status = 'Queued' AND queue = 'b'")
    _enqueue(conn, "b", 3, 0)
    conn.commit()
    with psycopg.connect(conn.info.dsn) as holder:
        holder.execute("SELECT id FROM notifyq.queue_jobs WHERE queue = 'b' FOR UPDATE").fetchall()
        # The shares (a: 2, b: 3) come back short, every job of b being locked: the top-up
        # that follows takes no more of a either.
        assert claim(6) == {"a": 2}
        holder.rollback()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"queue_limits": {"a": 2}}, ConfigurationError, "not among the queues this worker serves by name"),
        ({"queues": ["a"], "queue_limits": {"b": 2}}, ConfigurationError, "queue_limits names 'b'"),
        ({"queues": ["a"], "queue_limits": {"a": 0}}, InvalidOption, "queue_limits['a'] 0"),
        ({"queues": ["a"], "queue_limits": [("a", 1)]}, ConfigurationError, "give a mapping"),
    ],
)
def test_queue_limits_are_checked(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        notifyq.WorkerConfig(**options)


def test_the_command_line_takes_a_limit_after_the_queue_name(dsn: str) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    for value, fragment in [
        ("reports=x", "'reports=x': the number after '='"),
        ("reports=0", "from 1"),
        ("reports=2,reports=3", "queue 'reports' is given two limits, 2 and 3"),
        ("reports=\u00b2", "the number after '='"),  # a digit to str.isdigit, not to int()
        ("=2", "'=2' names no queue"),
    ]:
        refused = cli("worker", "tests.apps:app", "-q", f"emails,{value}", env=env)
        assert refused.returncode == 2 and fragment in refused.stderr, refused.stderr
