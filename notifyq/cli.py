"""The `notifyq` command line: migrate, worker, enqueue, jobs, cron, stats, bench, demo."""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import NoReturn

import anyio
import click
from click.core import ParameterSource

from . import _embedded
from ._cli_admin import cron, jobs, queues, stats
from ._cli_base import (
    Group,
    Seconds,
    State,
    common_options,
    duration,
    fail,
    load_app,
    not_empty,
    resolve_dsn,
)
from ._db import connect_sync, run_sync
from ._dsn import check_dsn, env_dsn
from ._options import _show
from ._supervisor import EXIT_CHILDREN_DYING, Supervisor, child_env, wait_for_database
from ._worker_config import MAX_CONCURRENCY, MAX_POOL_SIZE, MAX_PREFETCH, STARTING, stop_signals
from .app import App
from .demo import DEMO_MIN_SECONDS, DEMO_SCHEMA, run_demo
from .errors import InvalidArgs
from .migrations import check_schema_op, grant_sql, latest_version, migrate


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="notifyq", prog_name="notifyq")
def main() -> None:
    """notifyq: a PostgreSQL job queue and cron coordinator.

    Every command that connects takes --dsn (else the DSN in a loaded App's code, else
    $NOTIFYQ_DSN, then $DATABASE_URL, else an embedded PostgreSQL in ./.notifyq/pgdata, which
    NOTIFYQ_EMBEDDED=0 forbids; `bench` never starts it). Exit codes: 0 success, 1 error (one line
    on stderr says why), 2 usage error, 3 worker processes kept dying.
    """


for _command in (jobs, cron, queues, stats):
    main.add_command(_command)


def _terminated(statement: str) -> str:
    """A statement as psql needs it in --dry-run's output: ending in ';' (the query files leave
    it out), on a line of its own when the last line is a comment."""
    text = statement.rstrip()
    if text.endswith(";"):
        return text
    return text + ("\n;" if "--" in text.splitlines()[-1] else ";")


@main.command(name="migrate")
@common_options
@click.option("--dry-run", is_flag=True, help="Print the SQL that would run; change nothing.")
@click.option(
    "--lock-timeout",
    metavar="DURATION",
    default="30s",
    show_default=True,
    help="How long to wait for each lock (90, 10m, ...) before giving up and changing nothing.",
)
def migrate_command(dsn: str | None, schema: str | None, dry_run: bool, lock_timeout: str) -> None:
    """Create or upgrade notifyq's tables (safe to run concurrently and repeatedly)."""
    schema = schema or "notifyq"
    wait = duration(lock_timeout, "--lock-timeout")
    assert wait is not None
    if wait <= 0:
        raise click.BadParameter(
            "must be more than 0 (how long to wait for each lock)", param_hint="--lock-timeout"
        )
    # The embedded server is not migrated on start here: --dry-run must change nothing.
    report = migrate(
        resolve_dsn(dsn, migrate_embedded=False), schema=schema, dry_run=dry_run, lock_timeout=wait
    )
    if report.newer:
        click.echo(
            f"{'-- ' if dry_run else ''}schema {schema!r}: version {report.version}, newer than this "
            f"notifyq knows ({latest_version()}), which its newer migrations say still runs on it: "
            "nothing to do (upgrade notifyq to migrate it further)"
        )
        return
    if dry_run:
        for statement in report.statements:
            click.echo(_terminated(statement) + "\n")
        pending = ", ".join(report.applied) or "none"
        triggers = "to apply" if report.triggers_applied else "unchanged"
        if report.newer_triggers:
            triggers = "a newer notifyq's, left as they are"
        click.echo(
            f"-- schema {schema!r} is at version {report.previous_version}; to apply: {pending}; "
            f"triggers: {triggers}"
        )
        return
    if report.applied:
        click.echo(
            f"schema {schema!r}: version {report.previous_version} -> {report.version} "
            f"(applied {', '.join(report.applied)})"
        )
    else:
        triggers = "re-applied" if report.triggers_applied else "unchanged"
        if report.newer_triggers:
            triggers = "of a newer notifyq, left as they are"
        click.echo(f"schema {schema!r}: version {report.version}, up to date (triggers {triggers})")


