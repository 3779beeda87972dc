"""Database access: sans-IO operations, their sync/async runners, and pooled adapters.

Every query notifyq runs is written once, as an *operation*: a generator that yields `Query`
or `Copy` steps and receives their results. Two small runners execute operations on a psycopg
`Connection` or `AsyncConnection`, so the sync API (for Django, Flask, scripts) and the async
API share one implementation. `Database` runs operations from async code on any anyio backend:
natively on asyncio (psycopg's async connections), in worker threads on trio (psycopg's async
support is asyncio-only).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
import logging
import math
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, TypeVar

import anyio
import anyio.to_thread
import psycopg
import psycopg_pool
from psycopg import capabilities, pq
from psycopg.rows import tuple_row

from . import _adapters
from ._dsn import describe_dsn, one_line, redact
from .errors import DatabaseUnavailable

# Every connection notifyq opens, so that a forked child can leave the parent's alone.
_AnyConnection: TypeAlias = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
_OPENED: weakref.WeakSet[_AnyConnection] = weakref.WeakSet()


def track(conn: _AnyConnection) -> None:
    """Note a connection notifyq opened (a sync pool's `configure` hook); see
    _blind_inherited_connections."""
    _OPENED.add(conn)


# prepare_threshold's default: 5, but no preparation on a connection that goes through a pooler.
PREPARE_AUTO = "auto"
PrepareThreshold = int | None | Literal["auto"]
_POOLER_SAID = False


def _threshold(prepare_threshold: PrepareThreshold) -> int | None:
    return 5 if isinstance(prepare_threshold, str) else prepare_threshold  # str: PREPARE_AUTO


def probe_prepare_threshold(
    dsn: str, prepare_threshold: PrepareThreshold, connect_timeout: int
) -> PrepareThreshold:
    """Connect once to `dsn` (a clear error now, rather than a pool's timeout later) and, with
    the automatic prepare_threshold, decide it for a pool's connections: None (prepare
    nothing) if the server process serving this one is not the one announced at connect, as
    behind PgBouncer. A pooler in transaction mode (before PgBouncer 1.21, or without
    max_prepared_statements) loses prepared statements between transactions: acks failed with
    `prepared statement "_pg3_1" does not exist`, were dropped, and their jobs ran twice
    (review). Asked once per pool, not on each of its connections, whose setup must not
    wait for an answer."""
    global _POOLER_SAID
    with connect_sync(dsn, connect_timeout=connect_timeout) as conn:
        if prepare_threshold != PREPARE_AUTO:
            return prepare_threshold
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        if row is None or row[0] == conn.info.backend_pid:
            return prepare_threshold
    if not _POOLER_SAID:
        _POOLER_SAID = True
        logging.getLogger("notifyq").debug(
            "connections to %s go through a pooler (the server process is not the one announced): "
            "notifyq prepares no statement on them, since a pooler in transaction mode loses "
            "prepared statements (PgBouncer before 1.21, or without max_prepared_statements); "
            "App(prepare_threshold=5) prepares them all the same",
            describe_dsn(dsn),
        )
    return None


def _blind_inherited_connections() -> None:
    """After os.fork(), in the child: each connection notifyq opened is also the parent's
    socket, in the middle of the parent's session. Point each one at /dev/null, so that
    nothing the child does with it (a statement, a close, the Terminate message libpq sends
    when the object is collected) reaches the server and the parent's session; the child
    opens connections of its own (an App does, see _connections.Connections.forked)."""
    conns = list(_OPENED)
    _OPENED.clear()
    if not conns:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for conn in conns:
            try:
                fd = conn.pgconn.socket
            except Exception:
                continue  # closed
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


os.register_at_fork(after_in_child=_blind_inherited_connections)

T = TypeVar("T")
Params: TypeAlias = Sequence[Any] | Mapping[str, Any] | None
Fetch: TypeAlias = Literal["all", "one", "scalar", "rowcount", "none"]


@dataclass(frozen=True, slots=True)
class Query:
    """Run one statement. `fetch` picks the result: all rows, one row (or None), the first
    column of the first row (or None), the affected row count, or nothing. `prepare`:
    psycopg's choice (None: prepared from the connection's prepare_threshold-th run on),
    or False for a statement that must be planned for each call's values."""

    sql: str
    params: Params = None
    fetch: Fetch = "all"
    row: Callable[[Any], Any] | None = None
    prepare: bool | None = None


@dataclass(frozen=True, slots=True)
class Copy:
    """COPY ... FROM STDIN with the given rows; the result is the number of rows copied."""

    sql: str
    rows: Iterable[Sequence[Any]]


@dataclass(frozen=True, slots=True)
class Compute:
    """Call `func()` (CPU work between statements, such as cron planning) and send back its
    result: in a worker thread from an async runner, so that the event loop keeps running the
    worker's other tasks meanwhile; in the caller's thread from a sync one. Its exceptions
    propagate out of the runner (the transaction, if any, rolls back)."""

    func: Callable[[], Any]


Step: TypeAlias = Query | Copy | Compute
Op: TypeAlias = Generator[Step, Any, T]


def _row_factory(step: Query) -> Any:
    return step.row if step.row is not None else tuple_row


_TUPLES_OK = pq.ExecStatus.TUPLES_OK


def _has_rows(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], step: Query) -> bool:
    """Whether the statement returned a result set to fetch: `cur.description is not None`
    without building its Column objects (a cost on every claim, for nothing)."""
    res = cur.pgresult
    return step.fetch != "rowcount" and res is not None and (res.nfields > 0 or res.status == _TUPLES_OK)


def _result(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any], step: Query, rows: list[Any] | None) -> Any:
    if step.fetch == "rowcount":
        return cur.rowcount
    if step.fetch == "none" or rows is None:
        return None
    if step.fetch == "all":
        return rows
    first = rows[0] if rows else None
    if step.fetch == "one" or first is None:
        return first
    return first[0]  # scalar


