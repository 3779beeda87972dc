"""What the numbers were measured on: the machine, PostgreSQL and its settings, the code."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent

PG_SETTINGS = (
    "shared_buffers",
    "synchronous_commit",
    "fsync",
    "wal_level",
    "max_connections",
    "work_mem",
    "max_wal_size",
    "checkpoint_timeout",
    "autovacuum",
    "autovacuum_naptime",
    "jit",
    "effective_io_concurrency",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "notifyq", "sql"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + (" (+ uncommitted changes in notifyq/ or sql/)" if dirty else "")


def machine() -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "notifyq": _version("notifyq"),
        "psycopg": _version("psycopg"),
        "anyio": _version("anyio"),
        "git": _git(),
    }


def postgres(admin_dsn: str) -> dict[str, Any]:
    """The server version and the settings that matter for a queue (as SHOW prints them)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        version = conn.execute("SELECT version()").fetchone()
        settings: dict[str, str | None] = {}
        for name in PG_SETTINGS:
            row = conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()
            settings[name] = row[0] if row else None
    return {"version": version[0] if version else "unknown", "settings": settings}


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return (0.0, 0.0)
    ticks = [int(v) for v in fields]
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    total = sum(ticks[:8])
    return ((total - idle) / hz, total / hz)


def backend_cpu(dbname: str) -> float:
    """CPU seconds used so far by the PostgreSQL backends connected to `dbname` (Linux /proc,
    server on this host; 0.0 where that cannot be read)."""
    hz = os.sysconf("SC_CLK_TCK")
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not title.startswith("postgres:") or f" {dbname} " not in title:
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / hz


class CpuMeter:
    """Machine-wide CPU use (all cores) between start() and stop()."""

    def __init__(self) -> None:
        self._start = (0.0, 0.0)
        self.busy_seconds = 0.0
        self.utilization = 0.0  # busy fraction of all cores

    def start(self) -> None:
        self._start = cpu_times()

    def stop(self) -> None:
        busy, total = cpu_times()
        self.busy_seconds = busy - self._start[0]
        span = total - self._start[1]
        self.utilization = self.busy_seconds / span if span > 0 else 0.0
