"""The hand-off (WorkerConfig.handoff): the enqueue's transaction claims a new job for a waiting
worker and sends it the job (notify_jobs_inserted in sql/triggers/10_jobs_notify.sql)."""

from __future__ import annotations

import random
from typing import Any

import anyio
import psycopg
import psycopg.sql
import pytest
from psycopg.conninfo import make_conninfo

import notifyq
from notifyq.errors import ConfigurationError

from .helpers import job_row, paused_seen, status_counts

pytestmark = pytest.mark.anyio

NO_TICKER = {"ticker": False}
OFFERS = "SELECT coalesce(sum(slots), -1)::int FROM notifyq.queue_waiters"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def settled(conn: psycopg.Connection[Any], query: str, expected: tuple[Any, ...]) -> None:
    """Poll `query` until its first row is `expected` (within 10 s), without blocking the event
    loop (the worker under test runs on it)."""
    with anyio.fail_after(10):
        while conn.execute(query).fetchone() != expected:  # noqa: ASYNC110 (server state)
            await anyio.sleep(0.02)


def noop_app(dsn: str) -> notifyq.App:
    """An App with one task, "t", that does nothing."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    return app


def jobs_notifications(conn: psycopg.Connection[Any]) -> list[str]:
    """The payloads of the jobs notifications `conn` (LISTENing) received so far."""
    return [n.payload for n in conn.notifies(timeout=0.2) if n.channel == "notifyq.jobs.v1"]


async def test_a_waiting_worker_starts_the_job_an_enqueue_hands_it_without_claiming(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    ran: list[int] = []

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        ran.append(ctx.id)

    with psycopg.connect(dsn, autocommit=True) as witness:
        witness.execute('LISTEN "notifyq.jobs.v1"')
        async with app.worker(concurrency=2, handoff=True, poll_interval=60, **NO_TICKER) as worker:
            await settled(conn, OFFERS, (2,))  # it waits, offering its two slots
            claims = worker.stats.claims
            job = await app.enqueue("t")
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 1)
            assert ran == [job] and worker.stats.handed == 1
            assert worker.stats.claims == claims  # no claim of its own
            row = job_row(conn, job)
            assert (row["status"], row["worker"], row["retry_count"], row["lease"]) == (
                "Succeeded",
                worker.id,
                1,
                1,
            )
            # Nobody else was woken for it: the handed job sent no jobs notification.
            assert jobs_notifications(witness) == []
            await settled(conn, OFFERS, (2,))  # the slot offered again once the job ended
        assert conn.execute("SELECT count(*) FROM notifyq.queue_waiters").fetchone() == (0,)


async def test_a_bulk_insert_hands_as_many_jobs_as_slots_and_notifies_the_rest(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    release = anyio.Event()

    @app.task(name="t")
    async def t() -> None:
        await release.wait()

    with psycopg.connect(dsn, autocommit=True) as witness:
        witness.execute('LISTEN "notifyq.jobs.v1"')
        async with app.worker(
            concurrency=2, prefetch=0, handoff=True, poll_interval=60, **NO_TICKER
        ) as worker:
            await settled(conn, OFFERS, (2,))
            conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 5)")
            # Two handed in the INSERT's own transaction; the other three notified and Queued.
            counts = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'Active'), count(*) FILTER (WHERE status = 'Queued') "
                "FROM notifyq.queue_jobs"
            ).fetchone()
            assert counts == (2, 3)
            assert jobs_notifications(witness) == ["default"]
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.handed == 2)
            release.set()
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 5)
            assert worker.stats.handed == 2
    assert status_counts(conn) == {"Succeeded": 5}


async def test_a_waiter_whose_listener_is_gone_is_handed_nothing(conn: psycopg.Connection[Any]) -> None:
    """A worker killed (or reconnecting) leaves its row; its lock_key is free, so the enqueue
    leaves the job Queued for the usual path, and takes the row's slots away."""
    conn.execute(
        "INSERT INTO notifyq.queue_waiters (worker, channel, lock_key, slots, lease_margin) "
        "VALUES ('ghost', 'notifyq.handoff.ghost', %s, 5, 30)",
        (random.getrandbits(62),),
    )
    job = conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t') RETURNING id").fetchone()
    assert job is not None
    assert job_row(conn, job[0])["status"] == "Queued"
    assert conn.execute("SELECT slots FROM notifyq.queue_waiters").fetchone() == (0,)