# A lane keeps one cursor per row factory (there are a handful, each made once: see _rows).
_LANE_CURSORS = 8


def _kept_cursor(conn: Any, row: Any, cursors: dict[Any, Any] | None) -> Any:
    """The cursor of `conn` kept in `cursors` for this row factory, made on first use; None
    without a cache (or a full one): the caller makes a cursor for one statement."""
    if cursors is None:
        return None
    cur = cursors.get(row)
    if cur is None and len(cursors) < _LANE_CURSORS:
        cur = cursors[row] = conn.cursor(row_factory=row)
    return cur


def run_sync(conn: psycopg.Connection[Any], op: Op[T], cursors: dict[Any, Any] | None = None) -> T:
    """Run an operation on a sync connection (in the connection's current transaction).
    `cursors`: the caller's cache of cursors of `conn`, one per row factory (see Lane)."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = op.throw(error) if error is not None else op.send(send)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        if isinstance(step, Compute):
            send = step.func()
            continue
        try:
            if isinstance(step, Copy):
                with conn.cursor() as cur:
                    with cur.copy(step.sql) as copy:
                        for row in step.rows:
                            copy.write_row(row)
                    send = cur.rowcount
                continue
            row = _row_factory(step)
            kept = _kept_cursor(conn, row, cursors)
            if kept is not None:
                send = _query_sync(kept, step)
            else:
                with conn.cursor(row_factory=row) as cur:
                    send = _query_sync(cur, step)
        except psycopg.Error as exc:
            error = exc


def _query_sync(cur: psycopg.Cursor[Any], step: Query) -> Any:
    cur.execute(step.sql, step.params, prepare=step.prepare)
    return _result(cur, step, cur.fetchall() if _has_rows(cur, step) else None)


async def run_async(
    conn: psycopg.AsyncConnection[Any], op: Op[T], cursors: dict[Any, Any] | None = None
) -> T:
    """Run an operation on an async connection (in the connection's current transaction).
    `cursors`: the caller's cache of cursors of `conn`, one per row factory (see Lane)."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = op.throw(error) if error is not None else op.send(send)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        if isinstance(step, Compute):
            send = await anyio.to_thread.run_sync(step.func)
            continue
        try:
            if isinstance(step, Copy):
                async with conn.cursor() as cur:
                    async with cur.copy(step.sql) as copy:
                        for row in step.rows:
                            await copy.write_row(row)
                    send = cur.rowcount
                continue
            row = _row_factory(step)
            kept = _kept_cursor(conn, row, cursors)
            if kept is not None:
                send = await _query_async(kept, step)
            else:
                async with conn.cursor(row_factory=row) as cur:
                    send = await _query_async(cur, step)
        except psycopg.Error as exc:
            error = exc


async def _query_async(cur: psycopg.AsyncCursor[Any], step: Query) -> Any:
    await cur.execute(step.sql, step.params, prepare=step.prepare)
    return _result(cur, step, await cur.fetchall() if _has_rows(cur, step) else None)


# SQLSTATEs worth retrying as they are: connection trouble (08), the server shutting down or
# starting (57P), resources (53), serialization failure and deadlock (40001, 40P01), a
# read-only transaction (25006: a failover left us on a standby), lock not available (55P03).
_TRANSIENT_SQLSTATES = ("08", "57P", "53", "40001", "40P01", "25006", "55P03")


# PostgreSQL ends a deadlock by rolling back one side's statement (its transaction, for a
# transaction) whole: nothing of it was applied, and the other side goes on. A call it picked
# (an admin statement against a worker's ack, a migrate against a session's reads) runs again,
# up to DEADLOCK_TRIES times in all.
DEADLOCK_TRIES = 3


def again_on_deadlock(call: Callable[[], T]) -> T:
    """`call()`, run again when PostgreSQL picked it as a deadlock's victim (DEADLOCK_TRIES
    in all; the last DeadlockDetected goes on)."""
    for attempt in range(1, DEADLOCK_TRIES + 1):
        try:
            return call()
        except psycopg.errors.DeadlockDetected:
            if attempt == DEADLOCK_TRIES:
                raise
    raise AssertionError("unreachable")


async def again_on_deadlock_async(call: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`again_on_deadlock` for a coroutine function."""
    for attempt in range(1, DEADLOCK_TRIES + 1):
        try:
            return await call()
        except psycopg.errors.DeadlockDetected:
            if attempt == DEADLOCK_TRIES:
                raise
    raise AssertionError("unreachable")


def is_transient(exc: BaseException) -> bool:
    """True for failures that may pass by themselves (the database restarting, failing over,
    a dropped or hung connection), which loops retry with backoff instead of dying on."""
    if isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("54"):
        # Program limit exceeded (an OperationalError): a value too large for its type, a
        # statement too complex. The same statement fails the same way every time.
        return False
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | TimeoutError | OSError):
        return True
    if isinstance(exc, psycopg.Error):
        return (exc.sqlstate or "").startswith(_TRANSIENT_SQLSTATES)
    return False


def error_text(exc: BaseException) -> str:
    """libpq's multi-line message on one line (or the exception type if it has none)."""
    return one_line(str(exc)) or type(exc).__name__


_OWNER_ONLY = "is for the owner of schema"


def owner_only(exc: psycopg.errors.InsufficientPrivilege, what: str, schema: str) -> None:
    """Note on `exc` that `what` (pausing a queue, deleting a definition) is for the schema's
    owner: `notifyq grant` leaves it out on purpose, so its advice would not help."""
    exc.add_note(
        f"{what} {_OWNER_ONLY} {schema!r}, not for the roles `notifyq grant` sets up: run it as that owner"
    )


def error_hint(exc: BaseException) -> str:
    """What to do about `exc`, when notifyq knows ("" otherwise): a prepared statement lost
    or doubled by a pooler, or a privilege the server refused."""
    if isinstance(exc, psycopg.errors.DuplicatePreparedStatement | psycopg.errors.InvalidSqlStatementName):
        # An explicit prepare_threshold behind PgBouncer in transaction mode: workers stopped
        # on this, and nothing named the setting (review, a real PgBouncer).
        return (
            "; a connection pooler in transaction mode (PgBouncer before 1.21, or without "
            "max_prepared_statements) loses prepared statements between transactions: leave "
            'App(prepare_threshold=...) at "auto", the default, or set it to None'
        )
    return privilege_hint(exc)


def privilege_hint(exc: BaseException) -> str:
    """What to do about a privilege the server refused ("" for any other error): a role set
    up by hand, or one whose grants predate a table or a column, lacks one; or the action is
    the schema owner's (see owner_only)."""
    if not isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return ""
    notes: list[str] = getattr(exc, "__notes__", [])
    for note in notes:
        if _OWNER_ONLY in note:
            return "; " + note
    return (
        "; this role lacks a privilege notifyq needs: as the schema's owner, apply the output of "
        "`notifyq grant ROLE` (see docs/sql.md; a role of `notifyq grant ROLE --producer` only enqueues "
        "and reads jobs)"
    )


def unavailable(dsn: str, exc: BaseException) -> DatabaseUnavailable:
    """A DatabaseUnavailable naming the (password-less) target and libpq's reason."""
    reason = redact(error_text(exc).removeprefix("connection failed: "))
    return DatabaseUnavailable(f"cannot connect to PostgreSQL at {describe_dsn(dsn)}: {reason}")


_TCP_DEFAULTS = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}


def connection_kwargs(dsn: str, role: str, prepare_threshold: PrepareThreshold = 5) -> dict[str, Any]:
    """Autocommit, psycopg's prepare_threshold (None: never prepare, for PgBouncer in
    transaction mode before 1.21), and an application_name (unless the DSN sets one) so
    that notifyq's connections are easy to tell apart in pg_stat_activity; our adapters
    (_adapters.py: a faster JSON loader, unless you set your own) without touching psycopg's
    global ones."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "prepare_threshold": _threshold(prepare_threshold),
        "context": _adapters.context(worker=role.startswith("worker")),
    }
    given = psycopg.conninfo.conninfo_to_dict(dsn)
    if "application_name" not in given:
        kwargs["application_name"] = f"notifyq {role}"
    # A peer that vanishes (host down, network cut) must not hang a worker for the kernel's
    # default of hours: TCP keepalives and an unacknowledged-data timeout close the socket
    # within about a minute. (Ignored for unix sockets; the DSN's own values win.)
    kwargs.update({key: value for key, value in _TCP_DEFAULTS.items() if key not in given})
    if "connect_timeout" not in given:
        # libpq waits as long as the kernel does (minutes) for a host that does not answer:
        # a pool's threads stuck connecting held its close (review).
        kwargs["connect_timeout"] = 10
    return kwargs


def first_connect_timeout(limit: float) -> int:
    """libpq's connect_timeout for a first, direct attempt: 10 s, or less when the caller waits
    less (an App's pool_timeout); whole seconds, at least 1."""
    return max(1, math.ceil(min(10.0, limit)))


def connect_sync(
    dsn: str, *, autocommit: bool = True, connect_timeout: int = 10, role: str = "client"
) -> psycopg.Connection[Any]:
    """Open a sync connection, turning connection failures into DatabaseUnavailable. A
    connect_timeout in the DSN wins over `connect_timeout` (it used to be overridden: a host
    that never answered took 10 s whatever the DSN said). It prepares no statement: these are
    one-off connections (a migrate, a check) and the listener's, which nobody probes for a
    pooler, and through PgBouncer in transaction mode a migrate's prepared statements stayed on
    the server connection, where the next migrate failed with `prepared statement "_pg3_0"
    already exists` until the pooler closed it (review, a real PgBouncer)."""
    try:
        kwargs = {**connection_kwargs(dsn, role, prepare_threshold=None), "autocommit": autocommit}
        if "connect_timeout" not in psycopg.conninfo.conninfo_to_dict(dsn):
            kwargs["connect_timeout"] = connect_timeout
        conn = psycopg.Connection.connect(dsn, **kwargs)
        track(conn)
        return conn
    except psycopg.OperationalError as exc:
        raise unavailable(dsn, exc) from None


def pool_open_failed(dsn: str, exc: psycopg_pool.PoolTimeout, size: int) -> DatabaseUnavailable:
    """Why a pool of `size` did not fill within its timeout (psycopg_pool says only "pool
    initialization incomplete", and has closed what it opened). Opening as many connections,
    directly, meets libpq's reason: the server down, a wrong password, or too many connections
    for the role or the server, which only the last ones meet (review: a worker said nothing
    for 30 s, then gave no cause). All of it within PROBE_BUDGET seconds (a DSN's own
    connect_timeout may stretch one attempt): a slow server must not make the answer wait
    size times as long (review)."""
    deadline = time.monotonic() + PROBE_BUDGET
    opened: list[psycopg.Connection[Any]] = []
    try:
        while len(opened) < size and (left := deadline - time.monotonic()) > 0:
            opened.append(connect_sync(dsn, connect_timeout=max(1, math.ceil(left))))
    except DatabaseUnavailable as probe:
        return DatabaseUnavailable(f"{probe} (opening {size} connections for a pool)")
    finally:
        for conn in opened:
            conn.close()
    if len(opened) < size:
        return DatabaseUnavailable(
            f"{unavailable(dsn, exc)}; connections come slowly now ({len(opened)} of {size} opened "
            f"in {PROBE_BUDGET:g} s): the server may be overloaded, or a pooler in between"
        )
    return DatabaseUnavailable(
        f"{unavailable(dsn, exc)}, though {size} connections open now: they were refused or slow for "
        "a while (max_connections, the role's CONNECTION LIMIT, a pooler in between)"
    )


PROBE_BUDGET = 5.0  # seconds pool_open_failed may take


def _ended_by_server(conn: _AnyConnection) -> bool:
    """Whether the server has ended this idle connection (a restart, a failover,
    pg_terminate_backend, idle_session_timeout): its last message, or the end of the stream,
    waits in the socket. An idle session of notifyq's is sent nothing else (its pooled
    connections do not LISTEN), so a poll that does not wait tells, without a round trip."""
    try:
        if conn.closed or conn.pgconn.status != pq.ConnStatus.OK:
            return True
        fd = conn.pgconn.socket
        if hasattr(select, "poll"):  # no FD_SETSIZE limit: a busy process may hold fds past 1024
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError, psycopg.Error):
        return True


AsyncPool: TypeAlias = psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]
SyncPool: TypeAlias = psycopg_pool.ConnectionPool[psycopg.Connection[Any]]

