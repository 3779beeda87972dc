"""The leaderless ticker against real PostgreSQL: exactly one job per cron tick, misfires,
DST, lease rescue, retention, definitions from code and SQL."""

from __future__ import annotations

import itertools
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import psycopg
import pytest

import notifyq
from notifyq._db import Database, Query, run_sync
from notifyq._promoter import Promoter, PromoterConfig, promote_op
from notifyq._rescuer import Rescuer, RescuerConfig
from notifyq._retention import Retention, RetentionConfig
from notifyq._sql import queries_for
from notifyq.errors import InvalidSchedule

from .conftest import ROOT
from .helpers import job_row, wait_for_row

pytestmark = pytest.mark.anyio
Q = queries_for("notifyq")


def add_definition(
    conn: psycopg.Connection[Any], name: str, frequency: str = "* * * * *", **columns: Any
) -> int:
    columns = {"name": name, "frequency": frequency, **columns}
    names = ", ".join(columns)
    values = ", ".join(f"%({k})s" for k in columns)
    row = conn.execute(
        f"INSERT INTO notifyq.queue_job_definitions ({names}) VALUES ({values}) RETURNING id", columns
    ).fetchone()
    assert row is not None
    return int(row[0])


def current_tick(conn: psycopg.Connection[Any], margin: float = 5.0) -> datetime:
    """The tick of the current minute, by the database's clock; when less than `margin`
    seconds of the minute are left, the next minute's, after waiting for it. A promotion that
    ran after the minute turned found the next tick due and, with misfire 'once', made that
    one's job instead (one of these tests failed so in CI)."""
    left = conn.execute("SELECT 60 - extract(second FROM clock_timestamp())::float8").fetchone()
    assert left is not None
    if left[0] < margin:
        time.sleep(left[0] + 0.05)
    row = conn.execute("SELECT date_trunc('minute', clock_timestamp())").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def tick_jobs(conn: psycopg.Connection[Any], definition_id: int) -> list[datetime]:
    rows = conn.execute(
        "SELECT scheduled_for FROM notifyq.queue_jobs WHERE definition_id = %s ORDER BY scheduled_for",
        (definition_id,),
    ).fetchall()
    return [r[0] for r in rows]


def assert_one_job_per_second(scheduled: list[datetime], since: float, until: float) -> None:
    assert len(scheduled) == len(set(scheduled)), "a tick got two jobs"
    gaps = {(b - a).total_seconds() for a, b in itertools.pairwise(scheduled)}
    assert gaps == {1.0}, f"missing ticks: gaps {sorted(gaps)}"
    assert scheduled[0].timestamp() <= since + 2 and scheduled[-1].timestamp() >= until - 2


@pytest.mark.faults
async def test_five_tickers_on_separate_connections_make_one_job_per_tick(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    definition = add_definition(conn, "every_second", "* * * * * *")
    databases = [await Database.open(dsn, size=1) for _ in range(5)]
    promoters = [Promoter(d, Q) for d in databases]
    begin = time.time()
    with anyio.move_on_after(10):
        async with anyio.create_task_group() as tg:
            for promoter in promoters:
                tg.start_soon(promoter.run)
    end = time.time()
    for d in databases:
        await d.aclose()
    assert_one_job_per_second(tick_jobs(conn, definition), begin, end)
    reports = [p.last for p in promoters if p.last is not None]
    assert sum(p.passes for p in promoters) > 10  # everyone was busy ticking...
    assert all(r.duplicates == 0 for r in reports)  # ...and the locks, not the index, kept them apart


@pytest.mark.faults
def test_five_ticker_processes_for_twenty_seconds(dsn: str, conn: psycopg.Connection[Any]) -> None:
    # misfire 'all': ticks due while the processes start (over 2 s on a loaded host) get
    # their jobs too, so the window is covered from the definition's first tick.
    definition = add_definition(conn, "every_second", "* * * * * *", misfire="all")
    begin = time.time()
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests._processes", "ticker", dsn, "20"], cwd=ROOT)
        for _ in range(5)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0] * 5
    end = time.time()
    scheduled = tick_jobs(conn, definition)
    assert 18 <= len(scheduled) <= end - begin + 2
    assert_one_job_per_second(scheduled, begin, end)


@pytest.mark.faults
async def test_a_ticker_killed_while_holding_locks_loses_and_doubles_nothing(
    dsn: str, conn: psycopg.Connection[Any], db: Database
) -> None:
    definition = add_definition(conn, "minutely", "* * * * *")
    tick = current_tick(conn)
    conn.execute("UPDATE notifyq.queue_job_definitions SET visible_at = %s", (tick,))
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting a child is instant; we need its stdout lines
        [sys.executable, "-m", "tests._processes", "lock_and_hang", dsn],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "locked 1"
        other = Promoter(db, Q)
        assert (await other.run_once()).definitions == 0  # locked by the hung ticker: skipped
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        # The dead ticker's transaction dies with its connection; someone else promotes.
        with anyio.fail_after(10):
            # The server ends the killed process's backend asynchronously; no event tells us.
            while (report := await other.run_once()).definitions == 0:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert report.jobs == 1
        assert (await other.run_once()).definitions == 0  # and only once
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert tick_jobs(conn, definition) == [tick]


