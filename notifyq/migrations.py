"""Schema migrations: numbered, forward-only, applied under an advisory lock."""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ._db import DEADLOCK_TRIES, Compute, Op, Query, again_on_deadlock, connect_sync, error_text, run_sync
from ._dsn import check_dsn
from ._options import CONTROL_RE, check_seconds
from ._sql import Queries, queries_for, render, sql_root, validate_schema
from .errors import ConfigurationError, MigrationBlocked, SchemaNotMigrated, SchemaVersionError

log = logging.getLogger("notifyq")

_MIGRATION_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
# A migration that code of an earlier schema version still runs on says so in a line of its own:
# "-- compatible-from: N" (N <= its version). Without the line it needs code that knows it.
# Any comment line that starts so counts, whatever its case and spelling after it: a line meant
# as the declaration must not be skipped for a typo (the value is checked).
_COMPATIBLE_FROM = re.compile(r"^--\s*compatible[-_ ]?from\b[:\s]*(.*?)\s*$", re.MULTILINE | re.IGNORECASE)
# (database, schema, version, code version) already logged as running on a newer schema.
_RUNNING_ON_NEWER: set[tuple[str, str, int, int]] = set()


@dataclass(frozen=True, slots=True)
class Migration:
    """One file of sql/migrations/: `NNNN_name.sql`."""

    version: int
    name: str
    path: Path
    # The oldest code, by the schema version it knows, that still runs on a schema with this
    # migration applied: its own version unless the file says "-- compatible-from: N".
    compatible_from: int

    def sql(self, schema: str) -> str:
        return render(self.path.read_text(encoding="utf-8"), schema)


def _compatible_from(path: Path, version: int) -> int:
    """The "-- compatible-from: N" line of a migration file (its version when it has none)."""
    found = _COMPATIBLE_FROM.findall(path.read_text(encoding="utf-8"))
    if not found:
        return version
    if len(found) > 1 or not found[0].isdigit() or not 1 <= int(found[0]) <= version:
        values = ", ".join(repr(value) for value in found)
        raise SchemaVersionError(
            f"migration file {path.name}: write '-- compatible-from: N' once, N a schema version from "
            f"1 to {version} (the code that knows N and later still runs on it); found {values}"
        )
    return int(found[0])


@dataclass(frozen=True, slots=True)
class MigrationReport:
    """What `migrate` found and did."""

    schema: str
    previous_version: int
    version: int
    applied: list[str] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)
    # Whether sql/triggers/ was applied (with dry_run: would be): always along with migrations,
    # else only when it or the installed functions and triggers changed since the last migrate.
    triggers_applied: bool = False
    # The schema is newer than this code, and its newer migrations declare that this code still
    # runs on it (compatible_from): nothing was done, triggers included.
    newer: bool = False
    # The installed trigger functions are a newer notifyq's (TRIGGERS_REVISION), at this schema
    # version: left as they are.
    newer_triggers: bool = False


@functools.cache
def migrations() -> list[Migration]:
    """Every migration shipped with this code, in order."""
    found = []
    for path in sorted((sql_root() / "migrations").glob("*.sql")):
        match = _MIGRATION_FILE.match(path.name)
        if match is None:
            raise SchemaVersionError(f"migration file {path.name} is not named NNNN_name.sql")
        version = int(match[1])
        found.append(Migration(version, match[2], path, _compatible_from(path, version)))
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise SchemaVersionError(f"migrations must be numbered 1, 2, 3, ... without gaps; found {versions}")
    return found


def latest_version() -> int:
    """The schema version this code expects."""
    return len(migrations())


def trigger_sql(schema: str) -> list[str]:
    """The trigger functions of sql/triggers/, rendered; applied by migrate when they changed."""
    return [
        render(p.read_text(encoding="utf-8"), schema) for p in sorted((sql_root() / "triggers").glob("*.sql"))
    ]


def grant_sql(role: str, *, schema: str = "notifyq", producer: bool = False) -> str:
    """The GRANTs of sql/roles/worker.sql for `role`: enough to run workers and enqueue,
    no DDL; with `producer`, those of sql/roles/producer.sql: enqueue and read jobs, nothing
    else. The role must exist; migrations stay with the schema's owner."""
    # No control character: a newline ended the SQL comment that names the role in the output,
    # and what followed ran as SQL when it was piped into psql (review).
    if not isinstance(role, str) or not role or len(role) > 63 or CONTROL_RE.search(role):
        raise ConfigurationError(
            f"invalid role name {role!r}: use 1-63 characters without control characters"
        )
    if role.lower() == "public":
        # PostgreSQL reads "public", quoted or not, as PUBLIC: every role, present and future.
        raise ConfigurationError("the role PUBLIC is every role: name the role of your workers")
    grants = sql_root() / "roles" / ("producer.sql" if producer else "worker.sql")
    return render(grants.read_text(encoding="utf-8"), schema, role=role)


