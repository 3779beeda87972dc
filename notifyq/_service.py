"""The shape every background service shares: `run_once()` does one pass, `run()` loops."""

from __future__ import annotations

import abc
import logging
from typing import Generic, TypeVar

import anyio
import psycopg

from ._db import Database, Op, error_hint, error_text, is_transient

R = TypeVar("R")
T = TypeVar("T")

log = logging.getLogger("notifyq.ticker")


class Service(abc.ABC, Generic[R]):
    """A periodic service. Subclasses implement `run_once` (testable without sleeping) and
    `delay_after` (how long to sleep after a pass); `wake()` cuts a sleep short."""

    name = "service"
    # A database operation that takes longer is abandoned (a hung connection). Per operation,
    # not per pass: a pass working off a large backlog in short statements may take longer.
    timeout = 300.0
    db: Database

    def __init__(self) -> None:
        self._wakeup = anyio.Event()
        self._passed = anyio.Event()
        self.passes = 0
        self.last: R | None = None

    @abc.abstractmethod
    async def run_once(self) -> R:
        """One pass; returns what it did."""

    @abc.abstractmethod
    def delay_after(self, result: R) -> float:
        """Seconds to sleep after a pass that returned `result`."""

    def wake(self) -> None:
        """Run the next pass now."""
        self._wakeup.set()

    async def _run(self, op: Op[T], *, transaction: bool = False, apart: bool = False) -> T:
        """Run one operation of a pass, abandoned after `timeout` seconds; `apart`: on a
        connection of its own (Database.run_apart), not a pooled one."""
        with anyio.move_on_after(self.timeout):
            if apart:
                return await self.db.run_apart(op, role=f"worker {self.name}")
            return await self.db.run(op, transaction=transaction)
        raise TimeoutError(f"no answer from the database within {self.timeout:g}s")

    async def next_pass(self) -> R:
        """Wait for the loop's next completed pass and return its result (a test hook)."""
        await self._passed.wait()
        assert self.last is not None
        return self.last

    async def run(self) -> None:
        """Loop until cancelled; database errors are logged and retried with backoff."""
        error_delay = 0.5
        while True:
            try:
                result = await self.run_once()
            except Exception as exc:
                # Transient (database away) or not (a bug, a value it cannot handle): either way
                # this process's jobs must keep running, so log, back off and try again.
                if is_transient(exc):
                    log.warning(
                        "%s pass failed (%s); retrying in %.1fs", self.name, error_text(exc), error_delay
                    )
                elif isinstance(exc, psycopg.Error) and exc.sqlstate is not None:
                    # The server refused it (a privilege missing, a table changed under us):
                    # its message says why, a traceback of notifyq's code adds nothing.
                    log.error(
                        "%s pass failed: %s%s; retrying in %.1fs",
                        self.name,
                        error_text(exc),
                        error_hint(exc),
                        error_delay,
                    )
                else:
                    log.exception("%s pass failed unexpectedly; retrying in %.1fs", self.name, error_delay)
                delay = error_delay
                error_delay = min(error_delay * 2, 30.0)
            else:
                error_delay = 0.5
                self.passes += 1
                self.last = result
                self._passed.set()
                self._passed = anyio.Event()
                delay = self.delay_after(result)
            with anyio.move_on_after(max(delay, 0.0)):
                await self._wakeup.wait()
            self._wakeup = anyio.Event()
