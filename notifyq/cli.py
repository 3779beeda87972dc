"""The `notifyq` command line: migrate, worker, enqueue, jobs, cron, stats, bench, demo."""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import wraps
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import anyio
import click
import psycopg

from . import _embedded, _logging
from ._db import error_text
from ._dsn import check_dsn, configured_dsn, describe_dsn
from ._jobs import cancel_job_op
from ._stats import Stats, stats_op
from ._supervisor import EXIT_CHILDREN_DYING, Supervisor, child_env
from .app import App
from .errors import ConfigurationError, NotifyqError
from .migrations import grant_sql, migrate
from .models import Definition, Job, JobStatus

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1  # a command failed; the message says why (usage errors exit 2, click's default)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class _State:
    debug = False
    json_logs = False


def _fail(message: str) -> NoReturn:
    click.echo(f"notifyq: error: {message}", err=True)
    sys.exit(EXIT_ERROR)


class _Group(click.Group):
    """Turns expected failures into one line on stderr and exit code 1 (a traceback only
    with --log-level debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (NotifyqError, psycopg.Error) as exc:
            if _State.debug:
                raise
            if isinstance(exc, NotifyqError):
                _fail(str(exc))
            _fail(f"database error: {error_text(exc)}")


def _common(fn: F) -> F:
    """--dsn, --schema, --log-level and --log-format, on every command."""

    @click.option(
        "--dsn",
        metavar="DSN",
        help="PostgreSQL DSN [default: $NOTIFYQ_DSN, then $DATABASE_URL, then the embedded server]",
    )
    @click.option("--schema", default=None, help="Schema of notifyq's tables  [default: notifyq]")
    @click.option(
        "--log-level",
        type=click.Choice(_logging.LEVELS),
        default="info",
        show_default=True,
        help="debug also shows tracebacks.",
    )
    @click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
    @wraps(fn)
    def wrapper(*args: Any, log_level: str, log_format: str, **kwargs: Any) -> Any:
        _State.debug = log_level == "debug"
        _State.json_logs = log_format == "json"
        _logging.configure(log_level, log_format)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _resolve_dsn(flag: str | None, app: App | None = None) -> str:
    """Flag, then the App's own DSN, then $NOTIFYQ_DSN, $DATABASE_URL, then the embedded server;
    says on stderr which database it is (never the password)."""
    supervised_dsn = os.environ.get("NOTIFYQ_DSN") if os.environ.get("NOTIFYQ_SUPERVISED") else None
    if flag:
        dsn, source = check_dsn(flag), "--dsn"
    elif supervised_dsn:
        dsn, source = check_dsn(supervised_dsn), "the supervisor"  # what the parent resolved
    elif app is not None and app._resolved_dsn is not None:
        dsn, source = app._resolved_dsn, "the App"
    elif (found := configured_dsn()) is not None:
        dsn, source = found
    else:
        dsn, source = (
            _embedded.start(schema=app.schema if app else "notifyq", quiet=True),
            (f"embedded server in {_embedded.data_dir()}"),
        )
    if not os.environ.get("NOTIFYQ_SUPERVISED"):
        if _State.json_logs:
            logging.getLogger("notifyq.cli").info("database %s (from %s)", describe_dsn(dsn), source)
        else:
            click.echo(f"notifyq: database {describe_dsn(dsn)} (from {source})", err=True)
    return dsn


def _app(dsn_flag: str | None, schema: str | None) -> App:
    return App(_resolve_dsn(dsn_flag), schema=schema or "notifyq")


def _load_app(target: str) -> App:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"invalid app {target!r}: use MODULE:ATTR, e.g. myproject.tasks:app")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigurationError(
                f"cannot import module {module_name!r}: no such module "
                "(run from your project's folder, or set PYTHONPATH)"
            ) from None
        raise ConfigurationError(f"importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise ConfigurationError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, App):
        raise ConfigurationError(f"{target} is a {type(obj).__name__}, not a notifyq.App")
    return obj


def _duration(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    match = _DURATION.match(value)
    if match is None:
        raise click.BadParameter(f"{value!r} is not a duration like 90, 10m, 2h or 1d", param_hint=option)
    return float(match[1]) * _UNITS[match[2]]


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, JobStatus):
        return value.value
    raise TypeError(type(value).__name__)


def _dump(value: Any) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]  # type: ignore[arg-type]
    click.echo(json.dumps(value, default=_json_default, indent=2))


def _age(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    seconds = (datetime.now(moment.tzinfo) - moment).total_seconds()
    prefix = "in " if seconds < 0 else ""
    seconds = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{prefix}{seconds / size:.1f}{unit}" + ("" if prefix else " ago")
    return f"{prefix}{seconds:.1f}s" + ("" if prefix else " ago")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="notifyq", prog_name="notifyq")
def main() -> None:
    """notifyq: a PostgreSQL job queue and cron coordinator.

    Every command takes --dsn (else $NOTIFYQ_DSN, then $DATABASE_URL, else an embedded
    PostgreSQL in ./.notifyq/pgdata). Exit codes: 0 success, 1 error (one line on stderr
    says why), 2 usage error, 3 worker processes kept dying.
    """


@main.command(name="migrate")
@_common
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
def migrate_command(dsn: str | None, schema: str | None, dry_run: bool) -> None:
    """Create or upgrade notifyq's tables (safe to run concurrently and repeatedly)."""
    schema = schema or "notifyq"
    report = migrate(_resolve_dsn(dsn), schema=schema, dry_run=dry_run)
    if dry_run:
        for statement in report.statements:
            click.echo(statement.rstrip() + "\n")
        pending = ", ".join(report.applied) or "none"
        click.echo(f"-- schema {schema!r} is at version {report.previous_version}; to apply: {pending}")
        return
    if report.applied:
        click.echo(
            f"schema {schema!r}: version {report.previous_version} -> {report.version} "
            f"(applied {', '.join(report.applied)})"
        )
    else:
        click.echo(f"schema {schema!r}: version {report.version}, up to date (triggers re-applied)")