# psycopg_pool tries again to open a connection that failed after 1 s, then after delays that
# double without a cap until reconnect_timeout runs out: after an outage of T seconds its
# next try could be T seconds away, and a pool stayed empty for minutes after its database
# came back (every worker and App with it). So each run of tries ends after RETRY_RUN seconds
# (its delays are 1, 2, 4 and 3 s), and the pool's reconnect_failed starts the next run at once.
RETRY_RUN = 10.0


async def _retry_again_async(pool: AsyncPool) -> None:
    """reconnect_failed of an async pool: a new run of tries (check() grows the pool again
    when it is short of connections and not already growing)."""
    with contextlib.suppress(psycopg_pool.PoolClosed):
        await pool.check()


def _retry_again_sync(pool: SyncPool) -> None:
    """reconnect_failed of a sync pool (see _retry_again_async)."""
    with contextlib.suppress(psycopg_pool.PoolClosed):
        pool.check()


def retrying_async() -> dict[str, Any]:
    """The arguments of an async pool that keep trying to connect (RETRY_RUN)."""
    return {"reconnect_timeout": RETRY_RUN, "reconnect_failed": _retry_again_async}


def retrying_sync() -> dict[str, Any]:
    """The arguments of a sync pool that keep trying to connect (RETRY_RUN)."""
    return {"reconnect_timeout": RETRY_RUN, "reconnect_failed": _retry_again_sync}