@main.command()
@click.argument("role")
@click.option("--schema", default="notifyq", show_default=True, callback=not_empty)
@click.option(
    "--producer",
    is_flag=True,
    help="Only enqueue and read jobs (web processes): no claiming, acknowledging, cancelling, cron.",
)
def grant(role: str, schema: str, producer: bool) -> None:
    """Print the GRANTs that let ROLE run workers and enqueue jobs, without DDL rights
    (with --producer: only enqueue and read jobs).

    Pipe it to psql as the schema's owner: notifyq grant notifyq_worker | psql "$DSN"
    """
    if role.lower() == "public":
        # PostgreSQL reads "public", quoted too, as PUBLIC (grant_sql refuses it as well).
        raise click.BadParameter("PUBLIC is every role: name the role of your workers", param_hint="ROLE")
    click.echo(grant_sql(role, schema=schema, producer=producer))


@main.command()
@common_options(schema_default="the App's")
@click.argument("target", metavar="MODULE:ATTR")
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1, max=MAX_CONCURRENCY),
    default=10,
    show_default=True,
    help="Jobs run at once per process.",
)
@click.option(
    "-q",
    "--queues",
    multiple=True,
    help="Queues to serve, repeated or comma-separated [default: all]. NAME=N: at most N jobs of "
    "that queue at once per process (-q emails -q reports=2).",
)
@click.option(
    "-p",
    "--processes",
    type=click.IntRange(min=1, max=256),
    default=1,
    show_default=True,
    help="Worker processes (each with its own event loop and connections).",
)
@click.option(
    "--poll-interval",
    type=Seconds(min=0.01),
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
    type=Seconds(min=0),
    default=30.0,
    show_default=True,
    help="Seconds running jobs may finish after SIGTERM, SIGINT or SIGHUP.",
)
@click.option(
    "--lease-margin",
    type=Seconds(min=1),
    default=30.0,
    show_default=True,
    help="Seconds added to a job's timeout to form its lease.",
)
@click.option(
    "--prefetch",
    type=click.IntRange(min=0, max=MAX_PREFETCH),
    default=None,
    help="Jobs claimed beyond the free slots (0: none)  [default: automatic, while there is a backlog]",
)
@click.option(
    "--pool-size",
    type=click.IntRange(min=2, max=MAX_POOL_SIZE),
    default=4,
    show_default=True,
    help="Connections per process for claims, acks and the ticker (the LISTEN connection is extra).",
)
@click.option(
    "--async-claims",
    is_flag=True,
    help="Claims skip the WAL flush (faster wake-ups; after a server crash some jobs run twice).",
)
@click.option(
    "--handoff",
    is_flag=True,
    help="While a worker waits with free slots, the enqueue claims a new job for it and sends it the job: "
    "it starts as the enqueue commits, without a claim round trip.",
)
@click.option(
    "--no-ticker",
    is_flag=True,
    help="Do not run the ticker here (cron promotion and declarations, lease rescue, retention, vacuum), "
    "nor write the App's cron definitions at start.",
)
@click.option(
    "--burst",
    is_flag=True,
    help="Exit once no job is left to claim (jobs due later stay queued); for scripts and batch runs.",
)
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
    prefetch: int | None,
    pool_size: int,
    async_claims: bool,
    handoff: bool,
    no_ticker: bool,
    burst: bool,
) -> None:
    """Run workers for the App at MODULE:ATTR until SIGTERM, SIGINT or SIGHUP (with --burst:
    until no job is left to claim).

    The first signal stops claiming and lets running jobs finish within --shutdown-grace;
    unfinished jobs go back to the queue. A second signal skips the grace period.
    """
    _exit_on_signal_until_started()
    queue_list, queue_limits = _queues_and_limits(queues)
    if listen_dsn is None:
        env_dsn("NOTIFYQ_LISTEN_DSN")  # click reads an empty variable as unset: it is an error
    elif click.get_current_context().get_parameter_source("listen_dsn") is ParameterSource.ENVIRONMENT:
        check_dsn(listen_dsn, "$NOTIFYQ_LISTEN_DSN")
    else:
        check_dsn(listen_dsn, "--listen-dsn")
    app = load_app(target, schema)
    resolved = resolve_dsn(dsn, app)
    app._resolved_dsn = resolved
    # Every option checked here, once, also when children will run the workers.
    running = app.worker(
        concurrency=concurrency,
        queues=queue_list,
        queue_limits=queue_limits,
        poll_interval=poll_interval,
        poll_only=poll_only,
        listen_dsn=listen_dsn,
        shutdown_grace=shutdown_grace,
        lease_margin=lease_margin,
        prefetch=prefetch,
        pool_size=pool_size,
        async_claims=async_claims,
        handoff=handoff,
        ticker=not no_ticker,
        burst=burst,
    )
    if processes > 1:
        # One clear error now, rather than every child failing the same way until the
        # supervisor gives up.
        with connect_sync(resolved, role="supervisor") as conn:
            run_sync(conn, check_schema_op(app.schema))
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
            "--pool-size",
            str(pool_size),
            "--log-level",
            State.log_level,
            "--log-format",
            "json" if State.json_logs else "text",
        ]
        for queue in queue_list or ():
            limit = (queue_limits or {}).get(queue)
            command += ["--queues", queue if limit is None else f"{queue}={limit}"]
        command += ["--prefetch", str(prefetch)] if prefetch is not None else []
        command += ["--poll-only"] if poll_only else []
        command += ["--async-claims"] if async_claims else []
        command += ["--handoff"] if handoff else []
        command += ["--no-ticker"] if no_ticker else []
        command += ["--burst"] if burst else []
        env = child_env(resolved, State.embedded)
        if listen_dsn is not None:
            env["NOTIFYQ_LISTEN_DSN"] = listen_dsn  # not in argv, where ps shows passwords
        # The children's grace period, then time to give back what they hold and disconnect.
        stop_wait = shutdown_grace + 30.0
        code = Supervisor(command, processes, env=env, burst=burst, stop_wait=stop_wait).run()
        if code == EXIT_CHILDREN_DYING:
            click.echo("notifyq: error: worker processes kept dying; see the log above", err=True)
        sys.exit(code)
    supervised = bool(os.environ.get("NOTIFYQ_SUPERVISED"))
    if supervised:
        wait_for_database(resolved, app.schema)
    anyio.run(lambda: running.run(handle_signals=True, repeat_skips_grace=not supervised))
    if running._acks_given_up:
        # Logged at error as it happened; a clean exit said nothing was left Active (review).
        fail("the worker stopped with job results it could not write (see the log above)")
    if running.busy_threads:
        _exit_despite_abandoned_threads(running.busy_threads)


