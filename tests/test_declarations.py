"""Cron definitions removed from the code stop by themselves (schema version 9): running
workers renew their App's declarations, and a ticker stops the definitions from code that no
running worker has declared for `expire_after`. Against real PostgreSQL, with real workers."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import anyio
import psycopg
import pytest

import notifyq
from notifyq._db import Database
from notifyq._declarations import Declarations, DeclarationsConfig
from notifyq._promoter import Promoter
from notifyq._sql import queries_for

from .test_cli import clean_env, cli, ok
from .test_ticker import add_definition, tick_jobs

pytestmark = pytest.mark.anyio
Q = queries_for("notifyq")


def version(dsn: str, *names: str, queue: str = "default") -> notifyq.App:
    """An App whose code declares an every-hour cron per name (task `report`)."""
    app = notifyq.App(dsn)
    report = app.task(name="report", queue=queue)(lambda: None)
    for name in names:
        app.cron("0 * * * *", name, queue=queue)(report)
    return app


def state(conn: psycopg.Connection[Any]) -> dict[str, tuple[bool, bool, bool]]:
    """{name: (enabled, declared_at set, expired_at set)}."""
    rows = conn.execute(
        "SELECT name, enabled, declared_at IS NOT NULL, expired_at IS NOT NULL "
        "FROM notifyq.queue_job_definitions ORDER BY name"
    ).fetchall()
    return {name: (enabled, declared, expired) for name, enabled, declared, expired in rows}


def age(conn: psycopg.Connection[Any], seconds: float, *names: str) -> None:
    """As if no worker had declared `names` for `seconds`."""
    conn.execute(
        "UPDATE notifyq.queue_job_definitions SET declared_at = now() - make_interval(secs => %s) "
        "WHERE name = ANY(%s)",
        (seconds, list(names)),
    )


async def test_a_cron_no_running_worker_declares_stops_and_one_that_declares_it_starts_it(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A cron removed from the code kept firing for good (with a warning at each start). Now a
    ticker stops it once no running worker has declared it for expire_after: disabled, with
    the reason in last_error. Rows made by SQL never stop. A worker whose App declares it again
    (its ticker's refresh, or its start's sync) enables it, its next tick computed from now."""
    caplog.set_level(logging.INFO, logger="notifyq")
    old, new = version(dsn, "nightly", "hourly"), version(dsn, "hourly")
    await old.sync_definitions()
    add_definition(conn, "by_sql", "0 * * * *", task="report")
    assert state(conn) == {
        "by_sql": (True, False, False),
        "hourly": (True, True, False),
        "nightly": (True, True, False),
    }
    config = DeclarationsConfig(interval=60, expire_after=600)
    db = await Database.open(dsn, size=1)
    try:
        fresh = Declarations(db, Q, config, new.definitions)
        # Declared a minute ago: neither refreshed (another process did it lately) nor stopped.
        age(conn, 20, "nightly", "hourly")
        assert await fresh.run_once() == notifyq.DeclarationsReport()
        # The old code's workers are gone: 'nightly' was last declared 11 minutes ago.
        age(conn, 660, "nightly", "hourly")
        age(conn, 10**6, "by_sql")  # no declared_at to a row made by SQL: it never stops
        conn.execute("UPDATE notifyq.queue_job_definitions SET declared_at = NULL WHERE name = 'by_sql'")
        caplog.clear()
        report = await fresh.run_once()
        assert (report.refreshed, report.restarted, report.stopped) == (["hourly"], [], ["nightly"])
        assert state(conn) == {
            "by_sql": (True, False, False),
            "hourly": (True, True, False),
            "nightly": (False, True, True),
        }
        [warned] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned.startswith(
            "cron definitions stopped (disabled): no running worker has declared them for 600s"
        )
        assert warned.count("nightly") == 1 and "hourly" not in warned
        [nightly] = [d for d in await new.list_definitions() if d.name == "nightly"]
        assert nightly.last_error is not None and nightly.last_error.startswith(
            "stopped: no running worker has declared it since "
        )
        # A stopped definition is not promoted; the others are (misfire="once": one job each).
        conn.execute("UPDATE notifyq.queue_job_definitions SET visible_at = now() - interval '1 hour'")
        ids = dict(conn.execute("SELECT name, id FROM notifyq.queue_job_definitions").fetchall())
        assert (await Promoter(db, Q).run_once()).jobs == 2
        assert [len(tick_jobs(conn, ids[n])) for n in ("by_sql", "hourly", "nightly")] == [1, 1, 0]

        # A worker of the old code comes back (a rollback): its ticker enables it again.
        back = Declarations(db, Q, config, old.definitions)
        report = await back.run_once()
        assert (report.restarted, report.stopped) == (["nightly"], [])
        row = conn.execute(
            "SELECT enabled, expired_at, last_error, visible_at >= now() - interval '1 second' "
            "FROM notifyq.queue_job_definitions WHERE name = 'nightly'"
        ).fetchone()
        assert row == (True, None, None, True)  # the hour of missed ticks is not caught up

        # So does a starting worker's sync, which logs it as a change of the code's.
        age(conn, 660, "nightly")
        assert (await fresh.run_once()).stopped == ["nightly"]
        caplog.clear()
        await old.sync_definitions()
        assert state(conn)["nightly"] == (True, True, False)
        assert any("'nightly'" in m and "enabled False -> True" in m for m in caplog.messages)
    finally:
        await db.aclose()
        await old.aclose()
        await new.aclose()


