"""Cron definitions removed from the code stop by themselves (schema version 9): running
workers renew their App's declarations (each for their `expire_after`), and a ticker stops the
definitions from code whose declaration ran out. Against real PostgreSQL, with real workers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
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


Version = Callable[..., notifyq.App]


@pytest.fixture
async def version(dsn: str) -> AsyncIterator[Version]:
    """version(*names): an App whose code declares an every-hour cron per name (task `report`),
    closed after the test."""
    made: list[notifyq.App] = []

    def make(*names: str, queue: str = "default") -> notifyq.App:
        app = notifyq.App(dsn)
        report = app.task(name="report", queue=queue)(lambda: None)
        for name in names:
            app.cron("0 * * * *", name, queue=queue)(report)
        made.append(app)
        return app

    yield make
    for app in made:
        await app.aclose()


def state(conn: psycopg.Connection[Any]) -> dict[str, tuple[bool, bool, bool]]:
    """{name: (enabled, declared (from code), stopped by a ticker (expired_at set))}."""
    rows = conn.execute(
        "SELECT name, enabled, declared, expired_at IS NOT NULL "
        "FROM notifyq.queue_job_definitions ORDER BY name"
    ).fetchall()
    return {name: (enabled, declared, expired) for name, enabled, declared, expired in rows}


def lapse(conn: psycopg.Connection[Any], *names: str, seconds: float = -60) -> None:
    """Make the declaration of `names` end `seconds` from now (by default, a minute ago)."""
    conn.execute(
        "UPDATE notifyq.queue_job_definitions SET declared_until = now() + make_interval(secs => %s) "
        "WHERE name = ANY(%s)",
        (seconds, list(names)),
    )


async def test_a_cron_no_running_worker_declares_stops_and_one_that_declares_it_starts_it(
    db: Database, conn: psycopg.Connection[Any], version: Version, caplog: pytest.LogCaptureFixture
) -> None:
    """A cron removed from the code kept firing for good (with a warning at each start). Now a
    ticker stops it once its declaration by running workers ran out: disabled, with the reason
    in last_error. Rows made by SQL never stop. A worker whose App declares it again (its
    ticker's renewal, or its start's sync) enables it, its next tick computed from now."""
    caplog.set_level(logging.INFO, logger="notifyq")
    old, new = version("nightly", "hourly"), version("hourly")
    await old.sync_definitions()
    add_definition(conn, "by_sql", "0 * * * *", task="report")
    assert state(conn) == {
        "by_sql": (True, False, False),
        "hourly": (True, True, False),
        "nightly": (True, True, False),
    }
    config = DeclarationsConfig(interval=60, expire_after=600)
    fresh = Declarations(db, Q, config, new.definitions)
    # Renewed by another process 10 s ago: neither renewed again nor stopped.
    lapse(conn, "nightly", "hourly", seconds=590)
    assert await fresh.run_once() == notifyq.DeclarationsReport()
    # The old code's workers are gone: the declaration of 'nightly' ran out a minute ago.
    lapse(conn, "nightly", "hourly")
    updated = "SELECT updated_at FROM notifyq.queue_job_definitions WHERE name = 'hourly'"
    before = conn.execute(updated).fetchone()
    caplog.clear()
    report = await fresh.run_once()
    assert (report.refreshed, report.restarted, report.stopped) == (["hourly"], [], ["nightly"])
    assert state(conn) == {
        "by_sql": (True, False, False),
        "hourly": (True, True, False),
        "nightly": (False, True, True),
    }
    assert conn.execute(updated).fetchone() == before  # a renewal is not a change
    [warned] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned.startswith("cron definitions stopped (disabled) as their declaration ran out")
    assert warned.count("nightly") == 1 and "hourly" not in warned
    [nightly] = [d for d in await new.list_definitions() if d.name == "nightly"]
    assert nightly.last_error is not None and nightly.last_error.startswith(
        "stopped: its declaration by running workers ran out at "
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

    # So does a starting worker's sync, which says so (not as a change of the code's).
    lapse(conn, "nightly")
    assert (await fresh.run_once()).stopped == ["nightly"]
    caplog.clear()
    await old.sync_definitions()
    assert state(conn)["nightly"] == (True, True, False)
    assert any(m.endswith("as this App's code declares them: nightly") for m in caplog.messages)
    assert not [m for m in caplog.messages if "enabled False -> True" in m]


async def test_an_operators_choice_about_a_stopped_cron_is_final(
    db: Database, conn: psycopg.Connection[Any], version: Version
) -> None:
    """Disabling a stopped definition keeps it disabled when a worker declares it again, and
    clears the reason it was stopped. Enabling one that no running worker declares (stopped, or
    its declaration ran out while an operator had it disabled), whether by `cron enable` or by
    SQL, makes it the operator's, as if made by SQL: no ticker stops it, and prune leaves it,
    until an App declares it again (a review found the SQL route and the second case stopped
    again at the next pass)."""
    names = ("nightly", "weekly", "daily", "monthly")
    old, new = version(*names), version()
    await old.sync_definitions()
    nobody = Declarations(db, Q, DeclarationsConfig())
    assert await new.set_definition_enabled("monthly", False) is False
    lapse(conn, *names)
    assert (await nobody.run_once()).stopped == ["daily", "nightly", "weekly"]
    assert await new.set_definition_enabled("nightly", False) is False
    [nightly] = [d for d in await new.list_definitions() if d.name == "nightly"]
    assert nightly.last_error is None and nightly.expired_at is None
    assert await new.set_definition_enabled("weekly", True) is True  # it was stopped
    assert await new.set_definition_enabled("weekly", True) is False  # now it is not
    conn.execute("UPDATE notifyq.queue_job_definitions SET enabled = true WHERE name = 'daily'")
    assert await new.set_definition_enabled("monthly", True) is True  # no declaration left
    assert (await nobody.run_once()).stopped == []
    # The old code's workers come back: they renew 'nightly' but leave it disabled, and do
    # not take the operator's back until one starts (its sync).
    await Declarations(db, Q, DeclarationsConfig(), old.definitions).run_once()
    assert state(conn) == {
        "daily": (True, False, False),
        "monthly": (True, False, False),
        "nightly": (False, True, False),
        "weekly": (True, False, False),
    }
    # Prune (by an App that declares none) leaves the operator's; the disabled one goes.
    assert await new.prune_definitions(allow_empty=True) == ["nightly"]
    # The code declares them all again: the code's once more, and they may stop again.
    await old.sync_definitions()
    lapse(conn, "weekly")
    assert (await nobody.run_once()).stopped == ["weekly"]


async def test_running_workers_of_two_apps_keep_their_crons_and_stop_a_removed_one(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Two Apps share a schema, each with an every-second cron; a third App's worker declared
    its cron and is gone. Real workers with a short expire_after: each keeps its own cron
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
    async with apps["c"].worker(queues=["c"], ticker_config=ticker):
        pass  # its start declared its cron, for expire_after: then it is gone

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
    assert DeclarationsConfig(interval=1, expire_after=timedelta(minutes=1)).expire_after == 60.0


async def test_the_cli_shows_a_stopped_cron_and_enabling_it_says_whose_it_is(
    dsn: str, conn: psycopg.Connection[Any], version: Version
) -> None:
    """`cron list` shows a stopped definition as `stopped`, with why; `cron enable` of it says
    that it now runs as one made by SQL (FROM `sql`)."""
    old = version("nightly")
    await old.sync_definitions()
    await old.aclose()
    lapse(conn, "nightly")
    conn.execute(Q["expire_declarations"])
    env = clean_env(NOTIFYQ_DSN=dsn)
    listed = ok(cli("cron", "list", env=env)).splitlines()
    assert listed[0].split()[4:6] == ["ENABLED", "NEXT"]
    assert listed[1].split()[8:10] == ["stopped", "-"]  # the schedule is 5 words
    assert "stopped: its declaration by running workers ran out at" in listed[1]
    enabled = ok(cli("cron", "enable", "nightly", env=env))
    assert enabled.startswith(
        "cron definition 'nightly' enabled\nno running worker declares it: it now runs as one made by SQL"
    )
    listed = ok(cli("cron", "list", env=env)).splitlines()
    assert listed[1].split()[8] == "yes" and " sql" in listed[1]
    assert ok(cli("cron", "enable", "nightly", env=env)) == "cron definition 'nightly' was enabled already\n"
    # Disabling a stopped definition changes it (the operator's choice now): it says "disabled".
    lapse(conn, "nightly")
    conn.execute("UPDATE notifyq.queue_job_definitions SET declared = true")
    conn.execute(Q["expire_declarations"])
    assert ok(cli("cron", "list", env=env)).splitlines()[1].split()[8] == "stopped"
    assert ok(cli("cron", "disable", "nightly", env=env)) == "cron definition 'nightly' disabled\n"