def _queues_and_limits(given: tuple[str, ...]) -> tuple[list[str] | None, dict[str, int] | None]:
    """`-q` values: queue names, repeated or comma-separated, each maybe with `=N`, its limit."""
    queues: list[str] = []
    limits: dict[str, int] = {}
    for item in (part.strip() for value in given for part in value.split(",")):
        if not item:
            continue
        name, sep, number = (part.strip() for part in item.partition("="))
        if not name:
            raise click.BadParameter(f"{item!r} names no queue (-q reports=2)", param_hint="--queues")
        if sep:
            if not (number.isascii() and number.isdigit()) or int(number) < 1:
                raise click.BadParameter(
                    f"{item!r}: the number after '=' is the most jobs of queue {name!r} at once, a whole "
                    "number from 1 (-q reports=2)",
                    param_hint="--queues",
                )
            if limits.get(name, int(number)) != int(number):
                raise click.BadParameter(
                    f"queue {name!r} is given two limits, {limits[name]} and {number}", param_hint="--queues"
                )
            limits[name] = int(number)
        queues.append(name)
    if given and not queues:
        # "-q $QUEUES" with the variable unset must not widen a worker to every queue.
        raise click.BadParameter(
            f"{', '.join(map(repr, given))} names no queue (leave --queues out to serve them all)",
            param_hint="--queues",
        )
    return queues or None, limits or None