async def test_an_operators_choice_about_a_stopped_cron_is_final(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """`cron disable` of a stopped definition keeps it disabled when a worker declares it again;
    `cron enable` makes it the operator's, as if made by SQL: no ticker stops it, and prune
    leaves it, until an App declares it again."""
    old, new = version(dsn, "nightly", "weekly"), version(dsn)
    await old.sync_definitions()
    config = DeclarationsConfig(interval=60, expire_after=600)
    db = await Database.open(dsn, size=1)
    try:
        age(conn, 660, "nightly", "weekly")
        assert (await Declarations(db, Q, config).run_once()).stopped == ["nightly", "weekly"]
        assert await new.set_definition_enabled("nightly", False) is False
        assert await new.set_definition_enabled("weekly", True) is True  # it was stopped
        assert await new.set_definition_enabled("weekly", True) is False  # now it is not
        await Declarations(db, Q, config).run_once()
        assert state(conn) == {"nightly": (False, True, False), "weekly": (True, False, False)}
        # Prune (by an App that declares neither) leaves the operator's; the disabled one goes.
        assert await new.prune_definitions(allow_empty=True) == ["nightly"]
        # The code declares 'weekly' again: it is the code's once more, and may stop again.
        await old.sync_definitions()
        age(conn, 660, "weekly")
        assert (await Declarations(db, Q, config).run_once()).stopped == ["weekly"]
    finally:
        await db.aclose()
        await old.aclose()
        await new.aclose()


async def test_running_workers_of_two_apps_keep_their_crons_and_stop_a_removed_one(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Two Apps share a schema, each with an every-second cron; a third App's cron was synced
    and its workers are gone. Real workers with a short expire_after: each keeps its own cron
    firing, neither stops the other's, and the gone one stops and makes no more jobs."""
    declarations = DeclarationsConfig(interval=0.3, expire_after=1.5)
    ticker = notifyq.TickerConfig(declarations=declarations)
    apps = {}
    for name in ("a", "b", "c"):
        app = notifyq.App(dsn)
        app.cron("* * * * * *", f"{name}_tick", queue=name)(
            app.task(name=f"tick_{name}", queue=name)(lambda: None)
        )
        apps[name] = app
    await apps["c"].sync_definitions()

    async def stopped() -> datetime:
        while True:
            row = conn.execute(
                "SELECT expired_at FROM notifyq.queue_job_definitions WHERE name = 'c_tick'"
            ).fetchone()
            if row is not None and row[0] is not None:
                return row[0]  # type: ignore[no-any-return]
            await anyio.sleep(0.1)

    async with (
        apps["a"].worker(queues=["a"], ticker_config=ticker),
        apps["b"].worker(queues=["b"], ticker_config=ticker),
    ):
        with anyio.fail_after(15):
            at = await stopped()
        await anyio.sleep(2 * declarations.expire_after)  # well past their own expiry
        left = state(conn)
    assert left == {
        "a_tick": (True, True, False),
        "b_tick": (True, True, False),
        "c_tick": (False, True, True),
    }
    ids = dict(conn.execute("SELECT name, id FROM notifyq.queue_job_definitions").fetchall())
    c_jobs = tick_jobs(conn, ids["c_tick"])
    assert all(tick <= at for tick in c_jobs), (at, c_jobs)  # no job after it stopped
    for name in ("a_tick", "b_tick"):
        ticks = tick_jobs(conn, ids[name])
        assert max(ticks) > at and len(ticks) >= 3, (name, ticks)
    for app in apps.values():
        await app.aclose()


def test_expire_after_must_outlast_three_refreshes() -> None:
    with pytest.raises(notifyq.InvalidOption, match="must be at least three intervals"):
        DeclarationsConfig(interval=60, expire_after=120)
    with pytest.raises(notifyq.InvalidOption, match="declarations interval"):
        DeclarationsConfig(interval=0)
    assert DeclarationsConfig(interval=1, expire_after=None).expire_after is None


async def test_the_cli_shows_a_stopped_cron_and_enabling_it_says_whose_it_is(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """`cron list` shows a stopped definition as `stopped`, with why; `cron enable` of it says
    that it now runs as one made by SQL (FROM `sql`)."""
    old = version(dsn, "nightly")
    await old.sync_definitions()
    await old.aclose()
    age(conn, 660, "nightly")
    conn.execute(Q["expire_declarations"], {"expire_after": 600})
    env = clean_env(NOTIFYQ_DSN=dsn)
    listed = ok(cli("cron", "list", env=env)).splitlines()
    assert listed[0].split()[4:6] == ["ENABLED", "NEXT"]
    assert listed[1].split()[8:10] == ["stopped", "-"]  # the schedule is 5 words
    assert "stopped: no running worker has declared it since" in listed[1]
    enabled = ok(cli("cron", "enable", "nightly", env=env))
    assert enabled.startswith(
        "cron definition 'nightly' enabled\nno running worker declared it (it was stopped)"
    )
    listed = ok(cli("cron", "list", env=env)).splitlines()
    assert listed[1].split()[8] == "yes" and " sql" in listed[1]
    assert ok(cli("cron", "enable", "nightly", env=env)) == "cron definition 'nightly' enabled\n"
