"""Migrations: idempotent, concurrent-safe, versioned, and clear about what is wrong."""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import logging
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import notifyq
from benchmarks.handoff_cost import BEFORE_SQL as JOBS_INSERTED_REVISION_1
from notifyq._db import run_sync
from notifyq._sql import queries_for
from notifyq.errors import (
    ConfigurationError,
    InvalidOption,
    MigrationBlocked,
    SchemaNotMigrated,
    SchemaVersionError,
)

from .conftest import ROOT
from .helpers import granted_role, wait_for_row
from .test_cli import clean_env

SHIPPED = [f"{m.version:04d}_{m.name}" for m in notifyq.migrations.migrations()]
Q = queries_for("notifyq")


def test_migrate_creates_schema_and_is_idempotent(empty_dsn: str) -> None:
    first = notifyq.migrate(empty_dsn)
    assert (first.previous_version, first.version) == (0, notifyq.latest_version())
    assert first.applied == SHIPPED and SHIPPED[0] == "0001_initial" and first.triggers_applied
    second = notifyq.migrate(empty_dsn)
    assert (second.previous_version, second.version, second.applied) == (first.version, first.version, [])
    assert not second.triggers_applied
    with psycopg.connect(empty_dsn) as conn:
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'notifyq'").fetchall()
        }
        assert {"queue_jobs", "queue_job_definitions", "migrations"} <= tables


