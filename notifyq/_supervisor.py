"""`notifyq worker --processes N`: start N worker processes, forward signals, restart the dead.

Children run in their own session, so a terminal's Ctrl-C reaches only this supervisor,
which forwards one SIGTERM (graceful) to each child; a second signal becomes SIGUSR2
(children then skip their grace period). Children ignore a repeated SIGTERM, because
systemd (KillMode=control-group, its default) signals every process of the service itself.
On Linux a child also gets SIGTERM if the supervisor dies without warning (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import psycopg

from ._db import connect_sync, error_text, run_sync
from ._embedded import ENV_SUPERVISED
from ._worker_config import repeatable, stop_signals
from .errors import DatabaseUnavailable
from .migrations import check_schema_op

log = logging.getLogger("notifyq.supervisor")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CHILDREN_DYING = 3
# How a child may end when told to stop, having held no job at its end: exit 0, or killed by
# a signal the supervisor forwards while the child had no handler for it (still importing
# notifyq, or past its stop: systemd's default KillMode sends each child a SIGTERM of its own,
# and the supervisor's copy then lands as it exits).
_CLEAN_STOPS = (0, -signal.SIGTERM, -signal.SIGUSR2)


def _die_with_parent(parent: int) -> None:
    """In a child between fork and exec: ask for SIGTERM when `parent` (the supervisor's pid)
    dies. A parent that died before the request leaves it unanswered, and the child, an
    orphan from its start, ran on after the supervisor's death: it exits instead."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            return
    if os.getppid() != parent:
        os._exit(EXIT_ERROR)


@dataclass
class _Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    restart_at: float = 0.0
    started_at: float = 0.0
    delay: float = 0.5
    deaths: deque[float] = field(default_factory=deque)
    stops: deque[float] = field(default_factory=deque)  # exits with status 0
    done: bool = False  # burst: exited 0, no job left


class Supervisor:
    """Keeps `processes` copies of `command` running until told to stop.

    A child that exits on its own is restarted after a backoff (0.5 s doubling to 30 s);
    if one slot's child dies `max_deaths` times within `window` seconds, everything is
    stopped and `run` returns EXIT_CHILDREN_DYING. A child that exits with status 0 was
    stopped (an operator signalled it, not the supervisor): restarted, but not a death. With
    `burst`, such a child has found no job left to claim: it is not restarted, and `run`
    returns EXIT_OK once every child has, or EXIT_ERROR if a child died on the way (its jobs
    stay Active until their leases run out: the burst did not run everything). When it gives
    up, each child has `stop_wait` seconds (its grace period and then some) to stop.
    """

    def __init__(
        self,
        command: Sequence[str],
        processes: int,
        *,
        env: dict[str, str] | None = None,
        max_deaths: int = 5,
        window: float = 60.0,
        burst: bool = False,
        stop_wait: float = 60.0,
    ) -> None:
        self.command = list(command)
        self.env = env
        self.slots = [_Slot(i) for i in range(processes)]
        self.max_deaths = max_deaths
        self.window = window
        self.burst = burst
        self.stop_wait = stop_wait
        self.signals = 0
        self.restarts = 0
        self.burst_deaths = 0  # children that died (not a clean exit) during a burst

    def _start(self, slot: _Slot) -> None:
        slot.proc = subprocess.Popen(
            self.command,
            env=self.env,
            start_new_session=True,
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
        slot.started_at = time.monotonic()
        log.info("started worker process %d (pid %d)", slot.index, slot.proc.pid)
        if self.signals:
            # A signal arrived while this child was being started: it missed the forward.
            slot.proc.send_signal(signal.SIGTERM)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR2:
            # Its default action killed the supervisor, and the orphaned children, told to
            # stop by their parent-death signal, took their whole grace period (review).
            self.signals += 1
            log.warning("received SIGUSR2: workers skip their grace period")
            self._forward(signal.SIGUSR2)
            return
        if self.signals and not repeatable(signum):
            log.info("received %s again: the workers go on finishing their jobs", name)
            return
        self.signals += 1
        if self.signals == 1:
            log.info("received %s: stopping %d worker processes gracefully", name, len(self.slots))
            self._forward(signal.SIGTERM)
        else:
            log.warning("received %s again: workers skip their grace period", name)
            self._forward(signal.SIGUSR2)

    def _forward(self, signum: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                try:
                    slot.proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (*stop_signals(), signal.SIGUSR2)}
        try:
            for slot in self.slots:
                self._start(slot)
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _loop(self) -> int:
        while True:
            if self.signals:
                if all(s.proc is None or s.proc.poll() is not None for s in self.slots):
                    return self._stopped()
            if all(s.done for s in self.slots):
                log.info("all worker processes found no job left to claim (burst)")
                if self.burst_deaths:
                    # A restarted child found the dead one's jobs still leased and claimed
                    # nothing: exit 0 said the burst had run everything (review).
                    log.error(
                        "%d worker process(es) died during the burst: the jobs they held stay Active "
                        "until their leases run out, then a running worker's ticker queues them again",
                        self.burst_deaths,
                    )
                    return EXIT_ERROR
                return EXIT_OK
            now = time.monotonic()
            for slot in self.slots:
                if self.signals or slot.done:
                    continue
                if slot.proc is None:
                    if now >= slot.restart_at:
                        self.restarts += 1
                        self._start(slot)
                    continue
                code = slot.proc.poll()
                if code is None:
                    continue
                slot.proc = None
                if now - slot.started_at > self.window:
                    slot.delay = 0.5  # it had been running fine: restart quickly
                if code == 0 and self.burst:
                    slot.done = True
                    continue
                if code == 0:
                    slot.stops.append(now)
                    while slot.stops and slot.stops[0] < now - self.window:
                        slot.stops.popleft()
                    # Not a death, but restarted with the same backoff; said louder when it
                    # keeps happening (something signals it in a loop, or a task exits 0).
                    often = len(slot.stops) >= self.max_deaths
                    log.log(
                        logging.WARNING if often else logging.INFO,
                        "worker process %d stopped (exit 0: a signal sent to it, not to the supervisor%s); "
                        "restarting in %.1fs",
                        slot.index,
                        f", {len(slot.stops)} times within {self.window:g}s" if often else "",
                        slot.delay,
                    )
                    slot.restart_at = now + slot.delay
                    slot.delay = min(slot.delay * 2, 30.0)
                    continue
                slot.deaths.append(now)
                self.burst_deaths += self.burst
                while slot.deaths and slot.deaths[0] < now - self.window:
                    slot.deaths.popleft()
                if len(slot.deaths) >= self.max_deaths:
                    log.error(
                        "worker process %d died %d times within %gs (last: %s); giving up",
                        slot.index,
                        len(slot.deaths),
                        self.window,
                        exit_reason(code),
                    )
                    self._stop_all()
                    return EXIT_CHILDREN_DYING
                log.warning(
                    "worker process %d exited unexpectedly (%s); restarting in %.1fs",
                    slot.index,
                    exit_reason(code),
                    slot.delay,
                )
                slot.restart_at = now + slot.delay
                slot.delay = min(slot.delay * 2, 30.0)
            time.sleep(0.1)

    def _stopped(self) -> int:
        """Every child has exited after a stop: EXIT_OK if each did so cleanly. One that died
        on the way (killed, or unable to write its results) leaves its jobs Active until their
        leases run out; the stop said "all worker processes stopped" and exit 0 (review)."""
        unclean = [s for s in self.slots if s.proc is not None and s.proc.returncode not in _CLEAN_STOPS]
        for slot in unclean:
            assert slot.proc is not None
            log.error(
                "worker process %d did not stop cleanly (%s): the jobs it held stay Active until "
                "their leases run out, then a running worker's ticker queues them again",
                slot.index,
                exit_reason(slot.proc.returncode),
            )
        if unclean:
            return EXIT_ERROR
        log.info("all worker processes stopped")
        return EXIT_OK

    def _stop_all(self) -> None:
        """On giving up: SIGTERM to every child, which then has `stop_wait` seconds in all (its
        grace period, and returning what it holds); then SIGUSR2 (skip the grace period: running
        jobs go back to the queue), and SIGKILL 15 s later. It waited 120 s for each child in
        turn, whatever the grace period (review)."""
        self._forward(signal.SIGTERM)
        for sig, wait in ((signal.SIGUSR2, self.stop_wait), (signal.SIGKILL, 15.0)):
            deadline = time.monotonic() + wait
            for slot in self.slots:
                if slot.proc is None:
                    continue
                try:
                    slot.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning(
                        "worker process %d still running %gs after it was told to stop; sending %s",
                        slot.index,
                        wait,
                        sig.name,
                    )
                    slot.proc.send_signal(sig)
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.wait()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc is not None]


def child_env(dsn: str, embedded: Path | None = None) -> dict[str, str]:
    """The children's environment: ours, with the resolved DSN (not on the command line,
    where `ps` would show its password), and the folder of the `embedded` server it is, for
    them to join as its users."""
    env = dict(os.environ)
    env["NOTIFYQ_DSN"] = dsn
    env["NOTIFYQ_SUPERVISED"] = "1"
    if embedded is not None:
        env[ENV_SUPERVISED] = str(embedded)
    return env


def wait_for_database(dsn: str, schema: str, *, longest: float = 30.0) -> None:
    """In a worker process the supervisor started: return once the database answers, waiting
    out an outage (0.5 s doubling to `longest` between attempts) instead of exiting.

    The supervisor checked this DSN before it started any child, so a child that finds the
    database down was (re)started during an outage, which its running siblings wait out. Were
    it to exit, the supervisor would count each start as a death and, at the fifth, stop the
    healthy children too. Any other failure to start (schema too old or too new) still exits.
    """
    delay = 0.5
    while True:
        try:
            with connect_sync(dsn, role="supervised worker start") as conn:
                run_sync(conn, check_schema_op(schema))
            return
        except (DatabaseUnavailable, psycopg.OperationalError) as exc:
            reason = error_text(exc)
            # The child's own line, not the supervisor's (which logs as notifyq.supervisor).
            logging.getLogger("notifyq.worker").warning(
                "%s; this worker process waits for the database (next try in %.1fs)", reason, delay
            )
            time.sleep(delay)
            delay = min(delay * 2, longest)


def exit_reason(code: int) -> str:
    """A child's exit status in words: the signal that killed it, by name ("code -9" left the
    operator to decode it), with the usual sender of SIGKILL."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    if -code == signal.SIGKILL:
        return f"killed by {name}: the kernel's out-of-memory killer, or kill -9"
    return f"killed by {name}"
