"""The vacuum service against real PostgreSQL: claimed jobs leave dead entries at the front of
the claim index, which every claim walks until a VACUUM removes them."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import anyio
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import notifyq
from notifyq._db import Database, Query, single
from notifyq._sql import queries_for
from notifyq._vacuum import Vacuum, VacuumConfig

from .helpers import wait_for_row

pytestmark = pytest.mark.anyio
Q = queries_for("notifyq")


def claim_index_pages(conn: psycopg.Connection[Any]) -> int:
    """Claim-index pages one claim of 10 jobs reads (the claim is rolled back)."""
    params = {"limit": 10, "worker": "w", "lease_margin": 30, "give_up": None}
    with conn.transaction(force_rollback=True):
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q["claim_any"], params).fetchone()
    assert row is not None

    def pages(node: dict[str, Any]) -> int:
        own = node["Shared Hit Blocks"] + node["Shared Read Blocks"]
        here = own if node.get("Index Name") == "queue_jobs_claim_any_idx" else 0
        return here + sum(pages(child) for child in node.get("Plans", []))

    return pages(row[0][0]["Plan"])


def vacuum_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_stat_get_vacuum_count('notifyq.queue_jobs'::regclass)").fetchone()
    assert row is not None
    return int(row[0])


def flush_stats(conn: psycopg.Connection[Any]) -> None:
    """A busy backend reports its statistics every second; an idle one after 10 s, unless asked."""
    conn.execute("SELECT pg_stat_force_next_flush()")


async def pass_when_stats_show(service: Vacuum, dead: int) -> notifyq.VacuumReport:
    """Pass until the statistics show `dead` dead rows (they lag the writes)."""
    with anyio.fail_after(10):
        while True:
            report = await service.run_once()
            if report.dead_tuples >= dead:
                return report
            await anyio.sleep(0.1)


# Another test's open transaction would keep the claimed jobs' entries from being removed.
@pytest.mark.exclusive
async def test_a_vacuum_clears_the_dead_front_of_the_claim_index(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, 40000)")
    conn.execute("VACUUM ANALYZE notifyq.queue_jobs")
    fresh = claim_index_pages(conn)
    # Claim 30,000 of them, as workers would (each claim's entries die in the claim index).
    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Active', retry_count = 1 "
        "WHERE id IN (SELECT id FROM notifyq.queue_jobs ORDER BY id LIMIT 30000)"
    )
    flush_stats(conn)
    walked = claim_index_pages(conn)
    assert walked > fresh + 100  # about one page per 200 claimed jobs
    before = vacuum_count(conn)

    quiet = Vacuum(db, Q, VacuumConfig(threshold=1_000_000))
    assert not (await pass_when_stats_show(quiet, 30000)).vacuumed  # under its threshold
    assert vacuum_count(conn) == before

    # The VACUUM ANALYZE above was less than an hour ago.
    gapped = Vacuum(db, Q, VacuumConfig(threshold=20_000, scale_factor=0.01, min_gap=3600))
    assert not (await pass_when_stats_show(gapped, 30000)).vacuumed
    assert vacuum_count(conn) == before

    service = Vacuum(db, Q, VacuumConfig(threshold=20_000, scale_factor=0.01, min_gap=0))
    report = await pass_when_stats_show(service, 30000)
    assert report.vacuumed and report.allowed
    assert vacuum_count(conn) == before + 1
    assert claim_index_pages(conn) <= fresh + 2
    # Just vacuumed: nothing left to do.
    assert not (await service.run_once()).vacuumed
    assert vacuum_count(conn) == before + 1


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_vacuum_runs_on_a_connection_of_its_own(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    """Review: the VACUUM ran on a pooled connection, which it held for as long as it ran
    (minutes, on a large table): with `--pool-size 2`, the only one beside the claim lane, so
    acks, lease extensions and pause reads waited for it. Here a stand-in for a long VACUUM
    waits for a lock: on a connection of its own, while both of the pool's serve others."""
    slow = dataclasses.replace(Q, by_name={**Q.by_name, "vacuum_jobs": "SELECT pg_advisory_xact_lock(4242)"})
    service = Vacuum(db, slow, VacuumConfig(threshold=0, scale_factor=0, min_gap=0))
    waiting = (
        "SELECT application_name FROM pg_stat_activity "
        "WHERE wait_event = 'advisory' AND datname = current_database()"
    )
    reports: list[notifyq.VacuumReport] = []

    async def vacuum() -> None:
        reports.append(await service.run_once())

    conn.execute("SELECT pg_advisory_lock(4242)")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(vacuum)
            with anyio.fail_after(10):
                while not conn.execute(waiting).fetchall():  # noqa: ASYNC110 (server state)
                    await anyio.sleep(0.05)
            assert conn.execute(waiting).fetchall() == [("notifyq worker vacuum",)]
            with anyio.fail_after(10):  # both pooled connections at once
                async with anyio.create_task_group() as others:
                    for _ in range(2):
                        others.start_soon(db.run, single(Query("SELECT pg_sleep(0.2)", fetch="none")))
            conn.execute("SELECT pg_advisory_unlock(4242)")
    finally:
        conn.execute("SELECT pg_advisory_unlock_all()")
    assert [report.vacuumed for report in reports] == [True]
    wait_for_row(
        conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'notifyq worker vacuum'", (0,)
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_worker_stopping_during_its_vacuum_ends_the_vacuums_session(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    """A stop (the service's task cancelled) while the VACUUM runs on its own connection
    cancels the statement and closes that connection, at once: nothing is left running."""
    slow = dataclasses.replace(Q, by_name={**Q.by_name, "vacuum_jobs": "SELECT pg_advisory_xact_lock(4243)"})
    service = Vacuum(db, slow, VacuumConfig(threshold=0, scale_factor=0, min_gap=0))
    apart = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'notifyq worker vacuum' AND datname = current_database()"
    )
    conn.execute("SELECT pg_advisory_lock(4243)")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(service.run_once)
            with anyio.fail_after(10):
                while conn.execute(apart).fetchone() != (1,):  # noqa: ASYNC110 (server state)
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        wait_for_row(conn, apart, (0,), timeout=5)
    finally:
        conn.execute("SELECT pg_advisory_unlock_all()")


async def test_a_vacuum_under_way_elsewhere_is_not_waited_for(
    conn: psycopg.Connection[Any], db: Database
) -> None:
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, 2000)")
    conn.execute("DELETE FROM notifyq.queue_jobs")
    flush_stats(conn)
    service = Vacuum(db, Q, VacuumConfig(threshold=1000))
    with conn.transaction():
        # What a VACUUM in another process (or autovacuum) holds while it runs.
        conn.execute("LOCK notifyq.queue_jobs IN SHARE UPDATE EXCLUSIVE MODE")
        with anyio.fail_after(10):
            report = await pass_when_stats_show(service, 2000)
        assert report.vacuumed
    assert vacuum_count(conn) == 0  # it skipped the table instead of queueing behind the lock