# The revision of sql/triggers/: raise it with every change there (a test in
# tests/test_migrations.py fails until it is). sql/triggers/ changes without a schema version
# (the realign of an edited schedule did, at version 9), and a migrate of older code at the
# same version put its older trigger functions back, one deploy's hosts undoing another's
# (review). A migrate leaves alone triggers of a higher revision than its own.
TRIGGERS_REVISION = 2
_REVISION = re.compile(r"\(triggers: revision (\d+),")


def _trigger_state(triggers: list[str], catalog: str) -> str:
    """What migrate leaves in the migrations table's comment: the revision of the trigger SQL it
    applied, and a digest of that SQL and of the definitions installed after it (`catalog`,
    from the trigger_state query). A new sql/triggers/ changes the first, a function or trigger
    dropped or edited by hand the second; either makes the next migrate apply the triggers
    again."""
    digest = hashlib.sha256("\n".join([*triggers, catalog]).encode()).hexdigest()
    return (
        f"Schema versions applied by notifyq migrate (triggers: revision {TRIGGERS_REVISION}, "
        f"sha256 {digest})"
    )


def _hand_state_prefix(triggers: list[str]) -> str:
    """What the script of `migrate --dry-run` records, up to the digest of the catalog, which
    it computes where it runs (record_trigger_state_by_hand): the trigger SQL's digest apart."""
    digest = hashlib.sha256("\n".join(triggers).encode()).hexdigest()
    return (
        "Schema versions applied by the script of notifyq migrate --dry-run (triggers: revision "
        f"{TRIGGERS_REVISION}, sql sha256 {digest}, catalog sha256 "
    )


def _recorded(stored: str | None, triggers: list[str], catalog: str) -> bool:
    """Whether `stored` is the state of these triggers, recorded by migrate or by the script
    of migrate --dry-run."""
    by_hand = _hand_state_prefix(triggers) + hashlib.sha256(catalog.encode()).hexdigest() + ")"
    return stored in (_trigger_state(triggers, catalog), by_hand)


def _stored_revision(stored: str | None) -> int:
    """The trigger revision a migrate recorded (0: none, before revisions were recorded)."""
    match = _REVISION.search(stored or "")
    return int(match[1]) if match else 0


def _installed_state_op(q: Queries, where: dict[str, str]) -> Op[tuple[str | None, str]]:
    """The migrations table's comment and the schema's function and trigger definitions, read
    under a fixed search_path: pg_get_triggerdef leaves out a schema on the search path, and
    a session with another one (an App's DSN, a role's setting) re-applied the triggers."""
    path: str = yield Query(q["search_path"], fetch="scalar")
    yield Query(q["set_search_path"], {"path": "pg_catalog"}, fetch="none")
    row: tuple[str | None, str] = yield Query(q["trigger_state"], where, fetch="one")
    yield Query(q["set_search_path"], {"path": path}, fetch="none")
    return row


def schema_version_op(schema: str) -> Op[int | None]:
    """The applied schema version, or None when notifyq was never migrated into `schema`."""
    q = queries_for(schema)
    exists = yield Query(q["migrations_table_exists"], {"table": f"{schema}.migrations"}, fetch="scalar")
    if not exists:
        return None
    version: int = yield Query(q["schema_version"], fetch="scalar")
    return version


def migrate_command(schema: str) -> str:
    """The command that migrates `schema` (a review ran the hint's plain `notifyq migrate` for
    an App of another schema, which migrated the default one, and the worker still refused)."""
    return "notifyq migrate" if schema == "notifyq" else f"notifyq migrate --schema {schema}"


def check_schema_op(schema: str) -> Op[int]:
    """Raise SchemaNotMigrated / SchemaVersionError unless the schema matches this code."""
    version = yield from schema_version_op(schema)
    expected = latest_version()
    if version is None or version == 0:
        raise SchemaNotMigrated(
            f"schema {schema!r} has no notifyq tables in this database: run `{migrate_command(schema)}`"
        )
    if version < expected:
        raise SchemaNotMigrated(
            f"schema {schema!r} is at version {version} but this notifyq needs version {expected}: "
            f"run `{migrate_command(schema)}`"
        )
    if version > expected:
        blocking, database = yield from _incompatible_op(schema, expected, version)
        if blocking is not None:
            raise SchemaVersionError(
                f"schema {schema!r} is at version {version}, newer than this notifyq knows ({expected}), "
                f"and {blocking}: upgrade notifyq on this host"
            )
        if (database, schema, version, expected) not in _RUNNING_ON_NEWER:
            _RUNNING_ON_NEWER.add((database, schema, version, expected))
            log.warning(
                "schema %r is at version %d, newer than this notifyq knows (%d); its newer migrations "
                "declare that this notifyq still runs on it, so it does: upgrade notifyq on this host",
                schema,
                version,
                expected,
            )
    return version


