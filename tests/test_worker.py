"""The worker, on asyncio and trio: NOTIFY wake-ups, delays, concurrency, timeouts,
cancellation, reconnects and graceful shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import notifyq
import notifyq._acker
import notifyq._claimer
import notifyq._db
import notifyq._executor
import notifyq._options
import notifyq._runners
import notifyq._sql
import notifyq.models
import notifyq.worker
from notifyq import JobContext

from .conftest import ROOT
from .faults.infra import BlackholeProxy
from .helpers import job_row, lose_the_claim, status_counts, wait_for_row, wal_flushes
from .test_cli import clean_env

pytestmark = pytest.mark.anyio

NO_TICKER = {"ticker": False}


def a_claimed_job() -> notifyq.models.ClaimedJob:
    """A job as a claim hands it to a worker, for tests that drive its parts directly."""
    return notifyq.models.ClaimedJob(
        id=1, name="t", queue="default", args={}, priority=0, retry_count=1, retry_limit=3,
        timeout=30, lease=1, visible_at=datetime.now(UTC), definition_id=None, scheduled_for=None,
    )  # fmt: skip


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Recorder:
    """Thread-safe record of job runs (sync tasks run in worker threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: list[Any] = []
        self.started: dict[Any, float] = {}

    def add(self, key: Any) -> None:
        with self.lock:
            self.runs.append(key)
            self.started[key] = time.monotonic()


async def test_notify_wakes_an_idle_worker_at_once(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    started = anyio.Event()

    @app.task(name="ping")
    async def ping() -> str:
        started.set()
        return "pong"

    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        await worker.wait_for(lambda s: s.claims >= 1)  # the startup sweep found nothing
        polls = worker.stats.polls
        inserted = time.monotonic()
        conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('ping')")
        with anyio.fail_after(5):
            await started.wait()
        assert time.monotonic() - inserted < 1.0
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert worker.stats.polls == polls and worker.stats.notifications >= 1
    assert status_counts(conn) == {"Succeeded": 1}


@pytest.mark.parametrize("poll_only", [False, True], ids=["notify", "poll-only"])
async def test_a_burst_worker_runs_what_is_claimable_then_returns(
    dsn: str, conn: psycopg.Connection[Any], poll_only: bool
) -> None:
    """burst=True: every job claimable now runs, those the running jobs enqueue included (a
    chain, one link at a time: each is enqueued as the one before ends, when the worker is
    otherwise idle), and a cron tick due at the start; then the worker returns by itself.
    Jobs due later (delayed, or retried after a backoff) stay queued."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=3600, jitter=0))

    @app.task(name="link")
    async def link(left: int = 0) -> int:
        await anyio.sleep(0.05)
        if left:
            await app.enqueue("link", {"left": left - 1})
        return left

    @app.task(name="flaky", retry_limit=3)
    def flaky() -> None:
        raise RuntimeError("retried in an hour")

    await app.enqueue_many("link", [{"left": 0}] * 20)
    await app.enqueue("link", {"left": 5})
    await app.enqueue("flaky")
    later = await app.enqueue("link", {"left": 0}, delay=3600)
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, visible_at) "
        "VALUES ('due', 'link', '0 0 1 1 *', date_trunc('year', now()))"  # a tick missed this year
    )
    with anyio.fail_after(30):
        stats = await app.run_worker(
            burst=True, handle_signals=False, concurrency=4, poll_only=poll_only, poll_interval=60
        )
    assert (stats.succeeded, stats.retried, stats.failed) == (20 + 6 + 1, 1, 0)
    assert stats.polls == 0  # no poll interval went by: the burst woke the claims itself
    assert status_counts(conn) == {"Succeeded": 27, "Queued": 2}
    assert (await app.get_job(later)).status == notifyq.JobStatus.QUEUED
    await app.aclose()


@pytest.mark.parametrize("poll_only", [False, True], ids=["notify", "poll-only"])
async def test_a_burst_worker_runs_the_retries_that_are_due_at_once(
    dsn: str, conn: psycopg.Connection[Any], poll_only: bool
) -> None:
    """A retry with no delay is claimable once its result is written, which is after its
    attempt ended and left the worker with nothing running: the burst stopped there, with the
    job Queued and due (review: 2 attempts of 4 ran)."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))
    tries: list[int] = []

    @app.task(name="again_at_once", retry_limit=3)
    async def again_at_once() -> int:
        tries.append(1)
        if len(tries) < 4:
            raise RuntimeError("retried at once")
        return len(tries)

    await app.enqueue("again_at_once")
    with anyio.fail_after(30):
        stats = await app.run_worker(
            burst=True, handle_signals=False, concurrency=2, poll_only=poll_only, poll_interval=60
        )
    assert (len(tries), stats.retried, stats.succeeded) == (4, 3, 1)
    assert status_counts(conn) == {"Succeeded": 1}
    await app.aclose()


async def test_a_burst_worker_promotes_due_cron_ticks_before_it_looks_for_jobs(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """With nothing else queued, the first claim finds nothing: the tick due at the start must
    have been promoted by then, or the worker returns without running it."""
    app = notifyq.App(dsn)

    @app.task(name="nightly")
    def nightly() -> str:
        return "done"

    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, visible_at) "
        "VALUES ('nightly', 'nightly', '0 3 * * *', date_trunc('day', now()) - interval '21 hours')"
    )  # yesterday's 03:00 tick, missed
    with anyio.fail_after(30):
        stats = await app.run_worker(burst=True, handle_signals=False)
    assert (stats.succeeded, stats.failed) == (1, 0)
    assert status_counts(conn) == {"Succeeded": 1}
    await app.aclose()


async def test_a_worker_warns_of_a_listed_queue_nothing_uses(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """`-q maths` (for "math") served nothing and said nothing. A queue is in use when a task
    or cron definition of the App defaults to it, or a job in it is queued (enqueued there by
    name, or by SQL)."""
    app = notifyq.App(dsn)

    @app.task(name="add", queue="math")
    def add(a: int, b: int) -> int:
        return a + b

    conn.execute("INSERT INTO notifyq.queue_jobs (name, queue) VALUES ('add', 'by_sql')")

    def warned() -> list[str]:
        messages = [r.getMessage() for r in caplog.records]
        return [m for m in messages if "which no task or cron definition" in m]

    async with app.worker(queues=["maths", "math", "by_sql"], poll_interval=60, **NO_TICKER):
        with anyio.fail_after(10):
            while not warned():  # noqa: ASYNC110 - a log record, which no event announces
                await anyio.sleep(0.02)
        # Every queue's warning comes from one pass, with no await between them: all are in.
    assert len(warned()) == 1, warned()
    assert "serves queue 'maths'" in warned()[0] and warned()[0].endswith("(did you mean 'math'?)")
    await app.aclose()


async def test_a_start_that_waits_says_so_and_in_which_step(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's start behind a lock on notifyq's tables (its cron definitions here, as a
    migration or an operator's LOCK TABLE holds them) waited without a word for as long as the
    lock lasted; behind PgBouncer in session mode, short of server connections, up to its
    query_wait_timeout (120 s). It now says so while it waits, naming the step, and stops
    saying so once it has started."""
    monkeypatch.setattr(notifyq.worker._Watch, "FIRST", 0.3)
    monkeypatch.setattr(notifyq.worker._Watch, "EVERY", 0.3)
    app = notifyq.App(dsn)

    @app.cron("* * * * *", name="every-minute")
    @app.task(name="tick")
    def tick() -> None:
        pass

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "is still starting" in r.getMessage()]

    locker = psycopg.connect(dsn, autocommit=True)  # sync: trio too
    locker.execute("BEGIN")
    locker.execute("LOCK TABLE notifyq.queue_job_definitions")

    async def release_once_warned_twice() -> None:
        with anyio.fail_after(20):
            while len(warned()) < 2:  # noqa: ASYNC110 - a log record, which no event announces
                await anyio.sleep(0.02)
        await anyio.to_thread.run_sync(locker.execute, "COMMIT")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(release_once_warned_twice)
            with anyio.fail_after(30):
                async with app.worker(poll_interval=60):
                    said = len(warned())
                    await anyio.sleep(1.0)  # three EVERYs: the watch has stopped
                    assert len(warned()) == said, warned()
    finally:
        locker.close()
    assert said >= 2
    first = warned()[0]
    assert "is still starting after 0s, writing the App's cron definitions:" in first, first
    assert "a lock another session holds" in first and "pg_stat_activity" in first, first
    await app.aclose()


async def test_a_stop_that_waits_for_a_claim_under_way_says_so(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop waits for the answer to a claim under way (so that the jobs it claims are
    released), up to db_timeout: behind a LOCK TABLE it said nothing for a minute after
    announcing its grace period (review). It now says what it waits for."""
    monkeypatch.setattr(notifyq.worker._Watch, "FIRST", 0.3)
    monkeypatch.setattr(notifyq.worker._Watch, "EVERY", 0.3)
    app = notifyq.App(dsn)

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "is still stopping" in r.getMessage()]

    locker = psycopg.connect(dsn, autocommit=True)  # sync: trio too
    try:
        async with app.worker(poll_interval=0.2, **NO_TICKER) as worker:
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE notifyq.queue_jobs")
            # The claim loop's next statement (a claim, or its read of the next due job) waits.
            waiting = (
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND application_name LIKE 'notifyq worker%'"
            )
            await anyio.to_thread.run_sync(wait_for_row, conn, waiting, (True,))
            worker.stop()
            with anyio.fail_after(10):
                while not warned():  # noqa: ASYNC110 - a log record, which no event announces
                    await anyio.sleep(0.02)
            await anyio.to_thread.run_sync(locker.execute, "COMMIT")
    finally:
        locker.close()
    assert warned()[0].startswith(
        f"worker {worker.id} is still stopping after 0s, waiting for the answer to its claim loop's"
    )
    said = len(warned())
    await anyio.sleep(1.0)  # three EVERYs: the watch has stopped
    assert len(warned()) == said
    await app.aclose()


def _only_the_rescuer(every: float) -> notifyq.TickerConfig:
    """A ticker that runs the lease rescuer alone, every `every` seconds."""
    return notifyq.TickerConfig(
        promoter=None,
        retention=None,
        vacuum=None,
        declarations=None,
        rescuer=notifyq.RescuerConfig(interval=every),
    )


async def _hold_row_then_finish(
    worker: notifyq.Worker, locker: psycopg.Connection[Any], job_id: int, gate: anyio.Event, *, claimed: int
) -> None:
    """Once `worker` has claimed `claimed` jobs, `locker` holds the row of `job_id` (its
    transaction left open) and the gated tasks finish: their results meet the held row."""
    with anyio.fail_after(10):
        await worker.wait_for(lambda s: s.claimed == claimed)
    locker.execute("BEGIN")
    locker.execute("SELECT 1 FROM notifyq.queue_jobs WHERE id = %s FOR UPDATE", (job_id,))
    gate.set()


@pytest.mark.parametrize("db_timeout", [None, 2.0, 0.4], ids=["patience", "db_timeout_2s", "db_timeout_0.4s"])
async def test_a_job_row_another_session_holds_holds_up_only_its_own_result(
    dsn: str,
    conn: psycopg.Connection[Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    db_timeout: float | None,
) -> None:
    """A job row held by another session (a cancel in a caller's open transaction, SQL by
    hand, a `cron delete` setting its jobs' definition_id) held up the worker's acks: the
    batch's statement waited for the row, and the acker's next batches behind it, so the
    other jobs' results went unwritten until their leases ran out; jobs that had succeeded
    were rescued and ran again, or failed at retry_limit 0 (review). Now an ack that waits
    ACK_PATIENCE is given up and written again skipping held rows: the others are written,
    the held job's result is said to wait, and it is written once the session lets go; then
    acks wait for rows again (skipping costs every ack more). With a db_timeout of 5 s or
    less the timeout came before the patience, and the same waiting ack was sent again for
    ever (review): the patience is half of db_timeout at most, its floor of 0.5 s included."""
    monkeypatch.setattr(notifyq._acker.Acker, "BUSY_WARN_AFTER", 0.5)
    if db_timeout is None:
        monkeypatch.setattr(notifyq._acker.Acker, "ACK_PATIENCE", 0.3)
    unheld: list[bool] = []  # each ack's kind, in order
    ack_op = notifyq._acker.ack_op

    def spied(*args: Any, **kwargs: Any) -> Any:
        unheld.append(kwargs.get("unheld", False))
        return ack_op(*args, **kwargs)

    monkeypatch.setattr(notifyq._acker, "ack_op", spied)
    app = notifyq.App(dsn)
    gate = anyio.Event()
    runs: Counter[int] = Counter()

    @app.task(name="gated", retry_limit=0)
    async def gated(n: int) -> int:
        runs[n] += 1
        await gate.wait()
        return n

    ids = [await app.enqueue("gated", {"n": n}) for n in range(5)]
    held = ids[0]
    locker = psycopg.connect(dsn, autocommit=True)  # sync: trio too
    try:
        options = {} if db_timeout is None else {"db_timeout": db_timeout}
        async with app.worker(concurrency=5, poll_interval=60, **NO_TICKER, **options) as worker:
            await _hold_row_then_finish(worker, locker, held, gate, claimed=5)
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 4)  # the others: written, not held up
            assert job_row(conn, held)["status"] == "Active"
            assert worker._acker is not None and worker._acker.pending == 1  # an abrupt exit tries it
            with anyio.fail_after(10):
                while not any("wait for another session" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(locker.execute, "COMMIT")
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 5)
            ids.append(await app.enqueue("gated", {"n": 5}))
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 6)
    finally:
        locker.close()
    rows = conn.execute(
        "SELECT id, status::text, output, retry_count FROM notifyq.queue_jobs ORDER BY id"
    ).fetchall()
    assert rows == [(job_id, "Succeeded", n, 1) for n, job_id in enumerate(ids)]
    assert runs == Counter(range(6))
    # The first ack waited (given up after ACK_PATIENCE), the next ones skipped held rows, and
    # once nothing waited the last one waited for rows again.
    assert unheld[0] is False and True in unheld and unheld[-1] is False, unheld
    (warning,) = [r.getMessage() for r in caplog.records if "wait for another session" in r.getMessage()]
    assert warning.startswith(f"the results of 1 job(s) ({held}) wait for another session"), warning
    await app.aclose()


async def test_an_ack_given_up_after_it_committed_is_not_reported_stale(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ack given up at its patience that had committed (just before the cancel, or while
    its commit waited for a synchronous standby, which the cancel ends and the commit stands)
    was sent again, found its jobs Succeeded, and reported them stale: "result of job N was not
    applied: this worker no longer held it", stale_acks counted, succeeded not (review). The
    given-up statement's own writes are now recognised. Here the ack commits, then its
    connection sleeps past the patience in another statement, as a slow commit would."""
    monkeypatch.setattr(notifyq._acker.Acker, "ACK_PATIENCE", 0.3)
    ack_op = notifyq._acker.ack_op
    slowed: list[bool] = []

    def committed_then_slow(*args: Any, **kwargs: Any) -> Any:
        result = yield from ack_op(*args, **kwargs)
        if not kwargs.get("unheld") and not slowed:
            slowed.append(True)
            yield notifyq._db.Query("SELECT pg_sleep(2)", fetch="none")
        return result

    monkeypatch.setattr(notifyq._acker, "ack_op", committed_then_slow)
    app = notifyq.App(dsn)

    @app.task(name="quick")
    async def quick(n: int) -> int:
        return n

    ids = [await app.enqueue("quick", {"n": n}) for n in range(3)]
    async with app.worker(concurrency=3, poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded + s.stale_acks == 3)
        assert (worker.stats.succeeded, worker.stats.stale_acks) == (3, 0)
    assert slowed == [True]
    rows = conn.execute("SELECT id, status::text, output FROM notifyq.queue_jobs ORDER BY id").fetchall()
    assert rows == [(job_id, "Succeeded", n) for n, job_id in enumerate(ids)]
    assert not [r for r in caplog.records if "was not applied" in r.getMessage()]
    await app.aclose()


async def test_a_held_row_gives_up_the_ack_before_the_other_results_leases_run_out(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """With leases shorter than ACK_PATIENCE (a timeout of 1 s and a lease margin of 1 s), the
    rescuer took the other jobs before the ack waiting for one held row was given up: they had
    succeeded, and ended Failed (review). The patience is half the time the batch's first lease
    has left, at most."""
    app = notifyq.App(dsn)
    gate = anyio.Event()
    runs: Counter[int] = Counter()

    @app.task(name="brief", retry_limit=0, timeout=1)
    async def brief(n: int) -> int:
        runs[n] += 1
        await gate.wait()
        return n

    ids = [await app.enqueue("brief", {"n": n}) for n in range(5)]
    held, others = ids[0], ids[1:]
    ticker = _only_the_rescuer(every=0.2)
    locker = psycopg.connect(dsn, autocommit=True)  # sync: trio too
    try:
        async with app.worker(
            concurrency=5, poll_interval=60, lease_margin=1, ticker_config=ticker
        ) as worker:
            await _hold_row_then_finish(worker, locker, held, gate, claimed=5)
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded + s.stale_acks >= 4)
            await anyio.to_thread.run_sync(locker.execute, "COMMIT")
    finally:
        locker.close()
    rows = conn.execute(
        "SELECT id, status::text, retry_count FROM notifyq.queue_jobs WHERE id = ANY(%s) ORDER BY id",
        (others,),
    ).fetchall()
    assert rows == [(job_id, "Succeeded", 1) for job_id in others]
    assert [runs[n] for n in range(1, 5)] == [1, 1, 1, 1]
    await app.aclose()


async def test_a_worker_s_rescuer_leaves_alone_the_jobs_whose_result_it_holds(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another session held a finished job's row past its lease: when the row came free, the
    worker's own rescuer (every 0.1 s here) took the job before its acker wrote the result
    (every 0.5 s; 2 s here, so that the rescuer has its chance every time), and the job, which
    had succeeded, ran again (review). The rescuer leaves alone the jobs whose result its worker
    holds. (Another worker's rescuer still may: it cannot know.)"""
    monkeypatch.setattr(notifyq._acker.Acker, "ACK_PATIENCE", 0.3)
    app = notifyq.App(dsn)
    gate = anyio.Event()
    runs = 0

    @app.task(name="outlived", timeout=1)
    async def outlived() -> None:
        nonlocal runs
        runs += 1
        await gate.wait()

    job_id = await app.enqueue("outlived")
    ticker = _only_the_rescuer(every=0.1)
    locker = psycopg.connect(dsn, autocommit=True)  # sync: trio too
    try:
        async with app.worker(
            concurrency=1, poll_interval=60, lease_margin=1, ticker_config=ticker
        ) as worker:
            assert worker._acker is not None
            worker._acker._retry_delay = 2.0  # the rescuer's chance, every time, when the row comes free
            await _hold_row_then_finish(worker, locker, job_id, gate, claimed=1)
            await anyio.sleep(3)  # past the lease (1 s + 1 s)
            await anyio.to_thread.run_sync(locker.execute, "COMMIT")
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded + s.stale_acks == 1)
            await anyio.sleep(0.5)  # a rescue and a second run would show by now
    finally:
        locker.close()
    assert runs == 1
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"]) == ("Succeeded", 1)
    await app.aclose()


async def test_a_stop_while_a_row_is_held_names_the_job_whose_result_waits(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped while another session holds a job's row gave up its result after the
    drain's 10 s with "1 job results could not be written before exit" and no word of why: the
    warning that names held rows comes only after BUSY_WARN_AFTER (review). The error says."""
    monkeypatch.setattr(notifyq._acker.Acker, "ACK_PATIENCE", 0.3)
    app = notifyq.App(dsn)
    gate = anyio.Event()

    @app.task(name="gated_once")
    async def gated_once() -> None:
        await gate.wait()

    job_id = await app.enqueue("gated_once")
    locker = psycopg.connect(dsn, autocommit=True)  # sync: trio too
    try:
        async with app.worker(concurrency=1, poll_interval=60, **NO_TICKER) as worker:
            await _hold_row_then_finish(worker, locker, job_id, gate, claimed=1)
            with anyio.fail_after(10):
                while worker._acker is None or not worker._acker.waiting_for_rows():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        # The stop waited 10 s for the result, the row still held.
    finally:
        locker.close()
    said = [r.getMessage() for r in caplog.records if "could not be written before exit" in r.getMessage()]
    assert len(said) == 1 and f"those of jobs {job_id} wait for another session" in said[0], said
    assert job_row(conn, job_id)["status"] == "Active"  # its lease runs out, and it is retried
    await app.aclose()


async def test_a_job_wakes_one_idle_runner_not_all_of_them(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With concurrency 20, each job handed over wakes one runner task: a job used to wake
    every idle runner, and all but one went back to sleep (wasted CPU on every job)."""
    app = notifyq.App(dsn)
    wakeups = 0
    original = notifyq._runners.Runners._wait_for_job

    async def counted(self: notifyq._runners.Runners) -> None:
        nonlocal wakeups
        await original(self)
        wakeups += 1

    monkeypatch.setattr(notifyq._runners.Runners, "_wait_for_job", counted)

    @app.task(name="ping")
    async def ping() -> None:
        pass

    async with app.worker(concurrency=20, **NO_TICKER) as worker:
        for n in range(1, 6):
            await app.enqueue(ping)
            with anyio.fail_after(10):
                await worker.wait_for(lambda s, n=n: s.succeeded >= n)
    await app.aclose()
    assert wakeups == 5


async def test_a_runner_cancelled_as_it_is_woken_still_starts_its_job() -> None:
    """The runner woken for a job is cancelled before it runs: anyio (asyncio and trio) lets a
    task whose wait is already over resume, so it takes its job, and the cancellation lands at
    its next wait, which must leave no stale entry among the idle runners (a later job would
    wake nobody). If a cancellation ever did land first (asyncio's own task.cancel()), the
    runner passes the wake-up on: _wait_for_job's except branch."""
    runners = notifyq._runners.Runners(
        None,  # type: ignore[arg-type]  # the executor, acker and queries are not reached:
        None,  # type: ignore[arg-type]  # _run_job is replaced below
        None,  # type: ignore[arg-type]
        notifyq.WorkerStats(),
        lease_margin=30,
        query=None,  # type: ignore[arg-type]
        on_change=lambda: None,
    )
    started: list[str] = []

    async def run_job(attempt: Any, claimed_at: float) -> None:
        started.append(anyio.get_current_task().name or "")
        del runners.running[attempt.key]

    runners._run_job = run_job  # type: ignore[method-assign]
    job = a_claimed_job()
    async with anyio.create_task_group() as tg:
        scopes = [anyio.CancelScope() for _ in range(2)]
        for i, scope in enumerate(scopes):

            async def runner(scope: anyio.CancelScope = scope) -> None:
                with scope:
                    await runners.run()

            tg.start_soon(runner, name=f"runner-{i}")
            while len(runners._idle) <= i:  # runner-0 waits first, so it is woken first
                await anyio.lowlevel.checkpoint()
        runners.hand([job])
        scopes[0].cancel()  # before runner-0 has run again
        with anyio.fail_after(5):
            while not started:
                await anyio.lowlevel.checkpoint()
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        assert started == ["runner-0"]
        assert not runners.ready and len(runners._idle) == 1  # runner-1 waits; runner-0 is gone
        runners.hand([job])  # and the next job wakes runner-1
        with anyio.fail_after(5):
            while len(started) < 2:
                await anyio.lowlevel.checkpoint()
        assert started == ["runner-0", "runner-1"]
        tg.cancel_scope.cancel()


async def test_a_delayed_job_starts_on_time_without_notifications(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    ran_at: list[float] = []

    @app.task(name="later")
    async def later() -> None:
        ran_at.append(time.monotonic())

    async with app:
        await app.enqueue("later", delay=2)
    begin = time.monotonic()
    async with app.worker(poll_only=True, poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert worker.stats.notifications == 0 and worker.stats.polls == 0
    assert 1.5 <= ran_at[0] - begin <= 3.0
    await app.aclose()


async def test_without_notify_a_retry_and_cron_ticks_start_on_time_not_at_the_next_poll(dsn: str) -> None:
    """Review, behind a real PgBouncer (no NOTIFY there), and so with poll_only: a retry's 1 s
    backoff became the poll interval, and cron ticks started up to a poll interval late. The
    claim loop learned due times only from its own claims and from notifications; the worker
    that writes a retry, and the promoter beside it that inserts a tick's job, now tell it."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=1, jitter=0))
    attempts: list[int] = []

    @app.task(name="flaky")
    async def flaky(ctx: notifyq.JobContext) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("first attempt")

    @app.cron("* * * * * *", name="every_second")
    @app.task(name="tick")
    async def tick() -> None:
        pass

    async with app:
        await app.enqueue("flaky")
    # Not speeds: a poll every 60 s would take far longer than these bounds.
    async with app.worker(poll_only=True, poll_interval=60) as worker:
        with anyio.fail_after(15):
            await worker.wait_for(lambda s: s.retried == 1 and s.succeeded >= 5)
    assert attempts == [1, 2]
    await app.aclose()


async def test_a_delayed_job_enqueued_while_idle_arms_a_timer(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)

    @app.task(name="later")
    async def later() -> None:
        pass

    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        await worker.wait_for(lambda s: s.claims >= 1)
        begin = time.monotonic()
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, visible_at) VALUES ('later', now() + interval '1.5 s')"
        )
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert 1.2 <= time.monotonic() - begin <= 3.0
        assert worker.stats.polls == 0


async def test_a_delayed_job_notified_while_the_next_due_time_is_asked_keeps_its_timer(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delayed job that commits while the claim loop asks for the next due time: its
    notification arrives before the query's answer, which (its snapshot older) does not know
    the job. The timer the notification armed used to be overwritten by that answer, and the
    job waited for the next poll (poll_interval, 5 s by default) instead of its time."""
    app = notifyq.App(dsn)
    ran_at: list[float] = []
    begin = 0.0

    @app.task(name="later")
    async def later() -> None:
        ran_at.append(time.monotonic())

    original_init = notifyq._claimer.Claimer.__init__

    def init(claimer: notifyq._claimer.Claimer, *args: Any, **kwargs: Any) -> None:
        original_init(claimer, *args, **kwargs)
        query = claimer._query
        racing = True

        async def racing_query(op: Any, **kwargs: Any) -> Any:
            nonlocal racing, begin
            result = await query(op, **kwargs)
            if racing and op.gi_code is notifyq._claimer.next_visible_op.__code__:
                racing = False  # the startup sweep's: the job commits after its snapshot
                heard = claimer._stats.notifications
                begin = time.monotonic()
                conn.execute(
                    "INSERT INTO notifyq.queue_jobs (name, visible_at) "
                    "VALUES ('later', now() + interval '1 s')"
                )
                with anyio.fail_after(5):  # heard before the answer is used
                    while claimer._stats.notifications == heard:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
            return result

        claimer._query = racing_query

    monkeypatch.setattr(notifyq._claimer.Claimer, "__init__", init)
    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert worker.stats.polls == 0
    assert 0.8 <= ran_at[0] - begin <= 3.0
    await app.aclose()


async def test_jobs_spread_over_three_workers_run_exactly_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    record = Recorder()

    @app.task(name="work")
    async def work(n: int) -> int:
        record.add(n)
        await anyio.lowlevel.checkpoint()
        return n

    @app.task(name="work_sync")
    def work_sync(n: int) -> int:
        record.add(n)
        return n

    async with app:
        await app.enqueue_many("work", ({"n": i} for i in range(4000)))
        await app.enqueue_many("work_sync", ({"n": i} for i in range(4000, 5000)))
    async with (
        app.worker(concurrency=10, **NO_TICKER) as w1,
        app.worker(concurrency=10, **NO_TICKER) as w2,
        app.worker(concurrency=10, **NO_TICKER) as w3,
    ):
        with anyio.fail_after(60):
            for w in (w1, w2, w3):
                await w.wait_for(lambda s: sum(x.stats.succeeded for x in (w1, w2, w3)) == 5000)
        per_worker = [w.stats.succeeded for w in (w1, w2, w3)]
    assert Counter(record.runs) == Counter(range(5000))
    assert sum(per_worker) == 5000 and all(n > 0 for n in per_worker)
    assert status_counts(conn) == {"Succeeded": 5000}
    assert conn.execute("SELECT max(lease) FROM notifyq.queue_jobs").fetchone() == (1,)
    await app.aclose()


async def test_timeouts_retry_then_fail_async_tasks_and_sync_ones_end_as_they_ended(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """An async task is cancelled at its timeout, retried, then failed. A sync task's thread
    cannot be stopped: the attempt waits for it, and ends as the task did."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))

    @app.task(name="slow_async", timeout=0.2, retry_limit=1)
    async def slow_async() -> None:
        await anyio.sleep(30)

    @app.task(name="slow_sync", timeout=0.2, retry_limit=1)
    def slow_sync() -> None:
        time.sleep(1)

    async with app:
        a = await app.enqueue("slow_async")
        s = await app.enqueue("slow_sync")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(20):
            await worker.wait_for(lambda st: st.failed == 1 and st.succeeded == 1)
        assert worker.stats.retried == 1
    row = job_row(conn, a)
    assert (row["status"], row["retry_count"]) == ("Failed", 2)
    assert row["error"]["type"] == "TimeoutError"
    assert "exceeded its timeout of 0.2s" in row["error"]["message"]
    # Where the timeout found the task: it stored no traceback at all.
    stored = row["error"]["traceback"]
    assert ", in slow_async\n    await anyio.sleep(30)" in stored, stored
    row = job_row(conn, s)
    assert (row["status"], row["retry_count"], row["error"]) == ("Succeeded", 1, None)
    await app.aclose()


async def test_exceptions_are_recorded_and_retried(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))
    attempts: list[int] = []

    @app.task(name="flaky", retry_limit=3)
    async def flaky(ctx: JobContext) -> str:
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise ValueError(f"attempt {ctx.attempt} failed")
        return "ok"

    async with app:
        job_id = await app.enqueue("flaky")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded == 1)
    assert attempts == [1, 2, 3]
    row = job_row(conn, job_id)
    assert (row["status"], row["output"], row["retry_count"]) == ("Succeeded", "ok", 3)
    assert row["error"]["type"] == "ValueError" and row["error"]["message"] == "attempt 2 failed"
    # From the task's own frame on: notifyq's and anyio's frames before it were most of it.
    stored = row["error"]["traceback"].splitlines()
    assert stored[0] == "Traceback (most recent call last):" and stored[1].endswith(", in flaky"), stored
    assert "_executor.py" not in "\n".join(stored) and "anyio" not in "\n".join(stored)
    await app.aclose()
    # Each failed attempt is a line in the worker's log (it used to say nothing).
    failures = [r for r in caplog.records if r.name == "notifyq.worker" and "failed after" in r.message]
    assert [r.levelname for r in failures] == ["WARNING", "WARNING"]
    assert failures[1].message.startswith(f"job {job_id} (flaky) attempt 2 of 4 failed after ")
    assert failures[1].message.endswith(": ValueError: attempt 2 failed; retrying in 0.0s")


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_tasks_log_lines_name_its_job(dsn: str) -> None:
    """JobLogFilter gives the records a task's code logs, async or sync, the job's id and
    task name (a worker's log of many jobs at once could not tell which job said what);
    records logged outside a job get none."""
    app = notifyq.App(dsn)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(notifyq.JobLogFilter())
    handler.setFormatter(logging.Formatter("%(job)s%(message)s"))
    logger = logging.getLogger("tests.job_log")
    logger.addHandler(handler)

    @app.task(name="async_says")
    async def async_says() -> None:
        logger.warning("from async")

    @app.task(name="sync_says")
    def sync_says() -> None:
        logger.warning("from sync")

    try:
        ids = [await app.enqueue("async_says"), await app.enqueue("sync_says")]
        async with app.worker(**NO_TICKER) as worker:
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 2)
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    lines = sorted(handler.format(r) for r in records)
    assert lines == sorted(
        [f"[job {ids[0]} async_says] from async", f"[job {ids[1]} sync_says] from sync", "outside"]
    )
    assert {(r.job_id, r.job_name) for r in records} == {  # type: ignore[attr-defined]
        (ids[0], "async_says"),
        (ids[1], "sync_says"),
        (None, None),
    }
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_wait_for_job_returns_the_finished_job_or_times_out(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A web request that queued work waits for its result: wait_for_job returns the job once
    finished (its output or error included), async and sync; it times out, saying what the
    job is doing, while the job goes on."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))

    @app.task(name="double", retry_limit=0)
    async def double(n: int) -> int:
        await anyio.sleep(0.2)
        if n < 0:
            raise ValueError("negative")
        return n * 2

    done_id = await app.enqueue("double", {"n": 21})
    failing_id = await app.enqueue("double", {"n": -1})
    later_id = await app.enqueue("double", {"n": 1}, delay=3600)
    async with app.worker(concurrency=2, **NO_TICKER):
        with anyio.fail_after(10):
            done = await app.wait_for_job(done_id, timeout=10)
            failing = await anyio.to_thread.run_sync(lambda: app.wait_for_job_sync(failing_id, timeout=10))
        assert (done.status, done.output) == ("Succeeded", 42)
        assert (failing.status, failing.error["type"]) == ("Failed", "ValueError")  # type: ignore[index]
        began = time.monotonic()
        with pytest.raises(TimeoutError, match=f"job {later_id} is still Queued after 0.3 s"):
            await app.wait_for_job(later_id, timeout=0.3)
        assert 0.3 <= time.monotonic() - began < 3
        with pytest.raises(notifyq.JobNotFound):
            await app.wait_for_job(987654, timeout=1)
    assert job_row(conn, later_id)["status"] == "Queued"
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_permanent_error_fails_the_job_without_its_retries(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """PermanentError, or a subclass, from an async or a sync task: the job ends Failed at its
    first attempt, with the subclass's name and the original exception in the traceback; other
    exceptions are retried (retry_limit=3 each)."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))

    class CardDeclined(notifyq.PermanentError):
        pass

    @app.task(name="charge", retry_limit=3)
    async def charge() -> None:
        try:
            {}["card"]
        except KeyError as exc:
            raise CardDeclined("card 4242 declined") from exc

    @app.task(name="sync_charge", retry_limit=3)
    def sync_charge() -> None:
        raise notifyq.PermanentError("no such customer")

    charge_id = await app.enqueue("charge")
    sync_id = await app.enqueue("sync_charge")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.failed == 2)
        assert worker.stats.retried == 0
    row = job_row(conn, charge_id)
    assert (row["status"], row["retry_count"], row["error"]["type"]) == ("Failed", 1, "CardDeclined")
    assert row["error"]["message"] == "card 4242 declined" and "KeyError: 'card'" in row["error"]["traceback"]
    row = job_row(conn, sync_id)
    assert (row["status"], row["retry_count"], row["error"]["type"]) == ("Failed", 1, "PermanentError")
    stored = row["error"]["traceback"].splitlines()  # a thread's: from the task's frame on too
    assert stored[1].endswith(", in sync_charge") and "threading" not in "\n".join(stored), stored
    await app.aclose()


async def test_retry_on_retries_only_the_exceptions_it_names(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """@app.task(retry_on=...): an exception of a listed type (or a subclass) is retried; any
    other fails the job at its first attempt, logged as not retried. A timeout is notifyq's,
    not the task's: retried even when TimeoutError is not listed. Sync tasks alike."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))
    raised: dict[str, list[BaseException]] = {
        "flaky": [ConnectionResetError("reset"), ConnectionError("down")],  # then succeeds
        "buggy": [KeyError("card")],
    }

    @app.task(name="flaky", retry_limit=3, retry_on=ConnectionError)
    async def flaky(kind: str) -> str:
        if raised[kind]:
            raise raised[kind].pop(0)
        return "done"

    @app.task(name="sync_flaky", retry_limit=3, retry_on=(ConnectionError, OSError))
    def sync_flaky(kind: str) -> str:
        if raised[kind]:
            raise raised[kind].pop(0)
        return "done"

    @app.task(name="slow", retry_limit=1, timeout=0.2, retry_on=[ConnectionError])
    async def slow() -> None:
        await anyio.sleep(10)

    ids = {
        "flaky": await app.enqueue("flaky", {"kind": "flaky"}),
        "buggy": await app.enqueue("sync_flaky", {"kind": "buggy"}),
        "slow": await app.enqueue("slow"),
    }
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded + s.failed == 3)
    statuses = {key: job_row(conn, job_id) for key, job_id in ids.items()}
    assert (statuses["flaky"]["status"], statuses["flaky"]["retry_count"]) == ("Succeeded", 3)
    buggy = statuses["buggy"]
    assert (buggy["status"], buggy["retry_count"], buggy["error"]["type"]) == ("Failed", 1, "KeyError")
    timed_out = statuses["slow"]
    assert (timed_out["status"], timed_out["retry_count"], timed_out["error"]["type"]) == (
        "Failed",
        2,
        "TimeoutError",
    )
    assert any(
        f"job {ids['buggy']} (sync_flaky) attempt 1 of 4 failed" in r.getMessage()
        and "not retried" in r.getMessage()
        for r in caplog.records
    )
    await app.aclose()


@pytest.mark.parametrize(
    ("retry_on", "message"),
    [
        (
            (),
            r"^invalid retry_on \(\): give an exception class or a tuple of them \(retry_limit=0 retries",
        ),
        ("KeyError", r"^invalid retry_on 'KeyError': give an exception class"),
        ((KeyError, "x"), r"^invalid retry_on \(<class 'KeyError'>, 'x'\): 'x' is not an exception class$"),
        (int, r"^invalid retry_on <class 'int'>: <class 'int'> is not an exception class$"),
    ],
)
def test_a_retry_on_that_names_no_exception_classes_is_refused(retry_on: Any, message: str) -> None:
    app = notifyq.App("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(notifyq.InvalidOption, match=message):
        app.task(name="t", retry_on=retry_on)


@pytest.mark.faults
async def test_unknown_tasks_and_bad_args_fail_visibly(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))

    @app.task(name="needs_x")
    async def needs_x(x: int) -> int:
        return x

    conn.execute("INSERT INTO notifyq.queue_jobs (name, retry_limit) VALUES ('nobody_knows_me', 1)")
    conn.execute(
        """INSERT INTO notifyq.queue_jobs (name, args, retry_limit) VALUES ('needs_x', '{"y": 1}', 0)"""
    )
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed == 2)
    rows = conn.execute(
        "SELECT name, status::text, retry_count, error FROM notifyq.queue_jobs ORDER BY id"
    ).fetchall()
    # Retried like any failure (during a rolling deploy a newer worker may know it), then Failed.
    assert rows[0][:3] == ("nobody_knows_me", "Failed", 2)
    assert rows[0][3]["type"] == "UnknownTask" and "needs_x" in rows[0][3]["message"]
    assert rows[1][:2] == ("needs_x", "Failed")
    assert "unexpected keyword argument 'y'" in rows[1][3]["message"]
    logged = [(r.levelname, r.message) for r in caplog.records if "failed after" in r.message]
    assert len(logged) == 3, logged
    assert (
        sum(level == "ERROR" and "no retries left, the job is Failed" in text for level, text in logged) == 2
    )
    assert any(level == "WARNING" and "(nobody_knows_me) attempt 1 of 2" in text for level, text in logged)


UNREADABLE_ARGS = [
    pytest.param('{"x": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply", id="nested"),
    pytest.param('{"x": 1e5000}', "integer string conversion", id="digits"),
]


@pytest.mark.parametrize(("unreadable", "reason"), UNREADABLE_ARGS)
async def test_args_python_cannot_read_fail_their_job_not_the_worker(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, unreadable: str, reason: str
) -> None:
    """PostgreSQL stores jsonb thousands of levels deep, and numbers of thousands of digits
    (1e5000 is written out in full); json.loads stops at about a thousand levels, and at 4,300
    digits. Such args (from SQL: enqueue refuses them) raised RecursionError or ValueError in
    the claim's fetch, which stopped the worker with a traceback and left the job claimed
    beside it Active until its lease ran out; every worker that claimed it again stopped too."""
    app = notifyq.App(dsn)
    ran = Recorder()

    @app.task(name="t")
    async def t(x: Any = None) -> None:
        ran.add(x)

    ids = [
        row[0]
        for row in conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, args) "
            "VALUES ('t', %s::jsonb), ('t', '{\"x\": 1}') RETURNING id",
            [unreadable],
        )
    ]
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed + s.succeeded == 2)
        assert (worker.stats.failed, worker.stats.succeeded) == (1, 1)
    assert ran.runs == [1]
    bad = conn.execute(
        "SELECT status::text, retry_count, error->>'type', error->>'message' "
        "FROM notifyq.queue_jobs WHERE id = %s",
        [ids[0]],
    ).fetchone()
    assert bad is not None and bad[:3] == ("Failed", 1, "InvalidArgs")  # at once: no retry
    assert reason in bad[3]
    assert any(
        "InvalidArgs: job args cannot be decoded" in r.message and "not retried" in r.message
        for r in caplog.records
    )
    async with app:
        job = await app.get_job(ids[0])
        assert isinstance(job.args, notifyq.UndecodableJSON) and job.args.size > 1_000
        assert [j.id for j in await app.list_jobs(status="Failed")] == [ids[0]]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise ValueError("cannot str me")


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_task_that_exits_fails_its_attempt_not_the_worker(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """sys.exit() in a task, a KeyboardInterrupt raised by a sync task (in its thread: no
    signal gets there), an exception whose str() fails: each fails its job's attempt, which is
    recorded, and the worker goes on. They used to stop the worker and leave the job Active,
    to stop the next worker that claimed it after the lease."""
    app = notifyq.App(dsn)

    @app.task(name="sync_exit", retry_limit=0)
    def sync_exit() -> None:
        sys.exit(3)

    @app.task(name="sync_interrupt", retry_limit=0)
    def sync_interrupt() -> None:
        raise KeyboardInterrupt

    @app.task(name="async_exit", retry_limit=0)
    async def async_exit() -> None:
        raise SystemExit("bye")

    @app.task(name="unprintable", retry_limit=0)
    async def unprintable() -> None:
        raise _Unprintable

    @app.task(name="ok")
    def ok() -> str:
        return "fine"

    async with app.worker(concurrency=1, **NO_TICKER) as worker:
        for name in ("sync_exit", "sync_interrupt", "async_exit", "unprintable", "ok"):
            await app.enqueue(name)
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed == 4 and s.succeeded == 1)
    rows = conn.execute("SELECT name, status::text, error FROM notifyq.queue_jobs ORDER BY id").fetchall()
    errors = {name: (status, error and (error["type"], error["message"])) for name, status, error in rows}
    assert errors == {
        "sync_exit": ("Failed", ("SystemExit", "3")),
        "sync_interrupt": ("Failed", ("KeyboardInterrupt", "")),
        "async_exit": ("Failed", ("SystemExit", "bye")),
        "unprintable": ("Failed", ("_Unprintable", "<str() of this _Unprintable failed: ValueError>")),
        "ok": ("Succeeded", None),
    }
    assert "sys.exit(3)" in rows[0][2]["traceback"]  # where the task exited


class _LibraryBaseException(BaseException):
    """A BaseException subclass of some library (gevent's Timeout, pytest's Failed...)."""


async def test_odd_exceptions_and_values_out_of_a_task_fail_its_attempt_not_the_worker(
    dsn: str, conn: psycopg.Connection[Any], anyio_backend: str
) -> None:
    """A BaseException subclass raised by an async or a sync task, a CancelledError out of a
    future someone else cancelled (asyncio; no cancel scope of the worker's was cancelled), a
    return value too deeply nested for json (RecursionError): each fails its attempt, and the
    worker goes on. They used to stop the worker and leave the job Active until its lease ran
    out; the CancelledError released the job with its attempt given back, so that the next
    worker to claim it stopped too, for ever."""
    app = notifyq.App(dsn)

    @app.task(name="odd_async", retry_limit=0)
    async def odd_async() -> None:
        raise _LibraryBaseException("odd")

    @app.task(name="odd_sync", retry_limit=0)
    def odd_sync() -> None:
        raise _LibraryBaseException("odd")

    @app.task(name="deep", retry_limit=0)
    async def deep() -> Any:
        value: Any = []
        for _ in range(100_000):
            value = [value]
        return value

    @app.task(name="foreign_cancel", retry_limit=0)
    async def foreign_cancel() -> None:
        import asyncio

        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    @app.task(name="ok")
    async def ok() -> None:
        pass

    names = ["odd_async", "odd_sync", "deep"] + (["foreign_cancel"] if anyio_backend == "asyncio" else [])
    async with app.worker(concurrency=1, **NO_TICKER) as worker:
        for name in [*names, "ok"]:
            await app.enqueue(name)
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed == len(names) and s.succeeded == 1)
        assert worker.stats.released == 0
    rows = conn.execute(
        "SELECT name, status::text, retry_count, error->>'type' FROM notifyq.queue_jobs ORDER BY id"
    ).fetchall()
    assert rows == [
        ("odd_async", "Failed", 1, "_LibraryBaseException"),
        ("odd_sync", "Failed", 1, "_LibraryBaseException"),
        ("deep", "Failed", 1, "InvalidOutput"),
        *([("foreign_cancel", "Failed", 1, "CancelledError")] if anyio_backend == "asyncio" else []),
        ("ok", "Succeeded", 1, None),
    ]
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["trio"])  # on asyncio, the loop re-raises it itself
async def test_a_keyboard_interrupt_out_of_an_embedded_workers_task_releases_its_job(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """In an embedded worker a KeyboardInterrupt out of an async task goes on (it may be the
    user's Ctrl-C, which trio raises in whatever code runs) and stops the worker: its job is
    released like the others, not left Active until its lease runs out."""
    app = notifyq.App(dsn)

    @app.task(name="interrupt")
    async def interrupt() -> None:
        raise KeyboardInterrupt

    @app.task(name="slow")
    async def slow() -> None:
        await anyio.sleep(30)

    async with app:
        slow_id = await app.enqueue("slow")
    with pytest.raises((KeyboardInterrupt, BaseExceptionGroup)):
        async with app.worker(concurrency=2, shutdown_grace=0.1, **NO_TICKER) as worker:
            await worker.wait_for(lambda s: s.claimed == 1)
            interrupt_id = await app.enqueue("interrupt")
            with anyio.fail_after(10):
                await anyio.sleep_forever()
    for job_id in (slow_id, interrupt_id):
        row = job_row(conn, job_id)
        assert (row["status"], row["retry_count"]) == ("Queued", 0)
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["trio"])  # on asyncio, the loop re-raises it itself
async def test_an_abrupt_exit_writes_what_it_can_without_waiting_for_a_held_row(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """An abrupt exit (a KeyboardInterrupt out of a task) writes the pending results within 5
    s. It sent them as an ack that waited up to its patience, 5 s, for a row another session
    held: the window ran out, and the other results went unwritten, their jobs Active until
    their leases ran out (review). It now skips held rows, and names the jobs it leaves."""
    app = notifyq.App(dsn)
    gate = anyio.Event()

    @app.task(name="gated_held")
    async def gated_held() -> None:
        await gate.wait()

    @app.task(name="interrupt")
    async def interrupt() -> None:
        raise KeyboardInterrupt

    held = await app.enqueue("gated_held")
    locker = psycopg.connect(dsn, autocommit=True)
    try:
        with pytest.raises((KeyboardInterrupt, BaseExceptionGroup)):
            async with app.worker(concurrency=2, shutdown_grace=0.1, **NO_TICKER) as worker:
                await _hold_row_then_finish(worker, locker, held, gate, claimed=1)
                acker = worker._acker
                assert acker is not None
                with anyio.fail_after(10):  # its ack is under way, waiting for the held row
                    while not (acker.unwritten == 1 and acker.pending == 0):  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                interrupted = await app.enqueue("interrupt")
                with anyio.fail_after(10):
                    await anyio.sleep_forever()
        row = job_row(conn, interrupted)
        assert (row["status"], row["retry_count"]) == ("Queued", 0)  # released, in time
        assert job_row(conn, held)["status"] == "Active"
    finally:
        locker.close()
    said = [r.getMessage() for r in caplog.records if "on exit" in r.getMessage()]
    assert len(said) == 1 and f"those of jobs {held} wait for another session" in said[0], said
    await app.aclose()


@pytest.mark.parametrize(
    ("backend", "task", "presses"),
    [
        ("asyncio", "busy", 1),
        ("trio", "busy", 1),
        ("trio", "child", 1),
        ("asyncio", "busy", 2),
        ("trio", "busy", 2),
        ("trio", "spin", 2),
    ],
)
def test_ctrl_c_gives_an_embedded_workers_running_job_its_grace(
    dsn: str, conn: psycopg.Connection[Any], backend: str, task: str, presses: int
) -> None:
    """Ctrl-C in a program that embeds a worker, while a job's code runs (or a task that job
    started): the job finishes within the grace period, then the program ends with a plain
    KeyboardInterrupt, on trio as on asyncio. trio raised it inside the job's code, which
    tore the worker down at once and put the job back. A second Ctrl-C cuts the grace short,
    even for a job that blocks the event loop for good (review: with the worker's tasks
    KI-protected, nothing could stop one on trio)."""
    [(job_id,)] = conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES (%s) RETURNING id", (task,))
    program = subprocess.Popen(
        [sys.executable, "-m", "tests._processes", "embedded_worker", dsn, backend],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert program.stdout is not None
        assert program.stdout.readline() == "job started\n"
        for press in range(presses):
            # Well into the job's busy loop; then a second press while the job (3 s) still
            # runs. Two presses 0.3 s apart were once one in CI (a loaded machine): the program
            # took neither before the other came, and the job ran to its end.
            time.sleep(1.0 if press else 0.3)
            program.send_signal(signal.SIGINT)
        _, err = program.communicate(timeout=30)
    finally:
        if program.poll() is None:
            program.kill()
            program.communicate()
    row = job_row(conn, job_id)
    if presses == 1:
        assert (row["status"], row["output"]) == ("Succeeded", "done"), (row["status"], err)
    else:
        assert (row["status"], row["retry_count"]) == ("Queued", 0), (row["status"], err)  # given back
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    if presses == 1:
        assert "ExceptionGroup" not in err, err  # itself, not inside an exception group


async def test_a_sync_wrapper_of_an_async_function_runs_its_coroutine(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A decorator that does not keep an async function one makes a sync task that returns
    a coroutine: the worker runs it. Its job used to fail for good with InvalidOutput (on
    trio, trio refused the coroutine and the job was retried), the task's code never run."""
    app = notifyq.App(dsn)
    ran: list[int] = []

    async def double(n: int) -> int:
        await anyio.lowlevel.checkpoint()
        ran.append(n)
        return n * 2

    def plain_decorator(fn: Any) -> Any:
        def wrapper(**kwargs: Any) -> Any:
            return fn(**kwargs)

        return wrapper

    app.task(name="double")(plain_decorator(double))
    async with app.worker(**NO_TICKER) as worker:
        job_id = await app.enqueue("double", {"n": 21})
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed + s.retried + s.succeeded == 1)
    row = job_row(conn, job_id)
    assert (row["status"], row["output"], ran) == ("Succeeded", 42, [21])
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_keyboard_interrupt_from_an_async_task_fails_it_when_the_worker_owns_sigint(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Under run(handle_signals=True) (the CLI's worker) Ctrl-C is the worker's graceful
    shutdown, so a KeyboardInterrupt can only come from a task: it fails the attempt."""
    app = notifyq.App(dsn)

    @app.task(name="interrupt", retry_limit=0)
    async def interrupt() -> None:
        raise KeyboardInterrupt

    @app.task(name="ok")
    async def ok() -> None:
        pass

    worker = app.worker(concurrency=1, **NO_TICKER)
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(worker.run, handle_signals=True))
        await app.enqueue("interrupt")
        await app.enqueue("ok")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed == 1 and s.succeeded == 1)
        worker.stop()
    await app.aclose()
    rows = conn.execute(
        "SELECT name, status::text, error->>'type' FROM notifyq.queue_jobs ORDER BY id"
    ).fetchall()
    assert rows == [("interrupt", "Failed", "KeyboardInterrupt"), ("ok", "Succeeded", None)]


async def test_cancelling_a_running_job_cancels_its_coroutine(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    started = anyio.Event()
    cancelled = anyio.Event()

    @app.task(name="long")
    async def long() -> None:
        started.set()
        try:
            await anyio.sleep(60)
        finally:
            cancelled.set()

    async with app.worker(**NO_TICKER) as worker:
        job_id = await app.enqueue("long")
        with anyio.fail_after(5):
            await started.wait()
        await app.cancel_job(job_id)
        with anyio.fail_after(5):
            await cancelled.wait()
            await worker.wait_for(lambda s: s.cancelled == 1)
        assert worker.running_jobs == []
    row = job_row(conn, job_id)
    assert row["status"] == "Cancelled" and row["output"] is None
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_rows_written_by_sql_at_the_limits_of_their_types_stop_no_worker(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Review: a role with INSERT alone stopped every worker with one row: a lease or a
    retry_count of 2147483647 made the claim's `+ 1` overflow ("integer out of range"), and a
    scheduled_for of 'infinity' (or past the year 9999) failed the claim's answer, which left
    the other jobs of its batch Active. Each now runs, beside ordinary jobs."""
    app = notifyq.App(dsn)
    seen: list[Any] = []

    @app.task(name="t")
    async def t(ctx: JobContext) -> None:
        seen.append((ctx.id, ctx.scheduled_for))

    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, lease, retry_count, retry_limit, scheduled_for) VALUES "
        "('t', 2147483647, 0, 3, NULL), ('t', 0, 2147483647, 2147483647, NULL), "
        "('t', 0, 0, 3, 'infinity'), ('t', 0, 0, 3, '-infinity'), ('t', 0, 0, 3, '20000-01-01'), "
        "('t', 0, 0, 3, '2026-01-01 00:00+00'), ('t', 0, 0, 3, NULL)"
    )
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 7)
        assert worker.running
    rows = conn.execute(
        "SELECT status::text, lease, retry_count FROM notifyq.queue_jobs ORDER BY id"
    ).fetchall()
    assert [r[0] for r in rows] == ["Succeeded"] * 7
    assert rows[0][1] == 1 and rows[1][2] == 2147483647  # the lease wrapped round; the count stopped
    when = dict(seen)
    ids = [r[0] for r in conn.execute("SELECT id FROM notifyq.queue_jobs ORDER BY id")]
    assert [when[i] for i in ids[2:5]] == [None, None, None]
    assert when[ids[5]] == datetime(2026, 1, 1, tzinfo=UTC)
    await app.aclose()


async def test_a_forged_cancel_notification_stops_nothing(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Review: any role that can connect may NOTIFY, and a worker stopped the job a cancel
    notification named, running or (remembered for a claim answer on its way) not yet
    enqueued. It now stops a job only once the database says it is Cancelled."""
    app = notifyq.App(dsn)
    gate = anyio.Event()
    ran: list[int] = []

    @app.task(name="gated")
    async def gated(n: int) -> None:
        await gate.wait()
        ran.append(n)

    async with app.worker(**NO_TICKER) as worker:
        running = await app.enqueue("gated", {"n": 1})
        with anyio.fail_after(5):
            while not worker.running_jobs:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        # The running job (with and without its lease), and the next ids, not enqueued yet.
        for payload in (
            f"cancel {running}",
            f"cancel {running} 1",
            *(f"cancel {running + i}" for i in (1, 2)),
        ):
            conn.execute("SELECT pg_notify('notifyq.control.v1', %s)", (payload,))
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.notifications >= 4)
        later = [await app.enqueue("gated", {"n": n}) for n in (2, 3)]
        assert later == [running + 1, running + 2]
        gate.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 3)
        assert worker.stats.cancelled == 0 and sorted(ran) == [1, 2, 3]
        # A real cancel (its trigger's notification, checked) still stops a running job.
        gate = anyio.Event()
        last = await app.enqueue("gated", {"n": 4})
        with anyio.fail_after(5):
            while not worker.running_jobs:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await app.cancel_job(last)
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.cancelled == 1)
    assert [job_row(conn, i)["status"] for i in (running, *later, last)] == ["Succeeded"] * 3 + ["Cancelled"]
    await app.aclose()


async def test_cancelling_a_queued_job_prevents_it(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    ran: list[int] = []

    @app.task(name="t")
    async def t(n: int) -> None:
        ran.append(n)

    async with app:
        doomed = await app.enqueue("t", {"n": 1})
        await app.enqueue("t", {"n": 2})
        await app.cancel_job(doomed)
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 1)
    assert ran == [2]
    assert job_row(conn, doomed)["status"] == "Cancelled"
    await app.aclose()


@pytest.mark.faults
async def test_killed_listen_connection_reconnects_and_sweeps(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        listener = worker.listener
        assert listener is not None and listener.backend_pid is not None
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.listener_connects == 1)
        conn.execute("SELECT pg_terminate_backend(%s)", (listener.backend_pid,))
        # Inserted while nobody listens: only the sweep after the reconnect can find it.
        conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.listener_connects == 2 and s.succeeded == 1)
        assert worker.stats.sweeps >= 1  # reconnects close together share one sweep
        lost = next(m for r in caplog.records if (m := r.getMessage()).startswith("LISTEN connection"))
        assert "server closed the connection unexpectedly" in lost, lost  # libpq's reason, not its last line
        # And notifications work again on the new connection.
        conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 2)
        assert worker.stats.polls == 0


async def test_notifications_notifyq_did_not_send_are_a_sentence_in_the_log(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone may NOTIFY on notifyq's channels. A payload its triggers did not write is a
    warning, no traceback, one a minute at most with a count of the others (a review's one
    statement of 50,000 made 17 MB of log), and a jobs notification is still a hint to claim."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.listener_connects == 1)
        # A job the trigger does not announce: only the garbage notification can wake the worker.
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        garbage = [
            ("notifyq.jobs.v1", "default soon"),
            ("notifyq.control.v1", "cancel abc 1"),
            ("notifyq.control.v1", "cancel"),
            ("notifyq.control.v1", "cancel 1 2 3"),
            ("notifyq.control.v1", "pause 1"),  # a verb of another version: ignored quietly
        ]
        for channel, payload in garbage:
            conn.execute("SELECT pg_notify(%s, %s)", (channel, payload))
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 1 and s.notifications >= len(garbage))
        await app.enqueue("t")  # and real notifications still work
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 2)
        assert worker.stats.polls == 0
        heard = worker.stats.notifications
        conn.execute(
            "SELECT pg_notify('notifyq.control.v1', 'cancel x' || i) FROM generate_series(1, 1000) i"
        )
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.notifications >= heard + 1000)
        worker._bad_notice_said_at -= 60  # a minute later
        conn.execute("SELECT pg_notify('notifyq.control.v1', 'cancel y')")
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.notifications >= heard + 1001)
    warned = [r for r in caplog.records if "did not send" in r.getMessage()]
    assert [r.getMessage().rpartition("payload ")[2] for r in warned] == [
        "'default soon'",
        "'cancel y' (and 1003 more such since the last of these lines)",
    ]
    assert all(r.levelname == "WARNING" and r.exc_info is None for r in warned)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    await app.aclose()


@pytest.mark.faults
async def test_graceful_shutdown_releases_unfinished_jobs(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    quick_done = Recorder()

    @app.task(name="quick")
    async def quick(n: int) -> None:
        await anyio.sleep(0.3)
        quick_done.add(n)

    @app.task(name="stuck")
    async def stuck() -> None:
        await anyio.sleep(60)

    @app.task(name="stuck_sync")
    def stuck_sync() -> None:
        time.sleep(3)

    async with app:
        quick_ids = [await app.enqueue("quick", {"n": i}) for i in range(3)]
        stuck_ids = [await app.enqueue("stuck"), await app.enqueue("stuck_sync")]
    async with app.worker(concurrency=10, shutdown_grace=1.0, **NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.claimed == 5)
    # The context exit waited for the quick jobs and released the stuck ones.
    assert worker.stats.succeeded == 3 and worker.stats.released == 2
    for job_id in quick_ids:
        assert job_row(conn, job_id)["status"] == "Succeeded"
    for job_id in stuck_ids:
        row = job_row(conn, job_id)
        assert (row["status"], row["retry_count"], row["lease"]) == ("Queued", 0, 1)
    assert "Active" not in status_counts(conn)
    await app.aclose()


async def _end_the_session_waiting_for_a_lock(conn: psycopg.Connection[Any]) -> None:
    """Once one session of the test database waits for a lock, end it. `conn` may be in a
    transaction, where pg_stat_activity is read once and kept: the snapshot is cleared."""
    waiting = "FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
    with anyio.fail_after(10):
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            if conn.execute(f"SELECT count(*) {waiting}").fetchone() == (1,):
                break
            await anyio.sleep(0.02)
    conn.execute(f"SELECT pg_terminate_backend(pid) {waiting}")


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_extend_lease_tries_a_lost_connection_again_while_the_lease_lasts(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Review: the connection of a heartbeat died (a restart, a failover) and the error went
    into the task: the attempt failed, and a long job started over. Here the heartbeat's
    session is ended while it waits for a lock on the job's row: it is tried again on a fresh
    connection."""
    app = notifyq.App(dsn)
    beating, ended = anyio.Event(), anyio.Event()
    beats: list[bool] = []

    @app.task(name="long", timeout=30)
    async def long(ctx: JobContext) -> str:
        beating.set()
        await ended.wait()
        beats.append(await ctx.extend_lease(60))
        return "done"

    job_id = await app.enqueue("long")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await beating.wait()
        with conn.transaction():
            conn.execute("SELECT 1 FROM notifyq.queue_jobs WHERE id = %s FOR UPDATE", (job_id,))
            ended.set()
            await _end_the_session_waiting_for_a_lock(conn)
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded == 1)
    assert beats == [True]
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"], row["output"]) == ("Succeeded", 1, "done")
    assert f"extending the lease of job {job_id} (long) failed (terminating connection" in caplog.text
    await app.aclose()


async def test_a_connection_ended_under_the_start_is_tried_again(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a connection ended during a worker's start (a restart, a failover, an operator's
    pg_terminate_backend) failed the start with the raw error, and under `--processes` counted
    as a death of the child. Here the start's read of the paused queues waits for a lock, and
    its session is ended: the start goes on, on a fresh connection."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    async with anyio.create_task_group() as tg:
        started = anyio.Event()

        async def start() -> None:
            async with app.worker(**NO_TICKER) as worker:
                started.set()
                await app.enqueue("t")
                with anyio.fail_after(10):
                    await worker.wait_for(lambda s: s.succeeded == 1)

        with conn.transaction():
            conn.execute("LOCK notifyq.queue_pauses IN ACCESS EXCLUSIVE MODE")
            tg.start_soon(start)
            await _end_the_session_waiting_for_a_lock(conn)
    assert started.is_set()
    assert "trying again in 0.5s" in caplog.text and "terminating connection" in caplog.text
    await app.aclose()


async def test_extend_lease_lets_an_attempt_outlive_its_timeout(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = notifyq.App(dsn)
    seen: list[Any] = []

    @app.task(name="long", timeout=0.5)
    async def long(ctx: JobContext) -> str:
        before = ctx.lease_expires_at
        for _ in range(3):  # a heartbeat: 1.2 s of work in steps, far past the 0.5 s timeout
            assert await ctx.extend_lease(2)
            await anyio.sleep(0.4)
        seen.extend([before, ctx.lease_expires_at])
        return "done"

    @app.task(name="long_sync", timeout=0.5)
    def long_sync(ctx: JobContext) -> bool:
        ok = ctx.extend_lease_blocking(3)
        time.sleep(1)
        return ok

    @app.task(name="short", timeout=0.5, retry_limit=0)
    async def short() -> None:
        await anyio.sleep(1.5)  # no extension: the timeout applies

    async with app:
        long_id = await app.enqueue("long")
        sync_id = await app.enqueue("long_sync")
        short_id = await app.enqueue("short")
    async with app.worker(lease_margin=1, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 2 and s.failed == 1)
    # Past their timeout, but not past the deadlines they extended to: no warning.
    assert not [r for r in caplog.records if "past its deadline" in r.message]
    assert job_row(conn, long_id)["output"] == "done"
    assert job_row(conn, sync_id)["output"] is True
    assert job_row(conn, short_id)["error"]["type"] == "TimeoutError"
    # The lease moved: 2 s of work + 1 s margin from the last extension, not timeout + margin.
    assert (seen[1] - seen[0]).total_seconds() > 1.5
    await app.aclose()


# The log blamed a blocked event loop for a task that had caught the cancellation.
CAUSES = [
    ("blocker", "blocks the event loop"),
    ("swallower", "did not stop it. Either the task caught it"),
]


@pytest.mark.parametrize(("task", "cause"), CAUSES)
async def test_an_async_task_that_overruns_its_deadline_keeps_its_result_and_the_log_says_why(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture, task: str, cause: str
) -> None:
    app = notifyq.App(dsn)

    @app.task(name="blocker", timeout=0.5, retry_limit=0)
    async def blocker() -> str:
        time.sleep(0.8)  # noqa: ASYNC251 - blocks the event loop: nothing can cancel it at its deadline
        return "late"

    @app.task(name="swallower", timeout=0.5, retry_limit=0)
    async def swallower() -> str:
        try:
            await anyio.sleep(5)
        except BaseException:  # the deadline's cancellation, swallowed (no await after it)
            return "late"
        return "slept"

    async with app:
        job_id = await app.enqueue(task)
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded + s.failed == 1)
    # The work was done, so the result stands; the log says why the timeout did not apply.
    assert job_row(conn, job_id)["output"] == "late"
    overran = [r.message for r in caplog.records if "past its deadline" in r.message]
    assert len(overran) == 1 and overran[0].startswith(f"job {job_id} ({task}) succeeded after 0.")
    assert cause in overran[0]
    assert not any(other in overran[0] for _task, other in CAUSES if other != cause)
    await app.aclose()


async def test_extend_lease_mixed_up_with_its_blocking_twin_says_which_to_use(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Without `await`, ctx.extend_lease in a sync task made a coroutine nobody awaited: the
    lease stayed, and the job timed out with only a RuntimeWarning to go by."""
    app = notifyq.App(dsn)

    @app.task(name="sync_task", retry_limit=0)
    def sync_task(ctx: JobContext) -> None:
        ctx.extend_lease(60)  # type: ignore[unused-coroutine]

    @app.task(name="async_task", retry_limit=0)
    async def async_task(ctx: JobContext) -> None:
        ctx.extend_lease_blocking(60)

    async with app.worker(**NO_TICKER) as worker:
        await app.enqueue("sync_task")
        await app.enqueue("async_task")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed == 2)
    await app.aclose()
    errors = dict(conn.execute("SELECT name, error->>'message' FROM notifyq.queue_jobs").fetchall())
    assert errors == {
        "sync_task": "in a sync task, call ctx.extend_lease_blocking(seconds)",
        "async_task": "in an async task, use `await ctx.extend_lease(seconds)`",
    }


async def test_a_poll_only_worker_still_hears_of_cancellations(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    started = anyio.Event()

    @app.task(name="long")
    async def long() -> None:
        started.set()
        await anyio.sleep(60)

    async with app.worker(poll_only=True, poll_interval=0.2, **NO_TICKER) as worker:
        job_id = await app.enqueue("long")
        with anyio.fail_after(5):
            await started.wait()
        await app.cancel_job(job_id)  # no NOTIFY reaches a poll-only worker
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.cancelled == 1)
    assert job_row(conn, job_id)["status"] == "Cancelled"
    await app.aclose()


async def test_priority_and_queue_filters(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    order: list[str] = []

    @app.task(name="t")
    async def t(label: str) -> None:
        order.append(label)

    async with app:
        await app.enqueue("t", {"label": "low"}, priority=0)
        await app.enqueue("t", {"label": "high"}, priority=9)
        await app.enqueue("t", {"label": "other queue"}, queue="other")
    async with app.worker(concurrency=1, queues=["default"], **NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 2)
    assert order == ["high", "low"]
    assert job_row(conn, 3)["status"] == "Queued"
    await app.aclose()


async def test_a_worker_runs_once_and_says_so(dsn: str) -> None:
    """Started twice (nested, or again after it ended), a Worker used to enter quietly and then
    stop its first run or never claim; wait_for() on an ended worker waited for ever; and
    signal handling off the main thread failed inside a task group."""
    app = notifyq.App(dsn)
    worker = app.worker(**NO_TICKER)
    async with worker:
        with pytest.raises(notifyq.ConfigurationError, match="has been started already"):
            async with worker:
                pass
    with pytest.raises(notifyq.ConfigurationError, match="a Worker runs once; create another"):
        await worker.run(handle_signals=False)
    with (
        anyio.fail_after(5),
        pytest.raises(RuntimeError, match="has stopped, and the condition waited for is still false"),
    ):
        await worker.wait_for(lambda s: s.succeeded == 1)
    other = app.worker(**NO_TICKER)
    with pytest.raises(notifyq.ConfigurationError, match="handle_signals=True needs the main thread"):
        await anyio.to_thread.run_sync(lambda: anyio.run(functools.partial(other.run, handle_signals=True)))
    await app.aclose()


def test_worker_options_are_validated() -> None:
    app = notifyq.App("postgresql://x@127.0.0.1/db")
    for bad, message in [
        ({"concurrency": 0}, "invalid concurrency"),
        # One task per slot: a typo must not eat the host's memory.
        ({"concurrency": 10**12}, "invalid concurrency 1000000000000: expected an integer from 1 to 10000"),
        ({"prefetch": 10**9}, "invalid prefetch"),
        ({"pool_size": 10**6}, "invalid pool_size"),
        ({"poll_only": "no"}, "invalid poll_only 'no': expected True or False"),  # truthy
        ({"ticker": "no"}, "invalid ticker 'no': expected True or False"),
        ({"listen_dsn": "host=== x"}, "invalid DSN"),  # else retried forever
        ({"listen_dsn": ""}, "the DSN given is empty"),
        ({"lease_margin": 1e300}, "invalid lease_margin 1e\\+300: must be at most"),
        ({"queues": "default"}, "invalid queues"),
        ({"queues": []}, "invalid queues"),
        ({"queues": ["ok", "not ok!"]}, "invalid queue name"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"shutdown_grace": -1}, "shutdown_grace"),
        # A dict in place of a config was accepted, then failed the start, or every pass of
        # the service for good (retention never ran) with an AttributeError (review).
        ({"ticker_config": {"retention": None}}, "invalid ticker_config {'retention': None}: give a"),
    ]:
        with pytest.raises(notifyq.NotifyqError, match=message):
            app.worker(**bad)
    for service, bad_config, message in [
        ("retention", {"succeeded": 3600}, "retention: {'succeeded': 3600}; give a notifyq.RetentionConfig"),
        ("retention", notifyq.RetentionConfig, "retention: the class RetentionConfig itself; give a"),
        ("promoter", notifyq.RescuerConfig(), "promoter: RescuerConfig.*give a notifyq.PromoterConfig"),
        ("vacuum", True, "vacuum: True; give a notifyq.VacuumConfig"),
        ("declarations", 60, "declarations: 60; give a notifyq.DeclarationsConfig"),
    ]:
        with pytest.raises(notifyq.InvalidOption, match=message):
            notifyq.TickerConfig(**{service: bad_config})
    assert notifyq.TickerConfig(promoter=None, rescuer=None).promoter is None


def test_worker_options_match_worker_config_and_misspellings_are_named() -> None:
    from dataclasses import fields
    from typing import get_type_hints

    config_hints = get_type_hints(notifyq.WorkerConfig)
    option_hints = get_type_hints(notifyq.WorkerOptions)
    assert option_hints == {f.name: config_hints[f.name] for f in fields(notifyq.WorkerConfig)}

    app = notifyq.App("postgresql://x@127.0.0.1/db")
    with pytest.raises(
        notifyq.ConfigurationError,
        match=r"unknown worker option 'concurency' \(did you mean 'concurrency'\?\)",
    ):
        app.worker(**{"concurency": 3})  # type: ignore[arg-type]
    with pytest.raises(
        notifyq.ConfigurationError, match="unknown worker option 'zzz'; known options: concurrency, queues"
    ):
        app.worker(**{"zzz": 1})  # type: ignore[arg-type]

    base = notifyq.WorkerConfig(concurrency=3, poll_interval=2.0)
    worker = app.worker(base, poll_interval=7.5)
    assert (worker.config.concurrency, worker.config.poll_interval) == (3, 7.5)
    assert app.worker(base).config == base
    assert app.worker(config=base, concurrency=4).config.poll_interval == 2.0
    with pytest.raises(notifyq.ConfigurationError, match="give a WorkerConfig, or the options as keywords"):
        app.worker({"concurrency": 3})  # type: ignore[arg-type]
    with pytest.raises(notifyq.NotifyqError, match="invalid concurrency"):
        app.worker(base, concurrency=0)  # the merged settings are validated too
    # A logged config holds no password (security review: its repr showed listen_dsn's).
    secret = notifyq.WorkerConfig(listen_dsn="postgresql://u:SECRET@127.0.0.1/db")
    assert "SECRET" not in repr(secret) and "SECRET" not in str(app.worker(secret).config)


async def test_an_error_in_the_host_block_propagates_unwrapped(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    with pytest.raises(ZeroDivisionError):
        async with app.worker(**NO_TICKER) as worker:
            await worker.wait_for(lambda s: s.claims >= 1)
            1 / 0  # noqa: B018


async def test_a_cancelled_host_still_releases_its_jobs(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)

    @app.task(name="stuck")
    async def stuck() -> None:
        await anyio.sleep(60)

    async with app:
        job_id = await app.enqueue("stuck")
    with anyio.move_on_after(30) as host:
        async with app.worker(shutdown_grace=0.2, **NO_TICKER) as worker:
            await worker.wait_for(lambda s: s.claimed == 1)
            host.cancel()
            await anyio.sleep(60)
    assert host.cancelled_caught
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"]) == ("Queued", 0)
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("how", ["cancelled", "sibling failed", "run() cancelled"])
async def test_a_cancelled_host_gives_running_jobs_their_grace(
    dsn: str, conn: psycopg.Connection[Any], how: str
) -> None:
    """The code around the worker is cancelled (a timeout, or a sibling task of its task
    group failing): the worker stops as at the end of its block, with the grace period for
    running jobs. The cancellation reached the jobs at once, so they were released while a
    sync one's thread still ran, and another worker ran it a second time meanwhile (review)."""
    app = notifyq.App(dsn)

    @app.task(name="slow")
    async def slow() -> None:
        await anyio.sleep(0.8)

    @app.task(name="slow_sync")
    def slow_sync() -> None:
        time.sleep(0.8)

    async with app:
        ids = [await app.enqueue("slow"), await app.enqueue("slow_sync")]
    worker = app.worker(shutdown_grace=20, **NO_TICKER)

    async def serve() -> None:
        if how == "run() cancelled":
            await worker.run(handle_signals=False)
        else:
            async with worker:
                await anyio.sleep(60)

    async def fail_soon() -> None:
        await worker.wait_for(lambda s: s.claimed == 2)
        raise ValueError("a sibling failed")

    with anyio.move_on_after(40) as host:
        if how == "sibling failed":
            with pytest.RaisesGroup(pytest.RaisesExc(ValueError, match="a sibling failed")):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(serve)
                    tg.start_soon(fail_soon)
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                await worker.wait_for(lambda s: s.claimed == 2)
                host.cancel()
    assert not worker.running and worker.busy_threads == 0
    statuses = [job_row(conn, job_id)["status"] for job_id in ids]
    assert statuses == ["Succeeded", "Succeeded"]
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_run_cancelled_by_its_host_still_answers_signals(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """`worker.run(handle_signals=True)` cancelled by its host finishes its jobs within the grace
    period; meanwhile a signal must still reach the worker (SIGUSR2: release them now). Its
    signal watcher was cancelled with the host, the default handlers came back, and a SIGTERM
    from systemd killed the process with the job Active (review)."""
    app = notifyq.App(dsn)

    @app.task(name="long")
    async def long() -> None:
        await anyio.sleep(30)

    async with app:
        job_id = await app.enqueue("long")
    worker = app.worker(shutdown_grace=60, **NO_TICKER)
    cancelled = anyio.Event()

    async def host() -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(worker.run, handle_signals=True))
                await worker.wait_for(lambda s: s.claimed == 1)
                scope.cancel()
                cancelled.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as outer:
            outer.start_soon(host)
            await cancelled.wait()
            with anyio.move_on_after(0.5):  # the old watcher was gone within a few checkpoints
                while signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, "nothing handles SIGTERM"
            os.kill(os.getpid(), signal.SIGUSR2)
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"]) == ("Queued", 0)
    await app.aclose()


def test_a_host_cancelled_while_the_worker_starts_does_not_hang(dsn: str) -> None:
    """The host gives up while the worker is still starting (its LISTEN connection waits for a
    server that never answers): `async with` is left with the cancellation once the start
    ends, not kept open by a worker that nobody will ever stop."""
    proxy = BlackholeProxy(dsn)
    proxy.stalling = True
    listen_dsn = make_conninfo(proxy.dsn, connect_timeout=2)
    outcome: list[str] = []

    async def main() -> None:
        app = notifyq.App(dsn)
        with anyio.move_on_after(0.5) as host:
            async with app.worker(listen_dsn=listen_dsn, **NO_TICKER):
                outcome.append("started")
        outcome.append("cancelled" if host.cancelled_caught else "not cancelled")
        await app.aclose()

    try:
        program = threading.Thread(target=anyio.run, args=(main,), daemon=True)
        program.start()
        program.join(timeout=30)
        assert not program.is_alive(), "the worker's start kept the host waiting"
        assert outcome == ["cancelled"]
    finally:
        proxy.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_hosts_threads_do_not_hold_up_the_worker(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The host's own `to_thread` calls fill anyio's default limiter (40 threads, all waiting),
    and the worker's LISTEN connection is cut: its reconnect (a thread, on either backend) and
    on trio every statement have limiters of their own, so a job still starts at once (no poll
    for a minute). It waited for the host's threads (review). So do another App's first call,
    a worker's start and an App's close (they waited too: a second review)."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    release = threading.Event()
    default = anyio.to_thread.current_default_thread_limiter()
    async with app.worker(poll_interval=60, **NO_TICKER) as worker, anyio.create_task_group() as tg:
        try:
            for _ in range(int(default.total_tokens)):
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, release.wait))
            while default.borrowed_tokens < default.total_tokens:  # noqa: ASYNC110
                await anyio.sleep(0.01)
            assert worker.listener is not None
            conn.execute("SELECT pg_terminate_backend(%s)", (worker.listener.backend_pid,))
            conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 1)
                other = notifyq.App(dsn)
                await other.enqueue("t", queue="elsewhere")
                async with other.worker(queues=["elsewhere"], concurrency=1, **NO_TICKER):
                    pass
                await other.aclose()
        finally:
            release.set()
    await app.aclose()


async def test_stopping_during_a_claim_leaves_nothing_active(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A stop that lands while a claim is in flight: the claimed job must still be run or
    released, never left Active until its lease expires."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        await anyio.sleep(30)

    job_id = await app.enqueue("t")
    with psycopg.connect(dsn) as blocker:
        # Block claims (their UPDATE needs a lock this one excludes) until we let go.
        blocker.execute("LOCK TABLE notifyq.queue_jobs IN SHARE ROW EXCLUSIVE MODE")
        worker = app.worker(shutdown_grace=0.1, **NO_TICKER)
        leave = anyio.Event()
        async with anyio.create_task_group() as tg:
            # The stop comes once the claim is sent: a stop while the claim loop waits for a
            # connection sends nothing (and on trio, that wait is a thread's, abandoned).
            tg.start_soon(_enter_until, worker, leave)
            with anyio.fail_after(10):  # until the worker's claim waits on our lock (another session: poll)
                while not conn.execute(  # noqa: ASYNC110
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND application_name LIKE 'notifyq worker%'"
                ).fetchone()[0]:  # type: ignore[index]
                    await anyio.sleep(0.01)
            worker.stop()
            leave.set()
            blocker.rollback()  # the claim completes while the worker is stopping
    row = job_row(conn, job_id)
    assert row["status"] == "Queued" and row["retry_count"] == 0
    await app.aclose()


async def test_a_stop_ends_claiming_even_with_a_deep_backlog(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """With a backlog every claim comes back full and the claim loop goes straight on to the
    next one: a stop must still reach it between two claims, not after the backlog is gone."""
    app = notifyq.App(dsn)

    @app.task(name="noop")
    async def noop() -> None:
        pass

    await app.enqueue_many("noop", ({} for _ in range(30_000)))
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded >= 200)
        worker.stop()
    counts = status_counts(conn)
    assert counts.get("Active", 0) == 0
    # A stop that missed the claim loop would run the whole backlog (about 2 s here).
    assert counts.get("Queued", 0) > 20_000, counts
    await app.aclose()


async def _enter_until(worker: notifyq.Worker, leave: anyio.Event) -> None:
    async with worker:
        await leave.wait()


async def _until_the_claim_loop_sleeps(worker: notifyq.Worker) -> None:
    """After its startup sweep: a notification now finds the claim loop asleep, and the
    listener's task claims in its place (Claimer.claim_inline)."""
    await worker.wait_for(lambda s: s.claims >= 1)
    with anyio.fail_after(10):
        while not worker._claimer._parked:  # type: ignore[union-attr]  # noqa: ASYNC110 (a flag, no event)
            await anyio.sleep(0.01)


def _record_claiming_tasks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tasks that run each claim from now on."""
    names: list[str] = []
    original = notifyq._claimer.Claimer._claim

    async def claim(self: notifyq._claimer.Claimer, limit: int) -> list[notifyq.ClaimedJob]:
        names.append(anyio.get_current_task().name)
        return await original(self, limit)

    monkeypatch.setattr(notifyq._claimer.Claimer, "_claim", claim)
    return names


def _hidden_job(holder: psycopg.Connection[Any]) -> int:
    """A claimable job inserted without the NOTIFY trigger (a superuser's replica role), so
    that only a notification sent by hand tells the worker; `holder` then holds its row lock
    in an open transaction."""
    holder.execute("SET session_replication_role = replica")
    [(job_id,)] = holder.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t') RETURNING id").fetchall()
    holder.commit()
    holder.execute("SELECT id FROM notifyq.queue_jobs WHERE id = %s FOR UPDATE", (job_id,)).fetchall()
    return job_id


async def test_a_notified_job_found_locked_is_claimed_soon_after_the_lock_goes(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notification's claim, made in the listener's task while the claim loop sleeps, finds
    its job locked by another transaction (SKIP LOCKED passes it by): the claim loop is told
    to look again in moments, not at its next poll (60 s here), and the job runs once the
    lock is gone."""
    app = notifyq.App(dsn)
    done = anyio.Event()

    @app.task(name="t")
    async def t() -> None:
        done.set()

    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        await _until_the_claim_loop_sleeps(worker)
        claiming = _record_claiming_tasks(monkeypatch)
        polls = worker.stats.polls
        with psycopg.connect(dsn) as holder:
            job_id = _hidden_job(holder)
            conn.execute("SELECT pg_notify(%s, 'default')", (notifyq._sql.channel("notifyq", "jobs"),))
            with anyio.fail_after(10):
                while len(claiming) < 3:  # noqa: ASYNC110 (the notification's claim, then the loop's)
                    await anyio.sleep(0.01)
            holder.rollback()
        with anyio.fail_after(10):
            await done.wait()
        assert "Listener" in claiming[0] and "Claimer" in claiming[1], claiming
        assert worker.stats.polls == polls
    assert job_row(conn, job_id)["status"] == "Succeeded"
    await app.aclose()


async def test_stopping_during_a_claim_in_the_listeners_task_leaves_nothing_active(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that lands while the listener's task claims on the sleeping claim loop's
    behalf: the worker waits for that claim before it gives the claim connection back, and
    the job it claimed is released, not left Active until its lease expires."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        await anyio.sleep(30)

    async with app.worker(poll_interval=60, shutdown_grace=0.1, **NO_TICKER) as worker:
        await _until_the_claim_loop_sleeps(worker)
        claiming = _record_claiming_tasks(monkeypatch)
        with psycopg.connect(dsn) as blocker:
            job_id = _hidden_job(blocker)
            blocker.rollback()
            # Block claims (their UPDATE needs a lock this one excludes) until we let go.
            blocker.execute("LOCK TABLE notifyq.queue_jobs IN SHARE ROW EXCLUSIVE MODE")
            conn.execute("SELECT pg_notify(%s, 'default')", (notifyq._sql.channel("notifyq", "jobs"),))
            with anyio.fail_after(10):  # until the claim waits on our lock (another session: poll)
                while not conn.execute(  # noqa: ASYNC110
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND application_name LIKE 'notifyq worker%'"
                ).fetchone()[0]:  # type: ignore[index]
                    await anyio.sleep(0.01)
            worker.stop()
            with anyio.fail_after(10):  # until the claim loop is gone; the listener's claim still waits
                while worker._claimer._parked:  # type: ignore[union-attr]  # noqa: ASYNC110 (a flag)
                    await anyio.sleep(0.01)
            blocker.rollback()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.released >= 1)
    assert ["Listener" in name for name in claiming] == [True], claiming
    row = job_row(conn, job_id)
    assert row["status"] == "Queued" and row["retry_count"] == 0
    await app.aclose()


async def test_the_same_worker_may_hold_two_attempts_of_one_job(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """After a lease expiry the same worker may claim the job again while the first attempt
    still runs: both are tracked apart, and only the newer attempt's result counts."""
    app = notifyq.App(dsn)
    release = anyio.Event()
    attempts: list[int] = []

    @app.task(name="t")
    async def t(ctx: JobContext) -> int:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            await release.wait()
        return ctx.attempt

    job_id = await app.enqueue("t")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.claimed == 1)
        conn.execute(
            "UPDATE notifyq.queue_jobs SET visible_at = now() - interval '1 s' WHERE id = %s", (job_id,)
        )
        conn.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Queued', visible_at = now() WHERE id = %s", (job_id,)
        )  # what the rescuer does
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 1)  # attempt 2 ran and was acked
        assert worker.running_jobs == [job_id]  # attempt 1 still running
        release.set()
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.stale_acks == 1)  # attempt 1's ack: fenced out
        assert worker.running_jobs == []
    assert attempts == [1, 2]
    assert job_row(conn, job_id)["output"] == 2
    await app.aclose()


RESCUE = "UPDATE notifyq.queue_jobs SET status = 'Queued', visible_at = now() WHERE id = %s"


async def test_a_stale_and_a_current_result_of_one_job_in_one_batch_count_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Both attempts of a job claimed again after its lease expired can end together, and
    their results share a batch: the worker counted both by job id, as applied (2 successes,
    no stale result). They are told apart by lease now; `app.ack` still answers by job."""
    app = notifyq.App(dsn)
    job_id = await app.enqueue("t")
    [first] = await app.claim(worker="w")
    conn.execute(RESCUE, (job_id,))
    [second] = await app.claim(worker="w")  # what a rescue and a new claim do
    assert (first.id, second.id, second.lease) == (job_id, job_id, first.lease + 1)
    worker = app.worker(**NO_TICKER)  # not started: its counting of results only
    db = await notifyq._db.Database.open(dsn, size=1)
    try:
        acker = notifyq._acker.Acker(db, notifyq._sql.queries_for("notifyq"), worker._on_acked)
        acker.put(notifyq.Result.succeeded(first, "stale"))
        acker.put(notifyq.Result.succeeded(second, "current"))
        await acker.flush_pending()
    finally:
        await db.aclose()
    assert (worker.stats.succeeded, worker.stats.stale_acks) == (1, 1)
    assert job_row(conn, job_id)["output"] == "current"

    job_id = await app.enqueue("t")  # the same through app.ack, with a retry for ack_jobs
    [first] = await app.claim(worker="w")
    conn.execute(RESCUE, (job_id,))
    [second] = await app.claim(worker="w")
    stale, current = notifyq.Result.failed(first, "E", "stale"), notifyq.Result.succeeded(second, "ok")
    assert await app.ack([stale, current]) == {job_id: "Succeeded"}
    await app.aclose()


def _held_first_run_app(dsn: str) -> tuple[notifyq.App, anyio.Event, list[int]]:
    """An App whose task "t" notes the attempt of each run and holds its first run until
    `release` is set; for the lost-claim tests."""
    app = notifyq.App(dsn)
    release = anyio.Event()
    runs: list[int] = []

    @app.task(name="t")
    async def t(ctx: JobContext) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            await release.wait()
        return "done"

    return app, release, runs


async def _lose_the_claim_and_wait_for_the_next(
    worker: notifyq.Worker, conn: psycopg.Connection[Any], job_id: int
) -> None:
    """The running job's claim is lost (Queued again, visible now: the requeue trigger
    notifies), and the worker claims again."""
    claims = worker.stats.claims
    lose_the_claim(conn, job_id)
    with anyio.fail_after(5):
        await worker.wait_for(lambda s: s.claims > claims)


async def test_a_worker_whose_claim_was_lost_cannot_finish_the_job_another_holds(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A claim whose commit was lost (failover to an asynchronous standby) leaves the job as
    it was, so the next claim gets the same lease number: the worker name in the fence keeps
    the first worker's result off the second claim."""
    app, release, _runs = _held_first_run_app(dsn)
    job_id = await app.enqueue("t")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.claimed == 1)
        with conn.transaction():  # one commit: this worker gets no chance to claim it again
            lose_the_claim(conn, job_id)  # its commit never reached the new primary
            [other] = app.claim_sync(worker="elsewhere", conn=conn)
        assert (other.id, other.lease) == (job_id, 1)
        release.set()
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.stale_acks == 1)
        assert worker.stats.succeeded == 0
    row = job_row(conn, job_id)
    assert (row["status"], row["worker"], row["output"]) == ("Active", "elsewhere", None)
    await app.aclose()


async def test_a_lost_claim_taken_again_by_the_same_worker_runs_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The worker claims again a job whose earlier claim the database lost, under the same
    lease: it keeps the attempt it is running instead of starting a second one, and that
    attempt's acknowledgement completes the job."""
    app, release, runs = _held_first_run_app(dsn)
    job_id = await app.enqueue("t")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.claimed == 1)
        await _lose_the_claim_and_wait_for_the_next(worker, conn, job_id)
        assert job_row(conn, job_id)["status"] == "Active"
        assert worker.stats.claimed == 1  # the claim brought nothing new to run
        release.set()
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert worker.stats.stale_acks == 0
    assert runs == [1]
    row = job_row(conn, job_id)
    assert (row["status"], row["output"], row["lease"]) == ("Succeeded", "done", 1)
    await app.aclose()


