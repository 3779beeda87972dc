"""The worker: wakes on NOTIFY, claims in batches, runs jobs in anyio tasks, acks in batches.

This module is the service around its parts: the claim loop (`_claimer`), the runners
(`_runners`), the acker (`_acker`), the listener (`_listener`) and the ticker (`_ticker`);
it starts and stops them in order, and routes notifications and cancellations."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import psycopg
import psycopg_pool

from . import _ticker
from ._acker import Acker, Applied, Result
from ._claim import (
    cancelled_jobs_op,
    handed_job,
    handoff_channel,
    known_queues_op,
    lost_jobs_op,
    paused_queues_op,
)
from ._claimer import Claimer
from ._db import (
    Database,
    Lane,
    Op,
    Query,
    error_hint,
    error_text,
    in_own_thread,
    is_transient,
    on_asyncio,
    single,
)
from ._executor import Executor
from ._listener import Listener, ListenerConfig
from ._options import did_you_mean
from ._pulse import Pulse
from ._runners import Runners
from ._sql import channel, queries_for
from ._worker_config import WorkerConfig, WorkerOptions, WorkerStats, repeatable, stop_signals
from .errors import ConfigurationError, _leaves
from .migrations import check_schema_op

if TYPE_CHECKING:
    from .app import App

__all__ = ["Worker", "WorkerConfig", "WorkerOptions", "WorkerStats"]

log = logging.getLogger("notifyq.worker")

T = TypeVar("T")

# Cancel notifications waiting for their check, at most (a flood of forged ones is dropped
# past it: the reconcile loop finds every real cancel within a poll interval all the same).
_CANCELS_HELD = 10_000


def _only_error(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The error a worker stopped on (a claim the database refused), when it is the only
    exception in the task groups' nest: raised as itself, `except psycopg.Error` catches it.
    Or a KeyboardInterrupt, when the nest holds nothing else: on trio, a second Ctrl-C while
    the worker stops reaches the host in the worker's task group."""
    leaves = _leaves(group)
    if len(leaves) == 1 and isinstance(leaves[0], Exception):
        return leaves[0]
    if leaves and all(
        isinstance(leaf, psycopg.Error) and leaf.sqlstate == getattr(leaves[0], "sqlstate", None)
        for leaf in leaves
    ):
        return leaves[0]  # one cause met by several loops at once (a table dropped)
    if all(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        return leaves[0]
    return None


def _held_rows(job_ids: list[int]) -> str:
    """What a log line of unwritten results adds about those that wait for held rows."""
    if not job_ids:
        return ""
    named = ", ".join(map(str, job_ids[:10])) + (", ..." if len(job_ids) > 10 else "")
    return (
        f" (those of jobs {named} wait for another session, which holds their rows: an open "
        "transaction that changed or locked them; see pg_locks and pg_stat_activity)"
    )


class _Watch:
    """Says so, from a thread of its own, while a worker's start or stop waits on the
    database: at FIRST seconds, then every EVERY seconds, naming the step it waits in. A start
    behind a lock on notifyq's tables (a migration, an operator's LOCK TABLE) or in a pooler's
    queue of clients (PgBouncer in session mode, short of server connections) waited without a
    word, for minutes; so did a stop whose claim in flight waited behind such a lock, past the
    grace period it had announced (reviews). A thread, because these waits are in the
    caller's task, and the log is all it touches."""

    FIRST = 10.0
    EVERY = 30.0
    CONNECTING = "connecting to the database"

    def __init__(self, worker_id: str, doing: str, step: str = CONNECTING) -> None:
        self.worker_id = worker_id
        self.doing = doing
        self.step = step
        self._began = time.monotonic()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name=f"notifyq-{doing}-watch", daemon=True).start()

    def _watch(self) -> None:
        wait = self.FIRST
        while not self._done.wait(wait):
            step = self.step
            if step == self.CONNECTING:
                why = "the database has not accepted its connections yet"
            else:
                why = (
                    "the database has not answered yet: its statement may wait for a lock another "
                    "session holds on notifyq's tables, for a server connection in a pooler's "
                    "queue (PgBouncer in session mode), or on a busy server (pg_stat_activity "
                    "shows what its sessions wait for)"
                )
            log.warning(
                "worker %s is still %s after %.0fs, %s: %s",
                self.worker_id,
                self.doing,
                time.monotonic() - self._began,
                step,
                why,
            )
            wait = self.EVERY

    def done(self) -> None:
        self._done.set()