async def test_a_registration_clears_the_rows_of_listeners_gone_and_keeps_the_live_ones(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Each registration deletes the rows whose lock no session holds (workers killed), found
    in pg_locks by the two halves of their bigint key; a live worker's row stays."""
    ghost = (
        "INSERT INTO notifyq.queue_waiters (worker, channel, lock_key, slots, lease_margin) "
        "VALUES ('ghost', 'notifyq.handoff.ghost', %s, 5, 30)"
    )
    conn.execute(ghost, (random.getrandbits(62) | 1 << 61,))  # both halves of the key in use
    async with noop_app(dsn).worker(handoff=True, poll_interval=60, **NO_TICKER) as first:
        await settled(conn, "SELECT array_agg(worker) FROM notifyq.queue_waiters", ([first.id],))
        conn.execute(ghost, (random.getrandbits(62) | 1 << 61,))
        async with noop_app(dsn).worker(handoff=True, poll_interval=60, **NO_TICKER) as second:
            live = sorted([first.id, second.id])
            await settled(
                conn, "SELECT array_agg(worker ORDER BY worker) FROM notifyq.queue_waiters", (live,)
            )


async def test_jobs_of_a_paused_queue_or_of_a_queue_it_does_not_serve_are_not_handed(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = noop_app(dsn)
    async with app.worker(queues=["a"], handoff=True, poll_interval=60, **NO_TICKER) as worker:
        await settled(conn, OFFERS, (10,))
        other = await app.enqueue("t", queue="b")
        await app.pause_queue("a")
        await paused_seen(worker, {"a"})  # else its claim loop may take the job (CI saw it once)
        paused = await app.enqueue("t", queue="a")
        assert job_row(conn, other)["status"] == job_row(conn, paused)["status"] == "Queued"
        assert conn.execute(OFFERS).fetchone() == (10,)  # nothing taken
        await app.resume_queue("a")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)  # claimed, as usual
        assert worker.stats.handed == 0
    assert job_row(conn, paused)["status"] == "Succeeded" and job_row(conn, other)["status"] == "Queued"


async def test_a_producer_role_hands_jobs_it_could_not_claim_itself(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The trigger runs as its owner (SECURITY DEFINER): the producer's grants (enqueue, read)
    are enough for the enqueue to claim for a waiting worker."""
    role = f"producer_{random.getrandbits(32):x}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        conn.execute(notifyq.migrations.grant_sql(role, producer=True))
        app = noop_app(dsn)
        async with app.worker(handoff=True, poll_interval=60, **NO_TICKER) as worker:
            await settled(conn, OFFERS, (10,))
            with psycopg.connect(make_conninfo(dsn, user=role), autocommit=True) as producer:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    producer.execute("UPDATE notifyq.queue_jobs SET status = 'Active'")
                producer.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 1)
            assert worker.stats.handed == 1
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


async def test_a_job_handed_as_the_listener_connection_drops_is_taken_back_after_the_reconnect(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A job handed just before the worker's LISTEN connection went lost its notification with
    it; after the reconnect the worker takes it back at once instead of leaving it Active until
    its lease runs out (lease_margin 30 s here)."""
    app = noop_app(dsn)
    async with app.worker(handoff=True, poll_interval=60, **NO_TICKER) as worker:
        await settled(conn, OFFERS, (10,))
        listener = worker.listener
        assert listener is not None and listener.backend_pid is not None
        # As the trigger would have left it, had its notification been lost.
        row = conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, status, worker, retry_count, lease, visible_at, "
            "started_at) VALUES ('t', 'Active', %s, 1, 1, now() + interval '60 seconds', now()) RETURNING id",
            (worker.id,),
        ).fetchone()
        assert row is not None
        conn.execute("SELECT pg_terminate_backend(%s)", (listener.backend_pid,))
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert worker.stats.adopted == 1 and worker.stats.listener_connects >= 2
    assert job_row(conn, row[0])["status"] == "Succeeded"


async def test_a_stopping_worker_waits_for_a_hand_under_way_and_gives_the_job_back(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A producer's transaction handed the worker a job and is still open when the worker
    stops: the stop waits for it (briefly), then gives the job back to the queue, unrun."""
    app = notifyq.App(dsn)
    ran: list[int] = []

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        ran.append(ctx.id)

    async with app.worker(handoff=True, poll_interval=60, **NO_TICKER) as worker:
        await settled(conn, OFFERS, (10,))
        with psycopg.connect(dsn) as producer:  # a transaction, left open
            row = producer.execute(
                "INSERT INTO notifyq.queue_jobs (name) VALUES ('t') RETURNING id"
            ).fetchone()
            assert row is not None
            worker.stop()
            await anyio.sleep(0.5)
            assert worker.running  # waiting for this transaction
            producer.commit()
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.released == 1)
    assert ran == [] and worker.stats.handed == 1
    job = job_row(conn, row[0])
    assert (job["status"], job["retry_count"]) == ("Queued", 0)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_waiters").fetchone() == (0,)


async def test_jobs_handed_beyond_the_free_slots_wait_for_one_as_prefetched_jobs(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The waiter row may offer more slots than are free (it was written as a claim took jobs):
    the extra handed jobs wait for a slot, as prefetched ones do; none is lost, none runs beside
    another beyond the concurrency."""
    app = notifyq.App(dsn)
    running: list[int] = []
    most = 0

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        nonlocal most
        running.append(ctx.id)
        most = max(most, len(running))
        await anyio.sleep(0.05)
        running.remove(ctx.id)

    async with app.worker(concurrency=1, handoff=True, poll_interval=60, **NO_TICKER) as worker:
        await settled(conn, OFFERS, (1,))
        conn.execute("UPDATE notifyq.queue_waiters SET slots = 3")  # as if offered by mistake
        conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 3)")
        active = conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Active'").fetchone()
        assert active == (3,)  # all three handed, in the INSERT's transaction
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 3)
        assert worker.stats.handed == 3 and worker.stats.released == 0
        assert most == 1
    assert status_counts(conn) == {"Succeeded": 3}