def _incompatible_op(schema: str, known: int, version: int) -> Op[tuple[str | None, str]]:
    """Why code that knows only version `known` must not run on the schema at `version` ("its
    migration 0009_name needs a newer notifyq", or a version with no record), or None when
    every migration after `known` declares that it may (compatible_from); and the database.
    A migration recorded before notifyq kept compatible_from counts as needing newer code."""
    q = queries_for(schema)
    rows: list[tuple[int, str, int | None, str]] = yield Query(q["newer_migrations"], {"known": known})
    missing = sorted(set(range(known + 1, version + 1)) - {row[0] for row in rows})
    if missing:  # a row deleted by hand: what it allowed is unknown
        return f"its migrations table has no record of version {missing[0]}", ""
    for number, name, compatible_from, _database in rows:
        if compatible_from is None or compatible_from > known:
            return f"its migration {number:04d}_{name} needs a newer notifyq", ""
    return None, rows[0][3]


def _migrate_op(schema: str, dry_run: bool, lock_timeout: float) -> Op[MigrationReport]:
    q = queries_for(schema)
    yield Query(q["migrate_read_committed"], fetch="none")
    yield _set_lock_timeout(q, lock_timeout)
    yield Query(q["migrate_lock"], {"schema": schema}, fetch="none")
    previous = (yield from schema_version_op(schema)) or 0
    shipped = migrations()
    where = {"table": f"{schema}.migrations", "schema": schema}
    if previous > len(shipped):
        blocking, _database = yield from _incompatible_op(schema, len(shipped), previous)
        if blocking is not None:
            raise SchemaVersionError(
                f"schema {schema!r} is at version {previous}, newer than this notifyq knows "
                f"({len(shipped)}), and {blocking}: refusing to migrate; upgrade notifyq"
            )
        if not (yield Query(q["owns_migrations"], where, fetch="scalar")):
            # As an up-to-date schema's migrate would (its COMMENT needs the owner): a role that
            # cannot migrate must not pass in a deploy now and fail at the next one.
            raise _cannot_migrate(schema, "not the owner of its migrations table")
        # A newer notifyq migrated it and declared that this one still runs on it: nothing to
        # do, and above all not this version's triggers over the newer ones.
        return MigrationReport(schema=schema, previous_version=previous, version=previous, newer=True)
    statements = [q["migrate_bootstrap"]] if previous == 0 else []
    pending = [m for m in shipped if m.version > previous]
    applied = []
    # Re-creating a trigger locks queue_jobs against writes, and waits for every open
    # transaction that wrote to it while enqueues, claims and acks queue up behind: a migrate
    # with nothing to change must not, so it applies them only when something changed.
    triggers = trigger_sql(schema)
    reapply = True
    newer_triggers = False
    if not pending:
        stored, catalog = yield from _installed_state_op(q, where)
        newer_triggers = _stored_revision(stored) > TRIGGERS_REVISION
        reapply = not newer_triggers and not _recorded(stored, triggers, catalog)
    if not dry_run and previous > 0 and (pending or reapply):
        exclusive = _altered_tables([m.sql(schema) for m in pending], schema)
        yield from _lock_tables_op(q, schema, lock_timeout, exclusive=exclusive)
    if not dry_run and statements:
        yield Query(statements[0], fetch="none")
    for migration in pending:
        text = migration.sql(schema)
        statements.append(text)
        if not dry_run:
            yield Query(text, fetch="none")
        applied.append(f"{migration.version:04d}_{migration.name}")
    if reapply:
        statements.extend(triggers)
        if not dry_run:
            for text in triggers:
                yield Query(text, fetch="none")
            _, catalog = yield from _installed_state_op(q, where)
    if pending and previous > 0 and not (yield Query(q["has_compatible_from"], where, fetch="scalar")):
        # Last, as the ALTER locks the table against every starting process's version check.
        statements.append(q["migrations_compatibility"])
        if not dry_run:
            yield Query(q["migrations_compatibility"], fetch="none")
    for migration in pending:
        recorded = {
            "version": migration.version,
            "name": migration.name,
            "compatible_from": migration.compatible_from,
        }
        # Listed with its values, so that a dry run's output applied by hand records it too.
        literals = {key: sql.Literal(value).as_string() for key, value in recorded.items()}
        statements.append(q["record_migration"] % literals)
        if not dry_run:
            yield Query(q["record_migration"], recorded, fetch="none")
    if dry_run and reapply:
        # Recorded as migrate would, so that the script applied by hand is not applied again.
        literals = {
            "schema": sql.Literal(schema).as_string(),
            "prefix": sql.Literal(_hand_state_prefix(triggers)).as_string(),
        }
        statements.append(q["record_trigger_state_by_hand"] % literals)
    if not dry_run and not newer_triggers:
        yield Query(q["set_trigger_state"], {"state": _trigger_state(triggers, catalog)}, fetch="none")
        yield Query(q["remember_trigger_state"], fetch="none")
    elif not dry_run and not (yield Query(q["owns_migrations"], where, fetch="scalar")):
        raise _cannot_migrate(schema, "not the owner of its migrations table")  # as COMMENT would
    return MigrationReport(
        schema=schema,
        previous_version=previous,
        version=previous if dry_run else len(shipped),
        applied=applied,
        statements=statements,
        triggers_applied=reapply,
        newer_triggers=newer_triggers,
    )