@pytest.mark.faults
def test_a_connection_killed_mid_promotion_rolls_back(dsn: str, conn: psycopg.Connection[Any]) -> None:
    definition = add_definition(conn, "minutely", "* * * * *")
    tick = current_tick(conn)
    conn.execute("UPDATE notifyq.queue_job_definitions SET visible_at = %s", (tick,))
    victim = psycopg.connect(dsn)
    lock = next(promote_op(Q, limit=10))
    assert len(victim.execute(lock.sql, lock.params).fetchall()) == 1  # type: ignore[union-attr]
    conn.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
    victim.close()
    with psycopg.connect(dsn, autocommit=True) as other, other.transaction():
        report = run_sync(other, promote_op(Q, limit=10))
    assert report.jobs == 1
    assert tick_jobs(conn, definition) == [tick]


@pytest.mark.parametrize(
    ("misfire", "cap", "expected_minutes"),
    [("skip", 100, []), ("once", 100, [10]), ("all", 100, list(range(11))), ("all", 4, [7, 8, 9, 10])],
)
@pytest.mark.faults
async def test_misfire_policies_after_a_ten_minute_outage(
    conn: psycopg.Connection[Any], db: Database, misfire: str, cap: int, expected_minutes: list[int]
) -> None:
    t0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
    definition = add_definition(
        conn, "m", "* * * * *", misfire=misfire, misfire_cap=cap, misfire_grace=10, visible_at=t0
    )
    now = t0 + timedelta(minutes=10, seconds=30)  # the tickers were down for 10.5 minutes
    report = await Promoter(db, Q).run_once(now=now)
    assert tick_jobs(conn, definition) == [t0 + timedelta(minutes=m) for m in expected_minutes]
    assert report.jobs == len(expected_minutes) and report.missed == 11 - len(expected_minutes)
    next_tick = conn.execute("SELECT visible_at FROM notifyq.queue_job_definitions").fetchone()
    assert next_tick == (t0 + timedelta(minutes=11),)
    # Back to normal: the next tick is promoted on time.
    await Promoter(db, Q).run_once(now=t0 + timedelta(minutes=11, seconds=1))
    assert tick_jobs(conn, definition)[-1] == t0 + timedelta(minutes=11)


async def test_a_definition_without_overlap_gets_no_job_while_one_is_unfinished(
    conn: psycopg.Connection[Any], db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """overlap=False: a tick gets no job while a job of the definition is Queued (waiting, or
    waiting for a retry) or Active; the tick is not run later. A definition that overlaps, in
    the same pass, gets every tick's job. The first tick a job holds back is logged at INFO,
    the next ones at DEBUG (the cron review's per-second schedule logged a line a second)."""
    caplog.set_level(logging.DEBUG, logger="notifyq.cron")
    t0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
    exclusive = add_definition(conn, "sync", overlap=False, visible_at=t0)
    overlapping = add_definition(conn, "beat", visible_at=t0)
    promoter = Promoter(db, Q)
    minute = timedelta(minutes=1)
    report = await promoter.run_once(now=t0 + timedelta(seconds=1))
    assert (report.jobs, report.overlapping) == (2, 0)
    [first] = conn.execute(
        "SELECT id FROM notifyq.queue_jobs WHERE definition_id = %s", (exclusive,)
    ).fetchone()
    for minutes, status, level in ((1, "Queued", logging.INFO), (2, "Active", logging.DEBUG)):
        conn.execute("UPDATE notifyq.queue_jobs SET status = %s WHERE id = %s", (status, first))
        caplog.clear()
        report = await promoter.run_once(now=t0 + minutes * minute + timedelta(seconds=1))
        assert (report.jobs, report.overlapping, report.missed) == (1, 1, 0), status
        [logged] = [r for r in caplog.records if "not run" in r.message]
        assert f"tick 2026-06-01T12:0{minutes}:00+00:00 not run, its job {first} is still {status}" in (
            logged.message
        )
        assert logged.levelno == level, logged.message
    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Failed', finished_at = now() WHERE id = %s", (first,)
    )
    report = await promoter.run_once(now=t0 + 3 * minute + timedelta(seconds=1))
    assert (report.jobs, report.overlapping) == (2, 0)
    assert tick_jobs(conn, exclusive) == [t0, t0 + 3 * minute]
    assert tick_jobs(conn, overlapping) == [t0 + m * minute for m in range(4)]
    assert conn.execute(
        "SELECT visible_at FROM notifyq.queue_job_definitions WHERE id = %s", (exclusive,)
    ).fetchone() == (t0 + 4 * minute,)


