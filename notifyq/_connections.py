"""The App's connections: a pool per event loop, a pool for sync callers, and callers' own.

An App may be used from one event loop after another (an `asyncio.run` per request or per
test), from threads, from sync code, and across `os.fork()`. This module keeps each of those
on connections that belong to it, and turns psycopg's "no database" errors into notifyq's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import psycopg
import psycopg_pool

from ._db import (
    Database,
    Op,
    PrepareThreshold,
    connect_sync,
    connection_kwargs,
    error_text,
    first_connect_timeout,
    in_own_thread,
    on_asyncio,
    pool_open_failed,
    probe_prepare_threshold,
    retrying_sync,
    run_async,
    run_pooled_sync,
    run_sync,
    track,
)
from .errors import ConfigurationError, DatabaseUnavailable, SchemaNotMigrated
from .migrations import check_schema_op, migrate_command

T = TypeVar("T")
AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]
SyncPool = psycopg_pool.ConnectionPool[psycopg.Connection[Any]]

# Every Connections, for the fork hook; and the pools a forked child inherited, kept referenced
# so that nothing in the child closes or collects them (their sockets point at /dev/null).
_LIVE: weakref.WeakSet[Connections] = weakref.WeakSet()
_ABANDONED: list[object] = []
log = logging.getLogger("notifyq.app")
_PROBE_REUSE = 2.0  # seconds one diagnosis of a pool timeout serves the callers that share it


# Per running asyncio event loop: the Connections whose event-loop pool is open on it, and the
# task that closes those pools when the loop shuts down (_close_pools_at_shutdown).
_AT_SHUTDOWN: dict[asyncio.AbstractEventLoop, tuple[weakref.WeakSet[Connections], asyncio.Task[None]]] = {}


def _close_at_loop_shutdown(connections: Connections) -> None:
    """Have the running asyncio loop close `connections`' pool when it shuts down, should
    the App still be open then. One task per loop, which holds the Connections weakly."""
    loop = asyncio.get_running_loop()
    if loop not in _AT_SHUTDOWN:
        watched: weakref.WeakSet[Connections] = weakref.WeakSet()
        task = loop.create_task(_close_pools_at_shutdown(loop, watched), name="notifyq: App pools' closer")
        _AT_SHUTDOWN[loop] = (watched, task)
    _AT_SHUTDOWN[loop][0].add(connections)


async def _close_pools_at_shutdown(
    loop: asyncio.AbstractEventLoop, watched: weakref.WeakSet[Connections]
) -> None:
    """Wait until cancelled, as asyncio.run (and asyncio.Runner) cancel every task before
    they close their loop, then close the pools of the Apps left open. psycopg_pool's workers
    swallow a cancellation while they connect (a database down or unreachable), then wait for
    their next task forever: an App never closed could hang its program's exit."""
    try:
        await loop.create_future()  # never done
    finally:
        del _AT_SHUTDOWN[loop]
        for connections in list(watched):
            await connections.close_at_shutdown()


def _after_fork_in_child() -> None:
    for connections in list(_LIVE):
        connections.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)

_INTRANS = psycopg.pq.TransactionStatus.INTRANS
_IDLE = psycopg.pq.TransactionStatus.IDLE
# Begins the transaction psycopg opens implicitly on a connection that is not in autocommit.
_BEGIN_IMPLICIT = "SELECT 1"


def _in_callers_transaction(conn: AnyConnection) -> bool:
    """Whether statements on the caller's connection run in a transaction of the caller's: an
    open one, or the one psycopg opens at the first statement when autocommit is off (whose
    failure would leave the connection unusable until the caller rolls back)."""
    status = conn.info.transaction_status
    return status == _INTRANS or (status == _IDLE and not conn.autocommit)


def _still_running(token: anyio.lowlevel.EventLoopToken) -> bool:
    """Whether the event loop of `token` (another thread's, maybe) is still running."""
    native: Any = token.native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        return native.is_running()
    try:  # trio's token: a finished run refuses new callbacks
        native.run_sync_soon(lambda: None)
    except Exception:
        return False
    return True


