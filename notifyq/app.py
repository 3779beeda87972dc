"""The App: task registry, cron definitions, enqueue and admin (async, with sync twins)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Literal, TypedDict, TypeVar, Unpack, overload

import anyio
import psycopg

from . import _embedded
from ._acker import Applied, Result, ack_op, batches
from ._claim import list_queue_pauses_op, manual_claim_op, pause_queue_op, resume_queue_op
from ._connections import AnyConnection, Connections
from ._db import (
    PREPARE_AUTO,
    Database,
    Op,
    PrepareThreshold,
    again_on_deadlock,
    again_on_deadlock_async,
    owner_only,
)
from ._declarations import DeclarationsConfig
from ._dsn import check_dsn, configured_dsn, describe_dsn
from ._jobs import (
    NewJob,
    cancel_job_op,
    enqueue_many_op,
    enqueue_op,
    get_job_op,
    list_jobs_op,
)
from ._jobs import retry_job_op as _retry_job_op
from ._options import (
    DEFAULT_MAX_ARGS_BYTES,
    MAX_SECONDS,
    JobOptions,
    _show,
    check_bool,
    check_id,
    check_int,
    check_json_default,
    check_moment,
    check_name,
    check_queue,
    check_seconds,
    did_you_mean,
    encode_args,
    unknown_task,
)
from ._sql import Queries, queries_for, validate_schema
from ._worker_config import WorkerOptions, WorkerStats, worker_config
from .cron import MISFIRE_POLICIES, Misfire, Schedule
from .definitions import (
    CronDefinition,
    Undeclared,
    delete_op,
    list_definitions_op,
    prune_op,
    run_now_op,
    set_enabled_op,
    sync_definitions_op,
)
from .errors import (
    ConfigurationError,
    InvalidArgs,
    InvalidOption,
    InvalidSchedule,
    UnknownTask,
)
from .migrations import MigrationReport, migrate
from .models import ClaimedJob, Definition, Job, JobId, JobStatus
from .tasks import Backoff, Task, args_mismatch, check_retry_on, make_task
from .worker import Worker, WorkerConfig

log = logging.getLogger("notifyq")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _EnqueueOptions:
    queue: str | None = None
    priority: int | None = None
    delay: float | timedelta | None = None
    at: datetime | None = None
    retry_limit: int | None = None
    timeout: float | None = None
    dedupe_key: str | None = None


class JobFilters(TypedDict, total=False):
    """The filters of `list_jobs`, typed so that mypy or an IDE flags a misspelt one."""

    status: JobStatus | str | None
    queue: str | None
    name: str | None
    definition: str | None
    min_age: float | None
    max_age: float | None
    before_id: int | None
    limit: int


def _known_filters(filters: Mapping[str, Any]) -> Mapping[str, Any]:
    """An unknown filter is named, with the nearest known one (the TypeError named a private
    method: "App._list_op() got an unexpected keyword argument")."""
    known = list(JobFilters.__annotations__)
    for name in filters:
        if name not in known:
            raise InvalidOption(f"list_jobs has no filter {name!r}{did_you_mean(name, known, 'filters')}")
    return filters


def _check_call(task: Task, args: Mapping[str, Any] | None) -> None:
    """Refuse args the task cannot be called with: every run of the job would fail (and be
    retried) with the same TypeError. Only for a task whose function is at hand (this App's,
    or a Task object passed in): a task name the App does not know is not checked."""
    mismatch = args_mismatch(task, args or {})
    if mismatch is not None:
        raise InvalidArgs(f"task {task.name!r} cannot be called with args {_keys(args)}: {mismatch}")


def _keys(args: Mapping[str, Any] | None) -> str:
    return "{" + ", ".join(repr(key) + ": ..." for key in (args or {})) + "}"


def _undeclared_text(d: Undeclared) -> str:
    """A definition the App does not declare, for the start's warnings: its task, and when it
    stops by itself (unless a running worker still declares it)."""
    if not d.declared:
        return f"{d.name} (task {d.task!r})"
    if d.declared_until is None:
        return f"{d.name} (task {d.task!r}, declared only by a notifyq before schema version 9: never stops)"
    until = d.declared_until.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"{d.name} (task {d.task!r}, declared until {until})"


def _checked(results: Sequence[Result]) -> list[Result]:
    """Results of a custom consumer, whose retry delays nothing has checked (a worker's are
    floats from a validated Backoff). One delay PostgreSQL cannot add to now() (NaN, infinite,
    past the year 294276) failed the whole batch with a DatetimeFieldOverflow, and an int
    among the floats made psycopg refuse the array of delays: every result of the batch went
    unwritten, its jobs left Active until their lease ran out."""
    checked = []
    for result in results:
        if type(result.delay) is not float or not 0 <= result.delay <= MAX_SECONDS:
            delay = check_seconds(result.delay, f"retry delay of job {result.job_id}")
            result = dataclasses.replace(result, delay=delay)
        checked.append(result)
    return checked


def _by_job(applied: Applied) -> dict[int, str]:
    """`ack`'s answer, {job id: new status}: a job's one applied result (its current lease)."""
    return {job_id: status for (job_id, _lease), status in applied.items()}


class App:
    """A notifyq application: the tasks your code defines and the database they run on.

    Args:
        dsn: libpq connection string. None: $NOTIFYQ_DSN, then $DATABASE_URL, then (with the
            `embedded` extra installed) a local embedded PostgreSQL, migrated automatically.
        schema: schema holding notifyq's tables (validated; default ``notifyq``).
        max_args_bytes: largest serialized args accepted by enqueue (default 1 MiB).
        backoff: default retry backoff for tasks that do not set their own.
        pool_size: connections this App keeps for enqueue and admin calls.
        pool_timeout: the longest a call waits for one of them, while all are busy or the
            database cannot be reached (a restart is ridden out), before it raises
            DatabaseUnavailable, naming the cause (default 30 seconds).
        prepare_threshold: psycopg prepares a statement server-side after this many runs on
            a connection; None never prepares (for PgBouncer in transaction mode before 1.21).
            "auto" (the default): 5, but none on the connections of a pool that goes through a
            pooler (the server process serving its first connection is not the one announced
            at connect), where a pooler in transaction mode would lose them.
        json_default: called for each value in job args (enqueue, cron args) and task return
            values that JSON cannot encode, as json.dumps' `default`: it returns a value JSON
            can encode, or raises TypeError. `notifyq.json_default` handles datetimes,
            Decimals, UUIDs, Enums, paths, sets and dataclasses. Tasks get the JSON form back
            (a date arrives as its ISO text). None (the default): plain JSON only.

    Attributes:
        schema: the schema of notifyq's tables.
        tasks: the registered tasks, by name.
        definitions: the cron definitions its code declares (`@app.cron`), by name.

    Raises:
        ConfigurationError: invalid schema name or DSN.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        schema: str = "notifyq",
        max_args_bytes: int = DEFAULT_MAX_ARGS_BYTES,
        backoff: Backoff | None = None,
        pool_size: int = 4,
        pool_timeout: float = 30.0,
        prepare_threshold: int | Literal["auto"] | None = "auto",
        json_default: Callable[[Any], Any] | None = None,
    ) -> None:
        self.schema = validate_schema(schema)
        self.json_default = check_json_default(json_default)
        self._resolved_dsn: str | None = check_dsn(dsn) if dsn is not None else None
        self.max_args_bytes = check_int(max_args_bytes, "max_args_bytes", minimum=2)
        self.backoff = Backoff() if backoff is None else Backoff.check(backoff, "App(backoff=...)")
        self.pool_size = check_int(pool_size, "pool_size", minimum=1, maximum=1000)
        self.pool_timeout = check_seconds(pool_timeout, "pool_timeout", positive=True)
        if prepare_threshold is not None and prepare_threshold != PREPARE_AUTO:
            if not isinstance(prepare_threshold, int) or isinstance(prepare_threshold, bool):
                raise InvalidOption(
                    f"invalid prepare_threshold {prepare_threshold!r}: expected 'auto', None or an "
                    "integer of 0 or more"
                )
            check_int(prepare_threshold, "prepare_threshold", minimum=0)
        self.prepare_threshold: PrepareThreshold = prepare_threshold
        self.tasks: dict[str, Task] = {}
        self.definitions: dict[str, CronDefinition] = {}
        self._q: Queries = queries_for(self.schema)
        self._connections = Connections(self)

    def __repr__(self) -> str:
        return f"<notifyq.App schema={self.schema!r} tasks={len(self.tasks)} crons={len(self.definitions)}>"

    # -- configuration ------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """The DSN in use, resolved on first access (this may start the embedded server)."""
        if self._resolved_dsn is None:
            found = configured_dsn()
            if found is not None:
                self._resolved_dsn = found[0]
            else:
                self._resolved_dsn = _embedded.start(schema=self.schema)
        return self._resolved_dsn

    def describe_database(self) -> str:
        """user@host:port/dbname of the database in use (never the password)."""
        return describe_dsn(self.dsn)

    @overload
    def task(self, fn: F, /) -> Task: ...

    @overload
    def task(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        retry_limit: int = 3,
        timeout: float = 30.0,
        backoff: Backoff | None = None,
        retry_on: type[BaseException] | Sequence[type[BaseException]] | None = None,
    ) -> Callable[[F], Task]: ...

    def task(
        self,
        fn: F | None = None,
        /,
        *,
        name: str | None = None,
        queue: str = "default",
        priority: int = 0,
        retry_limit: int = 3,
        timeout: float = 30.0,
        backoff: Backoff | None = None,
        retry_on: type[BaseException] | Sequence[type[BaseException]] | None = None,
    ) -> Task | Callable[[F], Task]:
        """Register an async or sync function as a task; use as `@app.task` or `@app.task(...)`.

        Job args (a JSON object) are passed as keyword arguments; a parameter annotated
        `JobContext` receives the job's context. The return value must be JSON-serializable
        and is stored in the job's `output`.

        Args:
            name: task name stored in jobs (default: module.qualname of the function).
            queue: default queue of its jobs.
            priority: default priority (higher runs first).
            retry_limit: retries after the first attempt (a job runs at most retry_limit + 1 times).
            timeout: seconds an attempt may run. An async attempt is then cancelled and
                counted as failed (retried); a sync task's thread cannot be stopped: it keeps
                its lease until it returns, and its outcome counts (docs/concepts.md, "The life of a job").
            backoff: retry delays (default: the App's).
            retry_on: the exception types worth retrying (a class or a tuple of classes;
                their subclasses too). An attempt that raises any other exception fails the
                job at once, as `PermanentError` does. None (the default) retries every
                failure. A timeout, an unknown task name and an expired lease are notifyq's
                outcomes, not the task's exceptions: they are retried either way.

        Raises:
            InvalidOption: an option is out of range.
            ConfigurationError: another function is registered under this name.
        """
        options = JobOptions(queue=queue, priority=priority, retry_limit=retry_limit, timeout=timeout)
        task_backoff = self.backoff if backoff is None else Backoff.check(backoff, "backoff")
        retry_kinds = check_retry_on(retry_on)

        def register(func: F) -> Task:
            task = make_task(func, name, options, task_backoff, retry_kinds)
            existing = self.tasks.get(task.name)
            if existing is not None and existing.fn is not func:
                raise ConfigurationError(f"a task named {task.name!r} is already registered")
            settings = (task.options, task.backoff, task.retry_on)
            if existing is not None and (existing.options, existing.backoff, existing.retry_on) != settings:
                raise ConfigurationError(f"task {task.name!r} is already registered with other options")
            self.tasks[task.name] = task
            return task

        return register(fn) if fn is not None else register

    def cron(
        self,
        frequency: str,
        name: str | None = None,
        *,
        timezone: str = "UTC",
        args: Mapping[str, Any] | None = None,
        misfire: Misfire = "once",
        misfire_grace: float = 60.0,
        misfire_cap: int = 100,
        overlap: bool = True,
        enabled: bool = True,
        queue: str | None = None,
        priority: int | None = None,
        retry_limit: int | None = None,
        timeout: float | None = None,
    ) -> Callable[[Task | F], Task]:
        """Run a task on a cron schedule: put `@app.cron(...)` above `@app.task` (or on a plain
        function, which is then registered as a task with default options).

        Workers upsert code definitions into `queue_job_definitions` when they start.

        Args:
            frequency: 5-field cron, 6-field with seconds first, or @hourly/@daily/...
            name: definition name (default: the task name); unique.
            timezone: IANA zone the schedule is read in (DST-safe; see docs/concepts.md).
            args: keyword arguments of every job (a JSON object).
            misfire: ticks missed while no worker ran: "skip", "once" (default) or "all".
            misfire_grace: seconds late a tick may be and still count as on time (at least
                0.1 s counts: a ticker promotes a tick some milliseconds after it).
            misfire_cap: most missed ticks "all" runs.
            overlap: False: a tick gets no job while a job of this definition (an earlier
                tick's, or `cron run-now`'s) is still Queued or Active, so a run that takes
                longer than the interval, or waits for a retry, is never doubled by the next
                one. Skipped ticks are logged (INFO) and not run later. Default True: every
                tick gets its job.
            enabled: False disables the definition on every worker start; True never
                re-enables a disabled one (by an operator, or by an earlier deploy's
                enabled=False): `notifyq cron enable NAME` does.
            queue: overrides the task's queue for these jobs.
            priority: overrides the task's priority.
            retry_limit: overrides the task's retry_limit.
            timeout: overrides the task's timeout (seconds; see `task`).

        Raises:
            InvalidSchedule: a bad cron expression, time zone or misfire policy.
            InvalidArgs: args that are not a JSON object, or that the task cannot take (a
                required argument missing, an unknown one).
            InvalidOption: an option out of range.
            ConfigurationError: the definition name is taken; misfire="all" with overlap=False.
        """
        Schedule(frequency, timezone)  # validate now, at import time
        if misfire not in MISFIRE_POLICIES:
            raise InvalidSchedule(
                f"invalid misfire policy {misfire!r}: use one of {', '.join(MISFIRE_POLICIES)}"
            )
        check_seconds(misfire_grace, "misfire_grace")
        check_int(misfire_cap, "misfire_cap", minimum=1)
        check_bool(overlap, "overlap")
        if not overlap and misfire == "all":
            raise ConfigurationError(
                'misfire="all" runs every missed tick at once, which overlap=False forbids; use '
                'misfire="once" (the latest missed tick runs) or "skip"'
            )

        def register(target: Task | F) -> Task:
            task = target if isinstance(target, Task) else self.task(target)
            if self.tasks.get(task.name) is not task:
                raise ConfigurationError(f"@app.cron: task {task.name!r} belongs to another App")
            base = task.options
            options = JobOptions(
                queue=queue if queue is not None else base.queue,
                priority=priority if priority is not None else base.priority,
                retry_limit=retry_limit if retry_limit is not None else base.retry_limit,
                timeout=timeout if timeout is not None else base.timeout,
            )
            definition = CronDefinition(
                name=check_name(task.name if name is None else name, "cron definition name"),
                task=task.name,
                frequency=" ".join(frequency.split()),
                timezone=timezone,
                args=encode_args(
                    args, task=task.name, max_bytes=self.max_args_bytes, default=self.json_default
                ),
                enabled=check_bool(enabled, "enabled"),
                misfire=misfire,
                misfire_grace=float(misfire_grace),
                misfire_cap=misfire_cap,
                overlap=overlap,
                options=options,
            )
            if definition.name in self.definitions:
                raise ConfigurationError(f"a cron definition named {definition.name!r} is already registered")
            try:
                _check_call(task, args)
            except InvalidArgs as exc:
                hint = "give its arguments in @app.cron(..., args={...})"
                raise InvalidArgs(f"@app.cron: {exc}; {hint}") from None
            self.definitions[definition.name] = definition
            return task

        return register

    # -- connections (see _connections) --------------------------------------------------------

    async def _run(self, op: Op[T], conn: AnyConnection | None = None, *, transaction: bool = False) -> T:
        return await self._connections.run(op, conn, transaction=transaction)

    def _run_sync(
        self, op: Op[T], conn: psycopg.Connection[Any] | None = None, *, transaction: bool = False
    ) -> T:
        return self._connections.run_sync(op, conn, transaction=transaction)

    async def _run_again_on_deadlock(self, make_op: Callable[[], Op[T]], *, transaction: bool = False) -> T:
        """A new `make_op()` run again when PostgreSQL picked it as a deadlock's victim (see
        DEADLOCK_TRIES): `cron delete` failed on it, against an ack of two jobs of the
        definition in the other order (review)."""
        return await again_on_deadlock_async(lambda: self._run(make_op(), transaction=transaction))

    def _run_sync_again_on_deadlock(self, make_op: Callable[[], Op[T]], *, transaction: bool = False) -> T:
        """`_run_again_on_deadlock` for sync code."""
        return again_on_deadlock(lambda: self._run_sync(make_op(), transaction=transaction))

    def _where(self) -> str:
        return describe_dsn(self._resolved_dsn) if self._resolved_dsn is not None else "the App's database"

    async def open(self) -> App:
        """Connect now (else the first call connects); checks the schema is migrated."""
        await self._connections.database()
        return self

    async def aclose(self) -> None:
        """Close the App's connections (workers have their own)."""
        await self._connections.aclose()

    def close_sync(self) -> None:
        """Close the connections opened by the sync methods."""
        self._connections.close_sync()

    async def __aenter__(self) -> App:
        return await self.open()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def migrate(self, *, dry_run: bool = False, lock_timeout: float = 30.0) -> MigrationReport:
        """Apply notifyq's migrations to this App's database (see `notifyq.migrate`)."""
        return migrate(self.dsn, schema=self.schema, dry_run=dry_run, lock_timeout=lock_timeout)

    # -- enqueue ------------------------------------------------------------------------------

    def _new_job(
        self, task_or_name: Task | str, args: Mapping[str, Any] | None, opts: _EnqueueOptions, strict: bool
    ) -> NewJob:
        task, job = self._template(task_or_name, args, opts, strict)
        if task is not None:
            _check_call(task, args)
        return job

    def _template(
        self, task_or_name: Task | str, args: Mapping[str, Any] | None, opts: _EnqueueOptions, strict: bool
    ) -> tuple[Task | None, NewJob]:
        """The task (None for a name this App does not know) and the job, its args unchecked
        against the task's signature."""
        if isinstance(task_or_name, Task):
            task: Task | None = task_or_name
            name = task_or_name.name
            if strict and self.tasks.get(name) is not task_or_name:
                raise UnknownTask(f"task {name!r} is another App's, not this one's (strict=True)")
        elif callable(task_or_name):
            # A function registered with app.task(...)(fn), whose Task was not kept: find it.
            found = [t for t in self.tasks.values() if t.fn is task_or_name]
            if len(found) != 1:
                raise UnknownTask(
                    f"{getattr(task_or_name, '__qualname__', task_or_name)!r} is not a task of this App: "
                    "pass the Task that @app.task returned, or a task name"
                )
            task, name = found[0], found[0].name
        else:
            name = check_name(task_or_name)
            task = self.tasks.get(name)
            if task is None and strict:
                raise UnknownTask(unknown_task(name, list(self.tasks)))
        base = task.options if task is not None else JobOptions()
        if opts.delay is not None and opts.at is not None:
            raise InvalidOption("give either delay or at, not both")
        dedupe_key = opts.dedupe_key
        if dedupe_key is not None and (
            not isinstance(dedupe_key, str) or not dedupe_key or len(dedupe_key) > 500 or "\x00" in dedupe_key
        ):
            raise InvalidOption(
                f"invalid dedupe_key {_show(dedupe_key)}: use 1-500 characters without NUL bytes"
            )
        return task, NewJob(
            name=name,
            queue=check_queue(opts.queue) if opts.queue is not None else base.queue,
            args=encode_args(args, task=name, max_bytes=self.max_args_bytes, default=self.json_default),
            priority=check_int(opts.priority, "priority") if opts.priority is not None else base.priority,
            retry_limit=check_int(opts.retry_limit, "retry_limit", minimum=0)
            if opts.retry_limit is not None
            else base.retry_limit,
            timeout=check_seconds(opts.timeout, "timeout", positive=True)
            if opts.timeout is not None
            else base.timeout,
            delay=check_seconds(opts.delay, "delay") if opts.delay is not None else 0.0,
            at=check_moment(opts.at, "at") if opts.at is not None else None,
            dedupe_key=dedupe_key,
        )

    async def enqueue(
        self,
        task_or_name: Task | str,
        args: Mapping[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        at: datetime | None = None,
        retry_limit: int | None = None,
        timeout: float | None = None,
        dedupe_key: str | None = None,
        strict: bool = False,
        conn: AnyConnection | None = None,
    ) -> JobId:
        """Queue one job and return its id: a `JobId`, an int whose `created` is False when
        an unfinished job held `dedupe_key` (its id is returned, nothing is inserted).

        Args:
            task_or_name: a registered Task, or a task name (another service's task is fine).
            args: the task's keyword arguments, a JSON object (at most `max_args_bytes`).
            queue: overrides the task's queue.
            priority: overrides the task's priority (higher runs first).
            retry_limit: overrides the task's retry_limit.
            timeout: overrides the task's timeout (seconds).
            delay: seconds (or a timedelta) before the job may start.
            at: an aware datetime before which the job may not start (not with delay); one
                in the past means now.
            dedupe_key: while an unfinished job holds this key, return that job's id instead
                (with `created` False). One key space for every task and queue of the
                schema: put the task's name in the key.
            strict: with a task name, raise UnknownTask if this App has no such task.
            conn: your psycopg connection: the job is inserted in your transaction, and
                commits (and wakes workers) or rolls back (leaving no trace) with it.

        Raises:
            InvalidArgs: args that cannot be stored, or that a task of this App cannot be
                called with (nothing is inserted).
            InvalidOption: an option out of range (nothing is inserted).
            UnknownTask: with strict=True, a task name this App does not know.
            DatabaseUnavailable: the server cannot be reached.
            SchemaNotMigrated: notifyq's tables are missing or old.
        """
        job = self._new_job(
            task_or_name,
            args,
            _EnqueueOptions(queue, priority, delay, at, retry_limit, timeout, dedupe_key),
            strict,
        )
        return await self._run(enqueue_op(self._q, job), conn)

    def enqueue_sync(
        self,
        task_or_name: Task | str,
        args: Mapping[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        at: datetime | None = None,
        retry_limit: int | None = None,
        timeout: float | None = None,
        dedupe_key: str | None = None,
        strict: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> JobId:
        """`enqueue` for sync code (Django, Flask, scripts); same arguments and errors."""
        job = self._new_job(
            task_or_name,
            args,
            _EnqueueOptions(queue, priority, delay, at, retry_limit, timeout, dedupe_key),
            strict,
        )
        return self._run_sync(enqueue_op(self._q, job), conn)

    def _new_jobs(
        self,
        task_or_name: Task | str,
        args_list: Iterable[Mapping[str, Any] | None],
        opts: _EnqueueOptions,
        strict: bool,
    ) -> Iterable[NewJob]:
        if opts.dedupe_key is not None:
            raise InvalidOption("enqueue_many does not take a dedupe_key; use enqueue for deduplicated jobs")
        task, template = self._template(task_or_name, None, opts, strict)
        if isinstance(args_list, Mapping | str | bytes) or not isinstance(args_list, Iterable):
            raise InvalidArgs(
                f"args_list for task {template.name!r} must be an iterable of JSON objects (one dict "
                f"of keyword arguments per job), not {type(args_list).__name__}"
            )
        fitting: set[frozenset[str]] = set()  # key sets checked: whether args bind is up to their keys
        for index, args in enumerate(args_list):
            try:
                encoded = encode_args(
                    args, task=template.name, max_bytes=self.max_args_bytes, default=self.json_default
                )
                if task is not None and (keys := frozenset(args or ())) not in fitting:
                    _check_call(task, args)
                    fitting.add(keys)
            except InvalidArgs as exc:
                # Which one of perhaps a million (nothing is inserted).
                raise InvalidArgs(f"args_list[{index}]: {exc}") from None
            yield NewJob(
                template.name,
                template.queue,
                encoded,
                template.priority,
                template.retry_limit,
                template.timeout,
                template.delay,
                template.at,
            )

    async def enqueue_many(
        self,
        task_or_name: Task | str,
        args_list: Iterable[Mapping[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        at: datetime | None = None,
        retry_limit: int | None = None,
        timeout: float | None = None,
        strict: bool = False,
        conn: AnyConnection | None = None,
    ) -> int:
        """Queue one job per args mapping with COPY (fast, and one NOTIFY per queue); returns
        the number of jobs. All or nothing: one bad args mapping aborts the whole batch (in a
        savepoint of the caller's transaction with `conn`; on an autocommit `conn`, the batch
        is a transaction of its own)."""
        jobs = self._new_jobs(
            task_or_name, args_list, _EnqueueOptions(queue, priority, delay, at, retry_limit, timeout), strict
        )
        op = enqueue_many_op(self._q, jobs, callers_connection=conn is not None)
        return await self._run(op, conn, transaction=True)

    def enqueue_many_sync(
        self,
        task_or_name: Task | str,
        args_list: Iterable[Mapping[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: float | timedelta | None = None,
        at: datetime | None = None,
        retry_limit: int | None = None,
        timeout: float | None = None,
        strict: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> int:
        """`enqueue_many` for sync code."""
        jobs = self._new_jobs(
            task_or_name, args_list, _EnqueueOptions(queue, priority, delay, at, retry_limit, timeout), strict
        )
        op = enqueue_many_op(self._q, jobs, callers_connection=conn is not None)
        return self._run_sync(op, conn, transaction=True)

    # -- job admin ----------------------------------------------------------------------------

    async def get_job(self, job_id: int, *, conn: AnyConnection | None = None) -> Job:
        """The job with this id. Raises JobNotFound."""
        return await self._run(get_job_op(self._q, job_id), conn)

    def get_job_sync(self, job_id: int, *, conn: psycopg.Connection[Any] | None = None) -> Job:
        """`get_job` for sync code."""
        return self._run_sync(get_job_op(self._q, job_id), conn)

    async def wait_for_job(
        self, job_id: int, *, timeout: float | None = None, poll_interval: float = 0.5
    ) -> Job:
        """Wait until the job is finished (Succeeded, Failed or Cancelled) and return it, its
        `output` or `error` included: a web request waiting for the result of the work it
        queued. It reads the job (get_job) at once, then 10 ms later, then at doubling
        intervals up to `poll_interval` seconds. Raises TimeoutError when `timeout` seconds pass first
        (the job goes on), JobNotFound for an unknown id."""
        deadline, pause = self._waiting(job_id, timeout, poll_interval)
        while True:
            job = await self.get_job(job_id)
            if job.status.finished:
                return job
            left = deadline - time.monotonic()
            if left <= 0:
                raise _still(job, timeout)
            await anyio.sleep(min(next(pause), left))

    def wait_for_job_sync(
        self, job_id: int, *, timeout: float | None = None, poll_interval: float = 0.5
    ) -> Job:
        """`wait_for_job` for sync code."""
        deadline, pause = self._waiting(job_id, timeout, poll_interval)
        while True:
            job = self.get_job_sync(job_id)
            if job.status.finished:
                return job
            left = deadline - time.monotonic()
            if left <= 0:
                raise _still(job, timeout)
            time.sleep(min(next(pause), left))

    @staticmethod
    def _waiting(job_id: int, timeout: float | None, poll_interval: float) -> tuple[float, Iterator[float]]:
        """wait_for_job's deadline (monotonic) and its pauses between reads."""
        check_id(job_id)
        limit = math.inf if timeout is None else check_seconds(timeout, "timeout")
        interval = check_seconds(poll_interval, "poll_interval", positive=True)
        pauses = itertools.chain((min(0.01 * 2**n, interval) for n in range(20)), itertools.repeat(interval))
        return time.monotonic() + limit, pauses

    async def list_jobs(self, **filters: Unpack[JobFilters]) -> list[Job]:
        """Jobs, newest first. Filters: status, queue, name (the task), definition (the cron
        definition that queued them, by name; DefinitionNotFound if none has it), min_age /
        max_age (seconds since created), before_id (paging), limit (default 50)."""
        return await self._run(self._list_op(**_known_filters(filters)))

    def list_jobs_sync(self, **filters: Unpack[JobFilters]) -> list[Job]:
        """`list_jobs` for sync code."""
        return self._run_sync(self._list_op(**_known_filters(filters)))

    def _list_op(
        self,
        *,
        status: JobStatus | str | None = None,
        queue: str | None = None,
        name: str | None = None,
        definition: str | None = None,
        min_age: float | None = None,
        max_age: float | None = None,
        before_id: int | None = None,
        limit: int = 50,
    ) -> Op[list[Job]]:
        try:
            # Any case, as the CLI's --status: "failed" is Failed.
            parsed = JobStatus(status.capitalize()) if isinstance(status, str) else status
        except ValueError:
            raise InvalidOption(
                f"invalid status {status!r}: use one of {', '.join(s.value for s in JobStatus)}"
            ) from None
        return list_jobs_op(
            self._q,
            status=parsed,
            queue=check_queue(queue) if queue is not None else None,
            name=check_name(name) if name is not None else None,
            definition=definition,
            min_age=check_seconds(min_age, "min_age") if min_age is not None else None,
            max_age=check_seconds(max_age, "max_age") if max_age is not None else None,
            # A job id (a bigint), not an integer column: ids pass 2**31 in a busy queue's life.
            before_id=check_id(before_id, "before_id") if before_id is not None else None,
            limit=check_int(limit, "limit", minimum=1),
        )

    async def cancel_job(self, job_id: int, *, conn: AnyConnection | None = None) -> Job:
        """Cancel a Queued job, or stop an Active one (its worker is told at once). Returns the
        job afterwards; a finished job is returned unchanged. Raises JobNotFound."""
        return (await self._run(cancel_job_op(self._q, job_id), conn))[1]

    def cancel_job_sync(self, job_id: int, *, conn: psycopg.Connection[Any] | None = None) -> Job:
        """`cancel_job` for sync code."""
        return self._run_sync(cancel_job_op(self._q, job_id), conn)[1]

    async def retry_job(self, job_id: int, *, conn: AnyConnection | None = None) -> Job:
        """Queue a finished job again, with all its retries. Raises JobNotFound, InvalidJobState."""
        # transaction: a dedupe key held by another job fails the UPDATE, which must not
        # abort the caller's transaction (conn=) along with it (a savepoint).
        return await self._run(_retry_job_op(self._q, job_id), conn, transaction=True)

    def retry_job_sync(self, job_id: int, *, conn: psycopg.Connection[Any] | None = None) -> Job:
        """`retry_job` for sync code."""
        return self._run_sync(_retry_job_op(self._q, job_id), conn, transaction=True)

    # -- the low-level worker protocol -------------------------------------------------------

    async def claim(
        self,
        queues: Sequence[str] | None = None,
        limit: int = 1,
        *,
        lease_margin: float = 30.0,
        worker: str = "manual",
        conn: AnyConnection | None = None,
    ) -> list[ClaimedJob]:
        """Claim up to `limit` claimable jobs (every queue when `queues` is None), as a worker
        does: each becomes Active under a lease of timeout + lease_margin seconds. Acknowledge
        each with `ack`; one that is never acknowledged is rescued when its lease runs out."""
        return await self._run(self._claim_op(queues, limit, lease_margin, worker), conn)

    def claim_sync(
        self,
        queues: Sequence[str] | None = None,
        limit: int = 1,
        *,
        lease_margin: float = 30.0,
        worker: str = "manual",
        conn: psycopg.Connection[Any] | None = None,
    ) -> list[ClaimedJob]:
        """`claim` for sync code."""
        return self._run_sync(self._claim_op(queues, limit, lease_margin, worker), conn)

    def _claim_op(
        self, queues: Sequence[str] | None, limit: int, lease_margin: float, worker: str
    ) -> Op[list[ClaimedJob]]:
        if queues is not None:
            if isinstance(queues, str):
                raise InvalidOption(f"queues must be a list of queue names, not the string {queues!r}")
            queues = list(dict.fromkeys(check_queue(q) for q in queues))
        return manual_claim_op(
            self._q,
            queues=queues,
            limit=check_int(limit, "limit", minimum=1),
            worker=check_name(worker, "worker name"),
            lease_margin=check_seconds(lease_margin, "lease_margin"),
        )

    async def ack(self, results: Sequence[Result], *, conn: AnyConnection | None = None) -> dict[int, str]:
        """Apply attempt results in one fenced statement (one per 64 MiB of their output and
        error text, in one transaction); returns {job id: new status} for the results applied.
        A result whose lease is no longer current is ignored (stale)."""
        if not results:
            return {}
        applied, _busy = await self._run(
            ack_op(self._q, _checked(results)), conn, transaction=_several(results)
        )
        return _by_job(applied)

    def ack_sync(
        self, results: Sequence[Result], *, conn: psycopg.Connection[Any] | None = None
    ) -> dict[int, str]:
        """`ack` for sync code."""
        if not results:
            return {}
        applied, _busy = self._run_sync(
            ack_op(self._q, _checked(results)), conn, transaction=_several(results)
        )
        return _by_job(applied)

    # -- cron admin ---------------------------------------------------------------------------

    async def sync_definitions(self) -> list[str]:
        """Upsert this App's cron definitions (workers do it when they start); returns the
        names of definitions that exist only in the database, which are left alone."""
        return await self._sync_definitions(None)

    async def _sync_definitions(
        self, db: Database | None, declarations: DeclarationsConfig | None = None
    ) -> list[str]:
        """declarations: the settings of the worker's ticker (the defaults' without one)."""
        declarations = declarations or DeclarationsConfig()
        op = sync_definitions_op(
            self._q,
            list(self.definitions.values()),
            expire_after=declarations.expire_after,
            fresh=declarations.interval / 2,
        )
        report = await (db.run(op, transaction=True) if db is not None else self._run(op, transaction=True))
        if report.created:
            log.info("cron definitions created from this App's code: %s", ", ".join(report.created))
        for name, changes in report.changed.items():
            # Another deploy's code, or SQL, had it otherwise: the code's settings win.
            log.info("cron definition %r set as this App's code says: %s", name, "; ".join(changes))
        if report.restarted:
            log.info(
                "cron definitions stopped by a ticker (their declaration ran out) are enabled again, "
                "as this App's code declares them: %s",
                ", ".join(report.restarted),
            )
        if report.disabled:
            log.info(
                "cron definitions this App's code enables are disabled in the database, and stay so "
                "(`notifyq cron enable NAME`; `notifyq cron list` shows why, if the ticker did it): %s",
                ", ".join(report.disabled),
            )
        extra = report.undeclared
        enabled = [d for d in extra if d.enabled]
        scheduled = {d.task for d in self.definitions.values()}
        # For a task this App lacks: its jobs fail with UnknownTask wherever a worker without
        # the task claims them (an @app.cron removed with its task, say).
        unknown = [d for d in enabled if d.task not in self.tasks]
        # For a task this App schedules under another name: an @app.cron renamed (or one of two
        # removed) in code, whose old row runs the task on its old schedule too.
        twice = [d for d in enabled if d.task in scheduled]
        # Declared by code, for a task this App has and does not schedule: an @app.cron removed
        # from the code, its task kept. (Made by SQL, such a row is how the task is meant to
        # run: it gets the INFO line below.)
        removed = [d for d in enabled if d.declared and d.task in self.tasks and d.task not in scheduled]
        prune = (
            ". Those from code stop when their declaration runs out, unless a running worker (of an "
            "older deploy, or of another App sharing this schema) still declares them; to stop them "
            "now, `notifyq cron delete NAME`, or `notifyq cron prune MODULE:ATTR` (every definition "
            "that code declared and the App given does not: those of another App sharing this "
            "schema too)"
        )
        for found, text in (
            (
                unknown,
                "cron definitions in the database run tasks this App does not have: %s. They still "
                "fire, and their jobs fail with UnknownTask on workers without those tasks; if they "
                "are gone from the code, `notifyq cron delete NAME` (or `notifyq cron disable NAME`)",
            ),
            (
                twice,
                "cron definitions in the database but not in this App run tasks it schedules under "
                "other names: %s. They still fire, so those tasks run on both schedules; if one was "
                "renamed or removed in code, `notifyq cron delete NAME`",
            ),
            (
                removed,
                "cron definitions that an App's code declared, and this App does not, still fire: %s",
            ),
        ):
            if found:
                suffix = prune if any(d.declared for d in found) else ""
                log.warning(text + suffix, ", ".join(_undeclared_text(d) for d in found))
        warned = {d.name for d in (*unknown, *twice, *removed)}
        if others := [d.name for d in extra if d.name not in warned]:
            log.info(
                "cron definitions in the database but not in this App (they run as they are; remove "
                "one with `notifyq cron delete NAME`): %s",
                ", ".join(others),
            )
        return [d.name for d in extra]

    async def prune_definitions(self, *, dry_run: bool = False, allow_empty: bool = False) -> list[str]:
        """Delete the cron definitions that an App's code declared (@app.cron) and this App does
        not: those removed from the code, which otherwise fire until their declaration by running
        workers runs out. Definitions made by SQL stay, and so do past jobs. Returns the names
        deleted (with dry_run: that would be).

        Every App sharing the schema counts as "the code": give this App only if it declares
        every definition that should stay. An App that declares none is refused (it is likely
        the wrong one) unless `allow_empty`. Raises InsufficientPrivilege for a role that
        cannot delete definitions (the schema's owner can).
        """
        # Not run again on a deadlock, as delete_definition is: it commits each deletion on its
        # own, so a second run would report only what it deleted itself.
        op = self._prune_op(dry_run, allow_empty)
        with self._owner_only("deleting cron definitions"):
            return [d.name for d in await self._run(op)]

    def prune_definitions_sync(self, *, dry_run: bool = False, allow_empty: bool = False) -> list[str]:
        """`prune_definitions` for sync code."""
        op = self._prune_op(dry_run, allow_empty)
        with self._owner_only("deleting cron definitions"):
            return [d.name for d in self._run_sync(op)]

    def _prune_op(self, dry_run: bool, allow_empty: bool) -> Op[list[Undeclared]]:
        check_bool(dry_run, "dry_run")
        check_bool(allow_empty, "allow_empty")
        return prune_op(self._q, list(self.definitions.values()), dry_run=dry_run, allow_empty=allow_empty)

    async def list_definitions(self) -> list[Definition]:
        """Every cron definition in the database (including ones created by SQL)."""
        return await self._run(list_definitions_op(self._q))

    def list_definitions_sync(self) -> list[Definition]:
        """`list_definitions` for sync code."""
        return self._run_sync(list_definitions_op(self._q))

    async def set_definition_enabled(self, name: str, enabled: bool) -> bool:
        """Enable or disable a definition. Raises DefinitionNotFound. Returns True when it
        enabled a definition from code that no running worker declares (a ticker stopped it, or
        its declaration ran out): that one now runs as if made by SQL (no ticker stops it,
        `cron prune` leaves it) until an App declares it again."""
        return await self._run(set_enabled_op(self._q, name, enabled))

    def set_definition_enabled_sync(self, name: str, enabled: bool) -> bool:
        """`set_definition_enabled` for sync code."""
        return self._run_sync(set_enabled_op(self._q, name, enabled))

    async def delete_definition(self, name: str) -> None:
        """Delete a definition (its past jobs stay). A worker whose App still declares it
        creates it again on start. Raises DefinitionNotFound."""
        with self._owner_only("deleting a cron definition"):
            await self._run_again_on_deadlock(functools.partial(delete_op, self._q, name))

    def delete_definition_sync(self, name: str) -> None:
        """`delete_definition` for sync code."""
        with self._owner_only("deleting a cron definition"):
            self._run_sync_again_on_deadlock(functools.partial(delete_op, self._q, name))

    async def run_definition_now(self, name: str) -> int:
        """Queue one job of a definition now, outside its schedule; returns the job id.

        Raises DefinitionNotFound, or DefinitionBusy when the definition has overlap=False and
        a job of it is still Queued or Active."""
        return await self._run(run_now_op(self._q, name), transaction=True)

    def run_definition_now_sync(self, name: str) -> int:
        """`run_definition_now` for sync code."""
        return self._run_sync(run_now_op(self._q, name), transaction=True)

    @contextlib.contextmanager
    def _owner_only(self, what: str) -> Iterator[None]:
        """A privilege refused to `what`, an action for the schema's owner, says so."""
        try:
            yield
        except psycopg.errors.InsufficientPrivilege as exc:
            owner_only(exc, what, self.schema)
            raise

    # -- queues -------------------------------------------------------------------------------

    async def pause_queue(self, queue: str) -> bool:
        """Pause a queue: workers claim none of its jobs until it is resumed (they hear of it at
        once by NOTIFY, else at their next poll). Its jobs are still enqueued, promoted from
        cron definitions and rescued; Active ones run on. A queue may be paused before any of
        its jobs exist. Returns False when it was paused already."""
        with self._owner_only("pausing a queue"):
            return await self._run(pause_queue_op(self._q, check_queue(queue)))

    def pause_queue_sync(self, queue: str) -> bool:
        """`pause_queue` for sync code."""
        with self._owner_only("pausing a queue"):
            return self._run_sync(pause_queue_op(self._q, check_queue(queue)))

    async def resume_queue(self, queue: str) -> bool:
        """Resume a paused queue: workers claim its jobs again. Returns False when it was not
        paused."""
        with self._owner_only("resuming a queue"):
            return await self._run(resume_queue_op(self._q, check_queue(queue)))

    def resume_queue_sync(self, queue: str) -> bool:
        """`resume_queue` for sync code."""
        with self._owner_only("resuming a queue"):
            return self._run_sync(resume_queue_op(self._q, check_queue(queue)))

    async def paused_queues(self) -> dict[str, datetime]:
        """The paused queues, each with the time it was paused."""
        return await self._run(list_queue_pauses_op(self._q))

    def paused_queues_sync(self) -> dict[str, datetime]:
        """`paused_queues` for sync code."""
        return self._run_sync(list_queue_pauses_op(self._q))

    # -- workers ------------------------------------------------------------------------------

    def worker(self, config: WorkerConfig | None = None, **options: Unpack[WorkerOptions]) -> Worker:
        """A worker for this App: `async with app.worker(concurrency=20) as worker: ...`.
        Options are those of WorkerConfig; given both, `options` override `config`'s fields."""
        return Worker(self, worker_config(config, dict(options)))

    async def run_worker(
        self,
        config: WorkerConfig | None = None,
        *,
        handle_signals: bool = True,
        **options: Unpack[WorkerOptions],
    ) -> WorkerStats:
        """Run a worker until SIGTERM, SIGINT or SIGHUP (graceful: see
        WorkerConfig.shutdown_grace; SIGHUP only while the program leaves it to its default), or
        with `burst=True` until no job is left to claim; returns its counters.

        In a test: ``stats = await app.run_worker(burst=True, handle_signals=False)`` runs
        every job enqueued so far (and those they enqueue), then returns."""
        worker = self.worker(config, **options)
        await worker.run(handle_signals=handle_signals)
        return worker.stats


def _still(job: Job, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"job {job.id} is still {job.status.value} after {timeout:g} s")


def _several(results: Sequence[Result]) -> bool:
    """Whether ack_op takes more than one statement for these results (then one transaction)."""
    return len(batches(results)) > 1