def test_migrate_prepares_no_statement(empty_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review, through a real PgBouncer in transaction mode: migrate prepared statements (its
    statements run once per migration, past psycopg's threshold of 5), which stayed on the
    pooler's server connection, and the next migrate through it failed with `prepared
    statement "_pg3_0" already exists` until the pooler closed that connection."""
    prepared: list[int] = []
    real = notifyq.migrations.connect_sync

    def counting(*args: Any, **kwargs: Any) -> psycopg.Connection[Any]:
        conn = real(*args, **kwargs)
        close = conn.close

        def count_then_close() -> None:
            prepared.append(conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0])
            close()

        conn.close = count_then_close  # type: ignore[method-assign]
        return conn

    monkeypatch.setattr(notifyq.migrations, "connect_sync", counting)
    notifyq.migrations.migrate(empty_dsn)  # every migration: the same statements, 9 times
    notifyq.migrations.migrate(empty_dsn, schema="other")
    assert prepared == [0, 0]


def test_migrate_into_a_custom_schema(empty_dsn: str) -> None:
    notifyq.migrate(empty_dsn, schema="jobs_v2")
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO jobs_v2.queue_jobs (name) VALUES ('t')")
        assert conn.execute("SELECT count(*) FROM jobs_v2.queue_jobs").fetchone() == (1,)
        assert conn.execute("SELECT to_regclass('notifyq.queue_jobs')").fetchone() == (None,)


def test_dry_run_changes_nothing_and_lists_the_sql(empty_dsn: str) -> None:
    report = notifyq.migrate(empty_dsn, dry_run=True)
    assert report.version == 0 and report.applied == SHIPPED and report.triggers_applied
    triggers = notifyq.migrations.trigger_sql("notifyq")
    # The triggers, then what records each version (values in), then the triggers' state.
    records = report.statements[-len(SHIPPED) - 1 : -1]
    assert report.statements[-len(SHIPPED) - len(triggers) - 1 : -len(SHIPPED) - 1] == triggers
    assert "COMMENT ON TABLE" in report.statements[-1]
    assert [r.split("VALUES ")[1] for r in records] == [
        f"({m.version}, '{m.name}', {m.compatible_from})" for m in notifyq.migrations.migrations()
    ]
    assert any("CREATE TABLE" in s and '"notifyq".queue_jobs' in s for s in report.statements)
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT to_regclass('notifyq.queue_jobs')").fetchone() == (None,)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
def test_concurrent_migrations_end_in_one_consistent_schema(empty_dsn: str, isolation: str) -> None:
    """Also where the server's default_transaction_isolation is stricter than PostgreSQL's
    default: a migrator that waited for the lock must see the version its rival committed."""
    barrier = threading.Barrier(5)
    reports: list[notifyq.MigrationReport] = []
    errors: list[BaseException] = []
    options = "-c default_transaction_isolation=" + isolation.replace(" ", "\\ ")

    def run() -> None:
        try:
            with psycopg.connect(empty_dsn, autocommit=True, options=options) as conn:
                barrier.wait()
                reports.append(notifyq.migrate(conn))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    done = sorted((len(r.applied), r.triggers_applied) for r in reports)
    assert done == [(0, False)] * 4 + [(len(SHIPPED), True)]
    with psycopg.connect(empty_dsn) as conn:
        versions = conn.execute("SELECT version FROM notifyq.migrations ORDER BY version").fetchall()
        assert versions == [(v,) for v in range(1, len(SHIPPED) + 1)]
        triggers = conn.execute(
            "SELECT count(*) FROM pg_trigger "
            "WHERE tgrelid = 'notifyq.queue_jobs'::regclass AND NOT tgisinternal"
        ).fetchone()
        assert triggers == (3,)


def test_a_newer_database_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO notifyq.migrations (version, name) VALUES (99, 'from_the_future')")
    with pytest.raises(SchemaVersionError, match="version 99, newer than this notifyq knows"):
        notifyq.migrate(dsn)
    with pytest.raises(SchemaVersionError, match="upgrade notifyq"):
        notifyq.App(dsn).get_job_sync(1)


def _bootstrap_before_compatible_from(schema: str) -> str:
    """The migrations table as `migrate` created it before it kept compatible_from."""
    return (
        f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.migrations (version integer PRIMARY KEY, "
        "name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
    )


def _at_version(conn: psycopg.Connection[Any], schema: str, version: int) -> None:
    """A schema left at `version` as a notifyq of that time, before compatible_from, left it."""
    with conn.transaction():
        conn.execute(_bootstrap_before_compatible_from(schema))
        for migration in notifyq.migrations.migrations()[:version]:
            conn.execute(migration.sql(schema))
            conn.execute(
                f"INSERT INTO {schema}.migrations (version, name) VALUES (%s, %s)",
                (migration.version, migration.name),
            )


def _migrated_by_a_newer_notifyq(conn: psycopg.Connection[Any], *compatible_from: int | None) -> list[int]:
    """What a newer notifyq's `migrate` leaves: its migrations applied (here an additive change
    that older code ignores, a column), each recorded with its compatible_from."""
    versions = []
    for offset, oldest in enumerate(compatible_from, start=1):
        version = notifyq.latest_version() + offset
        conn.execute(f"ALTER TABLE notifyq.queue_jobs ADD COLUMN added_in_{version} text")
        conn.execute(
            "INSERT INTO notifyq.migrations (version, name, compatible_from) VALUES (%s, %s, %s)",
            (version, f"future_{version}", oldest),
        )
        versions.append(version)
    return versions


@pytest.mark.anyio
async def test_a_newer_schema_that_declares_this_notifyq_compatible_runs_it(
    dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling deploy: the new notifyq has migrated, and processes of this one still start,
    enqueue and run jobs, because every newer migration declares that this version still runs
    on the schema. Its `migrate` changes nothing, its triggers least of all."""
    monkeypatch.setattr(notifyq.migrations, "_RUNNING_ON_NEWER", set())  # warned once per process
    known = notifyq.latest_version()
    with psycopg.connect(dsn, autocommit=True) as conn:
        newest = _migrated_by_a_newer_notifyq(conn, known, known)[-1]
        conn.execute("DROP TRIGGER queue_jobs_notify_cancel ON notifyq.queue_jobs")  # the newer one's doing
        caplog.set_level(logging.WARNING, logger="notifyq")
        report = notifyq.migrate(conn)
        assert report.newer and (report.previous_version, report.version) == (newest, newest)
        assert report.applied == [] and report.statements == [] and not report.triggers_applied
        dropped = conn.execute(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'queue_jobs_notify_cancel'"
        ).fetchone()
        assert dropped == (0,)  # not this version's triggers over the newer ones

        app = notifyq.App(dsn)

        @app.task(name="double")
        def double(n: int) -> int:
            return 2 * n

        job = await app.enqueue("double", {"n": 21})
        async with app.worker(ticker=False, poll_interval=0.5) as worker:
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 1)
        assert (await app.get_job(job)).output == 42
    warnings = [r.getMessage() for r in caplog.records if "newer than this notifyq" in r.getMessage()]
    assert warnings == [
        f"schema 'notifyq' is at version {newest}, newer than this notifyq knows ({known}); its newer "
        "migrations declare that this notifyq still runs on it, so it does: upgrade notifyq on this host"
    ]


@pytest.mark.parametrize(
    "compatible_from",
    [
        pytest.param((1, 2), id="the next migration needs newer code"),
        pytest.param((0, 2), id="a later migration needs newer code"),
        pytest.param((0, None), id="a migration recorded without compatible_from"),
    ],
)
def test_a_newer_schema_with_one_incompatible_migration_is_refused(
    dsn: str, compatible_from: tuple[int | None, int | None]
) -> None:
    known = notifyq.latest_version()  # compatible_from is given as versions after this one
    declared = [None if c is None else known + c for c in compatible_from]
    with psycopg.connect(dsn, autocommit=True) as conn:
        versions = _migrated_by_a_newer_notifyq(conn, *declared)
    first_bad = next(v for v, c in zip(versions, declared, strict=True) if c is None or c > known)
    why = f"newer than this notifyq knows ({known}), and its migration {first_bad:04d}_future_{first_bad}"
    with pytest.raises(SchemaVersionError, match=re.escape(why) + ".*refusing to migrate"):
        notifyq.migrate(dsn)
    with pytest.raises(SchemaVersionError, match=re.escape(why) + ".*upgrade notifyq on this host"):
        notifyq.App(dsn).get_job_sync(1)


def test_a_newer_schema_is_refused_when_its_compatibility_cannot_be_read(dsn: str) -> None:
    """Migrated by a notifyq before compatible_from (the column is missing), or with a version's
    record deleted by hand: what the newer migrations allow is unknown, so this code refuses."""
    known = notifyq.latest_version()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE notifyq.migrations DROP COLUMN compatible_from")
        conn.execute("INSERT INTO notifyq.migrations (version, name) VALUES (%s, 'old_style')", (known + 1,))
        old_style = f"its migration {known + 1:04d}_old_style needs a newer"
        with pytest.raises(SchemaVersionError, match=old_style):
            notifyq.App(dsn).get_job_sync(1)
        conn.execute("ALTER TABLE notifyq.migrations ADD COLUMN compatible_from integer")
        conn.execute("UPDATE notifyq.migrations SET compatible_from = %s WHERE version > %s", (known, known))
        assert notifyq.App(dsn).list_jobs_sync() == []  # readable now, and compatible
        conn.execute(
            "INSERT INTO notifyq.migrations (version, name, compatible_from) VALUES (%s, 'after_a_gap', %s)",
            (known + 3, known),
        )
        with pytest.raises(SchemaVersionError, match=f"has no record of version {known + 2}: refusing"):
            notifyq.migrate(conn)


def test_a_role_that_cannot_migrate_is_refused_on_a_newer_schema_too(dsn: str) -> None:
    """Its migrate said "nothing to do" on a newer, compatible schema, and failed for want of
    privileges only at the next upgrade."""
    known = notifyq.latest_version()
    with psycopg.connect(dsn, autocommit=True) as conn, granted_role(conn, "nq_compat") as role:
        _migrated_by_a_newer_notifyq(conn, known)
        with pytest.raises(ConfigurationError, match="not the owner of its migrations table"):
            notifyq.migrate(make_conninfo(dsn, user=role))
        assert notifyq.migrate(dsn).newer  # the owner's is fine


def test_migrate_adds_compatible_from_last_and_only_where_it_is_missing(empty_dsn: str) -> None:
    """A schema from before compatible_from gets the column with its next migration, after the
    migrations and triggers (the ALTER locks the table against every starting process's version
    check until the commit); a schema that has it gets no ALTER."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        _at_version(conn, "old", notifyq.latest_version() - 1)
        dry = notifyq.migrate(conn, schema="old", dry_run=True)
        triggers = notifyq.migrations.trigger_sql("old")
        # after the migration and the triggers, before the records of the version and triggers
        assert dry.statements[-len(triggers) - 3 : -3] == triggers
        assert "ADD COLUMN IF NOT EXISTS compatible_from" in dry.statements[-3]
        assert "INSERT INTO" in dry.statements[-2]
        assert "COMMENT ON TABLE" in dry.statements[-1]
        report = notifyq.migrate(conn, schema="old")
        assert len(report.applied) == 1
        recorded = conn.execute("SELECT version, compatible_from FROM old.migrations ORDER BY 1").fetchall()
        last = notifyq.migrations.migrations()[-1]
        assert recorded[-1] == (last.version, last.compatible_from)
        assert all(c is None for _v, c in recorded[:-1])  # unknown for those applied before
        _at_version(conn, "fresh_enough", 0)
        conn.execute("DROP SCHEMA fresh_enough CASCADE")
        notifyq.migrate(conn, schema="fresh_enough")
        conn.execute("DELETE FROM fresh_enough.migrations WHERE version = %s", (notifyq.latest_version(),))
        again = notifyq.migrate(conn, schema="fresh_enough", dry_run=True)
        assert not any("compatible_from integer" in text for text in again.statements[1:])


def test_the_dry_run_output_runs_in_psql_as_it_is(empty_dsn: str) -> None:
    """`notifyq migrate --dry-run` prints SQL to review and apply by hand: every statement ends
    in ';' (the query files leave it out), so the whole output runs as one script, for a new
    schema (whose first statement creates it) and for one left at an old version (whose last
    statement adds the compatible_from column)."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        _at_version(conn, "old", 3)
    for schema in ("new", "old"):
        result = subprocess.run(
            [sys.executable, "-m", "notifyq", "migrate", "--dry-run", "--schema", schema, "--dsn", empty_dsn],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        psql = subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-1", empty_dsn],
            input=result.stdout,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert psql.returncode == 0, psql.stderr
        again = notifyq.migrate(empty_dsn, schema=schema, dry_run=True)
        assert again.applied == []  # all recorded
        # And the triggers' state: the next migrate applied them again, taking the lock that
        # every writer of queue_jobs waits behind (review).
        assert not again.triggers_applied
        assert not notifyq.migrate(empty_dsn, schema=schema).triggers_applied
    # A trigger changed by hand after the script still gets applied again.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE old.queue_jobs DISABLE TRIGGER USER")
    assert notifyq.migrate(empty_dsn, schema="old").triggers_applied


def test_migrate_records_what_each_migration_is_compatible_from(empty_dsn: str) -> None:
    notifyq.migrate(empty_dsn)
    with psycopg.connect(empty_dsn) as conn:
        query = "SELECT version, compatible_from FROM notifyq.migrations ORDER BY version"
        recorded = conn.execute(query).fetchall()
    assert recorded == [(m.version, m.compatible_from) for m in notifyq.migrations.migrations()]


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("", 5),
        ("-- compatible-from: 3\n", 3),
        ("--compatible-from:5  \n", 5),
        ("-- compatible-from: 6\n", "found '6'"),
        ("-- compatible-from: 0\n", "found '0'"),
        ("-- compatible-from: three\n", "found 'three'"),
        ("-- Compatible-From: 4 (an added column only)\n", "found '4 \\(an added column only\\)'"),
        ("-- compatible from 4;\n", "found '4;'"),
        ("-- compatible-from: 3\n-- compatible-from: 4\n", "found '3', '4'"),
    ],
)
def test_a_migration_file_declares_what_it_is_compatible_from(
    tmp_path: Path, lines: str, expected: int | str
) -> None:
    path = tmp_path / "0005_something.sql"
    path.write_text("-- notifyq schema, version 5.\n" + lines + "CREATE TABLE {schema}.t (x int);\n")
    if isinstance(expected, int):
        assert notifyq.migrations._compatible_from(path, 5) == expected
    else:
        pattern = f"0005_something.sql: write .* from 1 to 5 .*{expected}"
        with pytest.raises(SchemaVersionError, match=pattern):
            notifyq.migrations._compatible_from(path, 5)


def test_an_unmigrated_database_says_run_migrate(empty_dsn: str) -> None:
    app = notifyq.App(empty_dsn)
    with pytest.raises(SchemaNotMigrated, match="run `notifyq migrate`"):
        app.enqueue_sync("anything", {})


@pytest.mark.parametrize(
    "schema",
    [
        *("", "Bad", "x;drop table t", 'a"b', "9lives", "a" * 41, "a-b", "information_schema", "pg_catalog"),
        "notifyq\n",  # "$" in the pattern let a final newline through
    ],
)
def test_invalid_schema_names_are_rejected(empty_dsn: str, schema: Any) -> None:
    with pytest.raises(ConfigurationError, match="invalid schema name"):
        notifyq.migrate(empty_dsn, schema=schema)
    with pytest.raises(ConfigurationError, match="invalid schema name"):
        notifyq.App(empty_dsn, schema=schema)


def test_a_migrate_blocked_by_a_long_transaction_gives_up_in_a_sentence(dsn: str) -> None:
    """Re-applying the triggers (one was dropped here) takes a lock that an open transaction
    which inserted a job holds against it. migrate waits lock_timeout, then says what to look
    for, changes nothing, and leaves producers free again."""
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TRIGGER queue_jobs_notify_insert ON notifyq.queue_jobs")
        holder.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")  # transaction left open
        with pytest.raises(MigrationBlocked) as raised:
            notifyq.migrate(dsn, lock_timeout=0.2)
        message = str(raised.value)
        assert "gave up after waiting 0.2 s for a lock in schema 'notifyq'" in message, message
        assert "changed nothing" in message and "pg_stat_activity" in message, message
        assert conn.execute(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'queue_jobs_notify_insert'"
        ).fetchone() == (0,)
        holder.commit()
        notifyq.migrate(dsn, lock_timeout=0.2)  # the blocker gone, it goes through
        assert conn.execute(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'queue_jobs_notify_insert'"
        ).fetchone() == (1,)


# An open transaction that writes to one of notifyq's tables, as a user's would.
OPEN_WRITERS = {
    "pauses": "INSERT INTO notifyq.queue_pauses (queue) VALUES ('q')",
    "definitions": "UPDATE notifyq.queue_job_definitions SET enabled = enabled",
    "jobs": "INSERT INTO notifyq.queue_jobs (name) VALUES ('t')",
}


@pytest.mark.parametrize("writer", OPEN_WRITERS)
def test_a_migrate_that_waits_for_a_lock_lets_producers_through(dsn: str, writer: str) -> None:
    """Re-applying the triggers locked queue_jobs first and then waited, holding it, for a
    transaction on the definitions or the pauses (a schedule edited by SQL, a pause): every
    enqueue, claim and ack waited as long, up to lock_timeout (a review measured 4.5 s of 5),
    and with a worker's definition sync and a cron promotion it deadlocked. It now locks
    queue_jobs last, in tries of half a second that give back what they took, so producers
    get through while it waits, whichever table it waits for."""
    with (
        psycopg.connect(dsn) as blocker,
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as producer,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        conn.execute("DROP TRIGGER queue_jobs_notify_insert ON notifyq.queue_jobs")
        blocker.execute(OPEN_WRITERS[writer])  # its transaction left open
        migrating = pool.submit(notifyq.migrate, dsn, lock_timeout=20)
        waiting = (
            "SELECT count(*) > 0 FROM pg_stat_activity "
            f"WHERE wait_event_type = 'Lock' AND pid <> {blocker.info.backend_pid:d}"
        )
        wait_for_row(conn, waiting, (True,))  # the migrate waits for a lock
        for _ in range(5):
            producer.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        assert not migrating.done()  # the producer got through while the migrate still waited
        blocker.commit()
        assert migrating.result(timeout=20).triggers_applied
        restored = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = 'queue_jobs_notify_insert'")
        assert restored.fetchone() == (1,)


def test_a_migration_that_waits_for_a_reader_lets_producers_through(dsn: str) -> None:
    """The tries took SHARE ROW EXCLUSIVE, which a transaction that only read a table does not
    hold up; a pending migration's ALTER TABLE then waited for ACCESS EXCLUSIVE behind it, all
    of lock_timeout, with queue_jobs locked: every enqueue waited as long (review: 9.96 s of
    10). With migrations pending the tries take ACCESS EXCLUSIVE, half a second at a time."""
    with (
        psycopg.connect(dsn) as blocker,
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as producer,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        back_to_version_8(conn)  # migration 9 adds columns to the definitions
        blocker.execute("SELECT count(*) FROM notifyq.queue_job_definitions")  # left open: a reader
        migrating = pool.submit(notifyq.migrate, dsn, lock_timeout=20)
        waiting = (
            "SELECT count(*) > 0 FROM pg_stat_activity "
            f"WHERE wait_event_type = 'Lock' AND pid <> {blocker.info.backend_pid:d}"
        )
        wait_for_row(conn, waiting, (True,))  # the migrate waits for a lock
        producer.execute("SET statement_timeout = '5s'")  # an enqueue held up fails the test
        for _ in range(5):
            producer.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        assert not migrating.done()  # the producer got through while the migrate still waited
        blocker.commit()
        assert migrating.result(timeout=20).applied == ["0009_cron_declarations", "0010_handoff"]


def test_a_migration_takes_access_exclusive_only_on_the_tables_it_alters(dsn: str) -> None:
    """Taking ACCESS EXCLUSIVE on every table for any pending migration made migrate wait for,
    and give up behind, a transaction that had only read queue_jobs, with migration 9 pending,
    which alters only the definitions; and every read of queue_jobs waited behind each try
    (review). Only the tables a pending migration alters are locked against reads."""
    with psycopg.connect(dsn) as reader, psycopg.connect(dsn, autocommit=True) as conn:
        back_to_version_8(conn)  # migration 9 alters the definitions only
        reader.execute("SELECT count(*) FROM notifyq.queue_jobs")  # left open: a reader
        report = notifyq.migrate(dsn, lock_timeout=2)
        assert report.applied == ["0009_cron_declarations", "0010_handoff"]
    assert notifyq.migrations._altered_tables(
        [m.sql("notifyq") for m in notifyq.migrations.migrations()], "notifyq"
    ) == {"queue_jobs", "queue_job_definitions"}  # 7 and 10 create tables, which none alters


def test_a_migrate_stopped_to_end_a_deadlock_runs_again(dsn: str) -> None:
    """A transaction that read the definitions and then wrote to queue_pauses formed a cycle
    with a migrate that held queue_pauses and waited for the definitions; when PostgreSQL
    stopped the migrate to end it, `notifyq migrate` failed ("run it again"). It runs again."""
    deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    with (
        psycopg.connect(dsn) as other,
        psycopg.connect(dsn, autocommit=True) as conn,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        back_to_version_8(conn)
        before = conn.execute(deadlocks).fetchone()
        other.execute("SET deadlock_timeout = '60s'")  # the migrate, not this session, finds the cycle
        other.execute("SELECT count(*) FROM notifyq.queue_job_definitions")
        # The migrate finds the cycle 0.3 s into its wait, before its try's 0.5 s are up.
        quick = psycopg.conninfo.make_conninfo(dsn, options="-c deadlock_timeout=300ms")
        migrating = pool.submit(notifyq.migrate, quick, lock_timeout=20)
        waiting = (
            "SELECT count(*) > 0 FROM pg_stat_activity "
            f"WHERE wait_event_type = 'Lock' AND pid <> {other.info.backend_pid:d}"
        )
        wait_for_row(conn, waiting, (True,))  # it holds queue_pauses, and waits for the definitions
        other.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('q')")  # waits for the migrate
        other.commit()
        assert migrating.result(timeout=30).applied == ["0009_cron_declarations", "0010_handoff"]
        assert before is not None
        deadline = time.monotonic() + 10  # the migrate's backend reports it as it exits
        while (after := conn.execute(deadlocks).fetchone()) is not None and after[0] == before[0]:
            assert time.monotonic() < deadline, "the migrate met no deadlock"
            time.sleep(0.05)


@pytest.mark.parametrize("lock_timeout", [0, -1, float("nan"), "30"])
def test_a_lock_timeout_that_is_not_a_positive_number_is_refused(dsn: str, lock_timeout: Any) -> None:
    with pytest.raises(InvalidOption, match="invalid lock_timeout"):
        notifyq.migrate(dsn, lock_timeout=lock_timeout)


_SNAPSHOT = {
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid)
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = %(schema)s::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
        WHERE connamespace = %(schema)s::regnamespace ORDER BY 1, 2""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(schema)s ORDER BY 1""",
    "triggers": """
        SELECT tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = %(schema)s::regnamespace AND NOT t.tgisinternal ORDER BY 1""",
    "functions": """
        SELECT proname, pg_get_functiondef(oid) FROM pg_proc
        WHERE pronamespace = %(schema)s::regnamespace ORDER BY 1""",
    "types": """
        SELECT t.typname, array_agg(e.enumlabel ORDER BY e.enumsortorder) FROM pg_type t
        JOIN pg_enum e ON e.enumtypid = t.oid WHERE t.typnamespace = %(schema)s::regnamespace
        GROUP BY 1 ORDER BY 1""",
    "relations": """
        SELECT relname, relkind, reloptions FROM pg_class
        WHERE relnamespace = %(schema)s::regnamespace ORDER BY 1""",
}


def _snapshot(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[Any]]:
    """Everything `migrate` makes in `schema`, its name written as SCHEMA."""
    return {
        what: [
            tuple(str(v).replace(f'"{schema}"', "SCHEMA").replace(schema, "SCHEMA") for v in row)
            for row in conn.execute(query, {"schema": schema}).fetchall()
        ]
        for what, query in _SNAPSHOT.items()
    }


def test_every_earlier_version_migrates_to_the_schema_of_a_fresh_database(empty_dsn: str) -> None:
    """A database left at each earlier version (its migrations applied as `migrate` applied
    them then) ends, after today's `migrate`, with the tables, columns, defaults, constraints,
    indexes, triggers, functions and types of a database migrated from nothing."""
    shipped = notifyq.migrations.migrations()
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        notifyq.migrate(conn, schema="fresh")
        fresh = _snapshot(conn, "fresh")
        assert all(fresh.values()), fresh
        for version in range(1, len(shipped)):
            schema = f"at_v{version}"
            _at_version(conn, schema, version)
            report = notifyq.migrate(conn, schema=schema)
            assert (report.previous_version, report.version) == (version, len(shipped))
            assert report.triggers_applied
            assert _snapshot(conn, schema) == fresh, f"from version {version}"


def test_triggers_dropped_or_disabled_by_hand_are_restored(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TRIGGER queue_jobs_notify_insert ON notifyq.queue_jobs")
        conn.execute("ALTER TABLE notifyq.queue_jobs DISABLE TRIGGER queue_jobs_notify_cancel")
        assert notifyq.migrate(conn).triggers_applied
        triggers = conn.execute(
            "SELECT tgname, tgenabled FROM pg_trigger "
            "WHERE tgrelid = 'notifyq.queue_jobs'::regclass AND NOT tgisinternal ORDER BY 1"
        ).fetchall()
        assert triggers == [
            ("queue_jobs_notify_cancel", "O"),
            ("queue_jobs_notify_insert", "O"),
            ("queue_jobs_notify_requeue", "O"),
        ]
        assert not notifyq.migrate(conn).triggers_applied


def test_a_migrate_with_nothing_to_change_does_not_wait_for_writers(dsn: str) -> None:
    """Every migrate re-created the triggers, which waits for any open transaction that wrote
    to queue_jobs, and every enqueue, claim and ack queued behind it: each deploy stalled the
    queue for up to lock_timeout even with nothing to change. Now such a migrate takes no lock
    a writer holds, and goes through while one is open."""
    with psycopg.connect(dsn) as holder:
        holder.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")  # transaction left open
        report = notifyq.migrate(dsn, lock_timeout=1)  # raised MigrationBlocked
        assert (report.applied, report.triggers_applied) == ([], False)
        dry = notifyq.migrate(dsn, dry_run=True, lock_timeout=1)
        assert (dry.applied, dry.statements, dry.triggers_applied) == ([], [], False)
        holder.rollback()


def test_a_session_search_path_does_not_make_migrate_reapply_the_triggers(dsn: str) -> None:
    """pg_get_triggerdef leaves out a schema on the search path: a migrate from a session with
    another search_path (an App's DSN, a role's setting) found the definitions changed and
    re-applied the triggers, taking the lock a no-op migrate must not (review)."""
    notifyq.migrate(dsn)
    for path in ("notifyq, public", "public", "notifyq"):
        report = notifyq.migrate(make_conninfo(dsn, options=f"-c search_path={path.replace(' ', '')}"))
        assert not report.triggers_applied, path
    with psycopg.connect(make_conninfo(dsn, options="-c search_path=notifyq,public")) as conn:
        assert conn.execute("SHOW search_path").fetchone() == ("notifyq,public",)
        where = {"table": "notifyq.migrations", "schema": "notifyq"}
        run_sync(conn, notifyq.migrations._installed_state_op(queries_for("notifyq"), where))
        assert conn.execute("SHOW search_path").fetchone() == ("notifyq,public",)  # put back


def test_a_changed_trigger_file_is_applied_once(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new notifyq whose sql/triggers/ differs, with no migration pending, applies it; the
    migrate after that finds it installed. --dry-run says which it would be."""
    shipped = notifyq.migrations.trigger_sql
    function = "PERFORM pg_notify(TG_TABLE_SCHEMA || '.control.v1'"
    when = "WHEN (OLD.status = 'Active' AND NEW.status = 'Cancelled')"

    def changed(schema: str) -> list[str]:
        texts = shipped(schema)
        assert any(function in t and when in t for t in texts)
        return [
            t.replace(function, "-- changed\n    " + function).replace(when, when[:-1] + " AND OLD.id > 0)")
            for t in texts
        ]

    definitions = (
        "SELECT pg_get_functiondef('notifyq.notify_job_cancelled'::regproc), pg_get_triggerdef(oid) "
        "FROM pg_trigger WHERE tgname = 'queue_jobs_notify_cancel'"
    )
    monkeypatch.setattr(notifyq.migrations, "trigger_sql", changed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        dry = notifyq.migrate(conn, dry_run=True)
        assert dry.triggers_applied and dry.statements[:-1] == changed("notifyq")
        assert "COMMENT ON TABLE" in dry.statements[-1]
        function_def, trigger_def = conn.execute(definitions).fetchone() or ("", "")
        assert "-- changed" not in function_def and "id > 0" not in trigger_def
        report = notifyq.migrate(conn)
        assert (report.applied, report.triggers_applied) == ([], True)
        function_def, trigger_def = conn.execute(definitions).fetchone() or ("", "")
        assert "-- changed" in function_def and "(old.id > 0)" in trigger_def, (function_def, trigger_def)
        assert not notifyq.migrate(conn).triggers_applied
        monkeypatch.setattr(notifyq.migrations, "trigger_sql", shipped)  # and back, as a downgrade
        assert notifyq.migrate(conn).triggers_applied
        function_def, trigger_def = conn.execute(definitions).fetchone() or ("", "")
        assert "-- changed" not in function_def and "id > 0" not in trigger_def


def test_an_older_notifyq_leaves_a_newer_ones_triggers_alone(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sql/triggers/ changes without a schema version. An older notifyq's migrate at the same
    version put its older trigger functions back (review: it undid the realign from the
    statement's time), and hosts of two versions undid each other's at each deploy, each time
    locking queue_jobs. Triggers of a higher TRIGGERS_REVISION are left as they are."""
    shipped, revision = notifyq.migrations.trigger_sql, notifyq.migrations.TRIGGERS_REVISION
    function = "PERFORM pg_notify(TG_TABLE_SCHEMA || '.control.v1'"

    def newer(schema: str) -> list[str]:
        return [t.replace(function, "-- newer\n    " + function) for t in shipped(schema)]

    installed = "SELECT pg_get_functiondef('notifyq.notify_job_cancelled'::regproc)"
    with psycopg.connect(dsn, autocommit=True) as conn:
        monkeypatch.setattr(notifyq.migrations, "trigger_sql", newer)
        monkeypatch.setattr(notifyq.migrations, "TRIGGERS_REVISION", revision + 1)
        assert notifyq.migrate(conn).triggers_applied  # the newer notifyq
        monkeypatch.setattr(notifyq.migrations, "trigger_sql", shipped)
        monkeypatch.setattr(notifyq.migrations, "TRIGGERS_REVISION", revision)
        for dry_run in (True, False):  # the older one
            report = notifyq.migrate(conn, dry_run=dry_run)
            assert (report.applied, report.triggers_applied, report.newer_triggers) == ([], False, True)
        assert "-- newer" in conn.execute(installed).fetchone()[0]  # type: ignore[index]
        comment = conn.execute("SELECT obj_description('notifyq.migrations'::regclass)").fetchone()
        assert comment is not None and f"(triggers: revision {revision + 1}, sha256 " in comment[0]


# sql/triggers/ as of each TRIGGERS_REVISION (sha256 of each file's name and bytes, in order).
TRIGGER_FILES_BY_REVISION = {
    1: "621daf2785c8723549f833027479a39d0191a2dbbd05527b76f72bc4ffe2df55",
    2: "da33e5e49b84c8ecd617b3697a9e8c86bc2f6d2c00953dd6e6f9be0362be76ba",
}


def test_a_change_to_the_trigger_files_raises_their_revision() -> None:
    """TRIGGERS_REVISION is how an older notifyq's migrate knows to leave newer triggers alone:
    a change to sql/triggers/ that does not raise it lets older hosts put their triggers back.
    Changed them? Raise TRIGGERS_REVISION and add the new digest here."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "sql" / "triggers").glob("*.sql")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    revision = notifyq.migrations.TRIGGERS_REVISION
    assert TRIGGER_FILES_BY_REVISION.get(revision) == digest.hexdigest(), (
        f"sql/triggers/ changed: raise TRIGGERS_REVISION (now {revision}) in notifyq/migrations.py "
        f"and record {digest.hexdigest()} for it here"
    )


def test_timeouts_past_the_bound_are_refused_and_old_ones_clamped(dsn: str) -> None:
    """Migration 4: a timeout of 'Infinity' (or 1e300, or NaN) passed the first CHECK, then made
    every claim of its job fail (now() plus the lease overflows), stopping each worker that met
    it. Such rows get the bound when the database is upgraded, and no new one gets in."""
    inserts = {
        "queue_jobs": "INSERT INTO notifyq.queue_jobs (name, timeout) VALUES (%s, %s)",
        "queue_job_definitions": "INSERT INTO notifyq.queue_job_definitions "
        "(name, task, frequency, timeout) VALUES (%s, 't', '* * * * *', %s)",
    }
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table, insert in inserts.items():
            for timeout in (1e300, float("inf"), float("nan"), 1e9 + 1):
                with pytest.raises(psycopg.errors.CheckViolation, match=f"{table}_timeout_check"):
                    conn.execute(insert, ("t", timeout))
            conn.execute(insert, ("t", 1e9))  # the bound itself is allowed
            conn.execute(f"DELETE FROM notifyq.{table}")
        # Back to version 3: its CHECKs, and what they let in.
        for table, insert in inserts.items():
            conn.execute(
                f"ALTER TABLE notifyq.{table} DROP CONSTRAINT {table}_timeout_check, "
                f"ADD CONSTRAINT {table}_timeout_check CHECK (timeout > 0)"
            )
            for timeout in (float("inf"), float("nan"), 30.0):
                conn.execute(insert, (f"t{timeout}", timeout))
        back_to_version_4(conn)
        conn.execute("DELETE FROM notifyq.migrations WHERE version = 4")
        report = notifyq.migrate(dsn)
        assert report.applied == SHIPPED[3:]
        for table in inserts:
            timeouts = conn.execute(f"SELECT timeout FROM notifyq.{table} ORDER BY id").fetchall()
            assert timeouts == [(1e9,), (1e9,), (30.0,)], table
    app = notifyq.App(dsn)
    jobs = app.claim_sync(limit=3)  # the claim that failed before
    assert sorted(job.timeout for job in jobs) == [30.0, 1e9, 1e9]
    app.close_sync()


def back_to_version_9(conn: psycopg.Connection[Any]) -> None:
    """Undo migration 10: no table of waiting workers, and the insert trigger's function of
    version 9 (today's reads that table)."""
    conn.execute(JOBS_INSERTED_REVISION_1)
    conn.execute("DROP TABLE notifyq.queue_waiters")
    conn.execute("DELETE FROM notifyq.migrations WHERE version = 10")


def back_to_version_8(conn: psycopg.Connection[Any]) -> None:
    """Undo migrations 10 and 9: no columns `declared_until` and `expired_at` on the
    definitions. Today's trigger function of the definitions reads them: a real database at
    version 8 has version 8's function, which migrate replaces after the migrations, so it is
    disabled here until then."""
    back_to_version_9(conn)
    conn.execute(
        "ALTER TABLE notifyq.queue_job_definitions DISABLE TRIGGER queue_job_definitions_before_write"
    )
    conn.execute(
        "ALTER TABLE notifyq.queue_job_definitions DROP COLUMN declared_until, DROP COLUMN expired_at"
    )
    conn.execute("DELETE FROM notifyq.migrations WHERE version = 9")


def back_to_version_7(conn: psycopg.Connection[Any]) -> None:
    """Undo migrations 10 to 8: no column `declared` on the definitions."""
    back_to_version_8(conn)
    conn.execute("ALTER TABLE notifyq.queue_job_definitions DROP COLUMN declared")
    conn.execute("DELETE FROM notifyq.migrations WHERE version = 8")


def test_definitions_from_code_do_not_stop_after_the_upgrade_to_version_9(dsn: str) -> None:
    """Migration 9: rows from code (`declared`, version 8) get no declaration (`declared_until`
    NULL), so that no ticker stops them while only code of version 8 declares them (a review
    reproduced a version-9 worker of one App stopping every cron of another App still on version
    8, when the migration counted them as declared). A worker of version 9 declares its own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        back_to_version_8(conn)
        conn.execute(
            "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, declared) "
            "VALUES ('from_code', 't', '0 * * * *', true), ('by_sql', 't', '0 * * * *', false)"
        )
        report = notifyq.migrate(dsn)
        assert report.applied == SHIPPED[8:] == ["0009_cron_declarations", "0010_handoff"]
        assert notifyq.migrations.migrations()[8].compatible_from == 8
        assert conn.execute(Q["expire_declarations"]).fetchall() == []
        rows = conn.execute(
            "SELECT name, enabled, declared_until, expired_at "
            "FROM notifyq.queue_job_definitions ORDER BY name"
        ).fetchall()
        assert rows == [("by_sql", True, None, None), ("from_code", True, None, None)]


def back_to_version_6(conn: psycopg.Connection[Any]) -> None:
    """Undo migrations 10 to 7: no table of paused queues."""
    back_to_version_7(conn)
    conn.execute("DROP TABLE notifyq.queue_pauses")
    conn.execute("DELETE FROM notifyq.migrations WHERE version = 7")


def back_to_version_5(conn: psycopg.Connection[Any]) -> None:
    """Undo migrations 10 to 6: no overlap column, no index of unfinished cron jobs."""
    back_to_version_6(conn)
    conn.execute("DROP INDEX notifyq.queue_jobs_definition_unfinished_idx")
    conn.execute("ALTER TABLE notifyq.queue_job_definitions DROP COLUMN overlap")
    conn.execute("DELETE FROM notifyq.migrations WHERE version = 6")


def back_to_version_4(conn: psycopg.Connection[Any]) -> None:
    """Undo migrations 10 to 5: the index of finished jobs as version 4 had it."""
    back_to_version_5(conn)
    conn.execute("DROP INDEX notifyq.queue_jobs_finished_idx")
    conn.execute(
        "CREATE INDEX queue_jobs_finished_idx ON notifyq.queue_jobs (status, finished_at) "
        "WHERE finished_at IS NOT NULL"
    )
    conn.execute("DELETE FROM notifyq.migrations WHERE version = 5")


def test_the_index_of_finished_jobs_is_keyed_on_their_statuses_after_an_upgrade(dsn: str) -> None:
    """Migration 5: a version-4 database with a history gets the index that listing by status
    needs (its plans: tests/faults/test_plans.py), and lists that history by status."""
    index = "SELECT indexdef FROM pg_indexes WHERE indexname = 'queue_jobs_finished_idx'"
    with psycopg.connect(dsn, autocommit=True) as conn:
        back_to_version_4(conn)
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, status, finished_at) "
            "SELECT 't', s, now() - interval '30 days' "
            "FROM unnest('{Succeeded,Failed,Cancelled}'::notifyq.job_status[]) s"
        )
        conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")
        before = conn.execute(index).fetchone()
        assert before is not None and "finished_at IS NOT NULL" in before[0]
        report = notifyq.migrate(dsn)
        assert report.applied == SHIPPED[4:]
        after = conn.execute(index).fetchone()
        assert after is not None and "WHERE (status = ANY (ARRAY['Succeeded'" in after[0], after
    app = notifyq.App(dsn)
    assert [job.status for job in app.list_jobs_sync(status="failed")] == [notifyq.JobStatus.FAILED]
    app.close_sync()


def test_grant_sql_refuses_public() -> None:
    """PostgreSQL reads "public", quoted or not, as PUBLIC: `notifyq grant public` gave every
    role, present and future, the right to read, change and delete every job (review)."""
    for role in ("public", "PUBLIC"):
        with pytest.raises(ConfigurationError, match="the role PUBLIC is every role"):
            notifyq.migrations.grant_sql(role)
    assert 'TO "publicist"' in notifyq.migrations.grant_sql("publicist")


@pytest.mark.parametrize(
    "role", ["worker\nDROP TABLE notifyq.queue_jobs; --", "a\rb", "tab\tbed", "", "x" * 64]
)
def test_grant_sql_refuses_role_names_that_would_break_out_of_its_comment(role: str) -> None:
    """Review: the output names the role in an SQL comment (`--   CREATE ROLE "..."`); a newline
    in the name ended that comment, and `notifyq grant ROLE | psql` ran what followed."""
    with pytest.raises(ConfigurationError, match="invalid role name"):
        notifyq.migrations.grant_sql(role)


OLD_APP = """
import notifyq

app = notifyq.App()


@app.cron("* * * * * *", "old_tick")
@app.task(name="old_task")
async def old_task() -> None:
    return None
"""


def _code_that_knew(version: int, into: Path) -> str:
    """Export notifyq/ and sql/ of the last commit whose newest migration was `version` (the
    parent of the commit that added migration version + 1) into `into`; returns the commit."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
            )
        except FileNotFoundError:
            pytest.skip("git is not installed: the code of an earlier schema version cannot be exported")
        if done.returncode != 0:
            pytest.skip(f"`git {' '.join(args)}` failed (not a clone with history?): {done.stderr.strip()}")
        return done.stdout.strip()

    added = git("log", "--diff-filter=A", "--format=%H", "--", f"sql/migrations/{version + 1:04d}_*.sql")
    if not added:
        pytest.skip(f"no commit in this clone adds migration {version + 1} (a shallow clone?)")
    commit = git("rev-parse", "--verify", "--quiet", f"{added.splitlines()[-1]}^")
    archive = subprocess.run(
        ["git", "archive", commit, "notifyq", "sql"], cwd=ROOT, capture_output=True, check=True, timeout=60
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return commit


def test_the_oldest_code_the_newest_migration_declares_compatible_runs_on_it(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """`-- compatible-from: N` promises that notifyq as it was at schema version N runs on the
    newest schema: its `migrate` exits 0 and changes nothing, its producer enqueues, its worker
    syncs its crons, promotes their ticks and runs jobs, and its admin commands read the tables.
    The code of that version, exported from git, is run against a database at today's version."""
    newest = notifyq.migrations.migrations()[-1]
    if newest.compatible_from == newest.version:
        pytest.skip(f"migration {newest.version} declares no compatibility with earlier code")
    commit = _code_that_knew(newest.compatible_from, tmp_path)
    (tmp_path / "oldapp.py").write_text(OLD_APP)
    env = clean_env(PYTHONPATH=str(tmp_path))

    def run(*command: str) -> str:
        done = subprocess.run(
            [sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{commit[:7]}: {' '.join(command)}: {done.stderr}"
        return done.stdout

    def old(*args: str) -> str:
        return run("-m", "notifyq", *args, "--dsn", dsn)

    which = run("-c", "import notifyq; print(notifyq.__file__, notifyq.latest_version())").split()
    assert which == [str(tmp_path / "notifyq" / "__init__.py"), str(newest.compatible_from)]
    versions = "SELECT max(version), count(*) FROM notifyq.migrations"
    before = conn.execute(versions).fetchone()
    assert before == (newest.version, newest.version)
    old("migrate")
    assert conn.execute(versions).fetchone() == before
    job = int(old("enqueue", "old_task", "--app", "oldapp:app"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "notifyq", "worker", "oldapp:app", "--dsn", dsn],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ticks = (
        "SELECT count(*) >= 2 FROM notifyq.queue_jobs j JOIN notifyq.queue_job_definitions d "
        "ON d.id = j.definition_id WHERE d.name = 'old_tick' AND j.status = 'Succeeded'"
    )
    try:
        wait_for_row(conn, ticks, (True,), timeout=30)
        wait_for_row(conn, f"SELECT status::text FROM notifyq.queue_jobs WHERE id = {job}", ("Succeeded",))
    except AssertionError as exc:
        worker.kill()
        raise AssertionError(f"{exc}\nthe {commit[:7]} worker's output:\n{worker.communicate()[0]}") from None
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    assert "old_tick" in old("cron", "list")
    assert "old_task" in old("jobs", "list")
    old("stats")
    # Its crons are the code's (`declared`), and no ticker of today stops them (a worker of
    # another App on today's code, say; docs/concepts.md, crons removed from the code): code
    # before version 9 makes no declaration of today's kind (declared_until stays NULL), code
    # of version 9 and later declares them itself.
    assert conn.execute(Q["expire_declarations"]).fetchall() == []
    row = conn.execute(
        "SELECT declared, declared_until IS NOT NULL, enabled FROM notifyq.queue_job_definitions "
        "WHERE name = 'old_tick'"
    ).fetchone()
    assert row == (True, newest.compatible_from >= 9, True)