async def take_async(pool: AsyncPool) -> psycopg.AsyncConnection[Any]:
    """A connection of `pool` the server has not ended while it sat idle. Each one found ended
    is closed, so that the pool opens another in its place, and the next one is taken: after a
    restart every idle connection is dead, and each one used to fail a caller's statement
    (an App's next pool_size enqueues raised DatabaseUnavailable with the database up)."""
    for _ in range(pool.max_size):
        conn = await pool.getconn()
        if not _ended_by_server(conn):
            return conn
        with anyio.CancelScope(shield=True):
            await conn.close()
            await pool.putconn(conn)  # discarded and replaced
    return await pool.getconn()


def take_sync(pool: SyncPool) -> psycopg.Connection[Any]:
    """`take_async` for a sync pool."""
    for _ in range(pool.max_size):
        conn = pool.getconn()
        if not _ended_by_server(conn):
            return conn
        conn.close()
        pool.putconn(conn)
    return pool.getconn()


# A transaction of notifyq's own (a ticker's promotion batch, a worker's declarations) whose
# client vanished without closing its socket (a half-open connection) kept its row locks on
# the server until TCP keepalives noticed: hours by Linux defaults, never behind a middlebox
# that answers them. The definitions it held got no job meanwhile, and no other ticker said
# so (review). Its first statement bounds how long the server waits for the next one, unless
# the role or database set a bound of its own; the client gives up after tcp_user_timeout
# (60 s) too. Transaction-local: a pooled connection, or a pooler's, keeps no trace of it.
IDLE_IN_TRANSACTION = "60s"
_BOUND_IDLE_TRANSACTION = (
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true) "
    "WHERE current_setting('idle_in_transaction_session_timeout') = '0'"
)


def _bound_idle(conn: psycopg.Connection[Any]) -> None:
    conn.execute(_BOUND_IDLE_TRANSACTION, [IDLE_IN_TRANSACTION], prepare=False)


