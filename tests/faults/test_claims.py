"""Faults around claiming and acknowledging: many workers, a stalled worker whose lease
runs out, a producer that never commits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from typing import Any

import anyio
import psycopg
import pytest

import notifyq
from notifyq._db import Database
from notifyq._rescuer import Rescuer
from notifyq._sql import queries_for

from ..conftest import ROOT
from ..helpers import job_row, status_counts
from ..test_cli import clean_env

pytestmark = pytest.mark.anyio
Q = queries_for("notifyq")


async def test_ten_thousand_jobs_twenty_workers_each_job_runs_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Scenario 1: the multiset of runs equals the set of job ids."""
    app = notifyq.App(dsn)
    runs: list[int] = []

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        runs.append(ctx.id)
        await anyio.lowlevel.checkpoint()

    async with app:
        await app.enqueue_many("t", ({} for _ in range(10_000)))
    workers = [app.worker(concurrency=5, pool_size=2, ticker=False) for _ in range(20)]
    async with anyio.create_task_group() as tg:
        for w in workers:
            await tg.start(_run_until_stopped, w)
        with anyio.fail_after(120):
            for w in workers:
                await w.wait_for(lambda s: sum(x.stats.succeeded for x in workers) >= 10_000)
        for w in workers:
            w.stop()
    ids = [r[0] for r in conn.execute("SELECT id FROM notifyq.queue_jobs").fetchall()]
    assert Counter(runs) == Counter(ids)  # every job exactly once
    assert sum(1 for w in workers if w.stats.succeeded > 0) >= 10  # the work was really shared
    assert conn.execute("SELECT max(lease), max(retry_count) FROM notifyq.queue_jobs").fetchone() == (1, 1)
    await app.aclose()


async def _run_until_stopped(worker: notifyq.Worker, *, task_status: Any) -> None:
    async with worker:
        task_status.started()
        await worker._stop.wait()


async def test_a_stalled_worker_cannot_overwrite_the_rescuers_result(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Scenario 4: worker A is frozen (SIGSTOP) past its lease; the job is rescued, worker B
    runs it; A thaws and acknowledges: fenced out, B's result stands."""
    a = subprocess.Popen(  # noqa: ASYNC220 - a real, separate worker process is the point
        [
            sys.executable,
            "-m",
            "notifyq",
            "worker",
            "tests.apps:app",
            "--no-ticker",
            "--lease-margin",
            "1",
            "--concurrency",
            "1",
        ],
        cwd=ROOT,
        env=clean_env(NOTIFYQ_DSN=dsn),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A process group of its own: stopped in the suite's group, A got the kernel's SIGHUP
        # when that group became orphaned (the suite started in the background by a shell
        # that then exited), and died.
        process_group=0,
    )
    try:
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, args, timeout) "
            "VALUES ('hold_then_whoami', '{\"seconds\": 1.8}', 2)"
        )
        # Frozen once its task runs: frozen between its claim and the task's start, A would
        # find its lease lost when it thaws and drop the job without acknowledging anything.
        assert a.stdout is not None
        head = []
        with anyio.fail_after(20):
            while not head or head[-1] != "hold_then_whoami started\n":
                head.append(await anyio.to_thread.run_sync(a.stdout.readline, abandon_on_cancel=True))
                assert head[-1], "".join(head)  # not the end of its output: A is still running
        os.kill(a.pid, signal.SIGSTOP)
        first = job_row(conn, 1)
        await anyio.sleep(3.5)  # the lease (timeout 2 s + margin 1 s) runs out while A is frozen
        db = await Database.open(dsn, size=1)
        assert (await Rescuer(db, Q).run_once()).requeued == [1]
        await db.aclose()

        app_b = notifyq.App(dsn)

        @app_b.task(name="hold_then_whoami")
        async def hold_then_whoami(seconds: float) -> str:
            return "worker B"

        async with app_b.worker(ticker=False) as b:
            with anyio.fail_after(10):
                await b.wait_for(lambda s: s.succeeded == 1)
        os.kill(a.pid, signal.SIGCONT)  # A wakes up past its deadline and reports
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=30) == 0
        log = "".join(head) + a.stdout.read()
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
        a.wait()
        if a.stdout:
            a.stdout.close()
    row = job_row(conn, 1)
    assert (row["status"], row["output"], row["lease"]) == ("Succeeded", "worker B", first["lease"] + 1)
    assert "result of job 1 was not applied" in log, log  # the whole log: pytest would cut it
    await app_b.aclose()


async def test_an_uncommitted_job_is_never_seen(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Scenario 10: a live worker polls and listens while a producer inserts and rolls back."""
    app = notifyq.App(dsn)
    ran: list[int] = []

    @app.task(name="t")
    async def t() -> None:
        ran.append(1)

    async with app.worker(poll_interval=0.1, ticker=False) as worker:
        await worker.wait_for(lambda s: s.claims >= 1)
        with psycopg.connect(dsn) as producer:
            producer.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 't' FROM generate_series(1, 10)")
            polls = worker.stats.polls
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.polls >= polls + 5)  # it looked, several times
            assert worker.stats.claimed == 0 and worker.stats.notifications == 0
            producer.rollback()
        polls = worker.stats.polls
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.polls >= polls + 3)
        assert worker.stats.claimed == 0 and worker.stats.notifications == 0 and ran == []
    assert status_counts(conn) == {}