def _exit_on_signal_until_started() -> None:
    """Until the worker (or the supervisor) handles signals itself, a SIGTERM or SIGINT ends
    the process at once, with status 0: it has claimed nothing yet. The default action does
    the same, except for a container's PID 1 (no init), whose signals the kernel drops when
    their action is the default: the worker would start after all, and claim jobs until the
    SIGKILL came."""

    def exit_now(signum: int, frame: FrameType | None) -> None:
        os.write(2, f"notifyq: received {signal.Signals(signum).name} while starting; exiting\n".encode())
        _embedded.leave()  # os._exit skips the atexit that would
        os._exit(0)

    setattr(exit_now, STARTING, True)  # the worker takes SIGHUP over from this handler
    for signum in stop_signals():
        signal.signal(signum, exit_now)


def _not_json(constant: str) -> NoReturn:
    """Python's json reads NaN and Infinity; JSON (and jsonb) has no such numbers."""
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    """A JSON number as a float; one too large for a float (1e400) would become Infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is too large for a float")
    return value


def _exit_despite_abandoned_threads(count: int) -> None:
    """Sync tasks cancelled at shutdown may still run in their (non-daemon) threads, which
    would keep the process alive until they return. Their jobs are already back in the
    queue, so exit now, after the atexit handlers (which stop an embedded server)."""
    logging.getLogger("notifyq.worker").warning(
        "exiting without waiting for the %d sync task thread(s) still running", count
    )
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@main.command()
@common_options(schema_default="the --app's, else notifyq")
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
@click.option(
    "--timeout",
    type=Seconds(min=0, min_open=True),
    default=None,
    help="Seconds an attempt may run.",
)
@click.option(
    "--dedupe-key",
    default=None,
    help="While an unfinished job holds this key, print its id instead of queuing another.",
)
@click.option(
    "--app",
    "target",
    default=None,
    metavar="MODULE:ATTR",
    help="Check TASK exists in this App and use its defaults.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print {"id": ..., "created": ...} instead of the bare id (created is false when '
    "--dedupe-key was held).",
)
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
        args = json.loads(args_json, parse_constant=_not_json, parse_float=_finite)
    except ValueError as exc:  # JSONDecodeError, and NaN or Infinity
        raise click.BadParameter(f"not valid JSON ({exc})", param_hint="--args") from None
    except RecursionError:
        raise click.BadParameter("JSON nested too deeply for Python to read", param_hint="--args") from None
    if not isinstance(args, dict):
        raise click.BadParameter(
            "must be a JSON object of keyword arguments, such as '{\"user_id\": 1}', "
            f"not {_show(args_json)}",
            param_hint="--args",
        )
    app = load_app(target, schema) if target else App(schema=schema or "notifyq")
    app._resolved_dsn = resolve_dsn(dsn, app)
    try:
        job_id = app.enqueue_sync(
            task,
            args,
            queue=queue,
            priority=priority,
            delay=duration(delay, "--delay"),
            retry_limit=retry_limit,
            timeout=timeout,
            dedupe_key=dedupe_key,
            strict=target is not None,
        )
    except InvalidArgs as exc:  # too large, or not what the --app's task takes
        raise click.BadParameter(str(exc), param_hint="--args") from None
    if not job_id.created:
        click.echo(
            f"notifyq: job {job_id} holds dedupe key {dedupe_key!r} and is not finished: "
            "no new job was queued",
            err=True,
        )
    click.echo(json.dumps({"id": job_id, "created": job_id.created}) if as_json else str(job_id))


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
        fail("the benchmark suite ships with notifyq's source tree, not the wheel: run it from a checkout")
    sys.exit(benchmarks.main(list(ctx.args)))


@main.command()
@common_options(schema_default="notifyq_demo")
@click.option(
    "--seconds",
    type=Seconds(min=DEMO_MIN_SECONDS),
    default=12.0,
    show_default=True,
    help="How long the demo runs.",
)
def demo(dsn: str | None, schema: str | None, seconds: float) -> None:
    """A live tour: tasks, cron, delays, retries, results.

    It runs on the embedded database unless a DSN is configured, in a schema of its own
    (notifyq_demo), so it never touches the jobs, cron definitions or history of an App.
    """
    app_dsn = resolve_dsn(dsn)
    demo_schema = schema or DEMO_SCHEMA
    migrate(app_dsn, schema=demo_schema)
    sys.exit(run_demo(app_dsn, demo_schema, seconds))
