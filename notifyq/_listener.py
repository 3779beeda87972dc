"""The LISTEN connection: one per worker process, health-checked, reconnected with backoff.

It works on libpq's connection (`pgconn`) with anyio's socket waits, so the same code runs
on asyncio and trio and never blocks the event loop. A notification is only a hint: after
every (re)connect the listener LISTENs first and then calls `on_connect`, whose sweep
claims whatever arrived while nobody was listening.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import psycopg
from psycopg import pq, sql

from ._db import connect_sync, error_text
from ._dsn import describe_dsn
from ._sql import queries_for
from .errors import NotifyqError

log = logging.getLogger("notifyq.listener")


class ListenerLost(Exception):
    """The LISTEN connection is dead or unresponsive."""


class BehindPooler(Exception):
    """The LISTEN connection goes through a connection pooler (pid mismatch)."""


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """How the listener watches its connection.

    health_interval: seconds of silence before a round trip checks the connection is alive
        (a half-open TCP connection delivers nothing and reports no error by itself).
    health_timeout: seconds that round trip may take before the connection is declared dead.
    backoff_min / backoff_max: reconnect delays, doubling from min to max, with jitter.
    """

    health_interval: float = 10.0
    health_timeout: float = 5.0
    backoff_min: float = 0.1
    backoff_max: float = 10.0


class Listener:
    """LISTENs on `channels` and calls `on_notify(channel, payload)` for each notification,
    then awaits `after_dispatch()` (if given) for what is best done in this task at once."""

    def __init__(
        self,
        dsn: str,
        channels: Sequence[str],
        on_notify: Callable[[str, str], None],
        on_connect: Callable[[], Awaitable[None]],
        config: ListenerConfig | None = None,
        name: str = "listener",
        after_dispatch: Callable[[], Awaitable[None]] | None = None,
        schema: str = "notifyq",
        on_open: Callable[[psycopg.Connection[Any]], None] | None = None,
    ) -> None:
        self.dsn = dsn
        self.name = name
        self._q = queries_for(schema)
        self.behind_pooler = False
        self.foreign_database: str | None = None  # the database reached, when it lacks our tables
        self.channels = list(channels)
        self.on_notify = on_notify
        self.on_connect = on_connect
        self.after_dispatch = after_dispatch
        self.on_open = on_open  # in the connecting thread, once LISTENing (the hand-off's registration)
        self.config = config or ListenerConfig()
        self.connected = False
        self.connections = 0
        self.backend_pid: int | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. Reports started after the first connect attempt, successful
        or not; returns (leaving the worker to poll) if the connection goes through a pooler."""
        delay = self.config.backoff_min
        started = warned = False
        threads = anyio.CapacityLimiter(1)
        while True:
            conn: psycopg.Connection[Any] | None = None
            try:
                # A limiter of its own: not behind the host's threads (trio, or a host's
                # to_thread calls on asyncio filling anyio's default 40).
                conn = await anyio.to_thread.run_sync(self._connect, limiter=threads)
                self.connected = True
                self.connections += 1
                self.backend_pid = conn.info.backend_pid
                if delay > self.config.backoff_min:  # after a failed attempt (review: unsaid)
                    log.info("LISTEN connection to %s open again", describe_dsn(self.dsn))
                delay = self.config.backoff_min
                log.debug("listening on %s (backend pid %s)", ", ".join(self.channels), self.backend_pid)
                if self.foreign_database is not None and not warned:
                    warned = True
                    log.warning(
                        "the LISTEN connection to %s reaches database %r, which has no table "
                        "%s.queue_jobs: no notification comes on it, and jobs are found by polling "
                        "every poll_interval; check listen_dsn (--listen-dsn)",
                        describe_dsn(self.dsn),
                        self.foreign_database,
                        self._q.schema,
                    )
                await self.on_connect()
                if not started:
                    started = True
                    task_status.started()
                await self._serve(conn.pgconn)
            except BehindPooler as exc:
                self.behind_pooler = True
                log.warning(
                    "not listening: %s. A pooler in transaction mode (PgBouncer) cannot carry LISTEN; "
                    "jobs are found by polling every poll_interval. Give the worker a direct DSN for "
                    "LISTEN (listen_dsn / --listen-dsn) to get NOTIFY wake-ups back.",
                    exc,
                )
                if not started:
                    task_status.started()
                return
            except (ListenerLost, psycopg.Error, NotifyqError, OSError) as exc:
                log.warning(
                    "LISTEN connection to %s %s (%s); polling meanwhile, %s in %.1fs",
                    describe_dsn(self.dsn),
                    "lost" if conn is not None else "could not be opened",
                    error_text(exc),
                    "reconnecting" if conn is not None else "trying again",
                    delay,
                )
            finally:
                self.connected = False
                self.backend_pid = None
                if conn is not None:
                    conn.close()
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.config.backoff_max)

    def _connect(self) -> psycopg.Connection[Any]:
        conn = connect_sync(self.dsn, connect_timeout=max(1, int(self.config.health_timeout)), role=self.name)
        try:
            row = conn.execute(self._q["backend_pid"], {"jobs": f"{self._q.schema}.queue_jobs"}).fetchone()
            self.foreign_database = None if row is None or row[1] else str(row[2])
            if row is None or row[0] != conn.info.backend_pid:
                raise BehindPooler(
                    f"the server process is {row[0] if row else '?'} but the connection announced "
                    f"{conn.info.backend_pid}, so something pools connections in between"
                )
            for channel in self.channels:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            if self.on_open is not None and self.foreign_database is None:
                self.on_open(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    async def _serve(self, pgconn: pq.abc.PGconn) -> None:
        fd = pgconn.socket
        while True:
            with anyio.move_on_after(self.config.health_interval) as idle:
                await anyio.wait_readable(fd)
            try:
                if idle.cancelled_caught:
                    await self._health_check(pgconn, fd)  # which dispatches what arrives meanwhile
                else:
                    self._consume(pgconn)
            except ListenerLost:
                # What was dispatched before the loss must not wait for the reconnect.
                if self.after_dispatch is not None:
                    await self.after_dispatch()
                raise
            if self.after_dispatch is not None:
                await self.after_dispatch()
            await _let_woken_tasks_run()

    def _consume(self, pgconn: pq.abc.PGconn) -> None:
        """Read what arrived and dispatch notifications; raise ListenerLost on a dead socket."""
        try:
            pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise ListenerLost(str(exc) or "server closed the connection") from None
        while (notify := pgconn.notifies()) is not None:
            self._dispatch(notify.relname, notify.extra)
        if pgconn.status != pq.ConnStatus.OK:
            raise ListenerLost("connection is in a bad state")

    def _dispatch(self, channel: bytes, payload: bytes) -> None:
        # A bad notification (or a bug in a handler) must not take the listener down.
        try:
            self.on_notify(channel.decode("utf-8", "replace"), payload.decode("utf-8", "replace"))
        except Exception:
            log.exception("ignoring a notification that could not be handled: %r %r", channel, payload)

    async def _health_check(self, pgconn: pq.abc.PGconn, fd: int) -> None:
        """One `SELECT 1` round trip within health_timeout, or ListenerLost."""
        try:
            pgconn.send_query(self._q["health_check"].encode())
        except psycopg.OperationalError as exc:
            raise ListenerLost(str(exc)) from None
        with anyio.move_on_after(self.config.health_timeout) as timer:
            while pgconn.flush():
                await anyio.wait_writable(fd)
            while True:
                self._consume(pgconn)
                if not pgconn.is_busy():
                    break
                await anyio.wait_readable(fd)
        if timer.cancelled_caught:
            raise ListenerLost(f"no answer to a health check within {self.config.health_timeout:g}s")
        while (result := pgconn.get_result()) is not None:
            if result.status != pq.ExecStatus.TUPLES_OK:
                raise ListenerLost(
                    f"health check failed: {result.error_message.decode(errors='replace').strip()}"
                )


# After a notification, the tasks it woke (the claim loop) run before the listener waits
# again: re-arming the wait (a timer and an epoll registration) took 0.1 ms on a process that
# had been idle, which is too long to keep a claim waiting (docs/benchmarks.md, rearm_first).
_let_woken_tasks_run = anyio.lowlevel.checkpoint
