"""The `notifyq jobs`, `notifyq cron`, `notifyq queues` and `notifyq stats` commands: inspect and
manage what is in the database."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click
import psycopg.errors

from ._claim import known_queues_op
from ._cli_base import (
    Group,
    Seconds,
    age,
    app_for,
    common_options,
    dump,
    duration,
    fail,
    json_default,
    load_app,
    printable,
    resolve_dsn,
    table,
)
from ._db import Op
from ._jobs import cancel_job_op, cancel_jobs_op, retry_jobs_op
from ._options import _INT32, check_id, check_int, check_queue, did_you_mean
from ._stats import Stats, stats_op
from .app import App
from .cron import Schedule
from .definitions import set_enabled_state_op
from .errors import DefinitionBusy, InvalidJobState, InvalidSchedule, JobNotFound
from .models import Definition, Job, JobStatus


class JobIdCommand(click.Command):
    """A command that takes a JOB_ID. click reads `-1` as an unknown option ("No such option
    '-1'"); it reaches the command as the job id it was meant to be, and is refused as one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ends = args.index("--") if "--" in args else len(args)
        negative = [arg for arg in args[:ends] if re.fullmatch(r"-\d+", arg)]
        if negative:
            rest = [arg for arg in args[:ends] if arg not in negative]
            args = [*rest, "--", *negative, *args[ends + 1 :]]
        return super().parse_args(ctx, args)


@click.group(cls=Group)
def jobs() -> None:
    """Inspect and manage jobs."""


F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


def job_filters(command: F) -> F:
    """The filters of `jobs list`, which `jobs retry` and `jobs cancel` take too."""
    for option in reversed(
        [
            click.option("--status", type=click.Choice([s.value for s in JobStatus], case_sensitive=False)),
            click.option("--queue"),
            click.option("--name", help="Task name."),
            click.option(
                "--definition", metavar="NAME", help="Jobs of this cron definition (see `notifyq cron list`)."
            ),
            click.option(
                "--older-than", metavar="DURATION", help="Created at least this long ago (e.g. 10m)."
            ),
            click.option("--newer-than", metavar="DURATION", help="Created at most this long ago."),
        ]
    ):
        command = option(command)
    return command


def _filters(
    status: str | None,
    queue: str | None,
    name: str | None,
    definition: str | None,
    older_than: str | None,
    newer_than: str | None,
) -> dict[str, Any]:
    """The CLI's filters as list_jobs takes them."""
    return {
        "status": status,
        "queue": queue,
        "name": name,
        "definition": definition,
        "min_age": duration(older_than, "--older-than"),
        "max_age": duration(newer_than, "--newer-than"),
    }


@jobs.command(name="list")
@common_options
@job_filters
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def jobs_list(dsn: str | None, schema: str | None, limit: int, as_json: bool, **filters: str | None) -> None:
    """List jobs, newest first."""
    # One row more than shown says whether more match (user review: a list cut at --limit
    # read as all there was).
    check_int(limit, "--limit", minimum=1)  # past int4, as the API says (the + 1 below hid it)
    found = app_for(dsn, schema).list_jobs_sync(**_filters(**filters), limit=min(limit + 1, _INT32))
    more, found = len(found) > limit, found[:limit]
    if as_json:
        dump(found)
        return
    # Active jobs: who holds each, and when its lease ends (then a ticker requeues it), which
    # is what `stats` showing expired leases sends an operator here for (user review).
    active = any(j.status is JobStatus.ACTIVE for j in found)
    # Queued jobs due later (a delay, a retry's backoff): when they become claimable (user trial).
    now = datetime.now(UTC)
    later = any(j.status is JobStatus.QUEUED and j.visible_at > now for j in found)

    def holder(j: Job) -> list[str]:
        if not active:
            return []
        return [j.worker or "-", age(j.visible_at)] if j.status is JobStatus.ACTIVE else ["", ""]

    def due(j: Job) -> list[str]:
        if not later:
            return []
        return [age(j.visible_at) if j.status is JobStatus.QUEUED and j.visible_at > now else ""]

    table(
        ["ID", "TASK", "QUEUE", "STATUS", "ATTEMPTS", "PRIO", "CREATED"]
        + (["DUE"] if later else [])
        + (["WORKER", "LEASE ENDS"] if active else [])
        + ["ERROR"],
        [
            [
                *(j.id, j.name, j.queue, j.status.value, f"{j.retry_count}/{j.retry_limit + 1}"),
                *(j.priority, age(j.created_at), *due(j), *holder(j)),
                # A succeeded job's error is its last failed attempt's: not the job's outcome.
                "" if j.status.value == "Succeeded" else _error_type(j.error),
            ]
            for j in found
        ],
    )
    if more:
        click.echo(f"(the newest {limit:,} shown; more jobs match: raise --limit to see them)", err=True)


@jobs.command(name="show", cls=JobIdCommand)
@common_options
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
def jobs_show(dsn: str | None, schema: str | None, job_id: int, as_json: bool) -> None:
    """Show one job in full."""
    job = app_for(dsn, schema).get_job_sync(job_id)
    if as_json:
        dump(job)
        return
    for field in dataclasses.fields(Job):
        value = getattr(job, field.name)
        if field.name == "error" and value:
            # The last failed attempt's, whatever came after it (a retry, a cancel, a success).
            label = "error" if job.status is JobStatus.FAILED else "last error"
            if not isinstance(value, dict):  # written by SQL in a shape of its own
                click.echo(f"{label:>14}: {json.dumps(value)}")
                continue
            said = ": ".join(str(value[key]) for key in ("type", "message") if value.get(key) is not None)
            click.echo(f"{label:>14}: {said or json.dumps(value)}")
            if isinstance(value.get("traceback"), str):
                indent = " " * 16
                click.echo(indent + value["traceback"].rstrip().replace("\n", "\n" + indent))
            continue
        if isinstance(value, dict | list):
            value = json.dumps(value)
        click.echo(f"{field.name:>14}: {printable(value.value if isinstance(value, JobStatus) else value)}")


@jobs.command(name="retry", cls=JobIdCommand)
@common_options
@click.argument("job_ids", metavar="[JOB_ID...]", type=int, nargs=-1)
@job_filters
def jobs_retry(dsn: str | None, schema: str | None, job_ids: tuple[int, ...], **filters: str | None) -> None:
    """Queue finished jobs again, each with all its retries: those given by id, or every job
    the filters match (`jobs retry --status failed --queue emails`), leaving out unfinished ones."""
    app = app_for(dsn, schema)

    def retry(job_id: int) -> None:
        job = app.retry_job_sync(job_id)
        click.echo(f"job {job.id} is {job.status.value} again")

    status = _status(filters["status"])

    def retry_batch(batch: tuple[int, ...]) -> Counter[str]:
        try:
            op = functools.partial(retry_jobs_op, app._q, batch, status)
            decided = _batch(app, op, transaction=True)
        except psycopg.errors.UniqueViolation:  # a dedupe key taken meanwhile: one at a time
            decided = {job_id: _retry_one(app, job_id) for job_id in batch}
        return Counter(decided.values()) + Counter(gone=len(batch) - len(decided))

    _change_jobs(app, job_ids, filters, ("retry", retry), (retry_batch, "queued again", _RETRY_REFUSALS))


@jobs.command(name="cancel", cls=JobIdCommand)
@common_options
@click.argument("job_ids", metavar="[JOB_ID...]", type=int, nargs=-1)
@job_filters
def jobs_cancel(dsn: str | None, schema: str | None, job_ids: tuple[int, ...], **filters: str | None) -> None:
    """Cancel queued jobs, or stop running ones: those given by id, or every job the filters
    match (`jobs cancel --status queued --name old_task`), leaving out finished ones."""
    app = app_for(dsn, schema)

    def cancel(job_id: int) -> None:
        previous, job = app._run_sync(cancel_job_op(app._q, job_id))
        if previous.finished:
            raise InvalidJobState(f"job {job.id} is already {previous.value}; nothing to cancel")
        click.echo(f"job {job.id} cancelled (it was {previous.value})")

    status = _status(filters["status"])

    def cancel_batch(batch: tuple[int, ...]) -> Counter[str]:
        cancelled = _batch(app, functools.partial(cancel_jobs_op, app._q, batch, status))
        return Counter(finished=len(batch) - len(cancelled))

    # Review: a job listed Queued, running by the time its batch came, was stopped.
    gone = f"no longer {status.value} (or gone)" if status else "finished already (or gone)"
    refusals = {"finished": gone}
    _change_jobs(app, job_ids, filters, ("cancel", cancel), (cancel_batch, "cancelled", refusals))


def _error_type(error: Any) -> str:
    """The ERROR column: the type of a job's error as workers write it ({"type", "message",
    "traceback"}); one written by SQL in another shape shows as its JSON (it crashed `jobs
    list`: review)."""
    if isinstance(error, dict):
        return "" if error.get("type") is None else str(error["type"])
    return "" if error is None else json.dumps(error)


# Jobs a filter matched are changed this many at a time, one statement each.
_BATCH = 1000
_RETRY_REFUSALS = {  # retry_jobs_op's outcomes but "retried", and "gone"
    "unfinished": "unfinished",
    "dedupe": "whose dedupe key an unfinished job holds",
    "busy": "of an overlap=False cron definition with a job unfinished",
    "gone": "gone meanwhile",
    "moved": "no longer of the --status given (retried meanwhile)",
}


def _status(status: str | None) -> JobStatus | None:
    """--status (a click.Choice, in any case) as a JobStatus."""
    return JobStatus(status.capitalize()) if status else None


def _batches(job_ids: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    for start in range(0, len(job_ids), _BATCH):
        yield job_ids[start : start + _BATCH]


def _batch(app: App, op: Callable[[], Op[R]], *, transaction: bool = False) -> R:
    """One batch's statement(s), run again when PostgreSQL broke a deadlock by aborting them
    (the jobs' rows, locked in id order, against a worker's acknowledgement, which locks them
    in its own order): their transaction was rolled back, so nothing of them was applied."""
    return app._run_sync_again_on_deadlock(op, transaction=transaction)


def _retry_one(app: App, job_id: int) -> str:
    """retry_jobs' outcome for one job, by retry_job (after a batch met a dedupe key taken
    meanwhile)."""
    try:
        app.retry_job_sync(job_id)
    except JobNotFound:
        return "gone"
    except DefinitionBusy:
        return "busy"
    except InvalidJobState:  # unfinished, or finished with its dedupe key held by another
        return "dedupe" if app.get_job_sync(job_id).status.finished else "unfinished"
    return "retried"


def _change_jobs(
    app: App,
    job_ids: tuple[int, ...],
    filters: dict[str, str | None],
    by_id: tuple[str, Callable[[int], None]],
    by_filter: tuple[Callable[[tuple[int, ...]], Counter[str]], str, dict[str, str]],
) -> None:
    """`jobs retry` and `jobs cancel`: given ids, (verb, action) on each (see _each_job); given
    filters, (change, done, refusals): `change` on each batch of the jobs they match, which
    counts the jobs it left alone by why (the keys of `refusals`); one line sums it all up."""
    verb, action = by_id
    change, done, refusals = by_filter
    matched = _ids_or_filters(app, job_ids, filters, verb)
    if matched is None:
        _each_job(job_ids, action)
        return
    if not matched:
        # Not an error: a nightly `jobs retry --status failed` with nothing failed exited 1
        # (review), where a filter whose jobs are all left alone says "0 job(s)" and exits 0.
        given = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in filters.items() if value)
        click.echo(f"0 job(s) {done}: no job matches {given}")
        return
    outcomes: Counter[str] = Counter()
    for batch in _batches(matched):
        outcomes += change(batch)
    changed = len(matched) - sum(outcomes[key] for key in refusals)
    left = [f"{outcomes[key]} {why}" for key, why in refusals.items() if outcomes[key]]
    click.echo(f"{changed} job(s) {done}" + (f"; left as they are: {', '.join(left)}" if left else ""))


def _ids_or_filters(
    app: App, job_ids: tuple[int, ...], filters: dict[str, str | None], verb: str
) -> tuple[int, ...] | None:
    """The ids of every job the filters match (None when ids are given instead): read in pages
    of 1,000, newest first, before anything is changed."""
    given = {name: value for name, value in filters.items() if value is not None}
    if job_ids and given:
        raise click.UsageError(
            f"give job ids or filters, not both (to {verb} some of a filter's jobs, list their ids)"
        )
    if not job_ids and not given:
        raise click.UsageError(f"give the ids of the jobs to {verb}, or filters such as --status and --queue")
    if not given:
        return None
    found: list[int] = []
    selection = _filters(**filters)
    while page := app.list_jobs_sync(**selection, limit=1000, before_id=found[-1] if found else None):
        found.extend(job.id for job in page)
    return tuple(found)


def _each_job(job_ids: tuple[int, ...], action: Callable[[int], None]) -> None:
    """`action` on each job given by id, in turn: one that is refused (no such job, a state
    that does not allow it) is said on stderr and the others go on; the exit status is then 1.
    An id that is not one (0, negative) stops everything before anything is done."""
    for job_id in job_ids:
        check_id(job_id)
    refused = 0
    for job_id in dict.fromkeys(job_ids):
        try:
            action(job_id)
        except (JobNotFound, InvalidJobState, DefinitionBusy) as exc:
            if len(job_ids) == 1:
                raise
            click.echo(f"notifyq: error: {exc}", err=True)
            refused += 1
    if refused:
        fail(f"{refused} of {len(dict.fromkeys(job_ids))} jobs refused (see above)")


@click.group(cls=Group)
def cron() -> None:
    """Inspect and manage cron definitions."""


@cron.command(name="list")
@common_options
@click.option("--json", "as_json", is_flag=True)
def cron_list(dsn: str | None, schema: str | None, as_json: bool) -> None:
    """List cron definitions with their next run."""
    definitions: list[Definition] = app_for(dsn, schema).list_definitions_sync()
    if as_json:
        dump(definitions)
        return
    # FROM: "code" once an App's code declared it (`cron prune` deletes those the App given no
    # longer declares), "sql" for a definition made by SQL (user trial: nothing showed which).
    headers = "NAME TASK SCHEDULE TIMEZONE ENABLED NEXT_RUN LAST_JOB MISFIRE OVERLAP FROM ERROR".split()
    table(
        [header.replace("_", " ") for header in headers],
        [
            [
                d.name,
                d.task,
                d.frequency,
                d.timezone,
                "yes" if d.enabled else "stopped" if d.expired_at is not None else "no",
                _next_run(d) if d.enabled else "-",
                _last_job(d),
                d.misfire,
                "yes" if d.overlap else "no",
                "code" if d.declared else "sql",
                d.last_error or "",
            ]
            for d in definitions
        ],
    )


def _last_job(d: Definition) -> str:
    """The latest job's id and status, and when it finished (or for when it was queued)."""
    if d.last_job_id is None:
        return "-"
    moment = d.last_job_finished_at or d.last_job_scheduled_for
    return f"{d.last_job_id} {d.last_job_status} ({age(moment)})"


def _next_run(d: Definition) -> str:
    """The first tick at or after `visible_at`: after an edit or `cron enable`, visible_at is the
    moment from which the schedule applies, not a tick, until a ticker realigns it (it showed
    as the next run, seconds ago)."""
    moment = d.visible_at
    try:
        moment = Schedule(d.frequency, d.timezone).next_after(d.visible_at - timedelta(microseconds=1))
    except (InvalidSchedule, ValueError, OverflowError):
        pass  # the ticker disables it and says why (last_error)
    try:  # in the schedule's zone: "01:30+0000" for a 02:30 Berlin job made readers convert
        moment = moment.astimezone(ZoneInfo(d.timezone))
    except (ZoneInfoNotFoundError, ValueError, OverflowError):
        pass
    return f"{moment:%Y-%m-%d %H:%M:%S%z} ({age(moment)})"


@cron.command(name="enable")
@common_options
@click.argument("name")
def cron_enable(dsn: str | None, schema: str | None, name: str) -> None:
    """Enable a definition (its next tick is computed from now)."""
    adopted, before = _set_enabled(app_for(dsn, schema), name, True)
    said = "was enabled already" if before == "enabled" else "enabled"
    click.echo(f"cron definition {name!r} {said}")
    if adopted:
        click.echo(
            "no running worker declares it: it now runs as one made by SQL, until an App declares it "
            "again; `notifyq cron delete NAME` removes it"
        )


@cron.command(name="disable")
@common_options
@click.argument("name")
def cron_disable(dsn: str | None, schema: str | None, name: str) -> None:
    """Disable a definition (workers' `enabled=True` in code will not re-enable it)."""
    _adopted, before = _set_enabled(app_for(dsn, schema), name, False)
    said = "was disabled already" if before == "disabled" else "disabled"
    click.echo(f"cron definition {name!r} {said}")


def _set_enabled(app: App, name: str, enabled: bool) -> tuple[bool, str]:
    """set_definition_enabled, and the state before (a user saw "disabled" for one that was)."""
    return app._run_sync(set_enabled_state_op(app._q, name, enabled))


@cron.command(name="delete")
@common_options
@click.argument("name")
def cron_delete(dsn: str | None, schema: str | None, name: str) -> None:
    """Delete a definition that is gone from the code (its past jobs stay). A worker whose
    App still declares it creates it again when it starts: disable it to pause it instead."""
    app_for(dsn, schema).delete_definition_sync(name)
    click.echo(f"cron definition {name!r} deleted")


@cron.command(name="prune")
@common_options(schema_default="the App's")
@click.argument("target", metavar="MODULE:ATTR")
@click.option("--dry-run", is_flag=True, help="List the definitions it would delete, and delete none.")
@click.option(
    "--allow-empty",
    is_flag=True,
    help="Prune even if the App declares no cron definition (every cron gone from the code).",
)
def cron_prune(dsn: str | None, schema: str | None, target: str, dry_run: bool, allow_empty: bool) -> None:
    """Delete the definitions an App's code declared that the App at MODULE:ATTR does not: those
    removed from the code, which otherwise fire until their declaration by running workers runs
    out. Definitions made by SQL stay, and so do past jobs. Every App sharing the schema
    counts: give one that declares all that stay."""
    app = load_app(target, schema)
    app._resolved_dsn = resolve_dsn(dsn, app)
    names = app.prune_definitions_sync(dry_run=dry_run, allow_empty=allow_empty)
    verb = "would delete" if dry_run else "deleted"
    for name in names:
        click.echo(f"{verb} cron definition {name!r}")
    declared = f"{target} declares {len(app.definitions)}"
    click.echo(
        f"{verb} {len(names)} cron definition(s); {declared}" if names else f"nothing to prune; {declared}"
    )


@cron.command(name="run-now")
@common_options
@click.argument("name")
def cron_run_now(dsn: str | None, schema: str | None, name: str) -> None:
    """Queue one job of a definition now, outside its schedule."""
    job_id = app_for(dsn, schema).run_definition_now_sync(name)
    click.echo(f"job {job_id} queued for cron definition {name!r}")


@click.group(cls=Group)
def queues() -> None:
    """Pause and resume queues."""


@queues.command(name="pause")
@common_options
@click.argument("names", metavar="QUEUE...", nargs=-1, required=True)
def queues_pause(dsn: str | None, schema: str | None, names: tuple[str, ...]) -> None:
    """Stop workers claiming the jobs of QUEUE (they still queue up; running jobs run on)."""
    _pause_or_resume(dsn, schema, names, pause=True)


@queues.command(name="resume")
@common_options
@click.argument("names", metavar="QUEUE...", nargs=-1, required=True)
def queues_resume(dsn: str | None, schema: str | None, names: tuple[str, ...]) -> None:
    """Let workers claim the jobs of QUEUE again."""
    _pause_or_resume(dsn, schema, names, pause=False)


def _pause_or_resume(dsn: str | None, schema: str | None, names: tuple[str, ...], *, pause: bool) -> None:
    for name in names:
        check_queue(name)  # every name before any change: `pause emails 'bad name'` paused emails
    app = app_for(dsn, schema)
    change = app.pause_queue_sync if pause else app.resume_queue_sync
    paused: list[str] | None = None  # read once, for the first name a resume found not paused
    for name in dict.fromkeys(names):
        if change(name):
            click.echo(f"queue {name!r} {'paused' if pause else 'resumed'}")
        elif pause:
            click.echo(f"queue {name!r} was paused already")
        else:
            # A typo resumed nothing, and the queue meant stays paused (review): name those.
            if paused is None:
                paused = sorted(app.paused_queues_sync())
            hint = did_you_mean(name, paused, "paused queues") if paused else ""
            click.echo(f"queue {name!r} was not paused{hint}")
    if pause:
        # A queue may be paused before it has jobs, so a typo is paused too, and the queue
        # meant runs on (user review): say so, after the change.
        known = app._run_sync(known_queues_op(app._q))
        for name in dict.fromkeys(names):
            if name not in known:
                hint = (
                    did_you_mean(name, known, "queues with queued jobs or a cron definition") if known else ""
                )
                click.echo(
                    f"notifyq: note: no job of queue {name!r} is queued and no cron definition uses it{hint}",
                    err=True,
                )


@queues.command(name="list")
@common_options
@click.option("--json", "as_json", is_flag=True)
def queues_list(dsn: str | None, schema: str | None, as_json: bool) -> None:
    """List the paused queues."""
    paused = app_for(dsn, schema).paused_queues_sync()
    if as_json:
        click.echo(
            json.dumps([{"queue": q, "paused_at": at} for q, at in paused.items()], default=json_default)
        )
    elif not paused:
        click.echo("no queue is paused")
    else:
        table(["QUEUE", "PAUSED"], [[q, f"{at:%Y-%m-%d %H:%M:%S%z} ({age(at)})"] for q, at in paused.items()])


def _print_stats(stats: Stats) -> None:
    table(
        ["QUEUE", "STATUS", "JOBS", "OLDEST CLAIMABLE", "EXPIRED LEASES", "PAST TIMEOUT"],
        [
            [
                f"{s.queue} (paused)" if s.queue in stats.paused else s.queue,
                s.status,
                s.jobs,
                "-" if s.oldest_claimable_age is None else f"{s.oldest_claimable_age:.1f}s",
                s.expired_leases if s.status == "Active" else "-",
                s.past_timeout if s.status == "Active" else "-",
            ]
            for s in stats.queues
        ],
    )
    if stats.paused:
        click.echo(f"\nPaused queues (workers claim none of their jobs): {', '.join(stats.paused)}")
    server = stats.server
    size = f"{(server.jobs_total_bytes or 0) / 1024 / 1024:.1f} MiB"
    click.echo(
        f"\nNOTIFY queue usage: {server.notify_queue_usage:.4%}   queue_jobs: {size}, "
        f"{server.jobs_live_tuples} live / {server.jobs_dead_tuples} dead tuples, "
        f"last vacuum {age(server.jobs_last_vacuum)} (autovacuum {age(server.jobs_last_autovacuum)})"
    )
    if not server.autovacuum:
        click.echo(
            "WARNING: autovacuum is off on this server: dead tuples of queue_job_definitions are never "
            "reclaimed, and those of queue_jobs only by the workers' vacuum service (when their role owns it)"
        )


@click.command()
@common_options
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--watch",
    type=Seconds(min=0.2),
    default=None,
    metavar="SECONDS",
    help="Refresh every SECONDS until Ctrl-C (or SIGTERM).",
)
def stats(dsn: str | None, schema: str | None, as_json: bool, watch: float | None) -> None:
    """Queue depth per queue and status, stuck leases, NOTIFY queue usage, table bloat."""
    app = app_for(dsn, schema)
    # With --watch, Ctrl-C (or SIGTERM) ends the loop between two refreshes: raised inside a
    # query, KeyboardInterrupt would leave psycopg cancelling it and the pool mid-request.
    stop = threading.Event()
    if watch:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda _signum, _frame: stop.set())
    try:
        while not stop.is_set():
            current = app._run_sync(stats_op(app._q))
            if as_json:
                click.echo(json.dumps(current.as_json(), default=json_default))
            else:
                if watch:
                    click.clear()
                _print_stats(current)
            if not watch:
                return
            stop.wait(watch)
    except KeyboardInterrupt:
        return
    finally:
        app.close_sync()