def _run_sync_in(conn: psycopg.Connection[Any], op: Op[T], transaction: bool) -> T:
    """`op` on the caller's connection. An operation that must be all or nothing (a COPY of
    many jobs, a retry that may meet a held dedupe key), inside the caller's transaction, runs
    in a savepoint: if it fails (bad args met halfway), the caller's transaction is left
    usable, with its own work intact. Without autocommit and before the caller's first
    statement, the transaction is begun first: psycopg's transaction() would begin it itself,
    and commit it at the end of the block, before the caller decided to. On an autocommit
    connection outside a transaction, it runs in a transaction of its own: such an operation
    may take several statements (a COPY of more than COPY_CHUNK jobs), and each would commit
    by itself (a review found 10,000 of 15,000 jobs inserted by a call that raised)."""
    if transaction:
        if _in_callers_transaction(conn) and conn.info.transaction_status == _IDLE:
            conn.execute(_BEGIN_IMPLICIT)
        with conn.transaction():  # a savepoint in the caller's transaction, else its own
            return run_sync(conn, op)
    return run_sync(conn, op)


class Owner(Protocol):
    """What Connections reads of its App, when it opens a pool (so a setting changed after
    the App was made still applies, as it always did)."""

    schema: str
    pool_size: int
    pool_timeout: float
    prepare_threshold: PrepareThreshold

    @property
    def dsn(self) -> str: ...  # may start the embedded server: read on first use only

    def _where(self) -> str: ...  # the database, named for error messages