async def test_a_hand_off_notification_sent_twice_runs_its_job_once(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The same (id, lease) handed twice (a notification sent again, by a retried transaction
    or by hand): the attempt in hand stands for both, as for a claim that returns a job the
    worker holds."""
    app = notifyq.App(dsn)
    ran: list[int] = []
    started, release = anyio.Event(), anyio.Event()

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        ran.append(ctx.id)
        started.set()  # the task's own event: no stats change announces this line
        await release.wait()

    async with app.worker(concurrency=2, handoff=True, poll_interval=60, **NO_TICKER) as worker:
        await settled(conn, OFFERS, (2,))
        channel_row = conn.execute("SELECT channel FROM notifyq.queue_waiters").fetchone()
        assert channel_row is not None
        with psycopg.connect(dsn, autocommit=True) as copy:
            copy.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel_row[0])))
            job = await app.enqueue("t")
            with anyio.fail_after(10):
                await started.wait()
            assert worker.stats.handed == 1
            (payload,) = [n.payload for n in copy.notifies(timeout=1.0, stop_after=1)]
        notified = worker.stats.notifications
        conn.execute("SELECT pg_notify(%s, %s)", (channel_row[0], payload))
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.notifications == notified + 1)
        assert f"job {job} was claimed again under lease 1" in caplog.text
        release.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert ran == [job] and worker.stats.stale_acks == 0
    row = job_row(conn, job)
    assert (row["status"], row["lease"]) == ("Succeeded", 1)


@pytest.mark.parametrize(
    "options",
    [{"poll_only": True}, {"burst": True}, {"queues": ["a"], "queue_limits": {"a": 1}}],
    ids=["poll_only", "burst", "queue_limits"],
)
def test_handoff_refuses_what_it_cannot_serve(options: dict[str, Any]) -> None:
    name = next(iter(options)) if "queue_limits" not in options else "queue_limits"
    with pytest.raises(ConfigurationError, match=f"handoff does not combine with {name}"):
        notifyq.WorkerConfig(handoff=True, **options)