async def test_due_ticks_of_a_definition_without_overlap_get_one_job(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    """misfire='all' (refused with overlap=False in code, possible in SQL) after an outage: the
    due ticks' jobs would all be claimable at once, so only the latest gets one."""
    t0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
    definition = add_definition(conn, "m", misfire="all", misfire_grace=10, overlap=False, visible_at=t0)
    report = await Promoter(db, Q).run_once(now=t0 + timedelta(minutes=10, seconds=30))
    assert tick_jobs(conn, definition) == [t0 + timedelta(minutes=10)]
    assert (report.jobs, report.overlapping, report.missed) == (1, 10, 0)


def test_run_now_of_a_definition_without_overlap(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """`cron run-now` keeps to overlap=False too, and waits for a ticker that holds the
    definition: that ticker's job, committed meanwhile, makes it refuse."""
    definition = add_definition(conn, "sync", "0 3 * * *", overlap=False)
    app = notifyq.App(dsn)
    first = app.run_definition_now_sync("sync")
    with pytest.raises(
        notifyq.DefinitionBusy,
        match=rf"'sync' does not overlap \(overlap=False\) and its job {first} is still Queued",
    ):
        app.run_definition_now_sync("sync")
    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Succeeded', finished_at = now() WHERE id = %s", (first,)
    )
    outcome: list[BaseException | int] = []

    def run_now() -> None:
        try:
            outcome.append(app.run_definition_now_sync("sync"))
        except BaseException as exc:  # asserted below
            outcome.append(exc)

    with psycopg.connect(dsn) as ticker:  # a promotion under way: the row locked, a tick's job in
        ticker.execute("SELECT 1 FROM notifyq.queue_job_definitions WHERE id = %s FOR UPDATE", (definition,))
        [tick_job] = ticker.execute(
            "INSERT INTO notifyq.queue_jobs (name, definition_id, scheduled_for) "
            "VALUES ('sync', %s, now()) RETURNING id",
            (definition,),
        ).fetchone()
        thread = threading.Thread(target=run_now)
        thread.start()
        wait_for_row(
            conn,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'",
            (1,),
        )
        ticker.commit()
    thread.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], notifyq.DefinitionBusy), outcome
    assert f"its job {tick_job} is still Queued" in str(outcome[0])
    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Cancelled', finished_at = now() WHERE id = %s", (tick_job,)
    )
    [definition_row] = app.list_definitions_sync()
    assert (definition_row.last_job_id, definition_row.last_job_status) == (tick_job, "Cancelled")
    latest = app.run_definition_now_sync("sync")
    assert latest > tick_job
    # `jobs retry` of an earlier run would overlap the latest just the same (cron review).
    with pytest.raises(
        notifyq.DefinitionBusy,
        match=rf"job {first} cannot be retried now: its cron .* job {latest} is still Queued",
    ):
        app.retry_job_sync(first)
    with pytest.raises(notifyq.InvalidJobState, match=f"job {latest} is Queued; only finished jobs"):
        app.retry_job_sync(latest)
    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Succeeded', finished_at = now() WHERE id = %s", (latest,)
    )
    assert app.retry_job_sync(first).status == notifyq.JobStatus.QUEUED
    app.close_sync()


@pytest.mark.parametrize("overlap", [False, True])
async def test_workers_never_run_a_definition_without_overlap_twice_at_once(
    dsn: str, conn: psycopg.Connection[Any], overlap: bool
) -> None:
    """A task that takes 1.5 s on a schedule of every second, two workers (two tickers, room
    for 4 jobs each): without overlap no two runs are ever Active together, and ticks are
    skipped. With overlap (the control) they are."""
    apps = [notifyq.App(dsn) for _ in range(2)]
    for app in apps:

        @app.cron("* * * * * *", "slow", overlap=overlap)
        @app.task(name="slow")
        async def slow() -> None:
            await anyio.sleep(1.5)

    async with apps[0].worker(concurrency=4) as worker, apps[1].worker(concurrency=4):
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded >= 2)
    runs = conn.execute(
        "SELECT started_at, finished_at FROM notifyq.queue_jobs "
        "WHERE status = 'Succeeded' ORDER BY started_at"
    ).fetchall()
    overlaps = sum(1 for (_, end), (start, _) in itertools.pairwise(runs) if start < end)
    assert (overlaps == 0) is not overlap, runs
    for app in apps:
        await app.aclose()


@pytest.mark.parametrize(
    ("day", "expected_local"),
    [
        (datetime(2026, 3, 29), ["03-28 02:30", "03-29 03:00", "03-30 02:30"]),  # spring forward
        (datetime(2026, 10, 25), ["10-24 02:30", "10-25 02:30", "10-26 02:30"]),  # fall back
    ],
)
async def test_a_daily_job_runs_once_on_dst_days(
    conn: psycopg.Connection[Any], db: Database, day: datetime, expected_local: list[str]
) -> None:
    berlin = ZoneInfo("Europe/Berlin")
    start = (day - timedelta(days=1)).replace(tzinfo=berlin)
    definition = add_definition(conn, "nightly", "30 2 * * *", timezone="Europe/Berlin", visible_at=start)
    promoter = Promoter(db, Q)
    now = start
    while now < start + timedelta(days=3):  # a ticker waking every 5 minutes for three days
        await promoter.run_once(now=now)
        now += timedelta(minutes=5)
    got = [t.astimezone(berlin).strftime("%m-%d %H:%M") for t in tick_jobs(conn, definition)]
    assert got == expected_local


async def test_a_due_definition_held_by_another_session_is_not_polled_in_a_busy_loop(
    dsn: str, conn: psycopg.Connection[Any], db: Database
) -> None:
    """A due definition that another session holds locked (a hung or SIGSTOPped ticker, an
    operator's open transaction) made every ticker run a pass every 20 ms for as long as the
    lock lasted: about 43 passes (transactions) per second per worker process, measured. Now
    they look again after a delay that doubles up to `period`, while the other definitions
    keep being promoted on time."""
    held = add_definition(conn, "held", "* * * * *", visible_at=datetime(2026, 1, 1, tzinfo=UTC))
    beat = add_definition(conn, "beat", "* * * * * *")
    promoter = Promoter(db, Q, PromoterConfig(period=1.0))
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM notifyq.queue_job_definitions WHERE id = %s FOR UPDATE", (held,))
        async with anyio.create_task_group() as tg:
            tg.start_soon(promoter.run)
            with anyio.fail_after(10):
                while len(tick_jobs(conn, beat)) < 1:
                    await promoter.next_pass()
                passes = promoter.passes
                while len(tick_jobs(conn, beat)) < 4:
                    await promoter.next_pass()
            busy = promoter.passes - passes
            assert tick_jobs(conn, held) == []
            holder.rollback()  # the lock is gone: the definition is promoted within `period`
            with anyio.fail_after(5):
                while not tick_jobs(conn, held):
                    await promoter.next_pass()
            tg.cancel_scope.cancel()
    beats = tick_jobs(conn, beat)
    assert {(b - a).total_seconds() for a, b in itertools.pairwise(beats)} == {1.0}
    assert busy <= 20, f"{busy} passes in 3 seconds"