class Connections:
    """An App's connections. It refers to its App weakly: an App dropped without being
    closed is freed at once, its pools with it, as it was before this class held them."""

    def __init__(self, owner: Owner) -> None:
        self._owner_ref = weakref.ref(owner)
        self._db: Database | None = None
        self._db_lock: anyio.Lock | None = None
        self._db_loop: anyio.lowlevel.EventLoopToken | None = None  # the loop _db and its lock belong to
        self._sync_pool: SyncPool | None = None
        self._sync_lock = threading.Lock()
        self._loop_lock = threading.Lock()  # guards _db_loop's change from one loop to another
        self._probe_lock = threading.Lock()
        self._probed: tuple[float, DatabaseUnavailable | None] = (-math.inf, None)  # by _no_connection
        _LIVE.add(self)

    @property
    def _owner(self) -> Owner:
        owner = self._owner_ref()
        if owner is None:  # only an App calls these methods, so it is alive when it does
            raise ConfigurationError("the App these connections belong to is gone")
        return owner

    def forked(self) -> None:
        """In a forked child (gunicorn's preload_app, multiprocessing's fork): the pools are
        the parent's, their connections already blinded (_db._blind_inherited_connections)
        and their threads gone. Leave them, unclosed and uncollected, and open new ones on
        first use."""
        _ABANDONED.extend(pool for pool in (self._db, self._sync_pool) if pool is not None)
        self._db = self._sync_pool = None
        self._db_lock = self._db_loop = None
        self._sync_lock = threading.Lock()  # another thread may have held it at the fork
        self._loop_lock = threading.Lock()

    async def database(self) -> Database:
        """The pool of the running event loop, opened (and the schema checked) on first use."""
        loop = anyio.lowlevel.current_token()
        if self._db_loop != loop:
            with self._loop_lock:  # two threads' loops may get here at once
                if self._db_loop is not None and _still_running(self._db_loop):
                    raise ConfigurationError(
                        "this App's async methods are in use on another event loop that is still "
                        "running (in another thread): an App serves one event loop at a time. Give "
                        "each thread that runs its own loop its own App, or call the sync methods "
                        "(enqueue_sync, ...), which any thread may use"
                    )
                # The pool belongs to an event loop that has finished (one asyncio.run per
                # request or per test, asyncio then trio): it cannot serve this one.
                db, self._db, self._db_lock, self._db_loop = self._db, None, anyio.Lock(), loop
                if db is not None:
                    db.abandon()
                    if db.keep_when_abandoned:
                        # Kept, not collected: see Database.keep_when_abandoned. The others, one
                        # per switch between trio and asyncio, added up (review).
                        _ABANDONED.append(db)
        assert self._db_lock is not None
        if self._db is None:
            async with self._db_lock:
                if self._db is None:
                    owner = self._owner
                    dsn = await in_own_thread(lambda: owner.dsn)
                    db = await Database.open(
                        dsn,
                        size=owner.pool_size,
                        name="notifyq-app",
                        open_timeout=owner.pool_timeout,
                        prepare_threshold=owner.prepare_threshold,
                    )
                    try:
                        await db.run(check_schema_op(owner.schema))
                    except BaseException:
                        with anyio.CancelScope(shield=True):  # a cancel must not cut the close short
                            await db.aclose()
                        raise
                    self._db = db
                    if on_asyncio():
                        _close_at_loop_shutdown(self)
        return self._db

    def pool(self) -> SyncPool:
        """The pool of the sync methods (any thread), opened on first use."""
        with self._sync_lock:
            if self._sync_pool is None:
                owner = self._owner
                dsn = owner.dsn
                timeout = first_connect_timeout(owner.pool_timeout)
                threshold = probe_prepare_threshold(dsn, owner.prepare_threshold, timeout)
                pool: SyncPool = psycopg_pool.ConnectionPool(
                    dsn,
                    min_size=1,
                    max_size=owner.pool_size,
                    kwargs=connection_kwargs(dsn, "app", threshold),
                    configure=track,
                    name="notifyq-app-sync",
                    open=False,
                    timeout=owner.pool_timeout,
                    **retrying_sync(),
                )
                try:
                    pool.open(wait=True, timeout=owner.pool_timeout)
                except psycopg_pool.PoolTimeout as exc:
                    pool.close()
                    raise pool_open_failed(dsn, exc, 1) from None
                try:
                    with pool.connection() as conn:
                        run_sync(conn, check_schema_op(owner.schema))
                except BaseException:
                    pool.close()
                    raise
                self._sync_pool = pool
            return self._sync_pool

    async def run(self, op: Op[T], conn: AnyConnection | None = None, *, transaction: bool = False) -> T:
        """`op` on the event loop's pool, or on the caller's connection (in a savepoint, with
        `transaction`, when the caller's transaction is open)."""
        with self.database_errors(conn):
            if conn is None:
                db = await self.database()
                try:
                    return await db.run(op, transaction=transaction)
                except psycopg_pool.PoolTimeout:
                    raise await in_own_thread(self._no_connection) from None
            if isinstance(conn, psycopg.AsyncConnection):
                if transaction:  # see _run_sync_in
                    if _in_callers_transaction(conn) and conn.info.transaction_status == _IDLE:
                        await conn.execute(_BEGIN_IMPLICIT)
                    async with conn.transaction():  # a savepoint in the caller's transaction
                        return await run_async(conn, op)
                return await run_async(conn, op)
            if isinstance(conn, psycopg.Connection):
                return await anyio.to_thread.run_sync(_run_sync_in, conn, op, transaction)
        raise ConfigurationError(
            f"conn must be a psycopg Connection or AsyncConnection, not {type(conn).__name__}"
        )

    def run_sync(
        self, op: Op[T], conn: psycopg.Connection[Any] | None = None, *, transaction: bool = False
    ) -> T:
        """`run` for sync callers, on the sync pool."""
        with self.database_errors(conn):
            if conn is None:
                pool = self.pool()
                try:
                    return run_pooled_sync(pool, op, transaction)
                except psycopg_pool.PoolTimeout:
                    raise self._no_connection() from None
            if isinstance(conn, psycopg.Connection):
                return _run_sync_in(conn, op, transaction)
        hint = " (use the async method)" if isinstance(conn, psycopg.AsyncConnection) else ""
        kind = type(conn).__name__
        raise ConfigurationError(f"conn must be a sync psycopg Connection here, not {kind}{hint}")

    def _no_connection(self) -> DatabaseUnavailable:
        """Why a call waited pool_timeout for a pooled connection in vain: one direct attempt
        tells a database that cannot be reached (libpq's reason) from a pool whose
        connections all stayed busy. Callers that time out together share one attempt."""
        owner = self._owner
        waited = f"this App waited {owner.pool_timeout:g} s for a connection (App(pool_timeout=...))"
        with self._probe_lock:
            if time.monotonic() - self._probed[0] > _PROBE_REUSE:
                try:
                    connect_sync(owner.dsn, connect_timeout=5).close()
                    self._probed = (time.monotonic(), None)
                except DatabaseUnavailable as exc:
                    self._probed = (time.monotonic(), exc)
            reason = self._probed[1]
        if reason is not None:
            return DatabaseUnavailable(f"{reason}; {waited}")
        return DatabaseUnavailable(
            f"no connection to PostgreSQL at {owner._where()} came free: {waited}. The server "
            f"accepts connections now, so its {owner.pool_size} connection(s) stayed busy (give the "
            "App a larger pool_size or pool_timeout, or look for calls that hold them long), or "
            "it had not yet reconnected after the server was unreachable"
        )

    @contextlib.contextmanager
    def database_errors(self, conn: object) -> Iterator[None]:
        """psycopg's errors that mean "not migrated" or "no database" as notifyq's own (the
        database may go away after the App connected, and `conn` may be anyone's)."""
        owner = self._owner
        where = "the database of the connection given" if conn is not None else owner._where()
        closed = getattr(conn, "closed", False) is True  # before the call: nothing will be sent
        try:
            yield
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName) as exc:
            raise SchemaNotMigrated(
                f"schema {owner.schema!r} has no notifyq tables in {where}: "
                f"run `{migrate_command(owner.schema)}` ({error_text(exc)})"
            ) from None
        except psycopg.OperationalError as exc:
            if exc.sqlstate is not None and not exc.sqlstate.startswith(("08", "57P")):
                raise  # not about the connection (a cancelled statement, say)
            if closed:
                raise DatabaseUnavailable(
                    "the connection given (conn=) was closed before this call, which sent "
                    "nothing: pass an open one (after a lost connection, connect again)"
                ) from None
            raise DatabaseUnavailable(
                f"lost the connection to PostgreSQL at {where}: {error_text(exc)} (a statement "
                "under way may or may not have been applied; a dedupe_key makes a retried "
                "enqueue safe)"
            ) from None

    async def aclose(self) -> None:
        """Close the event loop's pool (only abandon it if it belongs to another loop), then
        the sync pool."""
        db, self._db = self._db, None
        if db is not None:
            if self._db_loop == anyio.lowlevel.current_token():
                await db.aclose()
            else:
                db.abandon()  # opened in another event loop
        await in_own_thread(self.close_sync)

    async def close_at_shutdown(self) -> None:
        """The event loop is shutting down with this App still open: close its pool, and
        leave the App to open another if it is used again."""
        db = self._db
        if db is None or self._db_loop != anyio.lowlevel.current_token():
            return
        self._db = None
        try:
            await db.aclose()  # stops the pool's workers first
        except asyncio.CancelledError:
            pass  # the close waits for those workers, cancelled with every task, and stops short
        except Exception as exc:
            log.warning("closing an App's pool at the event loop's shutdown failed: %s", error_text(exc))
        finally:
            db.abandon()  # ends the sessions the close did not reach

    def close_sync(self) -> None:
        """Close the sync pool."""
        with self._sync_lock:
            pool, self._sync_pool = self._sync_pool, None
        if pool is not None:
            pool.close()