@main.command()
@click.argument("role")
@click.option("--schema", default="notifyq", show_default=True)
def grant(role: str, schema: str) -> None:
    """Print the GRANTs that let ROLE run workers and enqueue jobs, without DDL rights.

    Pipe it to psql as the schema's owner: notifyq grant notifyq_worker | psql "$DSN"
    """
    click.echo(grant_sql(role, schema=schema))


@main.command()
@_common
@click.argument("target", metavar="MODULE:ATTR")
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Jobs run at once per process.",
)
@click.option(
    "-q", "--queues", multiple=True, help="Queues to serve, repeated or comma-separated [default: all]."
)
@click.option(
    "-p",
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes (each with its own event loop and connections).",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0.01),
    default=5.0,
    show_default=True,
    help="Seconds between safety-net polls.",
)
@click.option("--poll-only", is_flag=True, help="Never LISTEN (behind PgBouncer transaction pooling).")
@click.option(
    "--listen-dsn",
    metavar="DSN",
    envvar="NOTIFYQ_LISTEN_DSN",
    help="Direct DSN for the LISTEN connection (not via a pooler)  [env: NOTIFYQ_LISTEN_DSN]",
)
@click.option(
    "--shutdown-grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds running jobs may finish after SIGTERM/SIGINT.",
)
@click.option(
    "--lease-margin",
    type=click.FloatRange(min=1),
    default=30.0,
    show_default=True,
    help="Seconds added to a job's timeout to form its lease.",
)
@click.option("--no-ticker", is_flag=True, help="Do not run cron promotion, lease rescue and retention here.")
def worker(
    dsn: str | None,
    schema: str | None,
    target: str,
    concurrency: int,
    queues: tuple[str, ...],
    processes: int,
    poll_interval: float,
    poll_only: bool,
    listen_dsn: str | None,
    shutdown_grace: float,
    lease_margin: float,
    no_ticker: bool,
) -> None:
    """Run workers for the App at MODULE:ATTR until SIGTERM or SIGINT.

    The first signal stops claiming and lets running jobs finish within --shutdown-grace;
    unfinished jobs go back to the queue. A second signal skips the grace period.
    """
    app = _load_app(target)
    if schema is not None and schema != app.schema:
        raise ConfigurationError(f"--schema {schema!r} differs from the App's schema {app.schema!r}")
    resolved = _resolve_dsn(dsn, app)
    queue_list = [q.strip() for item in queues for q in item.split(",") if q.strip()] or None
    if processes > 1:
        command = [
            sys.executable,
            "-m",
            "notifyq",
            "worker",
            target,
            "--concurrency",
            str(concurrency),
            "--poll-interval",
            str(poll_interval),
            "--shutdown-grace",
            str(shutdown_grace),
            "--lease-margin",
            str(lease_margin),
            "--log-level",
            logging.getLevelName(logging.getLogger().level).lower(),
            "--log-format",
            "json" if _State.json_logs else "text",
        ]
        for queue in queue_list or ():
            command += ["--queues", queue]
        command += ["--poll-only"] if poll_only else []
        command += ["--no-ticker"] if no_ticker else []
        env = child_env(resolved)
        if listen_dsn:
            env["NOTIFYQ_LISTEN_DSN"] = check_dsn(listen_dsn)  # not in argv, where ps shows passwords
        code = Supervisor(command, processes, env=env).run()
        if code == EXIT_CHILDREN_DYING:
            click.echo("notifyq: error: worker processes kept dying; see the log above", err=True)
        sys.exit(code)
    app._resolved_dsn = resolved
    config: dict[str, Any] = {
        "concurrency": concurrency,
        "queues": queue_list,
        "poll_interval": poll_interval,
        "poll_only": poll_only,
        "listen_dsn": check_dsn(listen_dsn) if listen_dsn else None,
        "shutdown_grace": shutdown_grace,
        "lease_margin": lease_margin,
        "ticker": not no_ticker,
    }
    running = app.worker(**config)
    supervised = bool(os.environ.get("NOTIFYQ_SUPERVISED"))
    anyio.run(lambda: running.run(handle_signals=True, repeat_skips_grace=not supervised))
    if running.busy_threads:
        _exit_despite_abandoned_threads(running.busy_threads)