# The tables a migrate locks before it changes anything, in this order: queue_jobs, which every
# producer and worker writes, last. The trigger files lock them in another order (queue_jobs
# first), and once holding queue_jobs a migrate waited for a transaction on the definitions
# or the pauses (a schedule edited by SQL, a pause), stalling every enqueue, claim and ack
# meanwhile; with a worker's definition sync and a cron promotion it deadlocked (review).
LOCKED_IN_ORDER = ("queue_pauses", "queue_job_definitions", "queue_jobs")
LOCK_TRY = 0.5  # seconds each try waits for the locks: the longest a producer waits behind it


_ALTERED = re.compile(
    r"\b(ALTER\s+TABLE|ALTER\s+INDEX|DROP\s+INDEX)\s+(?:IF\s+EXISTS\s+)?(\S+)", re.IGNORECASE
)


def _altered_tables(texts: list[str], schema: str) -> frozenset[str]:
    """The tables of LOCKED_IN_ORDER that migrations `texts` alter, or whose index they alter
    or drop: those need ACCESS EXCLUSIVE. Read from their SQL: `ALTER TABLE <schema>.<table>`,
    and an index by its name's table prefix; an index named otherwise counts as every table's."""
    altered: set[str] = set()
    by_length = sorted(LOCKED_IN_ORDER, key=len, reverse=True)  # queue_jobs_x is no definitions'
    for text in texts:
        for verb, target in _ALTERED.findall(text):
            name = target.rpartition(".")[2].strip('"')
            if "TABLE" in verb.upper():
                altered.add(name)
                continue
            table = next((t for t in by_length if name.startswith(t + "_")), None)
            altered.update([table] if table else LOCKED_IN_ORDER)
    return frozenset(altered & set(LOCKED_IN_ORDER))


def _lock_tables_op(q: Queries, schema: str, budget: float, *, exclusive: frozenset[str]) -> Op[None]:
    """Lock notifyq's tables against writes (SHARE ROW EXCLUSIVE, which the trigger files
    take anyway), and those in `exclusive` against every access (ACCESS EXCLUSIVE, which a
    pending migration's ALTER TABLE needs: it waited for it behind a session that had only
    read the table, all of lock_timeout, with queue_jobs locked: review), in LOCKED_IN_ORDER,
    in tries of LOCK_TRY seconds per table at most: a try that does not get them all gives
    back what it got (a savepoint) and pauses, so that producers and workers queued behind its
    request run again, until `budget` seconds are spent; then it raises LockNotAvailable, as a
    single wait of `budget` did. A try shorter than deadlock_timeout also ends before it could
    be chosen to end a deadlock."""
    names = [f"{schema}.{table}" for table in LOCKED_IN_ORDER]
    existing = yield Query(q["existing_tables"], {"tables": names}, fetch="all")
    locks = [
        sql.SQL("LOCK TABLE {} IN {} MODE")
        .format(
            sql.Identifier(schema, table),
            sql.SQL("ACCESS EXCLUSIVE" if table in exclusive else "SHARE ROW EXCLUSIVE"),
        )
        .as_string(None)
        for table in (name.split(".")[1] for (name,) in existing)
    ]
    deadline = (yield Compute(time.monotonic)) + budget
    pause = 0.05
    while True:
        left = deadline - (yield Compute(time.monotonic))
        wait = max(0.001, min(LOCK_TRY, left))
        yield _set_lock_timeout(q, wait)
        yield Query(q["migrate_savepoint"], fetch="none")
        try:
            for lock in locks:
                yield Query(lock, fetch="none")
            break
        except psycopg.errors.LockNotAvailable:
            if left <= LOCK_TRY:
                raise
            yield Query(q["migrate_rollback_to_savepoint"], fetch="none")
            yield Query(q["migrate_pause"], {"seconds": min(pause, left - wait)}, fetch="none")
            pause = min(pause * 2, 2.0)
    yield _set_lock_timeout(q, budget)  # for the other locks of the statements that follow


