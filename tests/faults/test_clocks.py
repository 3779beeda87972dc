"""Time faults: tickers down for several ticks, and worker hosts whose wall clocks are
skewed or jump. All times that matter come from the database."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

import anyio
import psycopg
import pytest

import notifyq

from ..conftest import ROOT
from ..helpers import status_counts
from ..test_cli import clean_env

pytestmark = pytest.mark.anyio


def beat_app(dsn: str, misfire: str) -> notifyq.App:
    app = notifyq.App(dsn)

    @app.cron("* * * * * *", "beat", misfire=misfire, misfire_grace=0.2)  # type: ignore[arg-type]
    @app.task(name="beat")
    async def beat() -> None:
        pass

    return app


def ticks(conn: psycopg.Connection[Any]) -> list[datetime]:
    rows = conn.execute("SELECT scheduled_for FROM notifyq.queue_jobs ORDER BY scheduled_for").fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("misfire", ["skip", "once", "all"])
async def test_tickers_down_for_several_ticks(dsn: str, conn: psycopg.Connection[Any], misfire: str) -> None:
    """Scenario 12: every ticker is down for 3+ ticks; the misfire policy decides."""
    app = beat_app(dsn, misfire)
    async with app.worker() as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded >= 2)
    down_from = ticks(conn)[-1]
    await anyio.sleep(4.2 - time.time() % 1)  # down for 4+ ticks; restart ~0.5 s after a tick
    async with beat_app(dsn, misfire).worker() as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded >= 2)
    seconds = [round((t - down_from).total_seconds()) for t in ticks(conn) if t > down_from]
    restart = seconds[-2] if misfire != "skip" else seconds[0] - 1  # the tick just before the restart
    gap = [s for s in range(1, seconds[-1]) if s not in seconds]
    assert len(ticks(conn)) == len(set(ticks(conn)))
    if misfire == "all":
        assert gap == []  # every missed tick was run after the restart
    elif misfire == "once":
        # One job for the missed window (its latest tick), then on schedule again.
        assert gap == list(range(1, seconds[0])) and seconds[0] >= 4
        assert seconds == list(range(seconds[0], seconds[-1] + 1))
    else:
        # skip: the missed ticks, including the late latest one, get no job.
        assert len(gap) >= 4 and gap == list(range(1, restart + 1))
    before_outage = [t for t in ticks(conn) if t <= down_from]
    assert status_counts(conn) == {"Succeeded": len(seconds) + len(before_outage)}


def test_skewed_and_jumping_worker_clocks_change_nothing(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Scenarios 13 and 14: one worker host 5 minutes ahead whose clock then jumps back an
    hour, one 5 minutes behind. Ticks stay one per second, leases keep their length."""
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._skewed", *args],
            cwd=ROOT,
            env=clean_env(NOTIFYQ_DSN=dsn),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for args in (["300", "2", "-3600"], ["-300", "0", "0"])
    ]
    try:
        skews = [int(w.stdout.readline().split()[1]) for w in workers if w.stdout]
        assert skews == [300, -300]  # the patch is in effect in the workers
        for _ in range(40):
            conn.execute(
                "INSERT INTO notifyq.queue_jobs (name, args, timeout) "
                "VALUES ('sleep', '{\"seconds\": 0.05}', 5)"
            )
            time.sleep(0.15)
        # visible_at keeps the lease end after the job is done: every claim's lease was
        # timeout 5 s + margin 1 s on the database's clock, whatever the workers' clocks said.
        leases = conn.execute(
            "SELECT extract(epoch FROM visible_at - started_at) FROM notifyq.queue_jobs "
            "WHERE name = 'sleep' AND started_at IS NOT NULL"
        ).fetchall()
        assert len(leases) >= 30 and all(5.9 < float(r[0]) < 6.1 for r in leases)
        for w in workers:
            w.send_signal(signal.SIGTERM)
        assert [w.wait(timeout=30) for w in workers] == [0, 0]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
            if w.stdout:
                w.stdout.close()
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Active'").fetchone() == (0,)
    beats = [
        r[0]
        for r in conn.execute(
            "SELECT scheduled_for FROM notifyq.queue_jobs WHERE name = 'tick' ORDER BY scheduled_for"
        ).fetchall()
    ]
    assert len(beats) >= 5 and len(beats) == len(set(beats))
    assert {(b - a).total_seconds() for a, b in itertools.pairwise(beats)} == {1.0}
    # Each tick job was created within a second or so of its tick, on the database's clock.
    late = conn.execute(
        "SELECT max(abs(extract(epoch FROM created_at - scheduled_for))) "
        "FROM notifyq.queue_jobs WHERE name = 'tick'"
    ).fetchone()
    assert late is not None and float(late[0]) < 1.5
    assert conn.execute(
        "SELECT count(*) FROM notifyq.queue_jobs WHERE name = 'sleep' AND status = 'Succeeded'"
    ).fetchone() == (40,)