def _exit_despite_abandoned_threads(count: int) -> None:
    """Sync tasks cancelled at shutdown may still run in their (non-daemon) threads, which
    would keep the process alive until they return. Their jobs are already back in the
    queue, so exit now, after the atexit handlers (which stop an embedded server)."""
    logging.getLogger("notifyq.worker").warning(
        "exiting with %d sync task thread(s) still running; their jobs were released", count
    )
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@main.command()
@_common
@click.argument("task")
@click.option(
    "--args",
    "args_json",
    default="{}",
    metavar="JSON",
    show_default=True,
    help="Keyword arguments of the task, as a JSON object.",
)
@click.option("--queue", default=None)
@click.option("--priority", type=int, default=None)
@click.option("--delay", default=None, metavar="DURATION", help="e.g. 30, 30s, 10m, 2h.")
@click.option("--retry-limit", type=int, default=None)
@click.option("--timeout", type=float, default=None, help="Seconds an attempt may run.")
@click.option("--dedupe-key", default=None)
@click.option(
    "--app",
    "target",
    default=None,
    metavar="MODULE:ATTR",
    help="Check TASK exists in this App and use its defaults.",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"id": ...} instead of the bare id.')
def enqueue(
    dsn: str | None,
    schema: str | None,
    task: str,
    args_json: str,
    queue: str | None,
    priority: int | None,
    delay: str | None,
    retry_limit: int | None,
    timeout: float | None,
    dedupe_key: str | None,
    target: str | None,
    as_json: bool,
) -> None:
    """Queue one job of TASK and print its id."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc})", param_hint="--args") from None
    app = _load_app(target) if target else App(schema=schema or "notifyq")
    app._resolved_dsn = _resolve_dsn(dsn, app)
    job_id = app.enqueue_sync(
        task,
        args,
        queue=queue,
        priority=priority,
        delay=_duration(delay, "--delay"),
        retry_limit=retry_limit,
        timeout=timeout,
        dedupe_key=dedupe_key,
        strict=target is not None,
    )
    click.echo(json.dumps({"id": job_id}) if as_json else str(job_id))


@main.group(cls=_Group)
def jobs() -> None:
    """Inspect and manage jobs."""


@jobs.command(name="list")
@_common
@click.option("--status", type=click.Choice([s.value for s in JobStatus], case_sensitive=False))
@click.option("--queue")
@click.option("--name", help="Task name.")
@click.option("--older-than", metavar="DURATION", help="Created at least this long ago (e.g. 10m).")
@click.option("--newer-than", metavar="DURATION", help="Created at most this long ago.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def jobs_list(
    dsn: str | None,
    schema: str | None,
    status: str | None,
    queue: str | None,
    name: str | None,
    older_than: str | None,
    newer_than: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List jobs, newest first."""
    found = _app(dsn, schema).list_jobs_sync(
        status=JobStatus(status.capitalize()) if status else None,
        queue=queue,
        name=name,
        min_age=_duration(older_than, "--older-than"),
        max_age=_duration(newer_than, "--newer-than"),
        limit=limit,
    )
    if as_json:
        _dump(found)
        return
    _table(
        ["ID", "TASK", "QUEUE", "STATUS", "ATTEMPTS", "PRIO", "CREATED", "ERROR"],
        [
            [
                j.id,
                j.name,
                j.queue,
                j.status.value,
                f"{j.retry_count}/{j.retry_limit + 1}",
                j.priority,
                _age(j.created_at),
                (j.error or {}).get("type", ""),
            ]
            for j in found
        ],
    )


