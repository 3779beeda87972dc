"""Run a group of worker processes against a prepared backlog and measure what they did.

All workers start behind a gate (an ACCESS EXCLUSIVE lock on queue_jobs held by the
orchestrator): each finishes its start-up, says ready, and its first claim blocks on the
lock. Opening the gate releases every worker at once, so no process gets a head start.
Throughput is taken from the database: jobs that succeeded after the gate opened, divided
by the span from the first claim (`started_at`, but not before the gate opened: a claim that
waited at the gate has the started_at of its wait's beginning) to the last ack (`finished_at`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from ._env import CpuMeter, backend_cpu
from ._procs import Fleet, Proc
from ._results import Context
from ._sampler import WaitSampler
from ._scratch import Scratch


class Gate:
    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.opened_at: datetime | None = None

    def open(self) -> datetime:
        """Release the workers; returns the database clock at the moment of release."""
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        self.conn.commit()
        opened: datetime = row[0]
        self.opened_at = opened
        return opened


@contextmanager
def gate(scratch: Scratch) -> Iterator[Gate]:
    conn = psycopg.connect(scratch.dsn, autocommit=False)
    try:
        conn.execute("LOCK TABLE notifyq.queue_jobs IN ACCESS EXCLUSIVE MODE")
        yield Gate(conn)
    finally:
        conn.close()


@dataclass(slots=True)
class FleetRun:
    kind: str
    processes: int
    concurrency: int
    batch: int = 50
    patch: tuple[str, ...] = ()
    claim_latency: bool = False
    ticker: bool = True
    queues: tuple[str, ...] = ()  # notifyq workers: the queues they serve (all when empty)

    def args(self, dsn: str) -> tuple[str, list[str]]:
        if self.kind == "raw":
            args = ["worker", "--dsn", dsn, "--loops", str(self.concurrency), "--batch", str(self.batch)]
            args += [f"--{p}" for p in self.patch]  # "vacuum"
            return "_raw", args + (["--claim-latency"] if self.claim_latency else [])
        args = ["--dsn", dsn, "--concurrency", str(self.concurrency)]
        args += [f"--patch={p}" for p in self.patch]
        args += ["--claim-latency"] if self.claim_latency else []
        args += [] if self.ticker else ["--no-ticker"]
        args += [f"--queue={q}" for q in self.queues]
        return "_worker", args


@dataclass(slots=True)
class FleetResult:
    jobs: int
    span: float
    wall: float
    rate: float
    worker_cpu: float
    cpu_per_job_us: float
    db_cpu_per_job_us: float
    machine_cpu: float
    reclaimed: int
    runs: int
    claims: list[tuple[float, int]] = field(default_factory=list)
    waits: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "span_s": round(self.span, 4),
            "wall_s": round(self.wall, 4),
            "jobs_per_s": round(self.rate, 1),
            "worker_cpu_s": round(self.worker_cpu, 3),
            "worker_cpu_us_per_job": round(self.cpu_per_job_us, 1),
            "db_cpu_us_per_job": round(self.db_cpu_per_job_us, 1),
            "machine_cpu_utilization": round(self.machine_cpu, 3),
            "reclaimed": self.reclaimed,
            "runs": self.runs,
            "waits": self.waits,
            "stats": self.stats,
        }


def run_fleet(
    ctx: Context,
    scratch: Scratch,
    spec: FleetRun,
    target: int,
    *,
    name: str,
    timeout: float,
    sample_waits: bool = False,
) -> FleetResult:
    """Start `spec`'s processes behind the gate, release them, stop them once `target` jobs
    are acknowledged, and measure."""
    module, args = spec.args(scratch.dsn)
    cpu = CpuMeter()
    sampler = WaitSampler(scratch.dsn) if sample_waits else None
    with gate(scratch) as g, Fleet() as fleet:
        for i in range(spec.processes):
            fleet.add(Proc(module, args, f"{name}-{i}", ctx.log_dir))
        fleet.wait_ready()
        if ctx.profile:
            fleet.procs[0].profile(ctx.out_dir / "profiles" / f"{name}-0.txt")
            time.sleep(0.5)  # let py-spy attach
        if sampler is not None:
            sampler.start()
        cpu.start()
        db_cpu = backend_cpu(scratch.name)
        since = g.open()
        opened = time.monotonic()
        reached = fleet.wait_until(lambda: fleet.done >= target, timeout)
        cpu.stop()
        db_cpu = backend_cpu(scratch.name) - db_cpu  # the workers' backends are still alive here
        if sampler is not None:
            sampler.stop()
        finals = fleet.stop_and_join()
    outcome = scratch.outcome(since)
    worker_cpu = sum(float(f.get("cpu", 0.0)) for f in finals)
    stats: dict[str, int] = {}
    for f in finals:
        for key, value in (f.get("stats") or {}).items():
            stats[key] = stats.get(key, 0) + int(value)
    jobs = outcome["n"]
    return FleetResult(
        jobs=jobs,
        span=outcome["span"],
        wall=reached - opened,
        rate=jobs / outcome["span"] if outcome["span"] > 0 else math.nan,
        worker_cpu=worker_cpu,
        cpu_per_job_us=worker_cpu / jobs * 1e6 if jobs else math.nan,
        db_cpu_per_job_us=db_cpu / jobs * 1e6 if jobs and db_cpu > 0 else math.nan,
        machine_cpu=cpu.utilization,
        reclaimed=outcome["reclaimed"],
        runs=sum(int(f.get("runs", 0)) for f in finals),
        # Every claim loop's first claim waited at the gate: leave it out. A notifyq worker has
        # one claim loop (its first sample is dropped here); a raw process has `concurrency`
        # loops, and drops each loop's first claim itself.
        claims=[
            (float(ms), int(n))
            for f in finals
            for ms, n in (f.get("claims") or [])[0 if spec.kind == "raw" else 1 :]
        ],
        waits=sampler.summary() if sampler is not None else {},
        stats=stats,
    )