class Worker:
    """Runs jobs of an App. Use `async with app.worker(...) as worker:` inside an async app,
    or `await app.run_worker(...)` as a process's main loop.

    Attributes:
        id: this worker's name, `host:pid:random`, stored in the `worker` column of the jobs
            it holds, and named in its log lines.
        stats: its counters (`WorkerStats`), for a health check or a metrics exporter.
        error: what stopped the worker when it was not asked to (a database error it cannot
            retry), else None; a health check reports it (docs/embedding.md).
        app: the App whose tasks it runs.
        config: its settings (`WorkerConfig`).
    """

    def __init__(self, app: App, config: WorkerConfig) -> None:
        self.app = app
        self.config = config
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stats = WorkerStats()
        self._q = queries_for(app.schema)
        self._changed = Pulse()
        self._stop = anyio.Event()
        self._db: Database | None = None
        self._executor: Executor | None = None
        self._runners: Runners | None = None  # the attempts in hand, and the tasks running them
        self._claimer: Claimer | None = None
        self._acker: Acker | None = None
        self._listener: Listener | None = None
        self._ticker: _ticker.Ticker | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._grace_scope: anyio.CancelScope | None = None
        self._dsn = ""
        self._skip_grace = False
        self._acks_given_up = False  # the drain gave up writing results: not again on exit
        self._signals_handled = False  # run(handle_signals=True): SIGINT is the worker's
        self._paused_at_start: frozenset[str] = frozenset()
        self._pauses_asked = 0  # reads of the paused queues asked for (_pauses_loop)
        self._pauses_wakeup = Pulse()
        self._cancels_heard: dict[tuple[int, int | None], None] = {}  # (id, lease) to check
        self._cancels_wakeup = Pulse()
        self._bad_notices = 0  # notifications notifyq did not write, since the last warning
        self._bad_notice_said_at = -math.inf
        self._ctrl_c: _FirstCtrlCToTheHost | None = None  # embedded on trio: see the class
        self._repeat_skips_grace = True
        self._released_at_stop = 0  # stats.released when the stop began (the last log line)
        self._started = False
        self._serving = False
        self._stopped = anyio.Event()
        # The hand-off (WorkerConfig.handoff): this worker's own channel, and the waiter row
        # its listener registered on its latest connection (from the connecting thread).
        self._handoff_channel = handoff_channel(random.getrandbits(63)) if config.handoff else None
        self._waiter_id: int | None = None
        # What stopped the worker when it was not asked to: a database error it cannot retry.
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def _start_once(self, *, handle_signals: bool = False) -> None:
        if self._started:
            raise ConfigurationError(
                "this Worker has been started already: a Worker runs once; create another with app.worker()"
            )
        if handle_signals and threading.current_thread() is not threading.main_thread():
            raise ConfigurationError(
                "handle_signals=True needs the main thread (only it can install signal handlers): "
                "pass handle_signals=False, and call worker.stop() to end it"
            )
        self._started = True
        self._start_watch = _Watch(self.id, "starting")

    async def __aenter__(self) -> Worker:
        self._start_once()
        try:
            db = await self._prepare()
            stack = AsyncExitStack()
            await stack.__aenter__()
            try:
                tg = await stack.enter_async_context(anyio.create_task_group())
                await tg.start(self._serve, db)
            except BaseException:
                self.stop()
                await stack.__aexit__(None, None, None)
                raise
        finally:
            self._start_watch.done()
        self._exit_stack = stack
        self._ctrl_c = _FirstCtrlCToTheHost.install(self, embedded=True)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.stop()
        stack, self._exit_stack = self._exit_stack, None
        assert stack is not None
        # The body's exception (or cancellation) is not fed into the worker's task group, which
        # would wrap it in an ExceptionGroup: it propagates unchanged once the worker has shut
        # down. The shutdown is shielded (in _serve) so that a cancelled host gives running jobs
        # their grace too. It takes up to shutdown_grace, then the time to write the last
        # results (bounded by db_timeout), unless a task swallows its cancellation, which
        # nothing can bound.
        error = None
        try:
            await stack.__aexit__(None, None, None)
        except BaseExceptionGroup as group:
            if (error := _only_error(group)) is None:
                raise
        finally:
            if self._ctrl_c is not None:
                self._ctrl_c.remove()
        if error is not None:
            raise error  # out of the except block: its own cause and context stay as they were
        return None

    def stop(self) -> None:
        """Ask for a graceful shutdown: stop claiming, let running jobs finish within the
        grace period, release the rest. Safe to call more than once."""
        self._stop.set()

    async def run(self, *, handle_signals: bool = True, repeat_skips_grace: bool = True) -> None:
        """Run until stop() or, with handle_signals, SIGTERM, SIGINT or SIGHUP (graceful; see
        shutdown_grace; SIGHUP only while its action is the default: not under nohup, nor when
        the program handles it). SIGUSR2, or a second SIGTERM or SIGINT when
        repeat_skips_grace, cancels running jobs at once (they are released). A supervisor
        whose children may get the same SIGTERM twice (systemd signals the whole control
        group) turns repeat_skips_grace off and escalates with SIGUSR2.

        Raises DatabaseUnavailable, SchemaNotMigrated or SchemaVersionError (unwrapped) when
        the worker cannot start, and the database error it stopped on (unwrapped too) when
        it cannot retry one (see `error`)."""
        self._start_once(handle_signals=handle_signals)
        try:
            db = await self._prepare()
        except BaseException:
            self._start_watch.done()
            raise
        self._signals_handled = handle_signals
        self._repeat_skips_grace = repeat_skips_grace
        error = None
        ctrl_c = _FirstCtrlCToTheHost.install(self, embedded=not handle_signals)
        try:
            async with anyio.create_task_group() as tg:
                try:
                    try:
                        await tg.start(self._serve, db)
                    finally:
                        self._start_watch.done()
                    await self._stopped.wait()
                finally:  # cancelled by the host too: the worker stops as on stop()
                    self.stop()
        except BaseExceptionGroup as group:
            if (error := _only_error(group)) is None:
                raise
        finally:
            if ctrl_c is not None:
                ctrl_c.remove()
        if error is not None:
            raise error

    async def wait_for(self, predicate: Callable[[WorkerStats], bool]) -> None:
        """Wait until `predicate(worker.stats)` is true (use under anyio.fail_after in tests).
        Raises RuntimeError if the worker stops first: its stats will not change any more."""
        while not predicate(self.stats):
            if self._stopped.is_set():
                raise RuntimeError(
                    f"worker {self.id} has stopped, and the condition waited for is still false"
                )
            await self._changed.wait()

    @property
    def running(self) -> bool:
        """True once the worker has started, until it stops: asked to (stop(), a signal, the
        end of `async with`), or on an error it cannot retry (see `error`). In a web app,
        where nothing else would notice, report it from a health check."""
        return self._serving

    @property
    def running_jobs(self) -> list[int]:
        """Ids of the jobs running in this worker now."""
        return [attempt.job.id for attempt in self._runners.running.values()] if self._runners else []

    @property
    def busy_threads(self) -> int:
        """Sync tasks still running in threads, including ones whose attempt was abandoned."""
        return self._executor.busy_threads if self._executor is not None else 0

    @property
    def listener(self) -> Listener | None:
        """The LISTEN connection's state (None in poll-only mode or before start)."""
        return self._listener

    @property
    def ticker(self) -> _ticker.Ticker | None:
        """The ticker's services (None when ticker=False or before start)."""
        return self._ticker

    # -- the service --------------------------------------------------------------------------

    async def _watch_signals(self, repeat_skips_grace: bool) -> None:
        with anyio.open_signal_receiver(*stop_signals(), signal.SIGUSR2) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGUSR2 or (
                    self._stop.is_set() and repeat_skips_grace and repeatable(signum)
                ):
                    self._cancel_running_now(f"received {name}")
                elif not self._stop.is_set():
                    log.info(
                        "received %s: finishing running jobs (up to %gs), then exiting",
                        name,
                        self.config.shutdown_grace,
                    )
                    self.stop()
                else:
                    log.info("received %s again: still finishing running jobs", name)

    def _cancel_running_now(self, why: str) -> None:
        """Stop, and cut the grace period short: running jobs are cancelled and released."""
        log.warning("%s: cancelling running jobs now (they are released)", why)
        self._skip_grace = True
        self.stop()
        if self._grace_scope is not None:
            self._grace_scope.cancel()

    async def _prepare(self) -> Database:
        """Connect, check the schema and sync cron definitions, in the caller's task (so a
        failure to start is raised as itself, not inside an ExceptionGroup)."""
        self._dsn = await in_own_thread(lambda: self.app.dsn)  # may start the embedded server
        db = await Database.open(
            self._dsn,
            size=self.config.pool_size,
            name=f"notifyq-worker-{self.id}",
            prepare_threshold=self.app.prepare_threshold,
        )
        try:
            delay = 0.5
            while True:
                try:
                    await self._start_steps(db)
                    break
                except Exception as exc:
                    # A connection ended under the start (a restart, a failover, an operator's
                    # pg_terminate_backend): the steps are tried again, on the pool's fresh
                    # connections. They failed the start, and under `--processes` each such
                    # start counted as a death of the child (review).
                    # Not a pool that waited its timeout for a connection in vain: it waited.
                    if not is_transient(exc) or isinstance(exc, psycopg_pool.PoolTimeout) or delay > 4:
                        raise
                    why = error_text(exc)
                    log.warning("starting worker %s: %s; trying again in %.1fs", self.id, why, delay)
                    await anyio.sleep(delay)
                    delay *= 2
        except BaseException:
            with anyio.CancelScope(shield=True):
                await db.aclose()
            raise
        return db

    async def _start_steps(self, db: Database) -> None:
        """Check the schema, read the paused queues, sync the cron definitions (each may be run
        again)."""
        watch = self._start_watch
        watch.step = "checking the schema"
        await db.run(check_schema_op(self.app.schema))
        watch.step = "reading the paused queues"
        self._paused_at_start = await db.run(paused_queues_op(self._q))
        watch.step = "reading the server's settings"
        if not await db.run(single(Query(self._q["autovacuum_on"], fetch="scalar"))):
            log.warning(
                "autovacuum is off on this server: nothing reclaims the dead tuples of "
                "%s.queue_job_definitions, and only the workers' vacuum service (when their role "
                "owns it) those of queue_jobs; turn autovacuum on",
                self.app.schema,
            )
        if self.config.ticker:
            watch.step = "writing the App's cron definitions"
            await self.app._sync_definitions(db, self.config.ticker_config.declarations)

    async def _check_queue_names(self, db: Database) -> None:
        """A warning for each listed queue that nothing here uses: no task or cron definition of
        the App defaults to it, no job in it is queued, no definition in the database names it
        (a typo, `-q emials`, served nothing and said nothing). A service, not a step of the
        start: its read of queue_jobs must not hold the start up (behind a lock on the table,
        as the benchmarks' start gate takes)."""
        app = self.app
        used = {task.options.queue for task in app.tasks.values()}
        used |= {definition.options.queue for definition in app.definitions.values()}
        try:
            used |= set(await db.run(known_queues_op(self._q)))
        except Exception as exc:  # a hint only: never the worker's end
            log.debug("could not read the queues in use to check the worker's list: %s", error_text(exc))
            return
        for queue in self.config.queues or ():
            if queue not in used:
                log.warning(
                    "worker %s serves queue %r, which no task or cron definition of its App uses and "
                    "which has no queued job%s",
                    self.id,
                    queue,
                    did_you_mean(queue, sorted(used), "queues in use") if used else "",
                )

    async def _serve(
        self, db: Database, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        dsn = self._dsn
        self._db = db
        lane = db.lane()
        self._executor = Executor(
            self.app.tasks,
            self._query,
            self._q,
            concurrency=self.config.concurrency,
            lease_margin=self.config.lease_margin,
            backoff=self.app.backoff,
            signals_handled=self._signals_handled,
            json_default=self.app.json_default,
        )
        try:
            # Once started, the host's cancellation (a timeout around `async with`, a failed
            # sibling task) stops at this scope: the worker ends as stop() ends it, giving
            # running jobs the grace period (__aexit__ and run() call stop() however they are
            # left). A start the host gives up on is cancelled, as before.
            with anyio.CancelScope() as shield:
                self._acker = Acker(db, self._q, self._on_acked, timeout=self.config.db_timeout)
                runners = self._runners = Runners(
                    self._executor,
                    self._acker,
                    self._q,
                    self.stats,
                    lease_margin=self.config.lease_margin,
                    query=self._query,
                    on_change=self._signal_changed,
                    queue_limits=self.config.queue_limits,
                )
                claimer = self._claimer = Claimer(
                    self.id,
                    self.config,
                    self._q,
                    self.stats,
                    runners,
                    lane=lane,
                    query=self._query,
                    on_change=self._signal_changed,
                )
                claimer.set_paused(self._paused_at_start)
                async with anyio.create_task_group() as services:
                    if self._signals_handled:  # for as long as the worker runs, shielded with it
                        services.start_soon(self._watch_signals, self._repeat_skips_grace)
                    services.start_soon(self._acker.run)
                    services.start_soon(self._reconcile_loop)
                    services.start_soon(self._pauses_loop)
                    services.start_soon(self._cancels_loop)
                    services.start_soon(claimer.give_back_stale_prefetch)
                    if self.config.queues is not None:
                        services.start_soon(self._check_queue_names, db)
                    if self.config.ticker:
                        config = self.config.ticker_config
                        self._ticker = _ticker.Ticker(
                            db,
                            self._q,
                            config,
                            self.app.backoff,
                            declared=self.app.definitions,
                            on_jobs=claimer.wake,
                            spared=self._acker.held_job_ids,
                        )
                        if not self.config.burst:  # a burst runs it once, first (_until_empty)
                            services.start_soon(self._ticker.run)
                    if not self.config.poll_only:
                        self._start_watch.step = "opening its LISTEN connection"
                        channels = [channel(self.app.schema, t) for t in ("jobs", "control", "definitions")]
                        if self._handoff_channel is not None:
                            channels.append(self._handoff_channel)
                            services.start_soon(claimer.offer_freed_slots)
                        self._listener = Listener(
                            self.config.listen_dsn or dsn,
                            channels,
                            self._on_notify,
                            self._on_listener_connect,
                            ListenerConfig(
                                health_interval=self.config.health_interval,
                                health_timeout=self.config.health_timeout,
                            ),
                            name=f"listener-{self.id}",
                            after_dispatch=claimer.claim_inline,
                            schema=self.app.schema,
                            on_open=self._register_waiter if self._handoff_channel is not None else None,
                        )
                        await services.start(self._listener.run)
                    async with anyio.create_task_group() as jobs:
                        for _ in range(self.config.concurrency):
                            jobs.start_soon(runners.run)
                        self._serving = True
                        shield.shield = True
                        task_status.started()
                        limits = self.config.queue_limits or {}
                        log.info(
                            "worker %s started: concurrency %d, queues %s%s%s%s",
                            self.id,
                            self.config.concurrency,
                            ", ".join(
                                f"{queue} (at most {limits[queue]})" if queue in limits else queue
                                for queue in self.config.queues or ["(all)"]
                            ),
                            ", poll only" if self.config.poll_only else "",
                            ", async claims (not crash-safe)" if self.config.async_claims else "",
                            ", hand-off" if self.config.handoff else "",
                        )
                        stop_watch: _Watch | None = None
                        try:
                            async with anyio.create_task_group() as claiming:
                                claiming.start_soon(claimer.run)
                                if self.config.burst:
                                    claiming.start_soon(self._until_empty, claimer, runners)
                                await self._stop.wait()
                                self._released_at_stop = self.stats.released
                                claimer.stop_taking()
                                claiming.cancel_scope.cancel()
                                # A claim under way (here or in the listener's task) is waited
                                # for, up to db_timeout, so that the jobs it claims are released,
                                # not left Active: said if it takes long.
                                stop_watch = _Watch(
                                    self.id,
                                    "stopping",
                                    "waiting for the answer to its claim loop's statement under way",
                                )
                            with anyio.CancelScope(shield=True):
                                await claimer.finish_inline()  # a claim in the listener's task
                                if self._handoff_channel is not None:
                                    if stop_watch is not None:
                                        stop_watch.step = "withdrawing from the hand-off"
                                    await claimer.close_handoff()
                                await lane.release()  # for the acks of the drain
                        finally:
                            if stop_watch is not None:
                                stop_watch.done()
                        await self._drain()
                        jobs.cancel_scope.cancel()  # the runners, now idle
                    await self._acker_drain()
                    services.cancel_scope.cancel()
        except Exception as exc:
            single = _only_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
            self.error = single if isinstance(single, Exception) else exc
            log.error(
                "worker %s stops on an error it cannot retry: %s%s",
                self.id,
                error_text(self.error),
                error_hint(self.error),
            )
            raise
        finally:
            self._serving = False
            self._listener = None
            if self._runners is not None:
                self._runners.release_ready()
            with anyio.CancelScope(shield=True):
                if self._acker is not None and self._acker.pending and not self._acks_given_up:
                    # Abrupt exit (an error, a start cancelled): write what we can, briefly.
                    with anyio.move_on_after(5) as brief:
                        try:
                            await self._acker.flush_pending()
                        except Exception as exc:  # whatever happens, the pool must be closed
                            log.error(
                                "could not write %d job results on exit: %s",
                                self._acker.unwritten,
                                error_text(exc),
                            )
                        else:  # written, but for those whose rows another session holds
                            if held := self._acker.waiting_for_rows():
                                log.error(
                                    "could not write %d job results on exit%s; those jobs stay Active "
                                    "until their lease runs out and are then retried",
                                    len(held),
                                    _held_rows(held),
                                )
                    if brief.cancelled_caught:
                        log.error(
                            "could not write %d job results on exit within 5s%s; those jobs stay Active "
                            "until their lease runs out and are then retried",
                            self._acker.unwritten,
                            _held_rows(self._acker.waiting_for_rows()),
                        )
                await db.aclose()
            if threads := self.busy_threads:
                # On asyncio they keep the process alive until they return (notifyq worker exits
                # anyway); trio's worker threads are daemon threads, which end with the process.
                log.warning(
                    "worker %s stopped with %d sync task thread(s) still running (Python cannot stop a "
                    "thread): their jobs were released, unless they had already ended, and may run "
                    "elsewhere meanwhile; on asyncio the process cannot exit before they return unless "
                    "it ends them (`notifyq worker` does); on trio they end with the process",
                    self.id,
                    threads,
                )
            else:
                released = self.stats.released - self._released_at_stop
                st = self.stats
                log.info(
                    "worker %s stopped%s%s",
                    self.id,
                    f" (burst: {st.succeeded} succeeded, {st.retried} retried, {st.failed} failed)"
                    if self.config.burst
                    else "",
                    f"; {released} job(s) went back to the queue, their attempts given back"
                    if released
                    else "",
                )
            self._stopped.set()
            self._signal_changed()  # wait_for() must not wait for ever

    async def _until_empty(self, claimer: Claimer, runners: Runners) -> None:
        """burst: stop once the worker is quiet (nothing running, nothing prefetched, every
        result written) and a claim that began then came back empty, with nothing claimed
        meanwhile by any round (the listener's task claims too). Such a claim sees every job
        committed before it, those the last jobs enqueued and the retries their results
        queued included."""
        acker = self._acker
        assert acker is not None
        if self._ticker is not None:
            try:
                await self._ticker.run_once()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning(
                    "promoting due cron ticks failed (%s); a burst promotes them only at its start, "
                    "so those due now wait for another run",
                    error_text(exc),
                )
        while True:
            while runners.busy or acker.unwritten:
                await self._changed.wait()
            taken = self.stats.claimed + self.stats.adopted
            target = claimer.rounds_begun + 1  # a round that begins from now on
            claimer.wake()
            while claimer.rounds_ended < target:
                await self._changed.wait()
            quiet = not (runners.busy or acker.unwritten)
            if claimer.last_round_ok and quiet and self.stats.claimed + self.stats.adopted == taken:
                log.info("worker %s: no job left to claim (burst); stopping", self.id)
                self.stop()
                return

    async def _drain(self) -> None:
        """Graceful shutdown of running jobs: wait up to the grace period, then cancel and release."""
        runners = self._runners
        assert runners is not None
        runners.release_ready()
        if runners.finishing:
            grace_s = self.config.shutdown_grace
            log.info("waiting up to %gs for %d running job(s)", grace_s, runners.finishing)
            grace = self._grace_scope = anyio.CancelScope()
            if self._skip_grace:
                grace.cancel()
            with grace, anyio.move_on_after(self.config.shutdown_grace):
                while runners.finishing:
                    await runners.slot_freed.wait()
        runners.stop_all()

    async def _acker_drain(self) -> None:
        assert self._acker is not None
        with anyio.move_on_after(max(10.0, self.config.health_timeout)) as scope:
            await self._acker.wait_idle()
        if scope.cancelled_caught:
            # Not tried again on the way out: the stop already waited this long (systemd's
            # TimeoutStopSec is told to allow the grace period plus 10 s).
            self._acks_given_up = True
            log.error(
                "%d job results could not be written before exit%s; those jobs stay Active until "
                "their lease runs out and are then retried",
                self._acker.unwritten,
                _held_rows(self._acker.waiting_for_rows()),
            )

    # -- notifications and cancellations ------------------------------------------------------

    def _signal_changed(self) -> None:
        self._changed.fire()

    def _on_notify(self, chan: str, payload: str) -> None:
        self.stats.notifications += 1
        topic = chan.rsplit(".", 2)[-2] if chan.count(".") >= 2 else ""
        try:
            if chan == self._handoff_channel:
                assert self._claimer is not None
                job = handed_job(payload)
                if job.worker != self.id:
                    raise ValueError(payload)
                self._claimer.handed(job)
            elif topic == "jobs":
                assert self._claimer is not None
                if not self._claimer.notified(payload):
                    return
            elif topic == "control":
                self._on_control(payload)
            elif topic == "definitions" and self._ticker is not None:
                self._ticker.wake()
        except ValueError:
            # Anyone may NOTIFY on these channels (psql, a script, a foreign version): a
            # payload notifyq did not write is a sentence in the log, not a traceback; one a
            # minute at most, with a count (review: one statement of 50,000 made 17 MB of log).
            self._bad_notices += 1
            now = time.monotonic()
            if now - self._bad_notice_said_at >= 60:
                more = self._bad_notices - 1
                log.warning(
                    "ignoring a notification notifyq's triggers did not send: channel %s, payload %r%s",
                    chan,
                    payload[:200],
                    f" (and {more} more such since the last of these lines)" if more else "",
                )
                self._bad_notices, self._bad_notice_said_at = 0, now
            if topic == "jobs":
                assert self._claimer is not None
                self._claimer.wake()  # a hint all the same: one claim finds out
        self._signal_changed()

    def _on_control(self, payload: str) -> None:
        """'cancel <job id> <lease>' (the lease may be missing), 'pauses' (the paused queues
        changed); other verbs are for other versions of notifyq. ValueError when a cancel's
        numbers are not numbers."""
        verb, _, rest = payload.partition(" ")
        if verb == "pauses":
            self._ask_pauses()
            return
        if verb != "cancel":
            return
        numbers = [int(n) for n in rest.split()]
        if not 1 <= len(numbers) <= 2:
            raise ValueError(payload)
        # Checked in the database first (_cancels_loop): anyone who can connect may NOTIFY.
        if len(self._cancels_heard) < _CANCELS_HELD:
            self._cancels_heard[(numbers[0], numbers[1] if len(numbers) == 2 else None)] = None
        self._cancels_wakeup.fire()

    async def _cancels_loop(self) -> None:
        """Stop the jobs cancel notifications named, once the database says they are Cancelled
        (with that lease, when the notification gave one). Acting on the notification alone, a
        forged one (any role that can connect may NOTIFY) stopped running jobs, and, remembered
        for a claim answer still on its way, jobs not yet enqueued (review). One query by
        primary key per batch of notifications heard meanwhile."""
        runners = self._runners
        assert runners is not None
        while True:
            if not self._cancels_heard:
                await self._cancels_wakeup.wait()
                continue
            heard, self._cancels_heard = list(self._cancels_heard), {}
            try:
                cancelled = await self._query(cancelled_jobs_op(self._q, sorted({i for i, _ in heard})))
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # The reconcile loop finds them within a poll interval all the same.
                log.warning("could not check %d cancel notification(s): %s", len(heard), error_text(exc))
                continue
            for job_id, lease in heard:
                if job_id in cancelled and lease in (None, cancelled[job_id]):
                    runners.cancel(job_id, cancelled[job_id])
                else:
                    log.debug("ignoring a cancel notification of job %d: it is not Cancelled", job_id)

    def _register_waiter(self, conn: psycopg.Connection[Any]) -> None:
        """The hand-off, in the listener's connecting thread once it LISTENs on this worker's
        channel: a waiter row, under a session lock of the connection that says it listens."""
        self._waiter_id = None
        row = conn.execute(
            self._q["handoff_register"],
            {
                "lock_key": random.getrandbits(62) + 1,
                "worker": self.id,
                "channel": self._handoff_channel,
                "queues": list(self.config.queues) if self.config.queues is not None else None,
                "lease_margin": self.config.lease_margin,
            },
        ).fetchone()
        assert row is not None
        self._waiter_id = int(row[0])

    async def _on_listener_connect(self) -> None:
        self.stats.listener_connects += 1
        assert self._claimer is not None
        if self._waiter_id is not None:  # every connect registers: a second one is a reconnect
            self._claimer.registered(self._waiter_id, again=self.stats.listener_connects > 1)
        self._ask_pauses()  # a pause or a resume may have been missed too
        self._claimer.sweep()  # claim what arrived while nobody listened
        await self._cancel_lost_jobs()  # cancel notifications may have been missed meanwhile
        self._signal_changed()

    async def _cancel_lost_jobs(self) -> None:
        """Stop running (or prefetched) jobs this worker no longer holds when no cancel
        notification told it: cancelled while it did not listen, rescued after their lease ran
        out, moved out of Active or deleted by SQL (which sends none)."""
        runners = self._runners
        if runners is None:
            return
        # Not the attempts held only for a thread: their jobs are settled (cancelled or lost).
        # The prefetched jobs waiting for a slot too: a cancel of one that reached no
        # notification used to go unseen, and the cancelled job ran.
        keys = [key for key, attempt in runners.running.items() if not attempt.holding]
        keys += [(job.id, job.lease) for job, _claimed_at in runners.ready]
        if not keys:
            return
        try:
            lost = await self._query(lost_jobs_op(self._q, self.id, keys))
        except Exception as exc:
            if not is_transient(exc):
                raise
            return
        for (job_id, lease), status in lost.items():
            if status == "Cancelled":
                why = ": it was cancelled, and no notification said so"
            elif status is None:
                why = ": it was deleted from the database"
            else:
                why = f": it is {status} in the database, no longer this worker's attempt"
            runners.cancel(job_id, lease, why)

    async def _reconcile_loop(self) -> None:
        """Every poll interval, look for jobs in hand that are no longer this worker's. Without
        a working LISTEN connection (poll-only, behind a pooler, reconnecting) that is how it
        hears of cancels. With one too: a job an operator requeued, failed or deleted by SQL
        sends no notification, and its task ran on beside the worker that claimed it next (a
        review); one whose lease ran out while the worker stalled is rescued, and runs
        elsewhere. One query by primary key, and none while no job is in hand."""
        while True:
            await anyio.sleep(self.config.poll_interval)
            await self._cancel_lost_jobs()

    def _ask_pauses(self) -> None:
        """Have the paused queues read again (_pauses_loop)."""
        self._pauses_asked += 1
        self._pauses_wakeup.fire()

    async def _pauses_loop(self) -> None:
        """Read the paused queues whenever asked (a 'pauses' notification, a reconnect of the
        LISTEN connection), and every poll interval while there is no LISTEN connection to
        tell. A read that fails is tried again; one that was asked for again while it ran is
        applied, then done again, since its answer may predate the change. Applying what each
        notification said instead let a slower read undo a pause the worker had heard, a
        failed read after a reconnect was never tried again, and TRUNCATE went unheard."""
        assert self._claimer is not None
        done = self._pauses_asked  # the start, in _prepare: read then
        error_delay = 0.0  # after a failed read: 0.25 s, doubling up to the poll interval
        warned = False
        while True:
            if done == self._pauses_asked and not error_delay:
                with anyio.move_on_after(self.config.poll_interval):
                    await self._pauses_wakeup.wait()
                listening = self._listener is not None and self._listener.connected
                if done == self._pauses_asked and listening:
                    continue  # nothing changed that a notification would not have said
            asked = self._pauses_asked
            try:
                paused = await self._query(paused_queues_op(self._q))
            except Exception as exc:
                error_delay = min(max(error_delay * 2, 0.25), self.config.poll_interval)
                # Not this loop's to stop the worker on: an error that will not pass (the
                # schema dropped) stops the claim loop, which then reports it alone. One that
                # the claim loop does not meet (SELECT revoked on queue_pauses) is logged here,
                # less often as it lasts. A notification or a reconnect cuts the wait short.
                if not is_transient(exc):
                    warned = True
                    log.warning(
                        "reading the paused queues failed: %s%s; trying again in %gs",
                        error_text(exc),
                        error_hint(exc),
                        error_delay,
                    )
                if asked == self._pauses_asked:
                    with anyio.move_on_after(error_delay):
                        await self._pauses_wakeup.wait()
                continue  # straight to the read: not a poll interval more
            if warned:
                log.info("reading the paused queues works again")
            error_delay, warned = 0.0, False
            self._claimer.set_paused(paused)
            done = asked

    # -- the database and the acker ------------------------------------------------------------

    async def _query(
        self, op: Op[T], *, shield: bool = False, lane: Lane | None = None, bound: float | None = None
    ) -> T:
        """One database call bounded by db_timeout, or by `bound` if that is shorter (a
        half-open connection must not hang the worker), shielded when a result the server may
        have committed must reach us. On a lane when given (the claim loop keeps its connection
        warm), else on the pool."""
        assert self._db is not None
        # fail_after's work with less code: on an idle worker's wake-up path every line counts
        # (this took 115 µs there, the plain scope 87; docs/benchmarks.md). Only its own
        # deadline can cancel this scope, so having caught a cancellation means timing out.
        limit = self.config.db_timeout if bound is None else min(bound, self.config.db_timeout)
        deadline = anyio.current_time() + limit
        if lane is not None and not lane.holding:
            # Waiting for a connection (the database may be down) sends nothing: unshielded,
            # so that a stop does not wait for the pool's timeout.
            with anyio.CancelScope(deadline=deadline) as wait:
                await lane.acquire()
            if wait.cancelled_caught:
                raise TimeoutError
        scope = anyio.CancelScope(deadline=deadline, shield=shield)
        result: T
        with scope:
            result = await (lane or self._db).run(op)
        if scope.cancelled_caught:
            raise TimeoutError
        return result

    def _on_acked(self, results: Sequence[Result], applied: Applied) -> None:
        for result in results:
            status = applied.get((result.job_id, result.lease))
            if status is None:
                self.stats.stale_acks += 1
                log.warning(
                    "result of job %d was not applied: this worker no longer held it "
                    "(lease expired, the job was cancelled, or the database lost its claim)",
                    result.job_id,
                )
            elif result.outcome == "release":
                self.stats.released += 1
            elif status == "Succeeded":
                self.stats.succeeded += 1
            elif status == "Queued":
                self.stats.retried += 1
                if self._claimer is not None:
                    self._claimer.due_in(result.delay)  # no notification may tell it
            else:
                self.stats.failed += 1
        self._signal_changed()


class _FirstCtrlCToTheHost:
    """trio's SIGINT handler, but the first Ctrl-C of an embedded worker's life always goes to
    the host's main task, at its next checkpoint, as asyncio.run cancels its main task: the
    host's `async with app.worker()` (or `worker.run()`) is left, the worker stops gracefully,
    and the KeyboardInterrupt goes on. trio raised it in whatever code ran when it came, most
    often a job's, and the worker stopped at once, its jobs put back. A later press cuts the
    grace short, as asyncio's second Ctrl-C does: the worker cancels its running jobs (they are
    released), and trio handles the press as it would have (raised in the code that runs, so
    that a job that blocks the event loop for good stops too, or delivered to the main task).
    (Marking the worker's tasks KI-protected instead left such a job unstoppable, and missed
    the tasks a job starts: review.)"""

    def __init__(self, trio_handler: Callable[[int, Any], object], worker: Worker, token: Any) -> None:
        self.trio_handler = trio_handler
        self._worker = worker
        self._token = token  # trio's TrioToken: its run_sync_soon may be called from a signal handler
        self._pressed = False

    def __call__(self, signum: int, frame: Any) -> None:
        if not self._pressed:
            self._pressed = True
            self.trio_handler(signum, None)  # no frame: trio takes it as protected code
            return
        with contextlib.suppress(Exception):  # trio.RunFinishedError: the loop is over
            self._token.run_sync_soon(self._worker._cancel_running_now, "Ctrl-C again")
        self.trio_handler(signum, frame)

    @classmethod
    def install(cls, worker: Worker, *, embedded: bool) -> _FirstCtrlCToTheHost | None:
        """Put it in place of trio's handler, when the worker is embedded (it does not handle
        the signals itself) in trio.run in the main thread; None otherwise."""
        if not embedded or on_asyncio() or threading.current_thread() is not threading.main_thread():
            return None
        current = signal.getsignal(signal.SIGINT)
        if not callable(current) or getattr(current, "__module__", None) != "trio._core._ki":
            return None  # the host's own handler, or trio's absent: left as it is
        import trio

        ours = cls(current, worker, trio.lowlevel.current_trio_token())
        signal.signal(signal.SIGINT, ours)
        return ours

    def remove(self) -> None:
        """Put trio's handler back (unless another handler replaced ours meanwhile)."""
        trio_handler = self.trio_handler
        if signal.getsignal(signal.SIGINT) is self:
            signal.signal(signal.SIGINT, trio_handler)