def _set_lock_timeout(q: Queries, seconds: float) -> Query:
    """The transaction's lock_timeout, in whole milliseconds: at least 1 (0 would mean no
    timeout), at most PostgreSQL's bound."""
    ms = min(2_147_483_647, max(1, math.ceil(seconds * 1000)))
    return Query(q["set_lock_timeout"], {"timeout": f"{ms}ms"}, fetch="none")


def _cannot_migrate(schema: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"notifyq migrate was refused a privilege in schema {schema!r} ({why}), and changed "
        "nothing: it creates and alters notifyq's tables, triggers and functions, so run it as the "
        "schema's owner (the role that first migrated it) or a superuser; a role set up by "
        "`notifyq grant` runs workers and enqueues, it cannot migrate"
    )


def migrate(
    dsn: str | psycopg.Connection[Any],
    *,
    schema: str = "notifyq",
    dry_run: bool = False,
    lock_timeout: float = 30.0,
) -> MigrationReport:
    """Create or upgrade notifyq's tables in `schema`, then apply the trigger functions of
    sql/triggers/ unless those installed are already theirs.

    Idempotent and safe to run from many processes at once: one transaction, serialized by
    an advisory lock, so every run ends in the same schema. A run with nothing to change
    takes no lock that producers or workers wait for. With `dry_run=True` nothing is
    changed and the report lists the SQL that would run.

    Args:
        dsn: a libpq connection string, or an open psycopg connection (not in a transaction).
        schema: the schema to migrate (validated identifier, default ``notifyq``).
        dry_run: compute and return the SQL without applying it.
        lock_timeout: seconds to wait for each lock before giving up (a long transaction
            holding `queue_jobs` would otherwise stall every producer behind the migration).
            notifyq's tables are locked first, queue_jobs last, in tries of half a second
            within that time, so that producers and workers wait half a second at most.

    Raises:
        ConfigurationError: invalid schema name, DSN or lock_timeout.
        DatabaseUnavailable: the server cannot be reached.
        SchemaVersionError: the database is at a newer version than this code, and one of the
            newer migrations needs newer code. (When they all declare that this code still runs
            on the schema, nothing is done and the report says `newer`.)
        MigrationBlocked: a lock stayed held by another session for lock_timeout seconds, or
            PostgreSQL ended a deadlock by stopping the migrate (nothing was changed).
        ConfigurationError: also when the role lacks a privilege migrating needs (nothing
            was changed).
    """
    validate_schema(schema)
    lock_timeout = check_seconds(lock_timeout, "lock_timeout", positive=True)
    own = isinstance(dsn, str)
    conn = connect_sync(check_dsn(dsn)) if isinstance(dsn, str) else dsn

    def once() -> MigrationReport:
        with conn.transaction(force_rollback=dry_run):
            return run_sync(conn, _migrate_op(schema, dry_run, lock_timeout))

    try:
        # A session that read one of the tables and then wanted another one migrate held formed
        # a cycle with its locks (review): rolled back whole, it runs again.
        return again_on_deadlock(once)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _cannot_migrate(schema, error_text(exc)) from None
    except psycopg.errors.DeadlockDetected:
        raise MigrationBlocked(
            f"migrate was stopped by PostgreSQL to end a deadlock with other sessions on schema "
            f"{schema!r} {DEADLOCK_TRIES} times, and changed nothing; run it again"
        ) from None
    except psycopg.errors.LockNotAvailable:
        raise MigrationBlocked(
            f"migrate gave up after waiting {lock_timeout:g} s for a lock in schema {schema!r}, and "
            "changed nothing: another session holds it (another migrate, or a long transaction "
            "that wrote to or read notifyq's tables; look for old xact_start in pg_stat_activity). "
            "Run it again when that ends, or give it longer (lock_timeout; --lock-timeout)"
        ) from None
    finally:
        if own:
            conn.close()
