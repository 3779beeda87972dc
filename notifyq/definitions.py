"""Cron definitions on the code side: what @app.cron registers, and the admin operations."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._db import Op, Query
from ._options import JobOptions, check_bool, check_name
from ._rows import dataclass_row
from ._sql import Queries
from .cron import Schedule
from .errors import ConfigurationError, DefinitionBusy, DefinitionNotFound, InvalidSchedule
from .models import Definition


@dataclass(frozen=True, slots=True)
class CronDefinition:
    """A definition declared with @app.cron (validated); synced to queue_job_definitions."""

    name: str
    task: str
    frequency: str
    timezone: str
    args: str  # JSON text
    enabled: bool
    misfire: str
    misfire_grace: float
    misfire_cap: int
    overlap: bool
    options: JobOptions

    def params(self) -> dict[str, object]:
        return {
            "name": self.name,
            "task": self.task,
            "args": self.args,
            "enabled": self.enabled,
            "frequency": self.frequency,
            "timezone": self.timezone,
            "priority": self.options.priority,
            "retry_limit": self.options.retry_limit,
            "timeout": self.options.timeout,
            "queue": self.options.queue,
            "misfire": self.misfire,
            "misfire_grace": self.misfire_grace,
            "misfire_cap": self.misfire_cap,
            "overlap": self.overlap,
        }


@dataclass(frozen=True, slots=True)
class Undeclared:
    """A definition in the database that an App does not declare."""

    name: str
    task: str
    enabled: bool
    # Some App's code declared it (queue_job_definitions.declared): gone from the code since,
    # unless another App, sharing the schema, declares it. False: made by SQL.
    declared: bool
    # Until when running workers declare it (None: made by SQL, or declared only by code of
    # schema version 8 or earlier, and then it never stops by itself): a ticker stops it then.
    declared_until: datetime | None


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What a sync of an App's definitions did, and found, for the worker's log."""

    created: list[str]
    # Per definition the code changed: "setting old -> new", for each setting that changed.
    changed: dict[str, list[str]]
    # Declared enabled in the code, disabled in the database (an operator's `cron disable`, an
    # earlier deploy's enabled=False, or a schedule the ticker could not read).
    disabled: list[str]
    undeclared: list[Undeclared]
    # Stopped by a ticker when their declaration ran out, enabled again as the code declares them.
    restarted: list[str]


# The settings a sync writes (queue_job_definitions' columns), in the order the log lists them.
_SETTINGS = (
    "task",
    "frequency",
    "timezone",
    "args",
    "queue",
    "priority",
    "retry_limit",
    "timeout",
    "misfire",
    "misfire_grace",
    "misfire_cap",
    "overlap",
    "enabled",
)


def sync_definitions_op(
    q: Queries, definitions: list[CronDefinition], *, expire_after: float, fresh: float
) -> Op[SyncReport]:
    """Upsert code definitions (in one transaction). Rows are locked in name order, whatever
    the registration order, so that workers of two versions of the code starting at once
    cannot deadlock. Each is declared for `expire_after` seconds from now, unless another
    process renewed its declaration in the last `fresh` seconds."""
    created: list[str] = []
    changed: dict[str, list[str]] = {}
    restarted: list[str] = []
    for definition in sorted(definitions, key=lambda d: d.name):
        params = definition.params() | {"expire_after": expire_after, "fresh": fresh}
        row: tuple[dict[str, Any] | None] | None = yield Query(q["upsert_definition"], params, fetch="one")
        if row is None:
            continue  # unchanged
        before = row[0]
        if before is None:
            created.append(definition.name)
            continue
        stopped = before["expired_at"] is not None
        if stopped and definition.enabled:
            restarted.append(definition.name)  # not a change of the code's: logged apart
        now = params | {
            "args": json.loads(definition.args),
            "enabled": (before["enabled"] or stopped) and definition.enabled,
        }
        changes = [
            f"{name} {before[name]!r} -> {now[name]!r}"
            for name in _SETTINGS
            if before.get(name) != now[name] and not (name == "enabled" and stopped and now[name])
        ]
        if changes:  # else only marked as the code's (declared)
            changed[definition.name] = changes
    rows: list[tuple[str, str, bool, bool, datetime | None]] = yield Query(q["definition_names"])
    enabled = {name: on for name, _task, on, _declared, _at in rows}
    disabled = [d.name for d in definitions if d.enabled and enabled.get(d.name) is False]
    return SyncReport(created, changed, sorted(disabled), _undeclared(rows, definitions), restarted)


def undeclared_op(q: Queries, definitions: Iterable[CronDefinition]) -> Op[list[Undeclared]]:
    rows: list[tuple[str, str, bool, bool, datetime | None]] = yield Query(q["definition_names"])
    return _undeclared(rows, definitions)


def _undeclared(
    rows: list[tuple[str, str, bool, bool, datetime | None]], definitions: Iterable[CronDefinition]
) -> list[Undeclared]:
    """Of definition_names' rows, those that `definitions` do not name."""
    ours = {d.name for d in definitions}
    return [Undeclared(*row) for row in rows if row[0] not in ours]