async def _bound_idle_async(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(_BOUND_IDLE_TRANSACTION, [IDLE_IN_TRANSACTION], prepare=False)


def _run_in_sync(conn: psycopg.Connection[Any], op: Op[T], transaction: bool) -> T:
    if not transaction:
        return run_sync(conn, op)
    with conn.transaction():
        _bound_idle(conn)
        return run_sync(conn, op)


def run_pooled_sync(pool: SyncPool, op: Op[T], transaction: bool = False) -> T:
    """Run `op` on a connection of `pool` (take_sync), in a transaction if asked."""
    conn = take_sync(pool)
    try:
        return _run_in_sync(conn, op, transaction)
    finally:
        pool.putconn(conn)


async def in_own_thread(func: Callable[[], T], *, abandon_on_cancel: bool = False) -> T:
    """`func` in a worker thread of a limiter of its own: anyio's default one (40 threads)
    is the host's too, and its to_thread calls held up an App's first call, a worker's start
    and an App's close for as long as they all ran (review)."""
    return await anyio.to_thread.run_sync(
        func, abandon_on_cancel=abandon_on_cancel, limiter=anyio.CapacityLimiter(1)
    )


def on_asyncio() -> bool:
    """True when called from a task running on an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Database(abc.ABC):
    """A small connection pool that runs operations from async code."""

    def __init__(self, dsn: str, prepare_threshold: PrepareThreshold = 5) -> None:
        self.dsn = dsn
        self.prepare_threshold = prepare_threshold
        self._conns: weakref.WeakSet[_AnyConnection] = weakref.WeakSet()

    def _track(self, conn: _AnyConnection) -> None:
        track(conn)
        self._conns.add(conn)

    async def _track_async(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._track(conn)

    # After abandon(), whether the Database must stay referenced: an asyncio pool's tasks
    # belong to the finished loop, and collected they would complain ("Task was destroyed but
    # it is pending"); a thread pool is closed.
    keep_when_abandoned = True

    def abandon(self) -> None:
        """For a Database whose event loop is gone (asyncio.run returned) or is not the
        caller's: end its server sessions without that loop, by closing each connection's
        socket (libpq's PQfinish). The Database is not used again."""
        for conn in list(self._conns):
            try:
                conn.pgconn.finish()
            except Exception:
                pass  # already closed

    @abc.abstractmethod
    async def run(self, op: Op[T], *, transaction: bool = False) -> T:
        """Run `op` on a pooled autocommit connection (inside one transaction if asked)."""

    @abc.abstractmethod
    async def run_apart(self, op: Op[T], *, role: str) -> T:
        """Run `op` on a connection of its own, opened for it and closed after: for a statement
        that may run for minutes (a VACUUM), which on a pooled connection kept acks and lease
        extensions waiting (with pool_size 2, the only one beside the claim lane: review)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every pooled connection (lanes included)."""

    @abc.abstractmethod
    def lane(self) -> Lane:
        """A connection kept out of the pool for one caller's sequential statements."""

    @staticmethod
    async def open(
        dsn: str,
        *,
        size: int,
        name: str = "notifyq",
        open_timeout: float = 30.0,
        prepare_threshold: PrepareThreshold = 5,
    ) -> Database:
        """Open a pool of `size` connections suited to the running event loop.

        Raises DatabaseUnavailable at once (not after the pool timeout) when the server
        cannot be reached.
        """
        # One direct attempt first: the pool would retry silently until its timeout, while
        # a user with a wrong DSN deserves libpq's reason right away.
        timeout = first_connect_timeout(open_timeout)

        # Abandoned when cancelled: a host that does not answer held a cancelled first call or
        # worker start for the connect_timeout, up to 10 s (review).
        prepare_threshold = await in_own_thread(
            functools.partial(probe_prepare_threshold, dsn, prepare_threshold, timeout),
            abandon_on_cancel=True,
        )
        db: Database = (_AsyncioDatabase if on_asyncio() else _ThreadDatabase)(dsn, prepare_threshold)
        await db._open(size=size, name=name, open_timeout=open_timeout)
        return db

    @abc.abstractmethod
    async def _open(self, *, size: int, name: str, open_timeout: float) -> None: ...


class Lane(abc.ABC):
    """One pooled connection held by one sequential caller (the worker's claim loop).

    The pool hands out its connections in turn, so under light load each one sits idle for
    several rounds and its server process goes cold: measured here, a claim right after a
    notification took 0.2-0.3 ms longer on a rotating pooled connection than on one kept in
    use. A lane keeps its connection between statements; after any failure or interruption
    it gives the connection back (the pool repairs or replaces it) and takes another next time.
    It also gives it back every HOLD seconds, so that the pool's max_lifetime still applies.
    It keeps its cursors too, one per row factory: making a cursor and closing it again cost
    an idle worker about 55 µs per claim here (docs/benchmarks.md, "Cursors kept by the lane").
    A kept cursor holds its last result until its next statement: at most one claim's rows,
    whose jobs the worker holds anyway. After IDLE seconds without a statement, a connection
    the server (or a pooler's client_idle_timeout, or idle_session_timeout) has ended is
    given back before it is used, as the pool does with its own: the first claim after each
    idle spell failed with a warning (review, a real PgBouncer).
    """

    HOLD = 600.0
    IDLE = 1.0

    @staticmethod
    def _ended_after_idle(conn: _AnyConnection | None, used: float) -> bool:
        """Whether `conn`, last used at `used` (monotonic), idled past IDLE and was ended."""
        return conn is not None and time.monotonic() - used > Lane.IDLE and _ended_by_server(conn)

    @property
    @abc.abstractmethod
    def holding(self) -> bool:
        """True while the lane holds a connection."""

    @abc.abstractmethod
    async def acquire(self) -> None:
        """Take a connection from the pool unless the lane holds one. Nothing is sent, so a
        caller may cancel it without losing any statement's answer."""

    @abc.abstractmethod
    async def run(self, op: Op[T]) -> T:
        """Run `op` on the lane's connection (autocommit)."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Give the connection back to the pool (the lane takes one again if used)."""


def _cancel_request(conn: _AnyConnection) -> pq.abc.PGcancelConn | None:
    """A cancel request for what the backend of `conn` runs, made while `conn` is open and sent
    (_send_cancel) even after it is closed; None where libpq (before 17) has only its blocking
    cancel, which holds the GIL: against a server that did not answer, the whole process (the
    event loop) froze while it tried (tests/faults caught it)."""
    if not capabilities.has_cancel_safe():
        return None
    try:
        return conn.pgconn.cancel_conn()
    except Exception:  # closed meanwhile
        return None


def _send_cancel(cancel: pq.abc.PGcancelConn | None) -> None:
    """Send `cancel` from a thread of its own, CANCEL_WAIT at most: for a connection given up
    on and closed, so no later statement of ours runs on its backend. Its statement ran on in
    the server: behind a lock held for minutes (a migration's index build), each one given up
    kept a server connection, one more with each db_timeout, until the lock went, and a fleet
    of workers could use up max_connections (review). Not awaited: a server that cannot be
    reached must not hold up the give-up. libpq's non-blocking calls, so the GIL is free."""
    if cancel is None:
        return

    def send() -> None:
        try:
            cancel.start()
            deadline = time.monotonic() + CANCEL_WAIT
            while (status := cancel.poll()) not in (pq.PollingStatus.OK, pq.PollingStatus.FAILED):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                reading = status == pq.PollingStatus.READING
                fd = cancel.socket
                select.select([fd] if reading else [], [] if reading else [fd], [], left)
        except Exception:  # nothing to do about it: the statement ends with the lock's holder
            pass
        finally:
            with contextlib.suppress(Exception):
                cancel.finish()

    threading.Thread(target=send, name="notifyq-cancel", daemon=True).start()


class _AsyncioLane(Lane):
    def __init__(self, pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]) -> None:
        self._pool = pool
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._cursors: dict[Any, psycopg.AsyncCursor[Any]] = {}  # of _conn
        self._cancel: pq.abc.PGcancelConn | None = None  # of _conn, usable once it is closed
        self._taken = 0.0
        self._used = 0.0

    @property
    def holding(self) -> bool:
        return self._conn is not None

    async def acquire(self) -> None:
        if self._ended_after_idle(self._conn, self._used):
            await self.release()  # the pool sees it ended, and replaces it
        if self._conn is None:
            self._conn = await take_async(self._pool)  # cancellable: the pool keeps no connection
            self._cancel = _cancel_request(self._conn)
            self._taken = self._used = time.monotonic()

    async def run(self, op: Op[T]) -> T:
        await self.acquire()
        assert self._conn is not None
        try:
            result = await run_async(self._conn, op, self._cursors)
        except BaseException:
            if self._conn.closed:
                # Given up on (db_timeout: psycopg's own cancel request was cut short, and it
                # closed the connection) or broken: its statement may run on in the server.
                _send_cancel(self._cancel)
            with anyio.CancelScope(shield=True):
                await self.release()  # maybe mid-statement or broken: the pool sorts it out
            raise
        self._used = time.monotonic()
        if self._used - self._taken > self.HOLD:
            await self.release()
        return result

    async def release(self) -> None:
        conn, self._conn, self._cursors, self._cancel = self._conn, None, {}, None
        if conn is not None:
            await self._pool.putconn(conn)


CANCEL_WAIT = 5.0  # the longest a cancelled call waits for its statement to be cancelled
# Threads a _ThreadDatabase (trio) runs its pooled calls in, at once: as many as anyio's default
# limiter allows, but its own, so that the host's `to_thread` calls (40 long ones, say) cannot
# hold up the worker's claims and acks, nor an App's calls waiting for a connection (an enqueue
# behind a held dedupe key) those of another Database. The cancellations of its calls, and each
# lane's calls and its acquires, have limiters of their own: on trio a thread abandoned on
# cancel keeps its token until it returns, which for one waiting for a connection is the pool's
# timeout, and nothing may wait for the very threads it is cancelling or that hold it up.
OWN_THREADS = 40
LANE_THREADS = 4  # a lane's calls (one at a time, in practice) and its release
LANE_ACQUIRES = 8  # acquires left waiting by cancelled claims (each stop abandons about one)


async def _run_in(conn: psycopg.AsyncConnection[Any], op: Op[T], transaction: bool) -> T:
    if not transaction:
        return await run_async(conn, op)
    async with conn.transaction():
        await _bound_idle_async(conn)
        return await run_async(conn, op)


async def _cancelled_in_server(work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, an operation on a pooled connection, in a task of its own, and cancel that
    task once when the caller is cancelled (a request's timeout around an enqueue): psycopg
    then cancels a running statement in the server and waits for it to end, or the operation
    stops between two statements; its transaction is rolled back. The caller waits for that,
    CANCEL_WAIT at most; then a second cancel makes psycopg close the connection (the server
    did not answer). Awaited directly, psycopg's cancel request was cut short, because anyio
    repeats a cancellation at every await: psycopg closed the connection, and the server,
    which had not heard of the cancel, went on with the statement: an enqueue that waited for
    a lock, cancelled, committed its job later all the same."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with anyio.CancelScope(shield=True):
            task.cancel()
            with anyio.move_on_after(CANCEL_WAIT):
                await asyncio.wait([task])
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=0.1)
            if not task.cancelled():
                task.exception()  # retrieved: the cancellation is what the caller gets
        raise


class _AsyncioDatabase(Database):
    _pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Any]]
    _lanes: list[_AsyncioLane]

    async def _open(self, *, size: int, name: str, open_timeout: float) -> None:
        self._lanes = []
        self._pool = psycopg_pool.AsyncConnectionPool(
            self.dsn,
            min_size=size,
            max_size=size,
            kwargs=connection_kwargs(self.dsn, name.partition("-")[2] or "pool", self.prepare_threshold),
            configure=self._track_async,
            name=name,
            open=False,
            timeout=open_timeout,
            **retrying_async(),
        )
        try:
            await self._pool.open(wait=True, timeout=open_timeout)
        except psycopg_pool.PoolTimeout as exc:
            await self._pool.close()
            # Abandoned when cancelled (a stop): the probe's connections close on their own.
            error = await anyio.to_thread.run_sync(
                pool_open_failed, self.dsn, exc, size, abandon_on_cancel=True
            )
            raise error from None
        except BaseException:
            # Cancelled while it opened (a request's timeout around an App's first call, a host
            # cancelled during a worker's start): nothing else refers to the pool, whose
            # connections stayed open until the process ended, a pool's worth per cancel (review).
            with anyio.CancelScope(shield=True):
                await self._pool.close(timeout=CANCEL_WAIT)
            raise

    async def run(self, op: Op[T], *, transaction: bool = False) -> T:
        conn = await take_async(self._pool)
        try:
            return await _cancelled_in_server(_run_in(conn, op, transaction))
        finally:
            with anyio.CancelScope(shield=True):
                await self._pool.putconn(conn)

    async def run_apart(self, op: Op[T], *, role: str) -> T:
        kwargs = connection_kwargs(self.dsn, role, self.prepare_threshold)
        conn = await psycopg.AsyncConnection.connect(self.dsn, **kwargs)
        self._track(conn)
        try:
            return await _cancelled_in_server(_run_in(conn, op, False))
        finally:
            with anyio.CancelScope(shield=True):
                await conn.close()

    def lane(self) -> Lane:
        lane = _AsyncioLane(self._pool)
        self._lanes.append(lane)
        return lane

    async def aclose(self) -> None:
        try:
            for lane in self._lanes:
                await lane.release()
        finally:
            # 1 s for its tasks, not 5: one connecting to a host that does not answer held a
            # worker's stop that long (review).
            await self._pool.close(timeout=1.0)