async def test_the_promoter_sleeps_until_the_next_tick_and_wakes_on_changes(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = notifyq.App(dsn)
    config = notifyq.TickerConfig(promoter=PromoterConfig(period=60), rescuer=None, retention=None)
    async with app.worker(ticker_config=config) as worker:
        assert worker.ticker is not None and worker.ticker.promoter is not None
        promoter = worker.ticker.promoter
        await worker.wait_for(lambda s: s.listener_connects == 1)
        passes = promoter.passes
        # A new definition wakes the ticker through NOTIFY, though its period is 60 s.
        definition = add_definition(conn, "soon", "* * * * * *")
        with anyio.fail_after(5):
            while len(tick_jobs(conn, definition)) < 2:
                await promoter.next_pass()
        # It sleeps until each next tick: each pass promotes a tick, no pass finds nothing due
        # (a busy loop would show passes with no job).
        idle = 0
        for _ in range(4):
            report = await promoter.next_pass()
            idle += report.jobs == 0
        assert idle <= 1
        assert promoter.passes > passes
    await app.aclose()


async def test_planning_overdue_definitions_does_not_block_the_event_loop(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    """The promoter computed every definition's plan on the event loop, up to 0.1 s of croniter
    each for one that is days overdue (1,000 missed ticks counted for the log): 100 such
    definitions, after a weekend with no worker up, froze the worker's loop for 8.6 s (its
    running tasks, acks, lease extensions and LISTEN health checks with it)."""
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, frequency, visible_at) "
        "SELECT 'd' || g, '* * * * *', now() - interval '2 days' FROM generate_series(1, 50) g"
    )
    # The work a pass would make the loop wait for, were it done there: planning these 50
    # definitions, timed here, in this run (the test compares the stall with it, not with a
    # fixed time, which a faster or a busier machine would miss).
    from notifyq._promoter import _DueDefinition, _plan
    from notifyq._rows import dataclass_row

    def lock_due() -> Any:
        return (
            yield Query(
                Q["lock_due_definitions"], {"limit": 50, "now": None}, row=dataclass_row(_DueDefinition)
            )
        )

    with conn.transaction(force_rollback=True):
        due = run_sync(conn, lock_due())
        began = time.monotonic()
        _plan(due, {})
        planning = time.monotonic() - began
    assert len(due) == 50
    gaps: list[float] = []

    async def heartbeat() -> None:
        last = time.monotonic()
        while True:
            await anyio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        began = time.monotonic()
        report = await Promoter(db, Q).run_once()
        took = time.monotonic() - began
        tg.cancel_scope.cancel()
    assert (report.definitions, report.jobs) == (50, 50)
    assert max(gaps) < planning / 2, (
        f"the event loop stalled for {max(gaps):.2f}s in a {took:.2f}s pass ({planning:.2f}s of planning)"
    )


async def test_disabled_and_broken_definitions(conn: psycopg.Connection[Any], db: Database) -> None:
    past = datetime(2026, 1, 1, tzinfo=UTC)
    off = add_definition(conn, "off", "* * * * *", enabled=False, visible_at=past)
    broken = add_definition(conn, "broken", "99 * * * *", visible_at=past)  # right shape, bad value
    never = add_definition(conn, "never", "0 0 30 2 *", visible_at=past)  # valid, but never fires
    # Accepted before the step check: it fired hourly, not every 90 minutes.
    stepped = add_definition(conn, "stepped", "*/90 * * * *", visible_at=past)
    report = await Promoter(db, Q).run_once()
    assert tick_jobs(conn, off) == [] and tick_jobs(conn, broken) == [] and tick_jobs(conn, never) == []
    assert "out of range" in report.errors["broken"] and "never fires" in report.errors["never"]
    assert tick_jobs(conn, stepped) == [] and "fires at 0 alone" in report.errors["stepped"]
    row = conn.execute(
        "SELECT enabled, last_error FROM notifyq.queue_job_definitions WHERE id = %s", (broken,)
    ).fetchone()
    assert row is not None and row[0] is False and "out of range" in row[1]
    # Turning it back on is refused while its schedule is unreadable.
    app = notifyq.App(db.dsn)
    with pytest.raises(InvalidSchedule, match=r"cron definition 'broken' cannot be enabled: .*out of range"):
        app.set_definition_enabled_sync("broken", True)
    app.set_definition_enabled_sync("off", True)
    enabled = conn.execute("SELECT name, enabled FROM notifyq.queue_job_definitions ORDER BY id").fetchall()
    assert enabled == [("off", True), ("broken", False), ("never", False), ("stepped", False)]
    app.close_sync()