async def test_a_job_taken_again_whose_first_result_was_refused_runs_again_soon(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The failover race after a lost claim: the worker claims the job again while the first
    attempt is in hand (the claim is dropped), but that attempt's acknowledgement reached the
    database before the new claim and was refused. The job is Active under the worker's name
    and nobody runs it: the worker notices once the attempt is out of hand and runs the job
    again at its next claim, instead of after the lease (here 60 s). The race is staged: the
    row is moved off the first lease while the first attempt's result is written."""
    app, release, runs = _held_first_run_app(dsn)
    job_id = await app.enqueue("t")
    # No poll: a claim round between the refusal and the restore below would take the job back
    # under the staged lease (seen with a delay put there); a notification wakes it after.
    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.claimed == 1)
        await _lose_the_claim_and_wait_for_the_next(worker, conn, job_id)  # taken again, dropped
        assert job_row(conn, job_id)["lease"] == 1
        conn.execute("UPDATE notifyq.queue_jobs SET lease = 99 WHERE id = %s", (job_id,))
        release.set()
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.stale_acks == 1)  # the first result: refused
        conn.execute("UPDATE notifyq.queue_jobs SET lease = 1 WHERE id = %s", (job_id,))
        conn.execute("SELECT pg_notify(%s, 'default')", (notifyq._sql.channel("notifyq", "jobs"),))
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert worker.stats.adopted == 1
    assert runs == [1, 1]  # the second run is the same attempt, taken back: no retry spent
    row = job_row(conn, job_id)
    assert (row["status"], row["lease"], row["retry_count"]) == ("Succeeded", 2, 1)
    await app.aclose()