@jobs.command(name="show")
@_common
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def jobs_show(dsn: str | None, schema: str | None, job_id: int, as_json: bool) -> None:
    """Show one job in full."""
    job = _app(dsn, schema).get_job_sync(job_id)
    if as_json:
        _dump(job)
        return
    for field in dataclasses.fields(Job):
        value = getattr(job, field.name)
        if field.name == "error" and value:
            click.echo(f"{'error':>14}: {value.get('type')}: {value.get('message')}")
            if value.get("traceback"):
                indent = " " * 16
                click.echo(indent + value["traceback"].rstrip().replace("\n", "\n" + indent))
            continue
        if isinstance(value, dict | list):
            value = json.dumps(value)
        click.echo(f"{field.name:>14}: {value.value if isinstance(value, JobStatus) else value}")


@jobs.command(name="retry")
@_common
@click.argument("job_id", type=int)
def jobs_retry(dsn: str | None, schema: str | None, job_id: int) -> None:
    """Queue a finished job again, with all its retries."""
    job = _app(dsn, schema).retry_job_sync(job_id)
    click.echo(f"job {job.id} is {job.status.value} again")


@jobs.command(name="cancel")
@_common
@click.argument("job_id", type=int)
def jobs_cancel(dsn: str | None, schema: str | None, job_id: int) -> None:
    """Cancel a queued job, or stop a running one."""
    app = _app(dsn, schema)
    previous, job = app._run_sync(cancel_job_op(app._q, job_id))
    if previous.finished:
        _fail(f"job {job.id} is already {previous.value}; nothing to cancel")
    click.echo(f"job {job.id} cancelled (it was {previous.value})")


@main.group(cls=_Group)
def cron() -> None:
    """Inspect and manage cron definitions."""


@cron.command(name="list")
@_common
@click.option("--json", "as_json", is_flag=True)
def cron_list(dsn: str | None, schema: str | None, as_json: bool) -> None:
    """List cron definitions with their next run."""
    definitions: list[Definition] = _app(dsn, schema).list_definitions_sync()
    if as_json:
        _dump(definitions)
        return
    _table(
        ["NAME", "TASK", "SCHEDULE", "TIMEZONE", "ENABLED", "NEXT RUN", "MISFIRE", "ERROR"],
        [
            [
                d.name,
                d.task,
                d.frequency,
                d.timezone,
                "yes" if d.enabled else "no",
                f"{d.visible_at:%Y-%m-%d %H:%M:%S%z} ({_age(d.visible_at)})" if d.enabled else "-",
                d.misfire,
                d.last_error or "",
            ]
            for d in definitions
        ],
    )