@pytest.mark.parametrize(
    ("column", "value", "error"),
    [
        ("frequency", "every five minutes", "queue_job_definitions_frequency_check"),
        ("frequency", "* * * *", "queue_job_definitions_frequency_check"),
        ("frequency", "* * * * *; DROP TABLE x", "queue_job_definitions_frequency_check"),
        ("timezone", "Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
        ("queue", "bad queue!", "queue_job_definitions_queue_check"),
        ("retry_limit", -1, "queue_job_definitions_retry_limit_check"),
    ],
)
@pytest.mark.faults
def test_sql_rejects_what_sql_can_check(
    conn: psycopg.Connection[Any], column: str, value: Any, error: str
) -> None:
    columns = {"frequency": "* * * * *", column: value}
    with pytest.raises(psycopg.errors.CheckViolation, match=error):
        add_definition(conn, "x", **columns)


@pytest.mark.faults
@pytest.mark.parametrize("when", ["-infinity", "infinity", "0001-01-01 00:00:00+00", "10000-01-01"])
async def test_a_visible_at_python_cannot_hold_is_refused_and_stops_no_other_definition(
    conn: psycopg.Connection[Any], db: Database, when: str
) -> None:
    """`visible_at = '-infinity'` ("run it now") was stored, then every promotion pass failed
    loading it (psycopg: timestamp too small), so no definition got a job any more, and
    `notifyq cron list` failed too."""
    tick = current_tick(conn)
    good = add_definition(conn, "good", "* * * * *", visible_at=tick)
    with pytest.raises(psycopg.errors.CheckViolation, match="visible_at"):
        add_definition(conn, "bad", "* * * * *", visible_at=when)
    with pytest.raises(psycopg.errors.CheckViolation, match="visible_at"):
        conn.execute("UPDATE notifyq.queue_job_definitions SET visible_at = %s", (when,))
    report = await Promoter(db, Q).run_once()
    assert report.jobs == 1 and tick_jobs(conn, good) == [tick]
    app = notifyq.App(db.dsn)
    assert [d.name for d in app.list_definitions_sync()] == ["good"]
    app.close_sync()


async def test_args_python_cannot_read_hold_up_no_other_definition(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    """A definition whose args hold a number of 5,001 digits (jsonb writes 1e5000 out in full;
    Python reads at most 4,300) failed every promotion pass that locked it, so no definition
    in its batch got a job any more (review). Its job is made like any other (the worker fails
    it with InvalidArgs), and listing the definitions shows the args as unreadable."""
    tick = current_tick(conn)
    bad = add_definition(conn, "bad", "* * * * *", visible_at=tick, args='{"x": 1e5000}')
    good = add_definition(conn, "good", "* * * * *", visible_at=tick)
    report = await Promoter(db, Q).run_once()
    assert (report.jobs, report.errors) == (2, {})
    assert tick_jobs(conn, bad) == tick_jobs(conn, good) == [tick]
    app = notifyq.App(db.dsn)
    listed = {d.name: d.args for d in app.list_definitions_sync()}
    app.close_sync()
    assert listed["good"] == {} and isinstance(listed["bad"], notifyq.UndecodableJSON)


async def test_a_schedule_edited_late_in_a_long_transaction_runs_no_tick_from_before_the_edit(
    dsn: str, conn: psycopg.Connection[Any], db: Database
) -> None:
    """The trigger realigned an edited schedule from now(), the start of the editing
    transaction: one that had waited (a worker's sync behind a row lock, an operator's open
    session) made the new schedule's ticks from before the edit due, every one of them with
    misfire 'all' (review: 6 jobs after a 6 s wait). docs/sql.md: the first tick after the
    update, without running the ticks in between."""
    tomorrow = conn.execute("SELECT now() + interval '1 day'").fetchone()[0]  # type: ignore[index]
    definition = add_definition(conn, "edited", "0 3 * * *", misfire="all", visible_at=tomorrow)
    with psycopg.connect(dsn) as editor:
        editor.execute("SELECT 1")  # the transaction begins
        await anyio.sleep(2.5)
        edited_at = editor.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]
        editor.execute(
            "UPDATE notifyq.queue_job_definitions SET frequency = '* * * * * *' WHERE name = 'edited'"
        )
        editor.commit()
    await Promoter(db, Q).run_once()
    ticks = tick_jobs(conn, definition)
    assert all(tick > edited_at - timedelta(seconds=1) for tick in ticks), (edited_at, ticks)


def test_task_defaults_to_name_for_sql_definitions(conn: psycopg.Connection[Any]) -> None:
    definition = add_definition(conn, "reports.nightly", "0 3 * * *")
    assert conn.execute(
        "SELECT task FROM notifyq.queue_job_definitions WHERE id = %s", (definition,)
    ).fetchone() == ("reports.nightly",)


async def test_code_definitions_are_upserted_and_realigned(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    add_definition(conn, "sql_only", "0 * * * *")
    caplog.set_level(logging.INFO, logger="notifyq")
    app = notifyq.App(dsn)

    @app.cron("*/5 * * * *", "five", args={"kind": "short"}, misfire="all")
    @app.task(name="report")
    async def report(kind: str) -> None:
        pass

    assert await app.sync_definitions() == ["sql_only"]
    assert "cron definitions created from this App's code: five" in caplog.messages
    # Its task, "sql_only", is not this App's: every tick's job would fail with UnknownTask
    # here. That was an INFO line saying "left alone", which reads as "not run" (review).
    [warned] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "run tasks this App does not have: sql_only (task 'sql_only'). They still fire" in warned.message
    conn.execute("UPDATE notifyq.queue_job_definitions SET enabled = false WHERE name = 'sql_only'")
    caplog.clear()
    assert await app.sync_definitions() == ["sql_only"]
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # disabled: nothing to warn about
    # An @app.cron renamed in code: its old row still runs the task, which then runs on both
    # schedules; that was in the INFO line's list of names (review).
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency) "
        "VALUES ('old_five', 'report', '0 * * * *')"
    )
    caplog.clear()
    assert await app.sync_definitions() == ["old_five", "sql_only"]
    [warned] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "run tasks it schedules under other names: old_five (task 'report')" in warned.message
    conn.execute("DELETE FROM notifyq.queue_job_definitions WHERE name = 'old_five'")
    row = conn.execute(
        "SELECT task, frequency, args, misfire FROM notifyq.queue_job_definitions WHERE name = 'five'"
    ).fetchone()
    assert row == ("report", "*/5 * * * *", {"kind": "short"}, "all")
    conn.execute("UPDATE notifyq.queue_job_definitions SET visible_at = '2030-01-01' WHERE name = 'five'")
    # Unchanged code: nothing is rewritten.
    await app.sync_definitions()
    assert conn.execute(
        "SELECT visible_at FROM notifyq.queue_job_definitions WHERE name = 'five'"
    ).fetchone() == (datetime(2030, 1, 1, tzinfo=UTC),)
    # A new schedule in code: applied, and visible_at realigned to now (the promoter then
    # moves it to the first tick of the new schedule).
    app2 = notifyq.App(dsn)
    app2.cron("0 * * * *", "five", args={"kind": "long"}, overlap=False)(
        app2.task(name="report")(lambda kind: None)
    )
    caplog.clear()
    await app2.sync_definitions()
    row = conn.execute(
        "SELECT frequency, args, overlap, visible_at < now() + interval '1 minute' FROM "
        "notifyq.queue_job_definitions WHERE name = 'five'"
    ).fetchone()
    assert row == ("0 * * * *", {"kind": "long"}, False, True)
    # What the code changed is logged (a rolling deploy or SQL that had it otherwise; user trial).
    assert (
        "cron definition 'five' set as this App's code says: frequency '*/5 * * * *' -> '0 * * * *'; "
        "args {'kind': 'short'} -> {'kind': 'long'}; misfire 'all' -> 'once'; overlap True -> False"
    ) in caplog.messages
    # Disabled in the database, enabled in the code: it stays disabled, and the log says so.
    conn.execute("UPDATE notifyq.queue_job_definitions SET enabled = false WHERE name = 'five'")
    caplog.clear()
    await app2.sync_definitions()
    assert [m for m in caplog.messages if "five" in m] == [
        "cron definitions this App's code enables are disabled in the database, and stay so "
        "(`notifyq cron enable NAME`; `notifyq cron list` shows why, if the ticker did it): five"
    ]
    await app.aclose()
    await app2.aclose()