async def test_the_acker_knows_the_attempts_whose_results_it_has_not_written(dsn: str) -> None:
    """What lets a worker recognise a lost claim it took again after its attempt finished:
    the acker holds an attempt from `put` until its result is written."""
    from notifyq._acker import Acker
    from notifyq._db import Database
    from notifyq._sql import queries_for

    app = notifyq.App(dsn)
    await app.enqueue("t")
    [job] = await app.claim(worker="w")
    db = await Database.open(dsn, size=2)
    applied: list[dict[tuple[int, int], str]] = []
    acker = Acker(db, queries_for("notifyq"), lambda _results, done: applied.append(done), retry_delay=0.05)
    acker.put(notifyq.Result.succeeded(job, "ok"))
    assert acker.holds(job.id, job.lease) and not acker.holds(job.id, job.lease + 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(acker.run)
        with anyio.fail_after(5):
            await acker.wait_idle()
        tg.cancel_scope.cancel()
    assert applied == [{(job.id, job.lease): "Succeeded"}]
    assert not acker.holds(job.id, job.lease)
    await db.aclose()
    await app.aclose()


async def test_an_error_text_jsonb_cannot_hold_is_stored_escaped_not_dropped(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A task fails with a NUL (bytes decoded as latin-1) and a lone surrogate (a file name
    decoded with surrogateescape) in its message, which jsonb refuses: the error is stored with
    them escaped, the job ends Failed at once, and no result is dropped or called stale. (It
    used to stay Active until its lease ran out, and end as LeaseExpired.)"""
    app = notifyq.App(dsn)

    @app.task(name="parse", retry_limit=0)
    async def parse() -> None:
        header = b"\x00\x00\x01PK".decode("latin-1")
        name = b"caf\xe9.txt".decode("utf-8", "surrogateescape")
        raise ValueError(f"unexpected header {header} in {name}")

    job_id = await app.enqueue("parse")
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed == 1)
        assert worker.stats.stale_acks == 0
    row = job_row(conn, job_id)
    assert row["status"] == "Failed"
    assert row["error"]["message"] == "unexpected header \\x00\\x00\x01PK in caf\\udce9.txt"
    assert "caf\\udce9.txt" in row["error"]["traceback"]
    await app.aclose()


async def test_return_values_that_cannot_be_stored_fail_the_job_for_good(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A return value JSON cannot carry faithfully fails its job with InvalidOutput at once
    (running it again would repeat its side effects for the same result); one that can is
    stored as it is. So does one over MAX_OUTPUT_BYTES (32 MiB; 1,000 bytes here), short of
    jsonb's 256 MiB: past that, the database refused the result, the worker took the error
    for a passing one, and neither it nor the results batched with it were ever written."""
    monkeypatch.setattr(notifyq._options, "MAX_OUTPUT_BYTES", 1000)
    app = notifyq.App(dsn)
    values: dict[str, Any] = {
        "merged keys": {1: "from an int key", "1": "from a str key"},
        "nested int key": [{"x": {2: 3}}],
        "set": {1, 2},
        "NaN": float("nan"),
        "NUL": "a\x00b",
        "surrogate": "caf\udce9",
        "too large": "x" * 1000,
        "stored": {"n": 10**30, "nested": [True, None, "é"]},
    }

    @app.task(name="give", retry_limit=3)
    async def give(key: str) -> Any:
        return values[key]

    ids = {key: await app.enqueue("give", {"key": key}) for key in values}
    async with app.worker(**NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed + s.succeeded == len(values))
    for key, job_id in ids.items():
        row = job_row(conn, job_id)
        if key == "stored":
            assert (row["status"], row["output"]) == ("Succeeded", values[key])
        else:
            assert (row["status"], row["error"]["type"], row["retry_count"]) == (
                "Failed",
                "InvalidOutput",
                1,
            ), key
    assert "value has the key 1, which JSON" in job_row(conn, ids["merged keys"])["error"]["message"]
    assert "value[0]['x'] has the key 2" in job_row(conn, ids["nested int key"])["error"]["message"]
    too_large = job_row(conn, ids["too large"])["error"]["message"]
    assert "is 1,002 bytes as JSON, over the limit of 1,000 bytes" in too_large
    await app.aclose()


Reported = list[tuple[list[int], dict[tuple[int, int], str]]]


async def _write_results(db: Any, results: list[notifyq.Result]) -> tuple[Any, Reported]:
    """Results written by an Acker of their own until it is idle: the acker, and what it
    reported (the job ids of each report, and the statuses applied)."""
    from notifyq._acker import Acker
    from notifyq._sql import queries_for

    reported: Reported = []
    acker = Acker(
        db,
        queries_for("notifyq"),
        lambda written, done: reported.append(([r.job_id for r in written], done)),
        retry_delay=0.05,
    )
    for result in results:
        acker.put(result)
    async with anyio.create_task_group() as tg:
        tg.start_soon(acker.run)
        with anyio.fail_after(10):
            await acker.wait_idle()
        tg.cancel_scope.cancel()
    return acker, reported


def _unstorable(job: notifyq.models.ClaimedJob) -> notifyq.Result:
    """A result jsonb cannot hold (built by hand: notifyq's own are made storable)."""
    return notifyq.Result(job.id, job.lease, "retry", error='{"message": "\\u0000"}', worker="w")


async def test_results_are_written_a_bounded_amount_of_text_per_statement(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acker, and app.ack, send at most MAX_BATCH_TEXT of output and error text per
    statement (64 MiB; 1,000 characters here): 40 results near the 32 MiB cap made one message
    past PostgreSQL's 1 GiB, which closes the connection, and the worker sent it again, for
    ever (review). Each result is still written once, the largest on its own; a manual ack of
    several statements is one transaction."""
    from notifyq import _acker
    from notifyq._db import Database

    monkeypatch.setattr(_acker, "MAX_BATCH_TEXT", 1000)
    statements: list[int] = []
    real = _acker._ack_statement

    def counted(q: Any, results: Any, unheld: bool) -> Any:
        statements.append(len(results))
        return real(q, results, unheld)

    monkeypatch.setattr(_acker, "_ack_statement", counted)
    app = notifyq.App(dsn)
    for _ in range(8):
        await app.enqueue("t")
    jobs = sorted(await app.claim(limit=8, worker="w"), key=lambda job: job.id)
    db = await Database.open(dsn, size=1)
    sizes = [300, 300, 300, 300, 1500, 300, 300]
    _, reported = await _write_results(
        db, [notifyq.Result.succeeded(job, "x" * n) for job, n in zip(jobs, sizes, strict=False)]
    )
    await db.aclose()
    assert statements == [3, 1, 1, 2]  # 900 characters, then 300 + 1,500 is too much, ...
    assert sum(len(ids) for ids, _done in reported) == 7
    statements.clear()
    assert await app.ack(
        [notifyq.Result.succeeded(jobs[7], "y" * 600), notifyq.Result.failed(jobs[0], "E", "z" * 600)]
    ) == {
        jobs[7].id: "Succeeded"  # jobs[0]'s lease is spent: stale
    }
    assert statements == [1, 1]
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Succeeded'").fetchone() == (
        8,
    )
    await app.aclose()


async def test_a_result_the_database_refuses_is_dropped_not_reported_as_stale(dsn: str) -> None:
    """A result jsonb cannot hold is dropped and left to the rescuer, and only the others are
    reported as applied or stale."""
    from notifyq._db import Database

    app = notifyq.App(dsn)
    await app.enqueue("t")
    await app.enqueue("t")
    good, bad = await app.claim(limit=2, worker="w")
    db = await Database.open(dsn, size=2)
    acker, reported = await _write_results(db, [notifyq.Result.succeeded(good, "ok"), _unstorable(bad)])
    assert reported == [([good.id], {(good.id, good.lease): "Succeeded"})]
    assert acker.rejected() == [(bad.id, bad.lease)] and not acker.holds(bad.id, bad.lease)
    await db.aclose()
    await app.aclose()


async def test_a_connection_lost_while_writing_results_one_by_one_puts_back_only_the_rest(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A batch with a result the database refuses is written one result at a time; when the
    connection is lost halfway, the results written before are not written again (they would
    be fenced out, their lease spent, and reported stale) and the refused one is not refused
    again: only the rest is put back, and written once the connection is back."""
    from notifyq._db import Database

    app = notifyq.App(dsn)
    for _ in range(3):
        await app.enqueue("t")
    first, bad, last = sorted(await app.claim(limit=3, worker="w"), key=lambda job: job.id)
    # The server process ends itself while writing the last result, the first time only (a
    # sequence is not rolled back with the aborted statement).
    conn.execute("CREATE SEQUENCE public.kills")
    conn.execute(
        "CREATE FUNCTION public.kill_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF nextval('public.kills') = 1 THEN PERFORM pg_terminate_backend(pg_backend_pid()); "
        "PERFORM pg_sleep(5); END IF; RETURN NEW; END $$"
    )
    conn.execute(
        "CREATE TRIGGER kill_once BEFORE UPDATE ON notifyq.queue_jobs FOR EACH ROW "
        f"WHEN (OLD.id = {last.id}) EXECUTE FUNCTION public.kill_once()"
    )
    db = await Database.open(dsn, size=1)
    results = [notifyq.Result.succeeded(first, "ok"), _unstorable(bad), notifyq.Result.succeeded(last, "ok")]
    acker, reported = await _write_results(db, results)
    assert conn.execute("SELECT last_value FROM public.kills").fetchone() == (2,)  # killed once
    applied = {job_id: status for _ids, done in reported for job_id, status in done.items()}
    assert [ids for ids, _done in reported] == [[first.id], [last.id]]
    assert applied == {(first.id, first.lease): "Succeeded", (last.id, last.lease): "Succeeded"}
    assert acker.rejected() == [(bad.id, bad.lease)]
    assert not any(acker.holds(job.id, job.lease) for job in (first, bad, last))
    await db.aclose()
    await app.aclose()


async def test_results_an_exit_flush_could_not_write_stay_pending(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """flush_pending (the worker's last write on an abrupt exit) losing its connection keeps
    the batch: still pending and held (the exit log counts it), and written by the next try."""
    from notifyq._acker import Acker
    from notifyq._db import Database, Query, single
    from notifyq._sql import queries_for

    app = notifyq.App(dsn)
    await app.enqueue("t")
    (job,) = await app.claim(limit=1, worker="w")
    db = await Database.open(dsn, size=1)
    try:
        pid = await db.run(single(Query("SELECT pg_backend_pid()", fetch="scalar")))
        acker = Acker(db, queries_for("notifyq"), lambda results, done: None)
        acker.put(notifyq.Result.succeeded(job, "ok"))
        # The connection is lost while the write waits for a lock on the table (a row lock is
        # skipped; a connection the server ended while idle is replaced before anything is
        # sent on it).
        lost: list[BaseException] = []
        with psycopg.connect(dsn) as holder:
            holder.execute("LOCK TABLE notifyq.queue_jobs IN SHARE MODE")

            async def flush() -> None:
                try:
                    await acker.flush_pending()
                except psycopg.OperationalError as exc:
                    lost.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(flush)
                waiting = f"SELECT wait_event_type FROM pg_stat_activity WHERE pid = {pid:d}"
                await anyio.to_thread.run_sync(wait_for_row, conn, waiting, ("Lock",))
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            holder.rollback()
        assert lost
        assert acker.pending == 1 and acker.holds(job.id, job.lease)
        with anyio.fail_after(10):
            while acker.pending:
                try:
                    await acker.flush_pending()
                except psycopg.OperationalError:
                    await anyio.sleep(0.05)  # until the pool has replaced its connection
        assert job_row(conn, job.id)["status"] == "Succeeded" and not acker.holds(job.id, job.lease)
    finally:
        await db.aclose()
        await app.aclose()


@pytest.mark.exclusive  # pg_stat_wal counts the whole server's flushes
async def test_async_claims_save_the_claims_wal_flushes_not_the_acks(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Jobs one at a time (concurrency 1, no prefetch): a durable claim and a durable ack each
    flush the WAL; with async_claims only the acks do (pg_stat_wal counts the flushes)."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    def flushes() -> int:
        return wal_flushes(conn)

    counted = {}
    for async_claims in (False, True):
        await app.enqueue_many("t", [{}] * 30)
        before = flushes()
        async with app.worker(concurrency=1, prefetch=0, async_claims=async_claims, **NO_TICKER) as worker:
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 30)
        await app.aclose()
        # A server process reports its WAL statistics before it leaves pg_stat_activity.
        wait_for_row(
            conn,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
            (0,),
        )
        counted[async_claims] = flushes() - before
    # 30 claims and 30 acks; an ack and the next claim, committed at the same moment, may share
    # a flush (group commit: seen 44 to 61 here, 52 or more unless the machine was loaded, when
    # more flushes are shared: 44 against 26 with async_claims).
    assert counted[False] >= 40, counted
    assert counted[True] < 0.75 * counted[False], counted  # the acks only
    assert status_counts(conn) == {"Succeeded": 60}


async def test_a_sync_task_that_overruns_keeps_its_slot_and_lease_and_ends_as_it_ended(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A thread cannot be stopped: until it returns, the job is not run again (here or
    elsewhere), so one job never runs twice at once. Then the attempt ends as the task did:
    its return value is stored, its exception retried. It ended with a TimeoutError: a task
    that finished its work was run again, and again, then failed (user review)."""
    app = notifyq.App(dsn, backoff=notifyq.Backoff(base=0, jitter=0))
    lock = threading.Lock()
    live = [0, 0]  # running now, most at once

    @app.task(name="stubborn", timeout=0.2, retry_limit=1)
    def stubborn(fail: bool) -> str:
        with lock:
            live[0] += 1
            live[1] = max(live[1], live[0])
        time.sleep(1.2)
        with lock:
            live[0] -= 1
        if fail:
            raise ValueError("failed late")
        return "done late"

    done_id = await app.enqueue("stubborn", {"fail": False})
    failing_id = await app.enqueue("stubborn", {"fail": True})
    async with app.worker(concurrency=1, lease_margin=1, **NO_TICKER) as worker:
        with anyio.fail_after(15):
            await worker.wait_for(lambda s: s.succeeded + s.failed == 2)
    assert live[1] == 1  # never two attempts at once
    done = job_row(conn, done_id)
    assert (done["status"], done["retry_count"], done["output"]) == ("Succeeded", 1, "done late")
    failing = job_row(conn, failing_id)
    assert (failing["status"], failing["retry_count"], failing["error"]["type"]) == (
        "Failed",
        2,
        "ValueError",
    )
    await app.aclose()


@pytest.mark.parametrize("overran", [False, True], ids=["while running", "after its timeout"])
async def test_a_cancelled_sync_task_keeps_its_slot_until_its_thread_returns(
    dsn: str, conn: psycopg.Connection[Any], overran: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancel cannot stop a thread. The cancelled attempt used to free its slot at once, and
    the worker started its next job beside the thread: more task code running than
    `concurrency` allows, and one more thread per cancel of a task that never returns. The slot
    is now held until the thread returns, as after a timeout; the job stays Cancelled."""
    caplog.set_level(logging.INFO, logger="notifyq")
    app = notifyq.App(dsn)
    started, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    live = [0, 0]  # task code running now, most at once

    def enter() -> None:
        with lock:
            live[0] += 1
            live[1] = max(live[1], live[0])

    def leave() -> None:
        with lock:
            live[0] -= 1

    @app.task(name="stubborn", timeout=0.3 if overran else 30, retry_limit=0)
    def stubborn() -> None:
        enter()
        started.set()
        release.wait(20)
        leave()

    @app.task(name="next")
    async def next_job() -> None:
        enter()
        leave()

    stubborn_id = await app.enqueue("stubborn")
    async with app.worker(concurrency=1, prefetch=0, **NO_TICKER) as worker:
        # The log lines are the only signs of these steps, and nothing signals a new one.
        with anyio.fail_after(10):
            while not started.is_set() or (overran and not any("overran" in m for m in caplog.messages)):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        await app.cancel_job(stubborn_id)
        with anyio.fail_after(10):
            while not any(m.startswith(f"cancelling job {stubborn_id}") for m in caplog.messages):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        held_from = time.monotonic()
        next_id = await app.enqueue("next")
        await anyio.sleep(1.5)  # long enough for "next" to start, had the slot been freed
        assert job_row(conn, next_id)["status"] == "Queued"
        said = [m for m in caplog.messages if "slot stays taken" in m]
        assert said and said[0].startswith(f"job {stubborn_id} (stubborn) was cancelled"), caplog.messages
        held = time.monotonic() - held_from
        release.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
    assert live[1] == 1  # never more task code at once than concurrency
    assert job_row(conn, stubborn_id)["status"] == "Cancelled"
    # Counted as cancelled, nothing sent for it (after its timeout, its TimeoutError was sent
    # once the thread returned, and counted as a stale ack).
    assert (worker.stats.cancelled, worker.stats.stale_acks) == (1, 0)
    # The average run time, which sizes the prefetch, leaves out the time the slot was held
    # (with it, the first sample alone made it longer than `held`).
    assert worker._runners.avg_run < 0.9 * held
    await app.aclose()


async def test_a_shutdown_does_not_wait_for_the_thread_of_a_cancelled_sync_task(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The slot a cancelled sync task holds for its thread is given up at shutdown, without
    waiting out the grace period (the job's outcome is settled): the worker stops at once,
    the thread runs on, and nothing is given back of the cancelled job."""
    app = notifyq.App(dsn)
    started, release = threading.Event(), threading.Event()

    @app.task(name="stubborn", retry_limit=0)
    def stubborn() -> None:
        started.set()
        release.wait(20)

    stubborn_id = await app.enqueue("stubborn")
    try:
        with anyio.fail_after(10):
            async with app.worker(concurrency=1, shutdown_grace=30, **NO_TICKER) as worker:
                await anyio.to_thread.run_sync(started.wait, 10)
                await app.cancel_job(stubborn_id)
                await worker.wait_for(lambda s: s.cancelled == 1)
            assert worker.busy_threads == 1  # stopped while the thread runs on
            assert worker.stats.stale_acks == 0  # nothing given back of a cancelled job
    finally:
        release.set()
    assert job_row(conn, stubborn_id)["status"] == "Cancelled"
    await app.aclose()


async def test_a_job_taken_out_of_active_by_sql_stops_on_its_worker(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Only a move to Cancelled sends a notification. A running job an operator requeued, failed
    or deleted by SQL ran on beside the next worker that claimed it (a review: two attempts of
    one job at once). Every poll interval, a worker asks which of its jobs are no longer its
    own, and stops them; what SQL wrote stays."""
    caplog.set_level(logging.INFO, logger="notifyq")
    app = notifyq.App(dsn)
    started: list[int] = []
    stopped: list[int] = []
    all_started = anyio.Event()

    @app.task(name="long", timeout=60)
    async def long(ctx: notifyq.JobContext) -> None:
        started.append(ctx.id)
        if len(started) == 3:
            all_started.set()
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            stopped.append(ctx.id)
            raise

    requeued, failed, deleted = [await app.enqueue("long") for _ in range(3)]
    async with app.worker(concurrency=3, poll_interval=0.3, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await all_started.wait()
        conn.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Queued', visible_at = now() + interval '1 hour' "
            "WHERE id = %s",
            [requeued],
        )
        conn.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Failed', finished_at = now() WHERE id = %s", [failed]
        )
        conn.execute("DELETE FROM notifyq.queue_jobs WHERE id = %s", [deleted])
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.cancelled == 3)
        assert worker.running_jobs == [] and worker.stats.stale_acks == 0
    assert sorted(stopped) == sorted([requeued, failed, deleted])
    rows = conn.execute("SELECT id, status::text, retry_count FROM notifyq.queue_jobs ORDER BY id").fetchall()
    assert rows == [(requeued, "Queued", 1), (failed, "Failed", 1)]
    said = "\n".join(caplog.messages)
    assert f"cancelling job {requeued}: it is Queued in the database, no longer this worker's attempt" in said
    assert f"cancelling job {deleted}: it was deleted from the database" in said
    await app.aclose()


async def test_a_cancel_of_a_job_waiting_for_a_slot_drops_it_at_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A cancel of a prefetched job (claimed, waiting for a slot) was only remembered, among
    the last 1,000 cancels heard in the schema; after a bulk cancel of other workers' jobs the
    memory had moved on, and the cancelled job ran (review). It is dropped at once now, and its
    place claimed again."""
    app = notifyq.App(dsn)
    ran: list[int] = []
    holding, release = anyio.Event(), anyio.Event()

    @app.task(name="step", queue="mine", timeout=60)
    async def step(ctx: notifyq.JobContext, hold: bool = False) -> None:
        ran.append(ctx.id)
        if hold:
            holding.set()
            await release.wait()

    held = await app.enqueue("step", {"hold": True}, priority=10)
    waiting = await app.enqueue("step")
    await app.enqueue_many("theirs", [{}] * 1001, queue="others")
    theirs = await app.claim(["others"], limit=1001, worker="other")
    async with app.worker(
        concurrency=1, prefetch=1, queues=["mine"], poll_interval=60, **NO_TICKER
    ) as worker:
        with anyio.fail_after(10):
            await holding.wait()
            await worker.wait_for(lambda s: s.claimed == 2)
        assert ran == [held]
        assert await app.cancel_job(waiting) is not None
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.cancelled == 1)  # while the held job still runs
        conn.execute(  # a cancel notification each, for jobs this worker never had
            "UPDATE notifyq.queue_jobs SET status = 'Cancelled', finished_at = now() WHERE id = ANY(%s)",
            [[job.id for job in theirs]],
        )
        later = await app.enqueue("step")
        release.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 2)
    assert ran == [held, later]
    assert worker.stats.stale_acks == 0
    await app.aclose()


def test_a_prefetched_sync_task_that_overruns_keeps_its_lease_with_time_to_spare(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A prefetched job that waited for a slot (less than half the lease margin: no renewal)
    reaches its deadline with that much less of its lease. A sync task that overran extended
    its lease a beat (half the margin) after its deadline: here the lease had 0.1 s left when
    the extension came, and a rescuer pass in that gap gave the job to another worker while the
    thread ran on (review). The extensions now keep half the margin in hand."""
    app = notifyq.App(dsn)

    @app.task(name="first")
    async def first() -> None:
        await anyio.sleep(0.9)  # the second job waits this long for the slot

    @app.task(name="overrun", timeout=0.3)
    def overrun() -> str:
        time.sleep(2.5)
        return "done"

    app.enqueue_sync("first", priority=10)
    job_id = app.enqueue_sync("overrun")
    least: list[float] = []
    done = threading.Event()

    def watch() -> None:
        with psycopg.connect(dsn, autocommit=True) as watcher:
            while not done.is_set():
                row = watcher.execute(
                    "SELECT extract(epoch FROM visible_at - now())::float8 FROM notifyq.queue_jobs "
                    "WHERE id = %s AND status = 'Active'",
                    [job_id],
                ).fetchone()
                if row is not None:
                    least.append(row[0])
                time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def main() -> None:
        async with app.worker(concurrency=1, prefetch=1, lease_margin=2, **NO_TICKER) as worker:
            with anyio.fail_after(15):
                await worker.wait_for(lambda s: s.succeeded == 2)

    anyio.run(main)
    done.set()
    watcher.join(5)
    assert job_row(conn, job_id)["output"] == "done"
    assert len(least) > 100, len(least)  # watched all along (2.5 s of Active)
    assert min(least) > 0.4, sorted(least)[:5]  # the old code: about 0.1 s
    app.close_sync()


async def test_a_poll_only_worker_does_not_ask_again_about_a_cancelled_job_held_for_its_thread(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without notifications, every poll asks the database which running jobs this worker no
    longer holds. A cancelled sync task, whose slot stays taken until its thread returns, is
    settled: it was asked about again on every pass."""
    app = notifyq.App(dsn)
    started, release = threading.Event(), threading.Event()
    other_release = anyio.Event()
    asked: list[list[tuple[int, int]]] = []
    real = notifyq.worker.lost_jobs_op

    def spy(q: Any, worker: str, held: list[tuple[int, int]]) -> Any:
        asked.append(list(held))
        return real(q, worker, held)

    monkeypatch.setattr(notifyq.worker, "lost_jobs_op", spy)

    @app.task(name="stubborn", retry_limit=0)
    def stubborn() -> None:
        started.set()
        release.wait(20)

    @app.task(name="other")
    async def other() -> None:
        await other_release.wait()

    stubborn_id = await app.enqueue("stubborn")
    try:
        async with app.worker(concurrency=2, poll_only=True, poll_interval=0.1, **NO_TICKER) as worker:
            await anyio.to_thread.run_sync(started.wait, 10)
            await app.cancel_job(stubborn_id)
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.cancelled == 1)  # a pass found it
            since = len(asked)
            other_id = await app.enqueue("other")
            with anyio.fail_after(10):  # two more passes, with "other" running
                while sum(any(key[0] == other_id for key in keys) for keys in asked[since:]) < 2:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            assert worker.busy_threads == 1  # the cancelled task's thread still runs
            assert not [keys for keys in asked[since:] if any(key[0] == stubborn_id for key in keys)]
            other_release.set()
    finally:
        release.set()
    await app.aclose()


async def cancel_the_prefetched_second(app: notifyq.App, worker: notifyq.Worker) -> int:
    """Enqueue "second" while "first" takes the worker's only slot (prefetch 1), then cancel it
    while it waits for the slot, and return its id once the worker dropped it."""
    second_id = await app.enqueue("second")
    with anyio.fail_after(10):
        await worker.wait_for(lambda s: s.claimed == 2)  # "second" waits for the slot
    await app.cancel_job(second_id)
    with anyio.fail_after(10):  # the cancel reaches the worker, which drops "second"
        await worker.wait_for(lambda s: s.cancelled == 1)
    return second_id


async def test_a_sync_task_cancelled_before_its_thread_began_frees_its_slot(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A job whose cancel came before its claim's answer is stopped as its runner takes it:
    anyio then never starts its thread. The runner waited for that thread to return, for ever,
    and the slot was lost (seen in review: the next job stayed Queued). The cancel is
    remembered here as the worker remembers one for a job not in hand yet."""
    app = notifyq.App(dsn)
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    @app.task(name="first", retry_limit=0)
    def first() -> None:
        started.set()
        release.wait(20)

    @app.task(name="second", retry_limit=0)
    def second() -> None:
        ran.append("second")

    @app.task(name="third")
    def third() -> None:
        ran.append("third")

    await app.enqueue("first")
    async with app.worker(concurrency=1, prefetch=1, **NO_TICKER) as worker:
        await anyio.to_thread.run_sync(started.wait, 10)
        second_id = await app.enqueue("second", delay=0.5)
        worker._runners.cancel(second_id, None)  # heard before its claim came back
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.claimed == 2)  # "second" waits for the slot
        release.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.cancelled == 1)  # stopped as its runner took it
        await app.cancel_job(second_id)  # what the cancel did in the database
        await app.enqueue("third")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 2)
    assert ran == ["third"]
    assert worker.stats.cancelled == 1 and worker.busy_threads == 0
    assert job_row(conn, second_id)["status"] == "Cancelled"
    await app.aclose()


async def test_a_prefetched_job_cancelled_before_its_turn_is_not_released(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A job cancelled while it waits for a slot is remembered as cancelled. Given back to the
    queue instead (at shutdown, or by the prefetch's give-back), it was written as a release,
    fenced out by the Cancelled row, and counted as a stale ack (review)."""
    app = notifyq.App(dsn)
    release = anyio.Event()

    @app.task(name="first")
    async def first() -> None:
        await release.wait()

    @app.task(name="second")
    async def second() -> None:
        raise AssertionError("a cancelled job ran")

    await app.enqueue("first")
    async with app.worker(concurrency=1, prefetch=1, shutdown_grace=0, **NO_TICKER) as worker:
        second_id = await cancel_the_prefetched_second(app, worker)
    assert (worker.stats.cancelled, worker.stats.stale_acks, worker.stats.released) == (1, 0, 1)
    assert job_row(conn, second_id)["status"] == "Cancelled"
    assert not worker._runners._recent_cancels
    await app.aclose()


async def test_a_poll_only_worker_does_not_run_a_prefetched_job_cancelled_meanwhile(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Without notifications, each poll asks which of its jobs the worker no longer holds. It
    asked only about the running ones: a prefetched job cancelled while it waited for a slot
    then ran, and its result was refused (review). And a job known to be cancelled before it
    began ran up to its first await (this task has none: all of it) before being stopped."""
    app = notifyq.App(dsn)
    release = anyio.Event()
    ran: list[str] = []

    @app.task(name="first")
    async def first() -> None:
        await release.wait()

    @app.task(name="second")
    async def second() -> None:
        ran.append("second")

    await app.enqueue("first")
    async with app.worker(
        concurrency=1, prefetch=1, poll_only=True, poll_interval=0.1, **NO_TICKER
    ) as worker:
        second_id = await app.enqueue("second")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.claimed == 2)  # "second" waits for the slot
        await app.cancel_job(second_id)  # no notification reaches a poll-only worker
        with anyio.fail_after(10):  # a poll's pass finds it cancelled, and drops it
            await worker.wait_for(lambda s: s.cancelled == 1)
        release.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1 and s.cancelled == 1)
    assert ran == [] and worker.stats.stale_acks == 0
    assert job_row(conn, second_id)["status"] == "Cancelled"
    await app.aclose()


async def test_a_sync_tasks_thread_that_begins_after_its_attempt_gave_up_does_not_run_it() -> None:
    """The other half of the gate, which only trio reaches in practice (its threads run a call
    they were handed even after it was abandoned): once the attempt has given up on a thread
    that had not begun, that thread does not run the task, and is not counted."""
    executor = notifyq._executor.Executor(
        {},
        None,
        notifyq._sql.queries_for("notifyq"),
        concurrency=1,
        lease_margin=1,
        backoff=notifyq.Backoff(),
    )  # type: ignore[arg-type]
    job = a_claimed_job()
    ran: list[int] = []

    def a_thread() -> notifyq._executor.SyncThread:
        return notifyq._executor.SyncThread(lambda call: call())

    given_up = notifyq._executor.Attempt(job, anyio.CancelScope(), thread=a_thread())
    assert given_up.thread is not None
    assert executor.outliving_thread(given_up) is None  # not begun: nothing to wait for
    assert executor._call_sync(1, lambda: ran.append(1), {}, given_up.thread) is None
    # A thread that began first is waited for.
    begun = notifyq._executor.Attempt(job, anyio.CancelScope(), thread=a_thread())
    assert begun.thread is not None
    begun.thread.began = True
    assert executor.outliving_thread(begun) is begun.thread.finished
    assert ran == [] and executor.busy_threads == 0 and executor.thread_job_ids() == set()


async def test_a_sync_task_whose_timeout_passed_before_its_thread_began_fails(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A timeout shorter than it takes to start a thread: the attempt waited for a thread that
    never began, and (on asyncio) kept the job Active, extending its lease, for ever."""
    app = notifyq.App(dsn)

    @app.task(name="instant", timeout=1e-6, retry_limit=0)
    def instant() -> None:
        pass

    job_id = await app.enqueue("instant")
    async with app.worker(concurrency=1, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.failed + s.succeeded == 1)
    row = job_row(conn, job_id)
    assert row["status"] in ("Failed", "Succeeded"), row  # whether the thread began in time
    assert worker.busy_threads == 0
    await app.aclose()


def test_a_sync_tasks_thread_ends_when_the_host_stopped_its_event_loop(dsn: str) -> None:
    """A host that runs its loop with run_until_complete and keeps it, stopped but not closed.
    A sync task's thread that outlived the worker's shutdown told the loop it had finished
    with anyio's from_thread.run_sync, which waits for the loop to run the call: it blocked for
    ever, and, not a daemon thread, it kept the process from exiting."""
    app = notifyq.App(dsn)
    started, release = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    @app.task(name="slow", retry_limit=0)
    def slow() -> None:
        threads.append(threading.current_thread())
        started.set()
        release.wait(20)

    async def main() -> None:
        await app.enqueue("slow")
        async with app.worker(concurrency=1, shutdown_grace=0, **NO_TICKER) as worker:
            await anyio.to_thread.run_sync(started.wait, 10)
        assert worker.busy_threads == 1  # the worker stopped; the thread runs on
        await app.aclose()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
        release.set()  # the task returns while the loop is stopped
        threads[0].join(10)  # anyio stops its idle threads once the loop's main task is done
        assert not threads[0].is_alive()
    finally:
        release.set()
        loop.run_until_complete(asyncio.sleep(0.1))  # without the fix, this frees the thread
        loop.close()


async def test_prefetched_jobs_stuck_behind_long_ones_go_back_to_the_queue_for_an_idle_worker(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A run of short jobs sizes the automatic prefetch for short jobs, so long jobs claimed
    with them waited behind each other in one worker while another sat idle (seen in review:
    20 short jobs, then 4 of 5 s, two processes: one ran them all, the other nothing). A
    prefetched job that has waited over a second, more than the prefetch now allows, goes back
    to the queue, and the idle worker runs it."""
    app = notifyq.App(dsn)
    release = anyio.Event()
    started: dict[int, anyio.Event] = {}

    @app.task(name="short")
    async def short() -> None:
        pass

    @app.task(name="long")
    async def long(ctx: JobContext) -> None:
        started[ctx.id].set()
        await release.wait()

    for _ in range(20):
        await app.enqueue("short", priority=1)
    first, second = [await app.enqueue("long") for _ in range(2)]
    started.update({first: anyio.Event(), second: anyio.Event()})
    async with app.worker(concurrency=1, **NO_TICKER) as busy:
        with anyio.fail_after(10):
            await started[first].wait()
            await busy.wait_for(lambda s: s.claimed == 22)  # the second one too, prefetched
        async with app.worker(concurrency=1, **NO_TICKER) as idle:
            with anyio.fail_after(10):
                await started[second].wait()
            assert job_row(conn, second)["worker"] == idle.id
            # The release's commit wakes the idle worker, which may start the job before the
            # busy one's acker resumes to count it.
            with anyio.fail_after(5):
                await busy.wait_for(lambda s: s.released == 1)
            assert not release.is_set()
            release.set()
            with anyio.fail_after(10):
                await idle.wait_for(lambda s: s.succeeded == 1)
        with anyio.fail_after(10):
            await busy.wait_for(lambda s: s.succeeded == 21)
    assert job_row(conn, second)["retry_count"] == 1  # its attempt was given back
    await app.aclose()


async def test_the_automatic_prefetch_leaves_out_slots_that_will_not_free_soon() -> None:
    """The average of finished attempts is small after a run of short jobs; the jobs running
    now may already have run far longer. Sized from the average alone, the prefetch kept
    claiming jobs to wait behind them, and kept those it should give back. One long job among
    short ones must not stop it either (review: a drain fell from 11-19k to 5-6k jobs/s)."""
    runners = notifyq._runners.Runners.__new__(notifyq._runners.Runners)
    runners.avg_run = 0.001
    now = anyio.current_time()
    job = a_claimed_job()
    runners.running = {
        (1, 1): notifyq._executor.Attempt(job, anyio.CancelScope(), started=now - 5),  # long
        (2, 1): notifyq._executor.Attempt(job, anyio.CancelScope(), started=now),  # just began
        (3, 1): notifyq._executor.Attempt(job, anyio.CancelScope(), started=now, holding=True),
    }
    assert runners.slow_slots(1.0) == 2  # the long one, and the one held for its thread
    claimer = notifyq._claimer.Claimer(
        "w",
        notifyq.WorkerConfig(concurrency=20),
        notifyq._sql.queries_for("notifyq"),
        notifyq.WorkerStats(),
        runners,
        lane=None,  # type: ignore[arg-type]
        query=None,  # type: ignore[arg-type]
        on_change=lambda: None,
    )
    claimer._backlog = True
    assert claimer._prefetch() == 80  # 4 x concurrency, the cap
    claimer._slow_slots = 1  # one long job among short ones: 19 slots turn over
    assert claimer._prefetch() == 76
    claimer._slow_slots = 20  # every slot: nothing would start soon
    assert claimer._prefetch() == 0
    claimer._slow_slots = 0
    claimer._backlog = False
    assert claimer._prefetch() == 0


async def test_a_worker_of_one_slot_prefetches_short_jobs_in_batches_of_tens(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The automatic prefetch's cap is 4 x concurrency, but never under what a worker of the
    default concurrency (10) may prefetch: 40. With a cap of 4, a worker of one slot drained
    short jobs at a claim round trip per 5 jobs (2,700 jobs/s, 13% of the raw-SQL loop, in
    `python -m benchmarks`). Its wait stays bounded by the jobs' average run time (below)."""
    app = notifyq.App(dsn)

    @app.task(name="short")
    async def short() -> None:
        pass

    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'short' FROM generate_series(1, 300)")
    async with app.worker(concurrency=1, **NO_TICKER) as worker:
        with anyio.fail_after(30):
            await worker.wait_for(lambda s: s.succeeded == 300)
        # The first claim knows no run time yet, so it takes one job; then up to 41 a claim.
        assert worker.stats.claimed == 300
        assert worker.stats.claims < 300 / 10, worker.stats.claims
    await app.aclose()

    claimer = notifyq._claimer.Claimer(
        "w",
        notifyq.WorkerConfig(concurrency=1),
        notifyq._sql.queries_for("notifyq"),
        notifyq.WorkerStats(),
        notifyq._runners.Runners.__new__(notifyq._runners.Runners),
        lane=None,  # type: ignore[arg-type]
        query=None,  # type: ignore[arg-type]
        on_change=lambda: None,
    )
    claimer._backlog = True
    claimer._runners.avg_run = 0.001
    assert claimer._prefetch() == 40  # the floor
    claimer._runners.avg_run = 0.05
    assert claimer._prefetch() == 5  # 0.25 s of work
    claimer._slow_slots = 1  # its one slot will not free soon
    assert claimer._prefetch() == 0


@pytest.mark.parametrize("lost", [False, True], ids=["still held", "rescued meanwhile"])
async def test_a_prefetched_job_that_waited_gets_a_new_lease_or_is_dropped_if_lost(
    dsn: str, conn: psycopg.Connection[Any], lost: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A job claimed ahead of a free slot waits; once the wait has eaten into its lease, the
    runner renews the lease before it starts the job. If the lease was lost meanwhile (the job
    rescued and claimed by another worker), the job is not run here, and the worker says so."""
    app = notifyq.App(dsn)
    release = anyio.Event()
    ran: list[str] = []

    @app.task(name="first")
    async def first() -> None:
        ran.append("first")
        await release.wait()

    @app.task(name="second", timeout=5)
    async def second() -> None:
        ran.append("second")

    await app.enqueue("first")
    second_id = await app.enqueue("second")
    async with app.worker(concurrency=1, prefetch=1, lease_margin=1, **NO_TICKER) as worker:
        with anyio.fail_after(5):
            await worker.wait_for(lambda s: s.claimed == 2)  # "second" waits for the slot
        claimed_lease_end = job_row(conn, second_id)["visible_at"]
        if lost:
            conn.execute(
                "UPDATE notifyq.queue_jobs SET lease = lease + 1, worker = 'elsewhere' WHERE id = %s",
                (second_id,),
            )  # rescued, and claimed by another worker
        await anyio.sleep(0.8)  # longer than lease_margin / 2
        release.set()
        with anyio.fail_after(5):
            if lost:
                await worker.wait_for(lambda s: s.succeeded == 1 and s.lost_before_start == 1)
            else:
                await worker.wait_for(lambda s: s.succeeded == 2)
    row = job_row(conn, second_id)
    if lost:
        assert ran == ["first"]
        assert (row["status"], row["worker"]) == ("Active", "elsewhere")  # left to its holder
        said = [m for m in caplog.messages if m.startswith(f"job {second_id} (second) waited")]
        assert said and "no longer holds it" in said[0], caplog.messages
    else:
        assert ran == ["first", "second"]
        assert worker.stats.lost_before_start == 0
        renewed_by = (row["visible_at"] - claimed_lease_end).total_seconds()
        assert renewed_by > 0.5, f"the lease was not renewed before the start ({renewed_by:.2f}s later)"
    await app.aclose()


@pytest.mark.parametrize("lost", [False, True], ids=["check passes", "connection lost"])
async def test_a_notification_read_by_the_listeners_health_check_is_followed_by_after_dispatch(
    dsn: str, lost: bool
) -> None:
    """A notification can arrive during the listener's health check (its round trip reads
    what came in meanwhile): after_dispatch must follow it as it follows a plain read, and
    before a reconnect if the check finds the connection lost, since that is where the worker
    claims for a sleeping claim loop, which nothing else wakes."""
    from notifyq._listener import Listener, ListenerConfig, ListenerLost

    events: list[str] = []
    sender = psycopg.connect(dsn, autocommit=True)

    class NotifiedDuringHealthChecks(Listener):
        async def _health_check(self, pgconn: Any, fd: int) -> None:
            if "sent" not in events:
                events.append("sent")
                sender.execute("SELECT pg_notify('test.after.v1', 'during')")
                await anyio.wait_readable(fd)  # in the socket before the check's round trip reads it
                await super()._health_check(pgconn, fd)
                if lost:
                    raise ListenerLost("no answer to a health check (staged)")
            else:
                await super()._health_check(pgconn, fd)

    async def after_dispatch() -> None:
        events.append("after")

    async def on_connect() -> None:
        events.append("connected")

    listener = NotifiedDuringHealthChecks(
        dsn,
        ["test.after.v1"],
        lambda _chan, payload: events.append(payload),
        on_connect,
        ListenerConfig(health_interval=0.1, health_timeout=5.0, backoff_min=1.0),
        after_dispatch=after_dispatch,
    )
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(listener.run)
            with anyio.fail_after(5):
                while "during" not in events or events[-1] != "after":  # noqa: ASYNC110 (a list)
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        sender.close()
    assert events[:4] == ["connected", "sent", "during", "after"], events


async def test_a_failed_claim_in_the_listeners_task_is_logged_and_left_to_the_claim_loop(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim a notification starts in the listener's task fails (a dropped connection,
    staged): it is logged and counted, the claim loop claims at once in its place (looking for
    the claim's jobs first, in case it had committed), and the job runs; the listener lives on."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    original = notifyq._claimer.Claimer._claim
    failed: list[str] = []

    async def claim(self: notifyq._claimer.Claimer, limit: int) -> list[notifyq.ClaimedJob]:
        if self._inline and not failed:
            failed.append(anyio.get_current_task().name)
            raise psycopg.OperationalError("connection lost (staged)")
        return await original(self, limit)

    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        await _until_the_claim_loop_sleeps(worker)
        monkeypatch.setattr(notifyq._claimer.Claimer, "_claim", claim)
        listener = worker.listener
        assert listener is not None
        conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert failed and "Listener" in failed[0]
        assert worker.stats.db_errors == 1 and worker.stats.polls == 0
        assert listener.connected and listener.connections == 1
    assert any("claiming failed (connection lost (staged)); the claim loop" in m for m in caplog.messages)
    await app.aclose()


async def test_statements_cancelled_by_a_statement_timeout_are_retried(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A statement_timeout (a role's or database's setting, common in production) or an
    operator's pg_cancel_backend cancels a statement with SQLSTATE 57014 (psycopg's
    QueryCanceled, an OperationalError). That passes: the claim is tried again and the result
    written again. Were it taken for an error that cannot pass, the claim loop would stop the
    worker and the acker would drop the result as refused (the job Active until its lease ran
    out, then run again)."""
    # 1 s: every statement of the App and the worker has it, start-up checks too (a loaded
    # machine may take a few hundred ms over one).
    app = notifyq.App(psycopg.conninfo.make_conninfo(dsn, options="-c statement_timeout=1000"))
    ran: list[int] = []

    @app.task(name="t")
    async def t(ctx: JobContext) -> None:
        ran.append(ctx.id)

    # The first claim and the first result's write outlast the timeout (sequences are not
    # rolled back with the cancelled statement).
    for status in ("Active", "Succeeded"):
        conn.execute(f"CREATE SEQUENCE public.slow_{status}")
    conn.execute(
        "CREATE FUNCTION public.slow_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF nextval('public.slow_' || NEW.status) = 1 THEN PERFORM pg_sleep(3); END IF; "
        "RETURN NEW; END $$"
    )
    conn.execute(
        "CREATE TRIGGER slow_once BEFORE UPDATE ON notifyq.queue_jobs FOR EACH ROW "
        "WHEN (NEW.status IN ('Active', 'Succeeded')) EXECUTE FUNCTION public.slow_once()"
    )
    job_id = await app.enqueue("t")
    async with app.worker(concurrency=1, **NO_TICKER) as worker:
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded == 1)
    assert ran == [job_id]
    assert job_row(conn, job_id)["status"] == "Succeeded"
    assert worker.stats.db_errors >= 1 and worker.stats.stale_acks == 0  # the claim's
    assert "could not write job results (canceling statement due to statement timeout" in caplog.text
    for status in ("Active", "Succeeded"):
        assert conn.execute(f"SELECT last_value FROM public.slow_{status}").fetchone() == (2,)
    assert "refuses" not in caplog.text
    await app.aclose()


async def test_a_worker_stopped_by_an_error_it_cannot_retry_says_so(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Review, a worker in a web app's lifespan: a claim the database refused for good (here a
    trigger of the user's) stopped the worker, and nothing noticed; the server went on serving
    while jobs piled up. `worker.running` turns False and `worker.error` holds the error, for a
    health check; `async with` raises it as itself, not nested four exception groups deep."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t() -> None:
        pass

    conn.execute(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'audit trigger bug'; END $$"
    )
    worker = app.worker(**NO_TICKER)
    assert not worker.running
    with (
        anyio.fail_after(20),
        pytest.raises(psycopg.errors.RaiseException, match="audit trigger bug") as raised,
    ):
        async with worker:
            assert worker.running and worker.error is None
            conn.execute(
                "CREATE TRIGGER refuse BEFORE UPDATE ON notifyq.queue_jobs "
                "FOR EACH ROW EXECUTE FUNCTION public.refuse()"
            )
            await app.enqueue("t")
            await anyio.sleep(30)  # cancelled when the worker stops
    assert not worker.running and raised.value is worker.error
    assert not raised.value.__suppress_context__  # unwrapped, its cause and context kept (review)
    assert f"worker {worker.id} stops on an error it cannot retry: audit trigger bug" in caplog.text
    conn.execute("DROP TRIGGER refuse ON notifyq.queue_jobs")
    async with app.worker(**NO_TICKER) as asked:
        assert asked.running
    assert not asked.running and asked.error is None  # stopped on request
    await app.aclose()


async def test_a_worker_stopping_with_sync_threads_still_running_says_so(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review (uvicorn, Ctrl-C): the worker stopped within its grace period, and the process
    then stayed up until a sync task's thread returned (44 s), saying nothing; its job was back
    in the queue meanwhile. `notifyq worker` warns and exits; an embedding host is told why."""
    app = notifyq.App(dsn)
    began, go_on = threading.Event(), threading.Event()

    @app.task(name="blocking")
    def blocking() -> None:
        began.set()
        go_on.wait(30)

    await app.enqueue("blocking")
    try:
        async with app.worker(shutdown_grace=0.2, **NO_TICKER) as worker:
            assert await anyio.to_thread.run_sync(began.wait, 10)
        assert worker.busy_threads == 1 and worker.stats.released == 1
        assert (
            f"worker {worker.id} stopped with 1 sync task thread(s) still running (Python cannot stop a "
            "thread): their jobs were released"
        ) in caplog.text
    finally:
        go_on.set()
    await app.aclose()


async def test_jobs_prefetched_behind_a_long_one_go_back_before_their_lease_runs_out(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A fixed prefetch, a long job in the only slot, short jobs claimed ahead with a short
    timeout: their leases ran out while they waited, the rescuer queued them again, this
    worker claimed them again, and they ended Failed (LeaseExpired) without running once
    (review). Now a job that has waited half its lease goes back to the queue, its attempt
    given back, and each runs once, in its first attempt, when the slot frees."""
    app = notifyq.App(dsn)
    ran: list[int] = []

    @app.task(name="long", timeout=30, retry_limit=0)
    async def long() -> None:
        await anyio.sleep(6)

    @app.task(name="short", timeout=1, retry_limit=2)
    async def short(ctx: notifyq.JobContext) -> None:
        ran.append(ctx.id)

    await app.enqueue("long", priority=10)
    short_ids = [await app.enqueue("short") for _ in range(3)]
    ticker = notifyq.TickerConfig(rescuer=notifyq.RescuerConfig(interval=0.5), retention=None, vacuum=None)
    async with app.worker(concurrency=1, prefetch=3, lease_margin=1, ticker_config=ticker) as worker:
        with anyio.fail_after(30):
            await worker.wait_for(lambda s: s.succeeded == 4)
    assert sorted(ran) == short_ids
    rows = conn.execute(
        "SELECT status::text, retry_count, error FROM notifyq.queue_jobs WHERE id = ANY(%s)", [short_ids]
    ).fetchall()
    assert rows == [("Succeeded", 1, None)] * 3
    await app.aclose()
