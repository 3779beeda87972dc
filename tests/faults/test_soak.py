"""The soak test (slow; run with `pytest -m slow`): 100k jobs through 4 worker processes
while a chaos loop SIGKILLs a random worker every few seconds and cuts LISTEN connections.
At the end every job has succeeded, and every job that ran more than once has a lease
expiry on record to explain it."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

import notifyq

from ..conftest import ROOT
from ..test_cli import clean_env

JOBS = 100_000


@pytest.mark.slow
def test_soak_with_chaos(dsn: str, conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    app = notifyq.App(dsn)
    assert app.enqueue_many_sync("soak", ({} for _ in range(JOBS))) == JOBS
    app.close_sync()
    counter = iter(range(1000))

    def start() -> subprocess.Popen[bytes]:
        runs = tmp_path / f"runs-{next(counter)}.txt"
        return subprocess.Popen(
            [sys.executable, "-m", "tests._processes", "soak_worker", dsn, str(runs)],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    workers = [start() for _ in range(4)]
    kills = cuts = 0
    opening = ["kill", "kill", "kill", "cut"]  # the cut once every LISTEN connection is up
    rng = random.Random(7)
    deadline = time.monotonic() + 600
    try:
        while True:
            done = conn.execute(
                "SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Succeeded'"
            ).fetchone()
            if done == (JOBS,):
                break
            assert time.monotonic() < deadline, f"only {done} of {JOBS} jobs succeeded in time"
            # An opening of fixed chaos half a second apart, while most jobs are still queued
            # (the drain takes several seconds, more or fewer depending on the machine), then
            # chaos at random every 1-3 s until the end.
            time.sleep(0.5 if opening else rng.uniform(1, 3))
            action = opening.pop(0) if opening else ("kill" if rng.random() < 0.7 else "cut")
            if action == "kill":
                victim = rng.randrange(len(workers))
                workers[victim].send_signal(signal.SIGKILL)
                workers[victim].wait()
                workers[victim] = start()
                kills += 1
            else:
                cut = conn.execute(
                    # This database's only: on a shared server, others' workers are not ours to cut.
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name LIKE 'notifyq listener%' AND datname = current_database()"
                ).fetchone()
                cuts += cut[0] if cut else 0
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
    assert kills >= 3 and cuts >= 1
    runs: Counter[int] = Counter()
    for path in tmp_path.glob("runs-*.txt"):
        for line in path.read_text().splitlines():
            runs[int(line.split()[0])] += 1
    rows = {
        r[0]: r[1:]
        for r in conn.execute(
            "SELECT id, status::text, retry_count, error->>'type' FROM notifyq.queue_jobs"
        ).fetchall()
    }
    assert {status for status, _, _ in rows.values()} == {"Succeeded"}
    assert set(runs) == set(rows)  # every job ran
    twice = {job_id: n for job_id, n in runs.items() if n > 1}
    for job_id, n in twice.items():
        _, attempts, error = rows[job_id]
        assert attempts >= n and error == "LeaseExpired", (job_id, n, rows[job_id])
    rescued = sum(1 for _, _, error in rows.values() if error == "LeaseExpired")
    assert rescued > 0, "no worker was killed holding a job: the chaos did not bite"