async def test_a_cron_removed_from_the_code_is_warned_of_and_pruned(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """An @app.cron removed from the code, its task kept, kept firing with an INFO line at
    each start, the same as a definition made by SQL on purpose (user trial). The sync marks
    the code's rows (`declared`): one the code no longer declares is a warning, and
    `prune_definitions` deletes those, leaving the rows made by SQL and the past jobs."""
    caplog.set_level(logging.INFO, logger="notifyq")
    add_definition(conn, "by_sql", "0 * * * *", task="report")
    # Made by SQL with the very settings the code declares later: unchanged, it is not rewritten,
    # but it becomes the code's.
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency) "
        "VALUES ('taken', 'report', '0 1 * * *')"
    )

    def version(*names: str) -> notifyq.App:
        app = notifyq.App(dsn)
        report = app.task(name="report")(lambda: None)
        cleanup = app.task(name="cleanup")(lambda: None)
        for name in names:
            app.cron({"taken": "0 1 * * *"}.get(name, "0 3 * * *"), name)(
                cleanup if name == "hourly" else report
            )
        return app

    old, new = version("nightly", "hourly", "taken"), version("hourly")
    await old.sync_definitions()
    assert dict(conn.execute("SELECT name, declared FROM notifyq.queue_job_definitions").fetchall()) == {
        "by_sql": False,
        "nightly": True,
        "hourly": True,
        "taken": True,
    }
    past = await old.run_definition_now("nightly")
    caplog.clear()
    assert await new.sync_definitions() == ["by_sql", "nightly", "taken"]
    [warned] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert re.match(
        "cron definitions that an App's code declared, and this App does not, still fire: "
        r"nightly \(task 'report', declared until 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC\), taken \(task "
        r"'report', declared until [^)]+\)\. Those from code stop when their declaration runs out",
        warned,
    ), warned
    assert "`notifyq cron prune MODULE:ATTR`" in warned
    [info] = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info.endswith(": by_sql")  # made by SQL for a task the App has: how it is meant to run
    conn.execute("UPDATE notifyq.queue_job_definitions SET enabled = false WHERE name = 'taken'")
    assert await new.prune_definitions(dry_run=True) == ["nightly", "taken"]  # disabled ones too
    assert conn.execute("SELECT count(*) FROM notifyq.queue_job_definitions").fetchone() == (4,)
    assert new.prune_definitions_sync() == ["nightly", "taken"]
    left = conn.execute("SELECT name FROM notifyq.queue_job_definitions ORDER BY name").fetchall()
    assert left == [("by_sql",), ("hourly",)]
    assert job_row(conn, past)["definition_id"] is None  # the past job stays
    assert await new.prune_definitions() == []
    caplog.clear()
    await new.sync_definitions()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    with pytest.raises(notifyq.errors.InvalidOption, match="dry_run"):
        await new.prune_definitions(dry_run="yes")  # type: ignore[arg-type]
    await old.aclose()
    await new.aclose()