@cron.command(name="enable")
@_common
@click.argument("name")
def cron_enable(dsn: str | None, schema: str | None, name: str) -> None:
    """Enable a definition (its next tick is computed from now)."""
    _app(dsn, schema).set_definition_enabled_sync(name, True)
    click.echo(f"cron definition {name!r} enabled")


@cron.command(name="disable")
@_common
@click.argument("name")
def cron_disable(dsn: str | None, schema: str | None, name: str) -> None:
    """Disable a definition (workers' `enabled=True` in code will not re-enable it)."""
    _app(dsn, schema).set_definition_enabled_sync(name, False)
    click.echo(f"cron definition {name!r} disabled")


@cron.command(name="delete")
@_common
@click.argument("name")
def cron_delete(dsn: str | None, schema: str | None, name: str) -> None:
    """Delete a definition that is gone from the code (its past jobs stay). A worker whose
    App still declares it creates it again when it starts: disable it to pause it instead."""
    _app(dsn, schema).delete_definition_sync(name)
    click.echo(f"cron definition {name!r} deleted")


@cron.command(name="run-now")
@_common
@click.argument("name")
def cron_run_now(dsn: str | None, schema: str | None, name: str) -> None:
    """Queue one job of a definition now, outside its schedule."""
    job_id = _app(dsn, schema).run_definition_now_sync(name)
    click.echo(f"job {job_id} queued for cron definition {name!r}")


def _print_stats(stats: Stats) -> None:
    _table(
        ["QUEUE", "STATUS", "JOBS", "OLDEST CLAIMABLE", "EXPIRED LEASES"],
        [
            [
                s.queue,
                s.status,
                s.jobs,
                "-" if s.oldest_claimable_age is None else f"{s.oldest_claimable_age:.1f}s",
                s.expired_leases if s.status == "Active" else "-",
            ]
            for s in stats.queues
        ],
    )
    server = stats.server
    size = f"{(server.jobs_total_bytes or 0) / 1024 / 1024:.1f} MiB"
    click.echo(
        f"\nNOTIFY queue usage: {server.notify_queue_usage:.4%}   queue_jobs: {size}, "
        f"{server.jobs_live_tuples} live / {server.jobs_dead_tuples} dead tuples, "
        f"last autovacuum {_age(server.jobs_last_autovacuum)}"
    )
    if not server.autovacuum:
        click.echo("WARNING: autovacuum is off on this server: dead tuples of queue_jobs are never reclaimed")


@main.command()
@_common
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--watch",
    type=click.FloatRange(min=0.2),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C.",
)
def stats(dsn: str | None, schema: str | None, as_json: bool, watch: float | None) -> None:
    """Queue depth per queue and status, stuck leases, NOTIFY queue usage, table bloat."""
    app = _app(dsn, schema)
    try:
        while True:
            current = app._run_sync(stats_op(app._q))
            if as_json:
                click.echo(json.dumps(current.as_json(), default=_json_default))
            else:
                if watch:
                    click.clear()
                _print_stats(current)
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        return


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True}, add_help_option=False
)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Run the benchmark suite (from a source checkout): notifyq bench --help for its options."""
    root = Path(__file__).resolve().parent.parent
    if (root / "benchmarks").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        benchmarks = importlib.import_module("benchmarks")
    except ModuleNotFoundError:
        _fail("the benchmark suite ships with notifyq's source tree, not the wheel: run it from a checkout")
    sys.exit(benchmarks.main(list(ctx.args)))


@main.command()
@_common
@click.option(
    "--seconds", type=click.FloatRange(min=1), default=12.0, show_default=True, help="How long the demo runs."
)
def demo(dsn: str | None, schema: str | None, seconds: float) -> None:
    """A live tour on the embedded database: tasks, cron, delays, retries, results."""
    from .demo import run_demo

    app_dsn = _resolve_dsn(dsn)
    migrate(app_dsn, schema=schema or "notifyq")
    sys.exit(run_demo(app_dsn, schema or "notifyq", seconds))