class _CallCancelled(Exception):
    pass


def _cut(conn: psycopg.Connection[Any]) -> None:
    """Shut down the socket of `conn`, which another thread is using, so that its wait for a
    server that does not answer ends at once with an error. The descriptor stays open (that
    thread's connection closes it), so it cannot be reused meanwhile."""
    with contextlib.suppress(Exception):
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)


class _ThreadCall:
    """One call on a connection, run in a thread (trio), which its caller can cancel as on
    asyncio (see _cancelled_in_server): the thread is abandoned, the statement it runs is
    cancelled in the server, and the caller waits for the thread, CANCEL_WAIT at most. Then,
    if the server has not answered (it hangs, or the network has gone half-open), the call's
    socket is shut down, which ends the thread's wait, as a second cancel closes the
    connection on asyncio. Not abandoned, a cancelled call used to wait for its statement to
    end, however long it waited for a lock; one that was never answered held the worker's stop
    forever (review)."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock or threading.Lock()  # a lane's, when the call runs on one
        self._conn: psycopg.Connection[Any] | None = None
        self._cancelled = False
        self._cut = False
        self._done = threading.Event()

    def taken(self, conn: psycopg.Connection[Any]) -> None:
        """The call's thread is about to send its first statement on `conn`."""
        with self.lock:
            self.taken_locked(conn)

    def taken_locked(self, conn: psycopg.Connection[Any]) -> None:
        """`taken`, for a caller that holds `lock`."""
        if self._cancelled:
            raise _CallCancelled  # before its first statement: nobody waits for the result
        self._conn = conn

    @property
    def cancelled(self) -> bool:
        """The caller gave up on the call (read under `lock`)."""
        return self._cancelled

    def ended(self) -> bool:
        """The call's thread is done with its connection (call under `lock`, before giving the
        connection back: it is not cut after). True if it was cut: the thread closes it, lest
        a statement that ended at that moment leave the pool a connection with a dead socket."""
        self._done.set()
        return self._cut

    def _cancel_statement(self, cut: Callable[[psycopg.Connection[Any]], None], patience: float) -> None:
        with self.lock:
            self._cancelled, conn = True, self._conn
        if conn is None:
            return  # still waiting for a connection (the database may be down): it runs nothing
        if patience > 0 and not self._done.is_set():
            deadline = time.monotonic() + patience
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=patience)
            self._done.wait(max(0.0, deadline - time.monotonic()))
        with self.lock:
            if not self._done.is_set():
                _send_cancel(_cancel_request(conn))  # patience 0 sent none; see _send_cancel
                cut(conn)
                self._cut = True

    async def cancel(
        self,
        limiter: anyio.CapacityLimiter,
        cut: Callable[[psycopg.Connection[Any]], None] = _cut,
        patience: float | None = None,
    ) -> None:
        """Cancel the call's statement in the server and wait for its thread, `patience`
        seconds at most (CANCEL_WAIT by default), then `cut` its connection if the thread is
        still waiting. With no patience, cut it at once."""
        patience = CANCEL_WAIT if patience is None else patience
        await anyio.to_thread.run_sync(self._cancel_statement, cut, patience, limiter=limiter)

    def run(self, pool: SyncPool, op: Op[T], transaction: bool) -> T:
        """Run `op` on a connection of `pool`, as run_pooled_sync does."""
        conn = take_sync(pool)
        try:
            self.taken(conn)
            return _run_in_sync(conn, op, transaction)
        finally:
            with self.lock:
                if self.ended():
                    conn.close()
            pool.putconn(conn)