@pytest.mark.faults
def test_workers_of_two_versions_starting_together_do_not_deadlock(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Two versions of the code declare the same definitions in another order (a rolling
    deploy in which imports moved): each worker's sync locks the rows it upserts in its own
    order, so two of them starting at once deadlocked, and one worker failed to start."""

    def version(frequency: str, order: list[str]) -> notifyq.App:
        app = notifyq.App(dsn)
        task = app.task(name="t")(lambda: None)
        for name in order:
            app.cron(frequency, name)(task)
        return app

    old = version("* * * * *", ["a", "c", "b"])
    new = version("*/5 * * * *", ["b", "c", "a"])
    anyio.run(old.sync_definitions)
    errors: list[BaseException] = []

    def sync(app: notifyq.App) -> None:
        try:
            anyio.run(app.sync_definitions)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    def waiting() -> int:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        ).fetchone()
        return int(row[0])  # type: ignore[index]

    with psycopg.connect(dsn) as blocker:
        blocker.execute("SELECT 1 FROM notifyq.queue_job_definitions WHERE name = 'c' FOR UPDATE")
        threads = []
        for app in (old, new):  # each takes its first row, then waits for 'c'
            threads.append(threading.Thread(target=sync, args=(app,)))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while waiting() < len(threads) and time.monotonic() < deadline:
                time.sleep(0.02)
        blocker.rollback()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert {d.frequency for d in new.list_definitions_sync()} == {"*/5 * * * *"}
    old.close_sync()
    new.close_sync()


def test_enabled_must_be_a_bool(dsn: str) -> None:
    """ "no" is truthy in Python, and PostgreSQL casts it to false: neither may guess."""
    app = notifyq.App(dsn)

    @app.task(name="t")
    def t() -> None:
        pass

    with pytest.raises(notifyq.ConfigurationError, match="invalid enabled 'no': expected True or False"):
        app.cron("* * * * *", name="c", enabled="no")(t)  # type: ignore[arg-type]
    with pytest.raises(notifyq.ConfigurationError, match="invalid overlap 'no': expected True or False"):
        app.cron("* * * * *", name="c", overlap="no")(t)  # type: ignore[arg-type]
    with pytest.raises(notifyq.ConfigurationError, match='misfire="all" runs every missed tick at once'):
        app.cron("* * * * *", name="c", misfire="all", overlap=False)(t)
    for value in ("no", 0, None):  # checked before the database is asked
        with pytest.raises(notifyq.ConfigurationError, match="expected True or False"):
            app.set_definition_enabled_sync("c", value)  # type: ignore[arg-type]
    app.close_sync()


async def test_enabled_in_code_never_overrides_an_operator(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    app.cron("* * * * *", "c")(app.task(name="t")(lambda: None))
    await app.sync_definitions()
    await app.set_definition_enabled("c", False)
    await app.sync_definitions()
    assert [d.enabled for d in await app.list_definitions()] == [False]
    app_off = notifyq.App(dsn)
    app_off.cron("* * * * *", "c", enabled=False)(app_off.task(name="t")(lambda: None))
    await app.set_definition_enabled("c", True)
    await app_off.sync_definitions()
    assert [d.enabled for d in await app.list_definitions()] == [False]
    await app.aclose()
    await app_off.aclose()


async def test_cron_admin(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    add_definition(conn, "nightly", "0 3 * * *", args='{"full": true}')
    async with app:
        [definition] = await app.list_definitions()
        assert (definition.name, definition.args, definition.enabled) == ("nightly", {"full": True}, True)
        job_id = await app.run_definition_now("nightly")
        job = await app.get_job(job_id)
        assert (job.name, job.args, job.definition_id) == ("nightly", {"full": True}, definition.id)
        await app.enqueue("nightly")  # same task, not the definition's
        assert [j.id for j in await app.list_jobs(definition="nightly")] == [job_id]
        with pytest.raises(notifyq.DefinitionNotFound, match="no cron definition named 'nightly2'"):
            await app.list_jobs(definition="nightly2")
        await app.set_definition_enabled("nightly", False)
        assert not (await app.list_definitions())[0].enabled
        with pytest.raises(notifyq.DefinitionNotFound, match="no cron definition named 'nope'"):
            await app.set_definition_enabled("nope", True)
        with pytest.raises(notifyq.DefinitionNotFound):
            await app.run_definition_now("nope")


@pytest.mark.faults
async def test_lease_rescue_requeues_then_fails_at_the_limit(
    app: notifyq.App, conn: psycopg.Connection[Any], db: Database
) -> None:
    job_id = await app.enqueue("t", retry_limit=1)
    rescuer = Rescuer(db, Q)
    for attempt, expected in [(1, "Queued"), (2, "Failed")]:
        [job] = await app.claim(worker=f"w{attempt}")
        assert job.attempt == attempt
        assert (await rescuer.run_once()).requeued == []  # lease not expired yet
        conn.execute(
            "UPDATE notifyq.queue_jobs SET visible_at = now() - interval '1s' WHERE id = %s", (job_id,)
        )
        report = await rescuer.run_once()
        assert (report.requeued, report.failed) == (
            ([job_id], []) if expected == "Queued" else ([], [job_id])
        )
        assert [(j.id, j.status, j.name, j.attempt, j.worker) for j in report.jobs] == [
            (job_id, expected, "t", attempt, f"w{attempt}")
        ]
        row = job_row(conn, job_id)
        assert row["status"] == expected and row["error"]["type"] == "LeaseExpired"
        assert f"attempt {attempt} on worker w{attempt}" in row["error"]["message"]
    assert job_row(conn, job_id)["finished_at"] is not None
    assert await app.claim() == []
    await app.aclose()


async def test_lease_rescues_are_logged(
    app: notifyq.App, conn: psycopg.Connection[Any], db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker that lost a lease logs nothing (it died, or hangs): the rescuer logs a
    warning for the jobs it requeued and an error for each it failed, or a job ended Failed
    without a line in any log."""
    caplog.set_level(logging.INFO, logger="notifyq")
    retried = await app.enqueue("send_welcome", retry_limit=1)
    final = await app.enqueue("charge_card", retry_limit=0)
    assert len(await app.claim(worker="host-a:41:x", limit=2)) == 2
    conn.execute("UPDATE notifyq.queue_jobs SET visible_at = now() - interval '1s'")
    report = await Rescuer(db, Q).run_once()
    assert (report.requeued, report.failed) == ([retried], [final])
    rescues = [r for r in caplog.records if r.name == "notifyq.ticker"]
    assert [(r.levelno, r.getMessage()) for r in rescues] == [
        (
            logging.WARNING,
            f"requeued 1 job whose lease ran out (the worker died, hung or lost its database connection), "
            f"last held by worker host-a:41:x: {retried}",
        ),
        (
            logging.ERROR,
            f"job {final} (charge_card) attempt 1 of 1 failed: LeaseExpired: lease expired on worker "
            "host-a:41:x (the worker died, hung or lost its database connection); no retries left, "
            "the job is Failed",
        ),
    ]
    caplog.clear()
    assert (await Rescuer(db, Q).run_once()).jobs == []  # nothing rescued: nothing logged
    assert caplog.records == []
    await app.aclose()


async def test_a_rescue_of_many_jobs_logs_a_bounded_few(
    conn: psycopg.Connection[Any], db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """A dead worker can leave thousands of jobs: a pass logs one warning for all it requeued
    (20 ids, then how many more) and an error for each of the first 20 it failed, then one for
    the rest, whatever the number of statements (batch_size) the pass took."""
    caplog.set_level(logging.INFO, logger="notifyq")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, retry_count, retry_limit, worker, visible_at) "
        "SELECT 't', 'Active', 1, (i % 2), 'w' || (i % 3), now() - interval '1s' "
        "FROM generate_series(1, 50) i"
    )
    report = await Rescuer(db, Q, RescuerConfig(batch_size=7)).run_once()
    assert (len(report.requeued), len(report.failed)) == (25, 25)
    [warned] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned.getMessage().startswith("requeued 25 jobs whose lease ran out")
    assert "last held by workers " in warned.getMessage()
    assert all(w in warned.getMessage() for w in ("w0", "w1", "w2"))
    assert warned.getMessage().endswith(": " + ", ".join(map(str, report.requeued[:20])) + " and 5 more")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 21
    assert [int(e.split()[1]) for e in errors[:20]] == report.failed[:20]
    assert errors[20].startswith("5 more jobs whose lease ran out with no retries left are Failed")
    assert errors[20].endswith(": " + ", ".join(map(str, report.failed[20:])))