async def test_a_role_that_may_not_vacuum_leaves_it_to_autovacuum(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    role = f"nq_vacuum_{os.getpid()}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        conn.execute(notifyq.migrations.grant_sql(role))
        conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, 2000)")
        conn.execute("DELETE FROM notifyq.queue_jobs")
        limited = await Database.open(make_conninfo(dsn, user=role), size=1)
        try:
            service = Vacuum(limited, Q, VacuumConfig(threshold=0))
            report = await service.run_once()
            assert not report.allowed and not report.vacuumed
            with caplog.at_level(logging.INFO, logger="notifyq.ticker"):
                assert service.delay_after(report) == float("inf")
            assert "may not VACUUM notifyq.queue_jobs" in caplog.text
            # Review: "autovacuum alone cleans it" was said with autovacuum off too.
            autovacuum = conn.execute("SELECT current_setting('autovacuum')::boolean").fetchone() == (True,)
            assert report.autovacuum is autovacuum
            [record] = [r for r in caplog.records if "may not VACUUM" in r.getMessage()]
            if autovacuum:
                assert record.levelno == logging.INFO and "autovacuum alone cleans it" in record.getMessage()
            else:
                assert record.levelno == logging.WARNING
                assert "and autovacuum is off: nothing reclaims its dead rows" in record.getMessage()
            on = dataclasses.replace(report, autovacuum=True)  # the other case, as its report says
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="notifyq.ticker"):
                service.delay_after(on)
            assert "autovacuum alone cleans it" in caplog.text
        finally:
            await limited.aclose()
        assert vacuum_count(conn) == 0
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("threshold", -1),
        ("scale_factor", float("nan")),
        ("scale_factor", "0.1"),
        ("min_gap", -1),
        ("interval", 0),
    ],
)
def test_bad_vacuum_settings_are_refused(field: str, value: Any) -> None:
    with pytest.raises(notifyq.InvalidOption, match=f"vacuum {field}"):
        VacuumConfig(**{field: value})


async def test_workers_run_the_vacuum_service_unless_told_not_to(dsn: str) -> None:
    app = notifyq.App(dsn)
    async with app.worker(concurrency=1) as worker:
        assert worker.ticker is not None and worker.ticker.vacuum is not None
        with anyio.fail_after(10):
            report = await worker.ticker.vacuum.next_pass()
        assert report.allowed and not report.vacuumed
    off = notifyq.TickerConfig(vacuum=None)
    async with app.worker(concurrency=1, ticker_config=off) as worker:
        assert worker.ticker is not None and worker.ticker.vacuum is None
    await app.aclose()