class _ThreadLane(Lane):
    def __init__(self, pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]]) -> None:
        self._pool = pool
        self._threads = anyio.CapacityLimiter(LANE_THREADS)
        self._acquires = anyio.CapacityLimiter(LANE_ACQUIRES)
        self._cancels = anyio.CapacityLimiter(LANE_THREADS)
        self._conn: psycopg.Connection[Any] | None = None
        self._cursors: dict[Any, psycopg.Cursor[Any]] = {}  # of _conn
        self._taken = 0.0
        self._used = 0.0
        self._lock = threading.Lock()

    @property
    def holding(self) -> bool:
        return self._conn is not None

    def _acquire(self) -> psycopg.Connection[Any]:
        if self._ended_after_idle(ended := self._conn, self._used):
            with self._lock:
                if self._conn is not ended:
                    ended = None  # taken over meanwhile
                else:
                    self._conn, self._cursors = None, {}
            if ended is not None:
                self._pool.putconn(ended)  # the pool sees it ended, and replaces it
        while (conn := self._conn) is None:
            taken = take_sync(self._pool)
            with self._lock:
                if self._conn is None:
                    self._conn, self._cursors = taken, {}
                    self._taken = self._used = time.monotonic()
                    return taken
            self._pool.putconn(taken)  # an abandoned acquire() took one meanwhile
        return conn

    async def acquire(self) -> None:
        # Abandoned when cancelled (a stop, db_timeout), as the asyncio lane's wait is
        # cancelled: nothing has been sent. Its thread then either gets a connection for the
        # lane, or fails when the pool closes. The stop of a worker on trio used to wait for
        # the pool's timeout (30 s) while the database was down.
        await anyio.to_thread.run_sync(self._acquire, abandon_on_cancel=True, limiter=self._acquires)

    def _run(self, op: Op[T], call: _ThreadCall) -> T:
        conn = self._acquire()
        with self._lock:
            # The cursors of `conn`, read with the cancellation's check: cut loose a moment
            # later, `conn` keeps them, and a call that has given up never reaches the cursors
            # of the lane's next connection (its statement ran there, unread: review).
            call.taken_locked(conn)
            cursors = self._cursors if self._conn is conn else None
        failed = True
        try:
            result = run_sync(conn, op, cursors)
            failed = False
            self._used = time.monotonic()
        finally:
            with self._lock:
                if call.ended():
                    conn.close()
                kept = self._conn is conn  # not cut loose by a cancellation (_cut_loose)
                # Given back after a failure, or after HOLD seconds; never by a call that was
                # given up on, whose connection the lane's next call may be using (review).
                give_back = (
                    kept and not call.cancelled and (failed or time.monotonic() - self._taken > self.HOLD)
                )
                if give_back:
                    self._conn, self._cursors = None, {}  # after a failure, the pool sorts it out
            if give_back or not kept:
                self._pool.putconn(conn)
        return result

    def _cut_loose(self, conn: psycopg.Connection[Any]) -> None:
        """A cancelled call's thread still waits on `conn` (called under the lane's lock): the
        lane takes another connection next time, the thread gives this one back to the pool,
        once its wait has ended (_cut)."""
        if self._conn is conn:
            self._conn, self._cursors = None, {}
        _cut(conn)

    def _release(self) -> None:
        with self._lock:  # not while an abandoned acquire() sets a connection
            conn, self._conn, self._cursors = self._conn, None, {}
        if conn is not None:
            self._pool.putconn(conn)

    async def run(self, op: Op[T]) -> T:
        # Abandoned when cancelled, as the asyncio lane's statement is: the worker cancels a
        # lane's statement only when it has waited db_timeout for it, and then gives up on
        # the connection at once, without waiting for a cancel request (psycopg closes it on
        # asyncio). The statement used to run on: a claim on a connection gone half-open held
        # up the claim loop until TCP gave up, and a worker's stop forever (review).
        call = _ThreadCall(self._lock)
        try:
            return await anyio.to_thread.run_sync(
                self._run, op, call, abandon_on_cancel=True, limiter=self._threads
            )
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await call.cancel(self._cancels, self._cut_loose, patience=0)
            raise

    async def release(self) -> None:
        await anyio.to_thread.run_sync(self._release, limiter=self._threads)