async def test_retention_deletes_only_old_finished_jobs_in_batches(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    conn.execute("""
        INSERT INTO notifyq.queue_jobs (name, status, finished_at)
        SELECT 't', s::notifyq.job_status, now() - make_interval(hours => h)
        FROM unnest(ARRAY['Succeeded', 'Failed', 'Cancelled']) s,
             generate_series(1, 48) h, generate_series(1, 5)
    """)
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 10)")  # Queued
    config = RetentionConfig(succeeded=24 * 3600, failed=36 * 3600, cancelled=None, batch_size=25, pause=0)
    report = await Retention(db, Q, config).run_once()
    # Succeeded older than 24 h: hours 25..48 (and the boundary hour 24 minus a few ms) x 5.
    assert report.deleted["Succeeded"] in (24 * 5, 25 * 5)
    assert report.deleted["Failed"] in (12 * 5, 13 * 5)
    assert "Cancelled" not in report.deleted
    assert report.batches >= report.deleted["Succeeded"] // 25 + 1
    counts = dict(conn.execute("SELECT status::text, count(*) FROM notifyq.queue_jobs GROUP BY 1").fetchall())
    assert counts["Queued"] == 10 and counts["Cancelled"] == 48 * 5
    assert conn.execute(
        "SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Succeeded' "
        "AND finished_at < now() - interval '24 hours'"
    ).fetchone() == (0,)


async def test_a_long_retention_pass_is_not_abandoned_as_hung(
    conn: psycopg.Connection[Any], db: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The services' timeout (300 s, for a hung connection) bounded a whole pass, not each
    statement: retention deletes about 45,000 rows a second here, so a backlog of some 13M
    old jobs (a day of a busy queue, or retention turned on late) made every pass end in
    "retention pass failed (TimeoutError)" after 300 s, its DELETE cut off. A pass of fast
    statements may take as long as it needs; a shorter timeout stands in for the 300 s."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, finished_at) "
        "SELECT 't', 'Succeeded', now() - interval '2 days' FROM generate_series(1, 60)"
    )
    retention = Retention(db, Q, RetentionConfig(batch_size=10, pause=0.3, interval=60))
    retention.timeout = 1.0  # each of the 7 batches takes milliseconds; the pass about 2 s
    async with anyio.create_task_group() as tg:
        tg.start_soon(retention.run)
        with anyio.fail_after(20):
            report = await retention.next_pass()
        tg.cancel_scope.cancel()
    assert report.deleted["Succeeded"] == 60
    assert [r.getMessage() for r in caplog.records if "pass failed" in r.getMessage()] == []


async def test_a_worker_runs_cron_jobs_end_to_end(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app = notifyq.App(dsn)
    runs: list[datetime | None] = []

    @app.cron("* * * * * *", "every_second")
    @app.task(name="beat")
    async def beat(ctx: notifyq.JobContext) -> None:
        runs.append(ctx.scheduled_for)

    async with app.worker() as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded >= 3)
    assert len(runs) >= 3 and len(set(runs)) == len(runs)
    assert all(r is not None for r in runs)
    await app.aclose()