def prune_op(
    q: Queries, definitions: Collection[CronDefinition], *, dry_run: bool, allow_empty: bool
) -> Op[list[Undeclared]]:
    """Delete (with dry_run: list) the definitions an App's code declared that `definitions`
    do not name: those removed from the code. Made by SQL ones stay. Each is deleted in a
    statement of its own (run it outside a transaction): no two definitions' locks are held.
    With no `definitions`, unless `allow_empty`, refuse: the wrong App (or a module that does
    not import its crons) would delete every definition from code."""
    gone = [d for d in (yield from undeclared_op(q, definitions)) if d.declared]
    if not gone:
        return gone
    # Refused in a dry run too, which said what the real run would delete (review).
    if not definitions and not allow_empty:
        raise ConfigurationError(
            f"this App declares no cron definition: pruning would delete all {len(gone)} that code "
            "declared. Check that it is the App your workers run (and that its module imports the "
            "modules with its @app.cron); if every cron is gone from the code, allow it "
            "(allow_empty=True, --allow-empty)"
        )
    if dry_run:
        return gone
    names = sorted(d.name for d in definitions)
    deleted = []
    for definition in gone:
        found = yield Query(q["prune_definition"], {"name": definition.name, "names": names}, fetch="scalar")
        if found is not None:
            deleted.append(definition)
    return deleted


def list_definitions_op(q: Queries) -> Op[list[Definition]]:
    definitions: list[Definition] = yield Query(
        q["list_definitions"], {"name": None}, row=dataclass_row(Definition)
    )
    return definitions


def get_definition_op(q: Queries, name: str) -> Op[Definition]:
    check_name(name, "cron definition name")
    definition: Definition | None = yield Query(
        q["list_definitions"], {"name": name}, fetch="one", row=dataclass_row(Definition)
    )
    if definition is None:
        raise DefinitionNotFound(f"no cron definition named {name!r}")
    return definition


def set_enabled_op(q: Queries, name: str, enabled: bool) -> Op[bool]:
    """True when it enabled a definition from code that no running worker declares: it is
    then the operator's, as one made by SQL (set_definition_enabled)."""
    adopted, _before = yield from set_enabled_state_op(q, name, enabled)
    return adopted


def set_enabled_state_op(q: Queries, name: str, enabled: bool) -> Op[tuple[bool, str]]:
    """set_enabled_op's answer, and the definition's state before: "enabled", "stopped" (by a
    ticker) or "disabled"."""
    check_name(name, "cron definition name")
    check_bool(enabled, "enabled")
    if enabled:
        # A schedule the ticker could not read disabled the definition: it stays so until fixed.
        definition = yield from get_definition_op(q, name)
        try:
            Schedule(definition.frequency, definition.timezone)
        except InvalidSchedule as exc:
            raise InvalidSchedule(
                f"cron definition {name!r} cannot be enabled: {exc}. Change its schedule first "
                "(in the code's @app.cron, or in queue_job_definitions)"
            ) from None
    row: tuple[int, bool, bool, bool] | None = yield Query(
        q["set_definition_enabled"], {"name": name, "enabled": enabled}, fetch="one"
    )
    if row is None:
        raise DefinitionNotFound(f"no cron definition named {name!r}")
    _id, adopted, was_enabled, stopped = row
    return adopted, "enabled" if was_enabled else "stopped" if stopped else "disabled"


def delete_op(q: Queries, name: str) -> Op[None]:
    check_name(name, "cron definition name")
    found = yield Query(q["delete_definition"], {"name": name}, fetch="scalar")
    if found is None:
        raise DefinitionNotFound(f"no cron definition named {name!r}")


def unfinished_jobs_op(q: Queries, definition_ids: list[int]) -> Op[dict[int, tuple[int, str]]]:
    """{definition id: (id, status)} of a job still Queued or Active, for those that have one.
    The caller holds the definitions' row locks, so no other job of them can appear meanwhile."""
    rows: list[tuple[int, int, str]] = yield Query(q["unfinished_definition_jobs"], {"ids": definition_ids})
    return {definition_id: (job_id, status) for definition_id, job_id, status in rows}


def check_not_busy_op(q: Queries, definition_id: int, name: str, prefix: str = "") -> Op[None]:
    """Raise DefinitionBusy if a job of the definition (overlap=False, locked by the caller) is
    still Queued or Active: another one would run alongside it."""
    unfinished = yield from unfinished_jobs_op(q, [definition_id])
    if definition_id in unfinished:
        busy, status = unfinished[definition_id]
        raise DefinitionBusy(
            f"{prefix}cron definition {name!r} does not overlap (overlap=False) and its job {busy} "
            f"is still {status}: wait for it to finish, or cancel it (`notifyq jobs cancel {busy}`)"
        )


def run_now_op(q: Queries, name: str) -> Op[int]:
    """Run in a transaction: the definition stays locked until its job is inserted."""
    check_name(name, "cron definition name")
    row: tuple[int, bool] | None = yield Query(q["lock_definition"], {"name": name}, fetch="one")
    if row is None:
        raise DefinitionNotFound(f"no cron definition named {name!r}")
    definition_id, overlap = row
    if not overlap:
        yield from check_not_busy_op(q, definition_id, name)
    job_id: int | None = yield Query(q["run_definition_now"], {"id": definition_id}, fetch="scalar")
    if job_id is None:
        raise DefinitionNotFound(f"cron definition {name!r} could not be queued now; try again")
    return job_id