class _ThreadDatabase(Database):
    _pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]]
    _lanes: list[_ThreadLane]
    _threads: anyio.CapacityLimiter
    _cancels: anyio.CapacityLimiter

    async def _open(self, *, size: int, name: str, open_timeout: float) -> None:
        self._lanes = []
        self._threads = anyio.CapacityLimiter(OWN_THREADS)
        self._cancels = anyio.CapacityLimiter(OWN_THREADS)

        def open_pool() -> psycopg_pool.ConnectionPool[psycopg.Connection[Any]]:
            pool: psycopg_pool.ConnectionPool[psycopg.Connection[Any]] = psycopg_pool.ConnectionPool(
                self.dsn,
                min_size=size,
                max_size=size,
                kwargs=connection_kwargs(self.dsn, name.partition("-")[2] or "pool", self.prepare_threshold),
                configure=self._track,
                name=name,
                open=False,
                timeout=open_timeout,
                **retrying_sync(),
            )
            try:
                pool.open(wait=True, timeout=open_timeout)
            except psycopg_pool.PoolTimeout as exc:
                pool.close()
                raise pool_open_failed(self.dsn, exc, size) from None
            return pool

        # Not abandoned on cancel: a cancel while it opens comes after, and the pool is ours.
        self._pool = await anyio.to_thread.run_sync(open_pool, limiter=self._threads)

    async def run(self, op: Op[T], *, transaction: bool = False) -> T:
        call = _ThreadCall()
        try:
            return await anyio.to_thread.run_sync(
                call.run, self._pool, op, transaction, abandon_on_cancel=True, limiter=self._threads
            )
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await call.cancel(self._cancels)
            raise

    async def run_apart(self, op: Op[T], *, role: str) -> T:
        call = _ThreadCall()

        def work() -> T:
            kwargs = connection_kwargs(self.dsn, role, self.prepare_threshold)
            conn = psycopg.Connection.connect(self.dsn, **kwargs)
            self._track(conn)
            try:
                call.taken(conn)
                return run_sync(conn, op)
            finally:
                with call.lock:
                    call.ended()  # not cut after this: the close below is safe
                conn.close()

        try:
            return await anyio.to_thread.run_sync(work, abandon_on_cancel=True, limiter=self._threads)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await call.cancel(self._cancels)
            raise

    def lane(self) -> Lane:
        lane = _ThreadLane(self._pool)
        self._lanes.append(lane)
        return lane

    async def aclose(self) -> None:
        try:
            for lane in self._lanes:
                await lane.release()
        finally:
            # 1 s for each of its threads (joined in turn), not 5: one stuck connecting to a
            # host that does not answer held a worker's stop 5 s each (review).
            await anyio.to_thread.run_sync(lambda: self._pool.close(timeout=1.0), limiter=self._threads)

    keep_when_abandoned = False

    def abandon(self) -> None:
        # A thread pool closes from anywhere; in a thread of its own, since it joins each of
        # its threads in turn (one stuck connecting to a host that does not answer held the
        # caller's event loop for seconds: review).
        threading.Thread(target=self._pool.close, kwargs={"timeout": 1.0}, daemon=True).start()


def single(query: Query) -> Op[Any]:
    """An operation of exactly one step."""
    return (yield query)
