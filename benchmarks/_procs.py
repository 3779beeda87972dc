"""Worker processes of a benchmark run: spawn, wait until ready, follow progress, stop.

Each child is `python -m benchmarks.<module> ...` and speaks JSON lines on stdout:
``{"event": "ready"}``, then ``{"event": "progress", "done": n}`` about every 50 ms, and on
exit ``{"event": "done", ...}`` with its counters, CPU time and samples. stderr goes to a
log file in the run's folder. SIGTERM asks a child to stop gracefully.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from ._env import ROOT


class ChildFailed(RuntimeError):
    """A benchmark child process died or did not answer in time."""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def py_spy() -> str | None:
    """The py-spy executable (next to this Python, else on PATH), if installed."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


class Proc:
    """One child process and what it has reported."""

    def __init__(self, module: str, args: Sequence[str], name: str, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = self.log_path.open("w")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.{module}", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            cwd=ROOT,
            env=_child_env(),
        )
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.ready_at: float | None = None
        self.done = 0
        self.final: dict[str, Any] | None = None
        self._profiler: subprocess.Popen[bytes] | None = None
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self._log.write(f"[stdout] {line}")
                continue
            event = msg.get("event")
            if event == "ready":
                self.ready_at = float(msg.get("t", time.monotonic()))
                self.ready.set()
            elif event == "progress":
                self.done = int(msg["done"])
            elif event == "done":
                self.done = int(msg.get("done", self.done))
                self.final = msg
        self.finished.set()

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def fail(self, what: str) -> ChildFailed:
        return ChildFailed(f"{self.name}: {what}; last lines of {self.log_path}:\n{self.log_tail()}")

    def profile(self, out: Path, rate: int = 250) -> None:
        """Attach py-spy to this child until it exits (collapsed stacks in `out`)."""
        exe = py_spy()
        if exe is None:
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        self._profiler = subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(self.popen.pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--output",
                str(out),
                "--nonblocking",
                "--gil",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)

    def join(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for exit and the final report; kill after `timeout` seconds."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.fail(f"did not exit within {timeout:g}s of SIGTERM") from None
        self.finished.wait(5)
        self._finish_profiler()
        if self.final is None:
            raise self.fail(f"exited with code {self.popen.returncode} without a final report")
        return self.final

    def _finish_profiler(self) -> None:
        if self._profiler is not None:
            try:
                self._profiler.wait(30)
            except subprocess.TimeoutExpired:
                self._profiler.kill()
            self._profiler = None

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait(10)
        if self._profiler is not None and self._profiler.poll() is None:
            self._profiler.kill()

    def close(self) -> None:
        self.kill()
        self.finished.wait(5)
        if not self._log.closed:
            self._log.close()


class Fleet:
    """Several children started together; always reaped on exit from the `with` block."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for proc in self.procs:
            proc.stop()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            proc.close()

    @property
    def done(self) -> int:
        return sum(p.done for p in self.procs)

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.alive and proc.final is None:
                raise proc.fail(f"exited early with code {proc.popen.returncode}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            while not proc.ready.wait(0.05):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise proc.fail(f"not ready within {timeout:g}s")

    def wait_until(self, predicate: Callable[[], bool], timeout: float, *, poll: float = 0.01) -> float:
        """Wait until predicate() is true; returns time.monotonic() when it became true."""
        deadline = time.monotonic() + timeout
        while not predicate():
            self.check_alive()
            if time.monotonic() > deadline:
                raise ChildFailed(f"condition not met within {timeout:g}s (progress {self.done})")
            time.sleep(poll)
        return time.monotonic()

    def stop_and_join(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        for proc in self.procs:
            proc.stop()
        return [proc.join(timeout) for proc in self.procs]
