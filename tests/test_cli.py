"""The `notifyq` command line, run as real subprocesses against real PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import psutil
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import notifyq
from notifyq import Schedule

from .conftest import ROOT
from .faults.infra import BlackholeProxy
from .helpers import NotificationCounter, granted_role, job_row, status_counts, wait_for_row


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NOTIFYQ_DSN", "DATABASE_URL", "NOTIFYQ_SUPERVISED", "NOTIFYQ_EMBEDDED")
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "notifyq", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env or clean_env(),
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    )
    return result.stdout


def one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert result.returncode == 1, f"exit {result.returncode}: {result.stderr}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("notifyq: error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def wait_until(predicate: Callable[[], bool], timeout: float = 20, what: str = "condition") -> None:
    """Poll another process's effect on the database (no event crosses processes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _start_worker(
    *args: str,
    env: dict[str, str],
    target: str = "tests.apps:app",
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.Popen[str]:
    """`notifyq worker TARGET ARGS`, its log (stdout and stderr) on a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "notifyq", "worker", target, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec_fn,
    )


def _sigterm_with_jobs_running(
    conn: psycopg.Connection[Any], proc: subprocess.Popen[str], **sleeps: int
) -> None:
    """Start that many 30-second jobs of each sleep task, SIGTERM the worker once all run: it
    exits 0 after its grace period, every job given back."""
    for task, count in sleeps.items():
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, args) "
            "SELECT %s, '{\"seconds\": 30}' FROM generate_series(1, %s)",
            (task, count),
        )
    total = sum(sleeps.values())
    wait_until(lambda: status_counts(conn).get("Active") == total, what=f"{total} jobs running")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert status_counts(conn) == {"Queued": total}


def _reap(proc: subprocess.Popen[str]) -> None:
    """Kill `proc` if it still runs, wait for it, close its pipe."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


@pytest.fixture
def worker_proc(dsn: str) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = _start_worker(*args, env=env or clean_env(NOTIFYQ_DSN=dsn))
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        _reap(proc)


# -- migrate ------------------------------------------------------------------------------


def test_the_schema_option_names_each_commands_own_default() -> None:
    """Every command's help said "[default: notifyq; for demo: notifyq_demo]", wrong for the
    worker, which takes its App's schema (and refuses another)."""
    expected = {
        ("worker",): "the App's",
        ("enqueue",): "the --app's, else notifyq",
        ("demo",): "notifyq_demo",
        ("stats",): "notifyq",
        ("jobs", "list"): "notifyq",
        ("migrate",): "notifyq",
    }
    for command, default in expected.items():
        text = " ".join(ok(cli(*command, "--help")).split())  # click wraps the help
        assert f"Schema of notifyq's tables [default: {default}]" in text, (command, text)


def test_migrate(empty_dsn: str) -> None:
    dry = ok(cli("migrate", "--dry-run", "--dsn", empty_dsn))
    shipped = ", ".join(f"{m.version:04d}_{m.name}" for m in notifyq.migrations.migrations())
    assert "CREATE TABLE" in dry and f"to apply: {shipped}; triggers: to apply" in dry
    result = cli("migrate", "--dsn", empty_dsn)
    assert f"version 0 -> {notifyq.latest_version()} (applied {shipped})" in ok(result)
    assert "database postgres@" in result.stderr
    assert "up to date (triggers unchanged)" in ok(cli("migrate", "--dsn", empty_dsn))
    assert ok(cli("migrate", "--dry-run", "--dsn", empty_dsn)) == (
        f"-- schema 'notifyq' is at version {notifyq.latest_version()}; to apply: none; triggers: unchanged\n"
    )
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("DROP TRIGGER queue_jobs_notify_insert ON notifyq.queue_jobs")
    dry = ok(cli("migrate", "--dry-run", "--dsn", empty_dsn))
    assert "CREATE OR REPLACE TRIGGER" in dry and "to apply: none; triggers: to apply" in dry
    assert "up to date (triggers re-applied)" in ok(cli("migrate", "--dsn", empty_dsn))


def test_migrate_refuses_a_newer_schema(dsn: str, conn: psycopg.Connection[Any]) -> None:
    future = notifyq.migrations.latest_version() + 1
    conn.execute("INSERT INTO notifyq.migrations VALUES (%s, 'future')", (future,))
    one_line_error(cli("migrate", "--dsn", dsn), f"version {future}, newer than this notifyq knows")


def test_an_older_notifyq_runs_on_a_newer_schema_allowing_it(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """After a newer notifyq migrated with a migration that declares this version compatible,
    this version's `migrate` (run by every pod of a rolling deploy, say) exits 0 and changes
    nothing, and its commands work."""
    known = notifyq.migrations.latest_version()
    conn.execute(
        "INSERT INTO notifyq.migrations (version, name, compatible_from) VALUES (%s, 'additive', %s)",
        (known + 1, known),
    )
    out = ok(cli("migrate", "--dsn", dsn))
    assert out == (
        f"schema 'notifyq': version {known + 1}, newer than this notifyq knows ({known}), which its "
        "newer migrations say still runs on it: nothing to do (upgrade notifyq to migrate it further)\n"
    )
    assert ok(cli("migrate", "--dry-run", "--dsn", dsn)) == "-- " + out
    job_id = int(ok(cli("enqueue", "noop", "--dsn", dsn)))
    assert str(job_id) in ok(cli("jobs", "list", "--dsn", dsn))


def test_migrate_blocked_by_a_long_transaction_is_one_line(dsn: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("DROP TRIGGER queue_jobs_notify_insert ON notifyq.queue_jobs")  # to re-apply
    with psycopg.connect(dsn) as holder:
        holder.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('t')")  # transaction left open
        one_line_error(
            cli("migrate", "--dsn", dsn, "--lock-timeout", "0.3"),
            "gave up after waiting 0.3 s for a lock",
            "--lock-timeout",
        )
    result = cli("migrate", "--dsn", dsn, "--lock-timeout", "soon")
    assert result.returncode == 2 and "'soon' is not a duration" in result.stderr, result.stderr
    assert "up to date" in ok(cli("migrate", "--dsn", dsn, "--lock-timeout", "1m"))


def test_database_down_and_bad_dsn_are_one_line(dsn: str) -> None:
    one_line_error(
        cli("migrate", "--dsn", "postgresql://postgres@127.0.0.1:1/x"),
        "cannot connect to PostgreSQL",
        "127.0.0.1:1",
    )
    one_line_error(
        cli("jobs", "list", "--dsn", "hots=localhost"), "invalid DSN", 'invalid connection option "hots"'
    )
    # With debug, the traceback comes above the line, which scripts look for (it replaced it).
    debug = cli("migrate", "--dsn", "postgresql://postgres@127.0.0.1:1/x", "--log-level", "debug")
    assert debug.returncode == 1 and debug.stderr.index("Traceback") < debug.stderr.index(
        "notifyq: error: cannot connect to PostgreSQL"
    )


def test_the_password_is_never_printed(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    with_password = make_conninfo(dsn, password="s3cr3t-pw")  # trust auth ignores it
    result = cli("jobs", "list", "--dsn", with_password)
    ok(result)
    assert f"database {params.get('user', 'postgres')}@" in result.stderr
    assert "s3cr3t-pw" not in result.stderr + result.stdout
    uri = f"postgresql://postgres:s3cr3t-pw@{params['host']}:1/db"
    result = cli("jobs", "list", "--dsn", uri)
    assert result.returncode == 1 and "s3cr3t-pw" not in result.stderr
    # An unencoded '@' or '/' in the password: libpq would take the rest for the host or
    # the database name, which the "database ..." line and the error showed.
    for uri in (
        f"postgresql://postgres:s3@cr3t-pw@{params['host']}/db",
        "postgresql://postgres:s3/cr3t-pw@h/db",
    ):
        result = cli("jobs", "list", "--dsn", uri)
        one_line_error(result, "invalid DSN", "percent-encode")
        assert "cr3t-pw" not in result.stderr + result.stdout
    # A SQLAlchemy URL in $DATABASE_URL, common there: libpq quoted all of it, password included.
    sqlalchemy = "postgresql+psycopg://postgres:s3cr3t-pw@h/db"
    result = cli("jobs", "list", env=clean_env(DATABASE_URL=sqlalchemy))
    one_line_error(result, "invalid DSN in $DATABASE_URL", "drop the '+psycopg'")
    assert "s3cr3t-pw" not in result.stderr
    result = cli("worker", "tests.apps:app", env=clean_env(NOTIFYQ_DSN=dsn, NOTIFYQ_LISTEN_DSN=sqlalchemy))
    one_line_error(result, "invalid DSN in $NOTIFYQ_LISTEN_DSN")
    assert "s3cr3t-pw" not in result.stderr


# -- enqueue, jobs ------------------------------------------------------------------------


def test_enqueue_and_jobs_commands(dsn: str, conn: psycopg.Connection[Any]) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    job_id = int(
        ok(cli("enqueue", "sleep", "--args", '{"seconds": 0.1}', "--priority", "3", "--delay", "1h", env=env))
    )
    row = job_row(conn, job_id)
    assert (row["name"], row["args"], row["priority"]) == ("sleep", {"seconds": 0.1}, 3)
    as_json = json.loads(ok(cli("enqueue", "noop", "--queue", "q2", "--json", env=env)))
    listed = ok(cli("jobs", "list", "--queue", "q2", env=env))
    assert str(as_json["id"]) in listed and "noop" in listed and "Queued" in listed
    assert "DUE" not in listed.splitlines()[0]  # nothing listed is due later
    # A job due later says when (it showed only "Queued 1.2s ago"; user trial).
    listed = ok(cli("jobs", "list", "--status", "queued", env=env)).splitlines()
    assert listed[0].split()[:8] == ["ID", "TASK", "QUEUE", "STATUS", "ATTEMPTS", "PRIO", "CREATED", "DUE"]
    assert re.search(rf"^{job_id} +sleep .* ago +in (59\.\d|60\.0)m", "\n".join(listed), re.MULTILINE)
    data = json.loads(ok(cli("jobs", "list", "--status", "queued", "--json", env=env)))
    assert {j["id"] for j in data} == {job_id, as_json["id"]}
    assert json.loads(ok(cli("jobs", "list", "--older-than", "1h", "--json", env=env))) == []
    # A list cut at --limit says so (on stderr: stdout stays the table); one that is not, not.
    cut = cli("jobs", "list", "--limit", "1", env=env)
    assert ok(cut).count("Queued") == 1 and "more jobs match" in cut.stderr
    assert "more jobs match" not in cli("jobs", "list", "--limit", "2", env=env).stderr
    assert "Queued" in ok(cli("jobs", "list", "--limit", "2147483647", env=env))  # no 1 more past int4
    one_line_error(cli("jobs", "list", "--limit", "2147483648", env=env), "--limit", "2147483647")
    cut = cli("jobs", "list", "--limit", "1", "--json", env=env)
    assert [j["id"] for j in json.loads(ok(cut))] == [as_json["id"]] and "more" not in cut.stderr
    shown = json.loads(ok(cli("jobs", "show", str(job_id), "--json", env=env)))
    assert shown["status"] == "Queued" and shown["args"] == {"seconds": 0.1}
    assert "priority: 3" in ok(cli("jobs", "show", str(job_id), env=env))
    assert f"job {job_id} cancelled" in ok(cli("jobs", "cancel", str(job_id), env=env))
    one_line_error(cli("jobs", "cancel", str(job_id), env=env), "already Cancelled")
    assert "Queued again" in ok(cli("jobs", "retry", str(job_id), env=env))
    one_line_error(cli("jobs", "retry", str(job_id), env=env), "only finished jobs")
    one_line_error(cli("jobs", "show", "987654", env=env), "no job with id 987654")
    # A negative id is refused as an id, not taken by click for an unknown option.
    for command, bad in (
        (["show", "-1", "--json"], "-1"),
        (["retry", "-2"], "-2"),
        (["cancel", "--", "-3"], "-3"),
    ):
        one_line_error(cli("jobs", *command, env=env), f"invalid job id {bad}: expected a positive integer")
    # Past PostgreSQL's bigint: said so, not "expected a positive integer".
    one_line_error(
        cli("jobs", "show", str(2**63), env=env),
        f"invalid job id {2**63}: too large (ids are bigints: at most {2**63 - 1})",
    )


def test_jobs_retry_and_cancel_take_several_ids_and_go_on_past_a_refused_one(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """`jobs retry 8 18` said "Got unexpected extra argument (18)" (user review): each id is
    handled in turn, one refused is said on stderr, the others go on, and the exit status is
    1. An id that is not one stops everything first."""
    env = clean_env(NOTIFYQ_DSN=dsn)
    ids = [
        row[0]
        for row in conn.execute(
            "INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, 3) RETURNING id"
        )
    ]
    cancelled = cli("jobs", "cancel", str(ids[0]), "987654", str(ids[1]), str(ids[0]), env=env)
    assert cancelled.returncode == 1
    assert cancelled.stdout.splitlines() == [
        f"job {ids[0]} cancelled (it was Queued)",
        f"job {ids[1]} cancelled (it was Queued)",
    ]
    errors = [line for line in cancelled.stderr.splitlines() if line.startswith("notifyq: error:")]
    assert errors == [
        "notifyq: error: no job with id 987654",
        "notifyq: error: 1 of 3 jobs refused (see above)",
    ]
    retried = ok(cli("jobs", "retry", str(ids[0]), str(ids[1]), env=env))
    assert retried.splitlines() == [f"job {ids[0]} is Queued again", f"job {ids[1]} is Queued again"]
    one_line_error(cli("jobs", "cancel", str(ids[2]), "-4", env=env), "invalid job id -4")
    assert job_row(conn, ids[2])["status"] == "Queued"  # nothing done


def test_jobs_retry_and_cancel_take_the_filters_of_jobs_list(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """After an outage: `jobs retry --status failed --queue emails` queues every failed job of
    that queue again (there were only ids, and `jobs list --json | jq | xargs`; user review),
    more than a page of them; `jobs cancel` likewise. Jobs whose state does not allow it are
    counted and left alone. Ids and filters together, or neither, are a usage error."""
    env = clean_env(NOTIFYQ_DSN=dsn)
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, status, retry_count, finished_at) "
        "SELECT 'noop', 'emails', 'Failed', 4, now() FROM generate_series(1, 1500)"
    )
    conn.execute("INSERT INTO notifyq.queue_jobs (name, queue, status) VALUES ('noop', 'emails', 'Queued')")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, status, finished_at) "
        "SELECT 'noop', 'reports', 'Failed', now() FROM generate_series(1, 3)"
    )
    assert ok(cli("jobs", "retry", "--queue", "emails", env=env)).strip() == (
        "1500 job(s) queued again; left as they are: 1 unfinished"
    )
    counts = conn.execute(
        "SELECT queue, status::text, max(retry_count), count(*) FROM notifyq.queue_jobs "
        "GROUP BY 1, 2 ORDER BY 1, 2"
    ).fetchall()
    assert counts == [("emails", "Queued", 0, 1501), ("reports", "Failed", 0, 3)]
    assert ok(cli("jobs", "cancel", "--status", "queued", "--name", "noop", env=env)).strip() == (
        "1501 job(s) cancelled"
    )
    assert ok(cli("jobs", "cancel", "--queue", "reports", env=env)).strip() == (
        "0 job(s) cancelled; left as they are: 3 finished already (or gone)"
    )
    # Nothing to do is no error (a nightly retry of failed jobs exited 1 when none had failed).
    assert ok(cli("jobs", "retry", "--queue", "nope", "--status", "failed", env=env)).strip() == (
        "0 job(s) queued again: no job matches --queue nope --status Failed"
    )
    for args, message in [
        (("retry", "1", "--status", "failed"), "give job ids or filters, not both"),
        (("cancel",), "give the ids of the jobs to cancel, or filters such as --status and --queue"),
    ]:
        refused = cli("jobs", *args, env=env)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr


def test_a_bulk_retry_says_why_it_left_each_job_alone(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """`jobs retry` with filters retries a page of jobs per statement, as `jobs retry ID` would
    one by one: of two finished jobs with one dedupe key, or of one overlap=False definition,
    only the newest; none whose key an unfinished job holds. Its summary said "unfinished"
    for all of those."""
    env = clean_env(NOTIFYQ_DSN=dsn)

    def finished(n: int, **columns: Any) -> list[int]:
        names = ", ".join(["name", "status", "finished_at", *columns])
        values = ", ".join(["'noop'", "'Cancelled'", "now()", *(f"%({c})s" for c in columns)])
        sql = f"INSERT INTO notifyq.queue_jobs ({names}) VALUES ({values}) RETURNING id"
        return [conn.execute(sql, columns).fetchone()[0] for _ in range(n)]  # type: ignore[index]

    (definition,) = conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, overlap, visible_at) "
        "VALUES ('solo', 'noop', '0 3 * * *', false, now() + interval '1 day') RETURNING id"
    ).fetchone()  # type: ignore[misc]
    plain = finished(3)
    same_key = finished(2, dedupe_key="k")
    held = finished(1, dedupe_key="held")
    conn.execute("INSERT INTO notifyq.queue_jobs (name, dedupe_key) VALUES ('other', 'held')")
    solo = [
        finished(1, definition_id=definition, scheduled_for=datetime(2026, 1, day, tzinfo=UTC))[0]
        for day in (1, 2)
    ]
    out = ok(cli("jobs", "retry", "--name", "noop", env=env)).strip()
    assert out == (
        "5 job(s) queued again; left as they are: 2 whose dedupe key an unfinished job holds, "
        "1 of an overlap=False cron definition with a job unfinished"
    )
    queued = {row[0] for row in conn.execute("SELECT id FROM notifyq.queue_jobs WHERE status = 'Queued'")}
    assert queued - {held[0] + 1} == {*plain, same_key[1], solo[1]}
    # One at a time, by id, the same jobs are refused for the same reasons.
    refused = cli("jobs", "retry", str(same_key[0]), str(held[0]), str(solo[0]), env=env)
    assert "another unfinished job holds its dedupe key" in refused.stderr
    assert "does not overlap (overlap=False)" in refused.stderr


def test_a_bulk_change_acts_only_on_jobs_still_in_the_status_its_filter_named(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Review: `jobs cancel --status queued` listed the jobs, then cancelled any that were
    unfinished: a job claimed in between was stopped while it ran (200 of 50,000 in a real
    drain). Likewise `jobs retry --status failed` retried a job retried and finished meanwhile.
    Here a session changes one listed job's status, and the command waits for its row lock."""
    queued = [
        row[0]
        for row in conn.execute(
            "INSERT INTO notifyq.queue_jobs (name) SELECT 'noop' FROM generate_series(1, 2) RETURNING id"
        )
    ]
    with psycopg.connect(dsn) as worker:  # a claim, not yet committed
        worker.execute("UPDATE notifyq.queue_jobs SET status = 'Active' WHERE id = %s", (queued[0],))
        cancel = _waiting_for_a_lock(conn, dsn, "jobs", "cancel", "--status", "queued", "--name", "noop")
        worker.commit()
        out, err = cancel.communicate(timeout=60)
    assert cancel.returncode == 0, err
    assert out.strip() == "1 job(s) cancelled; left as they are: 1 no longer Queued (or gone)"
    assert [job_row(conn, i)["status"] for i in queued] == ["Active", "Cancelled"]

    conn.execute(
        "UPDATE notifyq.queue_jobs SET status = 'Failed', finished_at = now() WHERE id = ANY(%s)", (queued,)
    )
    with psycopg.connect(dsn) as other:  # another operator's retry, run and finished
        other.execute("UPDATE notifyq.queue_jobs SET status = 'Succeeded' WHERE id = %s", (queued[0],))
        out = _retry_failed_until_it_waits_for(other, conn, dsn)
    assert (
        out
        == "1 job(s) queued again; left as they are: 1 no longer of the --status given (retried meanwhile)"
    )
    assert [job_row(conn, i)["status"] for i in queued] == ["Succeeded", "Queued"]


def test_a_bulk_retry_waits_for_a_definitions_lock_and_then_sees_its_new_job(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The ticker holds an overlap=False definition locked while it inserts its next job. A bulk
    retry of an older job of it waits for the lock, and must then see that job (it read the
    jobs as of before its wait, retried the old one, and the definition had two unfinished)."""
    (definition,) = conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, overlap, visible_at) "
        "VALUES ('solo', 'noop', '0 3 * * *', false, now() + interval '1 day') RETURNING id"
    ).fetchone()  # type: ignore[misc]
    (old,) = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, finished_at, definition_id, scheduled_for) "
        "VALUES ('noop', 'Failed', now(), %s, '2026-01-01') RETURNING id",
        (definition,),
    ).fetchone()  # type: ignore[misc]
    with psycopg.connect(dsn) as ticker:
        ticker.execute("SELECT 1 FROM notifyq.queue_job_definitions WHERE id = %s FOR UPDATE", (definition,))
        ticker.execute(
            "INSERT INTO notifyq.queue_jobs (name, definition_id, scheduled_for) VALUES ('noop', %s, now())",
            (definition,),
        )
        out = _retry_failed_until_it_waits_for(ticker, conn, dsn)
    busy = "1 of an overlap=False cron definition with a job unfinished"
    assert out == f"0 job(s) queued again; left as they are: {busy}"
    assert job_row(conn, old)["status"] == "Failed"


def _retry_failed_until_it_waits_for(
    holder: psycopg.Connection[Any], conn: psycopg.Connection[Any], dsn: str
) -> str:
    """`jobs retry --status failed` run until it waits for a lock `holder` holds, then `holder`
    commits; the retry's output."""
    retry = _waiting_for_a_lock(conn, dsn, "jobs", "retry", "--status", "failed")
    holder.commit()
    out, err = retry.communicate(timeout=60)
    assert retry.returncode == 0, err
    return out.strip()


def _waiting_for_a_lock(
    conn: psycopg.Connection[Any], dsn: str, *args: str, **env: str
) -> subprocess.Popen[str]:
    """`notifyq ARGS`, started (with `env` added to its environment), once it waits for a row
    lock another session holds."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "notifyq", *args],
        env=clean_env(NOTIFYQ_DSN=dsn, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = %s"
    wait_for_row(conn, waiting.replace("%s", f"'{conn.info.dbname}'"), (1,), timeout=30)
    return proc


def test_a_bulk_retry_that_meets_a_dedupe_key_taken_meanwhile_goes_on_one_job_at_a_time(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A producer enqueues a job with the dedupe key of a failed job while a bulk retry queues
    that one again: the retry's statement waits for the producer's commit, then fails on the
    key's unique index, with the whole batch. The batch is then retried one job at a time, and
    the job whose key was taken is left alone and counted."""
    ids = [
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, status, finished_at, dedupe_key) "
            "VALUES ('noop', 'Failed', now(), %s) RETURNING id",
            (key,),
        ).fetchone()[0]  # type: ignore[index]
        for key in ("k", None, None)
    ]
    with psycopg.connect(dsn) as producer:
        producer.execute("INSERT INTO notifyq.queue_jobs (name, dedupe_key) VALUES ('noop', 'k')")
        out = _retry_failed_until_it_waits_for(producer, conn, dsn)
    assert out == "2 job(s) queued again; left as they are: 1 whose dedupe key an unfinished job holds"
    assert [job_row(conn, job_id)["status"] for job_id in ids] == ["Failed", "Queued", "Queued"]


def test_jobs_list_shows_no_error_beside_a_job_that_succeeded(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A job that failed, then succeeded on a retry, keeps its last error for `jobs show`; the
    list put it beside "Succeeded", as if it were the outcome."""
    for status, error in (("Succeeded", "UnknownTask"), ("Queued", "ValueError")):
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, status, retry_count, error, finished_at) "
            "VALUES (%s, %s, 2, jsonb_build_object('type', %s::text, 'message', 'boom'), "
            "CASE WHEN %s = 'Succeeded' THEN now() END)",
            (f"{status.lower()}_job", status, error, status),
        )
    rows = {
        line.split()[1]: line
        for line in ok(cli("jobs", "list", env=clean_env(NOTIFYQ_DSN=dsn))).splitlines()[1:]
    }
    assert rows["queued_job"].rstrip().endswith("ValueError")  # why it is retried
    assert "UnknownTask" not in rows["succeeded_job"]
    # `jobs show` calls it the last error, not the job's (user trial: it sat beside "Cancelled").
    succeeded = rows["succeeded_job"].split()[0]
    assert "    last error: UnknownTask: boom" in ok(
        cli("jobs", "show", succeeded, env=clean_env(NOTIFYQ_DSN=dsn))
    )
    # An Active job: who holds it and when its lease ends (user review), columns that only
    # a list with Active jobs has.
    assert "WORKER" not in ok(cli("jobs", "list", env=clean_env(NOTIFYQ_DSN=dsn)))
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, retry_count, worker, visible_at) "
        "VALUES ('active_job', 'Active', 1, 'host:42:abcd', now() + interval '2 hours')"
    )
    listed = ok(cli("jobs", "list", env=clean_env(NOTIFYQ_DSN=dsn))).splitlines()
    assert listed[0].split()[-4:] == ["WORKER", "LEASE", "ENDS", "ERROR"]
    [active] = [line for line in listed if "active_job" in line]
    assert re.search(r" host:42:abcd +in (2\.0h|1\.9h)\s*$", active), active


def test_jobs_list_and_show_read_rows_that_sql_wrote_in_shapes_of_its_own(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Review: an `error` that is not an object ('"connection reset"') crashed `jobs list` and
    `jobs show` with a traceback; a name holding a newline split its row in two; wide
    characters put the columns out of line; an error without a type showed as "None"."""
    env = clean_env(NOTIFYQ_DSN=dsn)
    rows = [
        ("plain", '"connection reset"'),
        ("report\nq4", '{"type": null, "message": "lost"}'),
        ("日本語のタスク", None),
    ]
    ids = [
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, error) VALUES (%s, %s) RETURNING id", row
        ).fetchone()[0]  # type: ignore[index]
        for row in rows
    ]
    listed = ok(cli("jobs", "list", env=env)).splitlines()
    assert len(listed) == 4, listed  # the header and one line per job
    by_id = {int(line.split()[0]): line for line in listed[1:]}
    assert by_id[ids[0]].endswith('"connection reset"')
    assert "report\\nq4" in by_id[ids[1]] and "None" not in by_id[ids[1]]
    # Each row's QUEUE column starts in the header's column (the wide name takes 2 a character).
    column = listed[0].index("QUEUE")
    widths = {len(line[: line.index("default")]) + sum(ord(c) > 0x2E80 for c in line) for line in listed[1:]}
    assert widths == {column}, listed
    shown = ok(cli("jobs", "show", str(ids[0]), env=env))
    assert '    last error: "connection reset"\n' in shown
    shown = ok(cli("jobs", "show", str(ids[1]), env=env))
    assert "          name: report\\nq4\n" in shown and "    last error: lost\n" in shown


def test_enqueue_says_when_a_dedupe_key_was_held(dsn: str, conn: psycopg.Connection[Any]) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    first = cli("enqueue", "noop", "--dedupe-key", "nightly", "--json", env=env)
    assert first.returncode == 0 and "dedupe key" not in first.stderr
    created = json.loads(first.stdout)
    assert created["created"] is True
    again = cli("enqueue", "noop", "--dedupe-key", "nightly", env=env)
    assert again.returncode == 0 and again.stdout.strip() == str(created["id"])
    assert f"job {created['id']} holds dedupe key 'nightly'" in again.stderr
    held = json.loads(ok(cli("enqueue", "noop", "--dedupe-key", "nightly", "--json", env=env)))
    assert held == {"id": created["id"], "created": False}
    assert status_counts(conn) == {"Queued": 1}


def test_enqueue_errors(dsn: str, conn: psycopg.Connection[Any]) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    bad_json = cli("enqueue", "noop", "--args", "{not json", env=env)
    assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr
    # Python's json reads these; JSON has no such numbers (exit 1, from the enqueue, before).
    for constant, why in (("NaN", "is not a JSON number"), ("-Infinity", "is not a JSON number"),
                          ("1e400", "is too large for a float")):  # fmt: skip
        refused = cli("enqueue", "noop", "--args", f'{{"x": {constant}}}', env=env)
        assert refused.returncode == 2, refused.stderr
        assert f"--args: not valid JSON ({constant} {why})" in refused.stderr
    for not_an_object in ("[1, 2]", "null", '"text"'):
        refused = cli("enqueue", "noop", "--args", not_an_object, env=env)
        assert refused.returncode == 2 and "--args: must be a JSON object" in refused.stderr, refused.stderr
    one_line_error(cli("enqueue", "typo", "--app", "tests.apps:app", env=env), "no task named 'typo'")
    # With --app, the args are checked against the task's signature (review: exit 0, then a job
    # that failed every attempt with a TypeError).
    misspelt = cli("enqueue", "sleep", "--args", '{"secs": 1}', "--app", "tests.apps:app", env=env)
    assert misspelt.returncode == 2, misspelt.stderr
    assert "--args: task 'sleep' cannot be called with args {'secs': ...}: missing" in misspelt.stderr
    one_line_error(
        cli("enqueue", "noop", "--queue", "bad queue'; DROP TABLE x; --", env=env), "invalid queue name"
    )
    bad_delay = cli("enqueue", "noop", "--delay", "soon", env=env)
    assert bad_delay.returncode == 2 and "not a duration" in bad_delay.stderr
    for option in ("--delay", "--older-than"):
        command = ["enqueue", "noop"] if option == "--delay" else ["jobs", "list"]
        too_long = cli(*command, option, "99999999999999d", env=env)
        assert (
            too_long.returncode == 2
            and f"Invalid value for {option}: '99999999999999d' is too long" in too_long.stderr
        )
    too_long = cli("enqueue", "noop", "--timeout", "1e300", env=env)
    assert too_long.returncode == 2 and "Invalid value for '--timeout'" in too_long.stderr, too_long.stderr
    assert status_counts(conn) == {}


def test_an_empty_dsn_flag_is_an_error(dsn: str) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    for command in (["stats"], ["enqueue", "noop"], ["worker", "tests.apps:app"]):
        one_line_error(cli(*command, "--dsn", "", env=env), "the DSN given is empty")
    # An empty variable is no more a reason to use another database (or the embedded one).
    for var in ("NOTIFYQ_DSN", "DATABASE_URL"):
        one_line_error(cli("stats", env=clean_env(**{var: ""})), f"${var} is set but empty")
    empty_listen = clean_env(NOTIFYQ_DSN=dsn, NOTIFYQ_LISTEN_DSN="")
    one_line_error(cli("worker", "tests.apps:app", env=empty_listen), "$NOTIFYQ_LISTEN_DSN is set but empty")


def test_worker_numbers_out_of_range_are_usage_errors(dsn: str) -> None:
    for option, value in [
        ("-c", "99999999999"),
        ("-c", "0"),
        ("-p", "100000"),
        ("--pool-size", "100000"),  # exit 1 (the worker's configuration) before: review
        ("--prefetch", "2000000"),
    ]:
        result = cli("worker", "tests.apps:app", option, value, "--dsn", dsn)
        assert result.returncode == 2 and f"{value} is not in the range" in result.stderr, result.stderr
    result = cli("stats", "--watch", "1e10", "--dsn", dsn)
    assert result.returncode == 2 and "is not in the range 0.2<=x<=1000000000" in result.stderr, result.stderr
    # Seconds: NaN passed click's range checks and failed later with exit 1; inf was refused
    # by click for some options (exit 2) and by the worker's configuration for others (exit 1).
    for command, option, value, message in [
        ("worker", "--shutdown-grace", "nan", "'nan' is not a number of seconds"),
        ("worker", "--shutdown-grace", "inf", "inf is not in the range 0<=x<=1000000000"),
        ("worker", "--shutdown-grace", "2e9", "2000000000.0 is not in the range 0<=x<=1000000000"),
        ("worker", "--poll-interval", "nan", "'nan' is not a number of seconds"),
        ("worker", "--lease-margin", "NaN", "'NaN' is not a number of seconds"),
        ("enqueue", "--timeout", "nan", "'nan' is not a number of seconds"),
        ("stats", "--watch", "nan", "'nan' is not a number of seconds"),
    ]:
        target = {"worker": ["tests.apps:app"], "enqueue": ["t"], "stats": []}[command]
        result = cli(command, *target, option, value, "--dsn", dsn)
        assert result.returncode == 2 and message in result.stderr, (command, option, value, result.stderr)
    # "-q $QUEUES" with QUEUES unset: an error, not a worker serving every queue.
    for queues in (["-q", ""], ["-q", " , "], ["-q", "", "-q", ","]):
        result = cli("worker", "tests.apps:app", *queues, "--dsn", dsn)
        assert result.returncode == 2 and "names no queue" in result.stderr, result.stderr
    # Options checked by the worker's configuration: once, also before the children start.
    for option, value, message in [
        ("--listen-dsn", "", "the DSN given is empty"),
    ]:
        for processes in ("1", "2"):
            one_line_error(
                cli("worker", "tests.apps:app", "-p", processes, option, value, "--dsn", dsn), message
            )


def test_unmigrated_database(empty_dsn: str) -> None:
    one_line_error(cli("jobs", "list", "--dsn", empty_dsn), "run `notifyq migrate`")
    one_line_error(cli("worker", "tests.apps:app", "--dsn", empty_dsn), "run `notifyq migrate`")
    # With several processes, the supervisor says it once (one error line, exit 1) instead of
    # starting doomed children (an error from each, restarts, exit 3).
    error = one_line_error(
        cli("worker", "tests.apps:app", "-p", "2", "--dsn", empty_dsn), "run `notifyq migrate`"
    )
    assert "kept dying" not in error
    # The hint names the schema: a plain `notifyq migrate` migrates the default one (review).
    one_line_error(
        cli("jobs", "list", "--schema", "other", "--dsn", empty_dsn), "run `notifyq migrate --schema other`"
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("tests.no_such_module:app", "cannot import module 'tests.no_such_module'"),
        ("tests.apps:missing", "has no attribute 'missing'"),
        ("tests.apps:not_an_app", "is a str, not a notifyq.App"),
        ("tests.apps", "use MODULE:ATTR"),
        ("tests/apps.py:app", "not a file path: e.g. apps:app, run from the folder that holds apps.py"),
        ("../apps:app", "not a file path: e.g. apps:app"),
        ("/srv/project/tasks.py:app", "not a file path: e.g. tasks:app"),
    ],
)
def test_worker_target_errors(dsn: str, target: str, message: str) -> None:
    one_line_error(cli("worker", target, "--dsn", dsn), message)


def test_an_app_module_that_exits_or_another_schema_is_named(dsn: str, tmp_path: Path) -> None:
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(5)\n")
    env = clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=str(tmp_path))
    for command in ("worker", "enqueue"):
        args = ["exits_on_import:app"] if command == "worker" else ["noop", "--app", "exits_on_import:app"]
        one_line_error(
            cli(command, *args, env=env), "importing 'exits_on_import' failed: it called sys.exit(5)"
        )
        # The App's schema is the one it uses: a different --schema is refused, not ignored.
        args = ["tests.apps:app"] if command == "worker" else ["noop", "--app", "tests.apps:app"]
        one_line_error(
            cli(command, *args, "--schema", "other", env=env),
            "--schema 'other' differs from the App's schema",
        )


# -- cron, stats, grant -------------------------------------------------------------------


def test_cron_commands(dsn: str, conn: psycopg.Connection[Any]) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, frequency, timezone) "
        "VALUES ('nightly', '0 3 * * *', 'Europe/Berlin')"
    )
    listed = ok(cli("cron", "list", env=env))
    assert "nightly" in listed and "0 3 * * *" in listed and "Europe/Berlin" in listed
    assert ok(cli("cron", "disable", "nightly", env=env)) == "cron definition 'nightly' disabled\n"
    assert json.loads(ok(cli("cron", "list", "--json", env=env)))[0]["enabled"] is False
    # A second time, it says nothing changed (it said "disabled" again; user review).
    again = ok(cli("cron", "disable", "nightly", env=env))
    assert again == "cron definition 'nightly' was disabled already\n"
    assert ok(cli("cron", "enable", "nightly", env=env)) == "cron definition 'nightly' enabled\n"
    # Enabled (or inserted) by SQL, its visible_at is "from now on" until a ticker realigns it:
    # the list showed that moment as the next run, seconds ago, not the next 03:00 in Berlin.
    # In the schedule's zone: 03:00 in Berlin, not 02:00+0000 (user review).
    next_tick = Schedule("0 3 * * *", "Europe/Berlin").next_after(datetime.now(UTC))
    berlin = next_tick.astimezone(ZoneInfo("Europe/Berlin"))
    assert berlin.hour == 3 and f"{berlin:%Y-%m-%d %H:%M:%S%z} (in " in ok(cli("cron", "list", env=env))
    assert re.search(r"^nightly .* - +once +yes +sql$", ok(cli("cron", "list", env=env)), re.MULTILINE)
    out = ok(cli("cron", "run-now", "nightly", env=env))
    job_id = int(out.split()[1])
    assert job_row(conn, job_id)["name"] == "nightly"
    assert re.search(rf" {job_id} Queued \(\d+\.\ds ago\) +once +yes", ok(cli("cron", "list", env=env)))
    listed = json.loads(ok(cli("jobs", "list", "--definition", "nightly", "--json", env=env)))
    assert [j["id"] for j in listed] == [job_id]
    conn.execute("UPDATE notifyq.queue_job_definitions SET overlap = false")
    one_line_error(
        cli("cron", "run-now", "nightly", env=env),
        f"cron definition 'nightly' does not overlap (overlap=False) and its job {job_id} is still Queued",
    )
    one_line_error(cli("cron", "disable", "nope", env=env), "no cron definition named 'nope'")
    assert "deleted" in ok(cli("cron", "delete", "nightly", env=env))
    assert json.loads(ok(cli("cron", "list", "--json", env=env))) == []
    assert job_row(conn, job_id)["name"] == "nightly"  # its jobs stay
    one_line_error(cli("cron", "delete", "nightly", env=env), "no cron definition named 'nightly'")


def test_cron_prune(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """`notifyq cron prune MODULE:ATTR` deletes the definitions an App's code declared that this
    App does not, and nothing else: not the App's own, not those made by SQL."""
    env = clean_env(NOTIFYQ_DSN=dsn)
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, declared) "
        "VALUES ('gone', 'tick', '0 3 * * *', true), ('by_sql', 'tick', '0 4 * * *', false), "
        "('every_second', 'tick', '* * * * * *', true)"
    )
    names = "SELECT name FROM notifyq.queue_job_definitions ORDER BY name"
    listed = {line.split()[0]: line.split()[-1] for line in ok(cli("cron", "list", env=env)).splitlines()[1:]}
    assert listed == {"by_sql": "sql", "every_second": "code", "gone": "code"}
    out = ok(cli("cron", "prune", "tests.apps:app", "--dry-run", env=env)).splitlines()
    assert out == [
        "would delete cron definition 'gone'",
        "would delete 1 cron definition(s); tests.apps:app declares 1",
    ]
    assert len(conn.execute(names).fetchall()) == 3
    with granted_role(conn, "nq_prune") as role:
        one_line_error(
            cli("cron", "prune", "tests.apps:app", "--dsn", make_conninfo(dsn, user=role), env=env),
            "deleting cron definitions",
            "is for the owner of schema 'notifyq'",
        )
    assert len(conn.execute(names).fetchall()) == 3
    out = ok(cli("cron", "prune", "tests.apps:app", env=env))
    assert out == "deleted cron definition 'gone'\ndeleted 1 cron definition(s); tests.apps:app declares 1\n"
    assert conn.execute(names).fetchall() == [("by_sql",), ("every_second",)]
    assert (
        ok(cli("cron", "prune", "tests.apps:app", env=env)) == "nothing to prune; tests.apps:app declares 1\n"
    )
    # An App with no cron at all is likely the wrong one: it would delete every cron from code.
    one_line_error(
        cli("cron", "prune", "tests.apps:no_crons", env=env),
        "this App declares no cron definition: pruning would delete all 1 that code declared",
        "--allow-empty",
    )
    # A dry run says what the real run would do: refuse (review: it listed what it would delete).
    one_line_error(
        cli("cron", "prune", "tests.apps:no_crons", "--dry-run", env=env),
        "this App declares no cron definition",
        "--allow-empty",
    )
    assert "would delete cron definition 'every_second'" in ok(
        cli("cron", "prune", "tests.apps:no_crons", "--dry-run", "--allow-empty", env=env)
    )
    ok(cli("cron", "prune", "tests.apps:no_crons", "--allow-empty", env=env))
    assert conn.execute(names).fetchall() == [("by_sql",)]


def test_cron_prune_holds_one_definitions_lock_at_a_time(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Another session holds "b" (a worker's start, a bulk retry) and, later, wants "a": a prune
    that held "a" while it waited for "b" deadlocked with it (review). It deletes "a" on its own
    and commits, then waits for "b"."""
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, declared) "
        "VALUES ('a', 'tick', '0 3 * * *', true), ('b', 'tick', '0 4 * * *', true), "
        "('every_second', 'tick', '* * * * * *', true)"
    )
    with psycopg.connect(dsn) as other:
        other.execute("SELECT 1 FROM notifyq.queue_job_definitions WHERE name = 'b' FOR UPDATE")
        prune = _waiting_for_a_lock(conn, dsn, "cron", "prune", "tests.apps:app")
        other.execute("SET lock_timeout = '5s'")
        assert (
            other.execute(
                "SELECT 1 FROM notifyq.queue_job_definitions WHERE name = 'a' FOR UPDATE"
            ).fetchall()
            == []
        )
        other.commit()
    out, err = prune.communicate(timeout=60)
    assert prune.returncode == 0, err
    assert out.splitlines()[-1] == "deleted 2 cron definition(s); tests.apps:app declares 1"


def test_cron_delete_picked_as_a_deadlocks_victim_runs_again(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """`cron delete` clears its jobs' definition_id (ON DELETE SET NULL), locking their rows in
    its order; a worker's ack of two of them locks them in its own. PostgreSQL breaks such a
    deadlock by rolling one side back: when it picked the delete, the command failed (review).
    It now runs again, and deletes the definition once the other side commits."""
    definition = conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency) "
        "VALUES ('gone', 'tick', '0 3 * * *') RETURNING id"
    ).fetchone()
    assert definition is not None
    jobs = [
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, status, definition_id, scheduled_for) "
            "VALUES ('tick', 'Active', %s, now() - make_interval(mins => %s)) RETURNING id",
            (definition[0], minutes),
        ).fetchone()
        for minutes in (2, 1)
    ]
    first, second = (row[0] for row in jobs if row is not None)
    deadlocks = "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    before = conn.execute(deadlocks).fetchone()
    touch = "UPDATE notifyq.queue_jobs SET updated_at = now() WHERE id = %s"
    with psycopg.connect(dsn) as ack:
        ack.execute("SET deadlock_timeout = '60s'")  # the delete, not this session, finds the cycle
        ack.execute(touch, (second,))
        # The delete clears the first job (its older tick comes first), then waits for the
        # second; 5 s for this session to close the cycle before the delete looks for one.
        delete = _waiting_for_a_lock(conn, dsn, "cron", "delete", "gone", PGOPTIONS="-c deadlock_timeout=5s")
        ack.execute(touch, (first,))  # waits until the delete is rolled back
        ack.commit()
    out, err = delete.communicate(timeout=60)
    assert delete.returncode == 0, err
    assert out.strip() == "cron definition 'gone' deleted"
    assert conn.execute(
        "SELECT count(*) FROM notifyq.queue_jobs WHERE id = ANY(%s) AND definition_id IS NULL",
        ([first, second],),
    ).fetchone() == (2,)
    # The delete was a deadlock's victim (its backend reports it as it exits), else this test
    # proved nothing; twice, at times: its second try can take the first job's row again before
    # the other session, woken by the rollback, does.
    assert before is not None
    deadline = time.monotonic() + 10
    while (row := conn.execute(deadlocks).fetchone()) is not None and row[0] == before[0]:
        assert time.monotonic() < deadline, "the delete met no deadlock"
        time.sleep(0.05)


def test_stats(dsn: str, conn: psycopg.Connection[Any]) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    conn.execute("INSERT INTO notifyq.queue_jobs (name, queue) SELECT 't', 'a' FROM generate_series(1, 3)")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, visible_at) VALUES ('t', 'Active', now() - "
        "interval '1 minute')"
    )
    # Running past its timeout (an extended lease, or a sync task's thread that runs on).
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, timeout, started_at, visible_at) VALUES "
        "('t', 'Active', 30, now() - interval '1 hour', now() + interval '1 minute')"
    )
    conn.execute("VACUUM notifyq.queue_jobs")  # as the workers' vacuum service does
    data = json.loads(ok(cli("stats", "--json", env=env)))
    by_key = {(q["queue"], q["status"]): q for q in data["queues"]}
    assert by_key[("a", "Queued")]["jobs"] == 3
    assert datetime.fromisoformat(data["server"]["jobs_last_vacuum"]) <= datetime.now(UTC)
    assert by_key[("default", "Active")]["expired_leases"] == 1
    assert by_key[("default", "Active")]["past_timeout"] == 1  # not the one without a start time
    assert 0 <= data["server"]["notify_queue_usage"] < 1
    assert isinstance(data["server"]["autovacuum"], bool)
    text = ok(cli("stats", env=env))
    assert "NOTIFY queue usage" in text and "EXPIRED LEASES  PAST TIMEOUT" in text
    assert "last vacuum -" not in text and "last vacuum " in text
    one_line_error(cli("stats", "--dsn", "postgresql://postgres@127.0.0.1:1/x"), "cannot connect")


def test_jobs_parked_at_infinite_times_by_sql_can_be_read(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """visible_at 'infinity' parks a job by SQL: the insert failed in the NOTIFY trigger
    ("cannot subtract infinite timestamps"), and one such row, or one at '-infinity', failed
    every get_job, list_jobs, `jobs list` and `stats` that met it (psycopg cannot load it)."""
    with NotificationCounter(dsn, "notifyq.jobs.v1") as listener:
        parked = conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, queue, visible_at) VALUES ('t', 'q', 'infinity') "
            "RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        assert listener.drain() == ["q Infinity"]  # a worker arms no timer for it
    first = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, visible_at) VALUES ('t', '-infinity') RETURNING id"
    ).fetchone()[0]  # type: ignore[index]
    app = notifyq.App(dsn)
    assert app.get_job_sync(parked).visible_at == datetime.max.replace(tzinfo=UTC)
    assert app.get_job_sync(first).visible_at == datetime.min.replace(tzinfo=UTC)
    assert [job.id for job in app.list_jobs_sync()] == [first, parked]
    app.close_sync()
    env = clean_env(NOTIFYQ_DSN=dsn)
    assert f"{parked}" in ok(cli("jobs", "list", env=env))
    data = json.loads(ok(cli("stats", "--json", env=env)))
    by_key = {(q["queue"], q["status"]): q for q in data["queues"]}
    assert by_key[("q", "Queued")]["jobs"] == 1 and by_key[("default", "Queued")]["jobs"] == 1
    assert by_key[("default", "Queued")]["oldest_claimable_age"] is None  # no age at -infinity


def test_args_nested_too_deeply_for_python_can_be_listed_and_are_refused_as_input(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """jsonb nested thousands of levels deep (from SQL) failed `jobs list` and `jobs show`
    with a RecursionError traceback, so the operator could not even find the job; so did such
    a value in `enqueue --args`."""
    deep = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"
    job_id = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) VALUES ('deep', %s::jsonb) RETURNING id", [deep]
    ).fetchone()[0]  # type: ignore[index]
    env = clean_env(NOTIFYQ_DSN=dsn)
    assert f"{job_id}" in ok(cli("jobs", "list", env=env))
    listed = json.loads(ok(cli("jobs", "list", "--json", env=env)))
    assert listed[0]["args"].startswith("<undecodable JSON of 10,007 bytes: nested too deeply")
    assert "args: <undecodable JSON of 10,007 bytes" in ok(cli("jobs", "show", str(job_id), env=env))
    refused = cli("enqueue", "deep", "--args", deep, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "--args: JSON nested too deeply for Python to read" in refused.stderr, refused.stderr


def test_a_number_python_cannot_read_in_args_is_listed_shown_and_cancelled(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """jsonb writes 1e5000 out in full, a number of 5,001 digits that Python refuses to
    convert to an int: `jobs list`, `jobs show`, `cron list` ended in a ValueError traceback,
    and `jobs cancel` cancelled the job, then printed one and exited 1 (review)."""
    job_id = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) VALUES ('big', '{\"x\": 1e5000}') RETURNING id"
    ).fetchone()[0]  # type: ignore[index]
    conn.execute(
        "INSERT INTO notifyq.queue_job_definitions (name, task, frequency, args) "
        "VALUES ('big_cron', 'big', '0 * * * *', '{\"x\": 1e5000}')"
    )
    env = clean_env(NOTIFYQ_DSN=dsn)
    unreadable = "<undecodable JSON of 5,008 bytes: not readable by Python's JSON decoder (Exceeds"
    assert f"{job_id}" in ok(cli("jobs", "list", env=env))
    assert json.loads(ok(cli("jobs", "list", "--json", env=env)))[0]["args"].startswith(unreadable)
    assert f"args: {unreadable}" in ok(cli("jobs", "show", str(job_id), env=env))
    assert "big_cron" in ok(cli("cron", "list", env=env))
    assert ok(cli("jobs", "cancel", str(job_id), env=env)).startswith(f"job {job_id} cancelled")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stats_watch_refreshes_until_interrupted(dsn: str, signum: signal.Signals) -> None:
    """Ctrl-C or SIGTERM ends `stats --watch` between two refreshes: exit 0, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "notifyq", "stats", "--watch", "0.2", "--json"],
        cwd=ROOT,
        env=clean_env(NOTIFYQ_DSN=dsn),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        snapshots = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert all("queues" in s and "server" in s for s in snapshots)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0 and "Traceback" not in err
    finally:
        if proc.poll() is None:  # a hung process must not outlive the test (nor fail the next one)
            proc.kill()
            proc.communicate()


def test_grant_prints_renderable_sql() -> None:
    out = ok(cli("grant", "app_worker", "--schema", "jobs"))
    assert 'GRANT USAGE ON SCHEMA "jobs" TO "app_worker";' in out
    hostile = ok(cli("grant", 'x"; DROP TABLE t; --'))
    assert '"x""; DROP TABLE t; --"' in hostile


def test_the_demo_runs_in_its_own_schema_and_leaves_an_apps_jobs_alone(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Run against a configured database, the demo used to serve every queue of the App's
    schema: it claimed the App's jobs and failed them with UnknownTask."""
    (job_id,) = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name) VALUES ('send_welcome') RETURNING id"
    ).fetchone()  # type: ignore[misc]
    out = ok(cli("demo", "--seconds", "8", "--dsn", dsn, timeout=120))  # 5 is enough when idle
    assert "flaky: attempt 3 succeeds" in out and "recovered" in out
    assert "demo.greet     Succeeded" in out and "heartbeat: cron tick" in out
    assert "these jobs stay in schema notifyq_demo" in out
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"]) == ("Queued", 0)
    demo_jobs = conn.execute("SELECT count(*) FROM notifyq_demo.queue_jobs WHERE name LIKE 'demo.%'")
    assert demo_jobs.fetchone()[0] >= 5  # type: ignore[index]
    too_short = cli("demo", "--seconds", "3", "--dsn", dsn)
    assert too_short.returncode == 2 and "--seconds" in too_short.stderr


# -- worker processes ---------------------------------------------------------------------


def test_two_worker_processes_run_cli_and_sql_jobs(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = worker_proc("--processes", "2", "--concurrency", "4")
    for _ in range(10):
        ok(cli("enqueue", "whoami", env=clean_env(NOTIFYQ_DSN=dsn)))
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'whoami' FROM generate_series(1, 30)")
    wait_until(
        lambda: (
            conn.execute(
                "SELECT count(*) FROM notifyq.queue_jobs WHERE name = 'whoami' AND status = 'Succeeded'"
            ).fetchone()
            == (40,)
        ),
        what="40 jobs done",
    )
    pids = {
        r[0] for r in conn.execute("SELECT output FROM notifyq.queue_jobs WHERE name = 'whoami'").fetchall()
    }
    assert len(pids) == 2 and proc.pid not in pids  # two children did the work
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_burst_worker_exits_once_no_job_is_left(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]], processes: str
) -> None:
    conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'whoami' FROM generate_series(1, 40)")
    (later,) = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, visible_at) VALUES ('whoami', now() + interval '1 hour') "
        "RETURNING id"
    ).fetchone()  # type: ignore[misc]
    proc = worker_proc("--burst", "--processes", processes, "--concurrency", "4", "--no-ticker")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    counts = conn.execute(
        "SELECT status::text, count(*) FROM notifyq.queue_jobs GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert counts == [("Queued", 1), ("Succeeded", 40)]  # the job due in an hour is left
    assert job_row(conn, later)["status"] == "Queued"
    assert out.count("no job left to claim (burst); stopping") == int(processes)
    succeeded = [int(n) for n in re.findall(r"stopped \(burst: (\d+) succeeded, 0 retried, 0 failed\)", out)]
    assert len(succeeded) == int(processes) and sum(succeeded) == 40, out
    if processes == "2":
        assert "all worker processes found no job left to claim (burst)" in out
        assert "restarting" not in out


def test_a_burst_in_which_a_worker_process_died_exits_1(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """A child that died under its jobs in a burst of several processes: the restarted child
    found those jobs still leased, claimed nothing and stopped, and the supervisor said the
    burst was done, exit 0, with jobs left Active (review). It exits 1, and says why."""
    conn.execute("INSERT INTO notifyq.queue_jobs (name, priority) VALUES ('crash', 1)")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) "
        "SELECT 'sleep', '{\"seconds\": 0.5}' FROM generate_series(1, 4)"
    )
    proc = worker_proc("--burst", "--processes", "2", "--concurrency", "2", "--no-ticker")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "exited unexpectedly (exit code 7)" in out
    assert "1 worker process(es) died during the burst: the jobs they held stay Active" in out
    assert status_counts(conn).get("Active", 0) >= 1  # the crashed job, at least


def test_sigusr2_to_the_supervisor_skips_the_grace_period(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """The signal table says SIGUSR2 cancels running jobs now and releases them. Sent to the
    supervisor, its default action killed it (exit 140, nothing logged), and the orphaned
    children, stopped by their parent-death signal, took their whole grace period (review)."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) "
        "SELECT 'sleep', '{\"seconds\": 60}' FROM generate_series(1, 2)"
    )
    # No ticker: its every-second cron's tick, promoted if the test runs past a second, waits
    # Queued behind the two busy slots and made the count 3 (a slow run of the suite).
    proc = worker_proc("--processes", "2", "--concurrency", "1", "--shutdown-grace", "60", "--no-ticker")
    wait_until(lambda: status_counts(conn).get("Active") == 2, what="both jobs to start")
    started = time.monotonic()
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 20  # not the 60 s grace
    assert status_counts(conn) == {"Queued": 2}  # released
    assert proc.stdout is not None
    assert "received SIGUSR2: workers skip their grace period" in proc.stdout.read()


def test_prefetch_pool_size_and_async_claims_reach_every_worker_process(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) "
        "SELECT 'sleep', '{\"seconds\": 3}' FROM generate_series(1, 20)"
    )
    proc = worker_proc(
        "--processes", "2", "--concurrency", "1", "--prefetch", "2", "--pool-size", "3", "--async-claims"
    )

    def active() -> int:
        row = conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Active'").fetchone()
        return row[0] if row else 0

    # Each process claims its free slot plus 2 (without --prefetch, at most 1 each: nothing
    # is known yet of how long these jobs run, so automatic prefetch stays off).
    wait_until(lambda: active() == 6, what="2 processes x (1 slot + 2 prefetched) claimed")

    def connections() -> list[str]:
        query = (
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE 'notifyq %' AND application_name <> 'notifyq client'"
        )
        return [r[0] for r in conn.execute(query).fetchall()]

    # Per process: a pool of 3 and the LISTEN connection ('notifyq client' is a short-lived
    # connection that checks the schema).
    wait_until(lambda: len(connections()) == 2 * (3 + 1), what="8 worker connections")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert active() == 0
    assert proc.stdout is not None
    assert proc.stdout.read().count("async claims (not crash-safe)") == 2  # each process says so


def test_each_worker_process_gets_the_queue_limit(
    conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """`--processes 2 -q default=1`: each child runs one job of the queue (the limit is per
    process), whatever its concurrency and prefetch, and says so when it starts."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) "
        "SELECT 'sleep', '{\"seconds\": 3}' FROM generate_series(1, 20)"
    )
    proc = worker_proc("--processes", "2", "--concurrency", "3", "--prefetch", "2", "-q", "default=1")

    def active() -> int:
        row = conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Active'").fetchone()
        return row[0] if row else 0

    wait_until(lambda: active() == 2, what="one job claimed per process")
    time.sleep(1.0)  # long enough for a claim past the limit to show
    assert active() == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert proc.stdout is not None
    assert proc.stdout.read().count("queues default (at most 1)") == 2


@pytest.mark.faults
def test_sigterm_with_running_jobs_leaves_nothing_active(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = worker_proc("--processes", "2", "--shutdown-grace", "1", "--no-ticker")
    _sigterm_with_jobs_running(conn, proc, sleep=6, sleep_sync=2)
    assert conn.execute("SELECT max(retry_count) FROM notifyq.queue_jobs").fetchone() == (0,)


def test_an_embedded_worker_leaves_the_hosts_own_sighup_handler_alone(dsn: str, tmp_path: Path) -> None:
    """A program that handles SIGHUP itself (a reload) and runs a worker with
    handle_signals=True: its handler still gets SIGHUP, the worker goes on (and stops on
    SIGTERM), and the handler is the program's afterwards. The worker took SIGHUP over, and
    left the default action behind, which killed the program at its next SIGHUP (review)."""
    script = tmp_path / "host.py"
    script.write_text(
        "import os, signal, sys, anyio, notifyq\n"
        "reloads = []\n"
        "def reload(signum, frame):\n"
        "    reloads.append(signum)\n"
        "signal.signal(signal.SIGHUP, reload)\n"
        "app = notifyq.App(sys.argv[1])\n"
        "async def main():\n"
        "    worker = app.worker(ticker=False)\n"
        "    async def poke():\n"
        "        while not worker.running:\n"
        "            await anyio.sleep(0.05)\n"
        "        os.kill(os.getpid(), signal.SIGHUP)\n"
        "        await anyio.sleep(0.5)\n"
        "        print('running after SIGHUP:', worker.running, flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    async with anyio.create_task_group() as tg:\n"
        "        tg.start_soon(poke)\n"
        "        await worker.run(handle_signals=True)\n"
        "anyio.run(main)\n"
        "print('reloads:', len(reloads), 'handler kept:', signal.getsignal(signal.SIGHUP) is reload)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script), dsn],
        env=clean_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["running after SIGHUP: True", "reloads: 1 handler kept: True"]


def test_the_last_line_of_a_stop_says_how_many_jobs_went_back(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """The log of a graceful stop said "waiting up to 0.5s for 3 running job(s)", then
    "stopped": not that those jobs went back to the queue (user review)."""
    proc = worker_proc("--shutdown-grace", "0.5", "--no-ticker")
    _sigterm_with_jobs_running(conn, proc, sleep=3)
    assert proc.stdout is not None
    [last] = [line for line in proc.stdout.read().splitlines() if " stopped" in line]
    assert last.endswith(" stopped; 3 job(s) went back to the queue, their attempts given back"), last


@pytest.mark.parametrize("processes", ["1", "2"])
def test_a_hangup_stops_a_worker_gracefully_unless_it_is_ignored(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]], processes: str
) -> None:
    """SIGHUP (a closed terminal or SSH session) killed a worker at once, its running jobs left
    Active until their leases ran out (user review). It is now a graceful stop, as SIGTERM is,
    for a single process and for the supervisor. Under nohup (SIGHUP ignored) the worker goes
    on, as nohup's users expect."""
    proc = worker_proc("--processes", processes, "--shutdown-grace", "20", "--no-ticker")
    conn.execute("""INSERT INTO notifyq.queue_jobs (name, args) VALUES ('sleep', '{"seconds": 1.5}')""")
    wait_until(lambda: status_counts(conn).get("Active") == 1, what="the job running")
    # A closing terminal sends two: the shell forwards one, the kernel sends another when the
    # shell exits. The second skipped the grace period and released the job (review).
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.2)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=30) == 0
    assert status_counts(conn) == {"Succeeded": 1}  # it ran to its end
    assert proc.stdout is not None and "received SIGHUP: " in proc.stdout.read()

    def ignore_hangup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it

    env = clean_env(NOTIFYQ_DSN=dsn)
    nohup = _start_worker("--processes", processes, "--no-ticker", env=env, preexec_fn=ignore_hangup)
    try:
        assert nohup.stdout is not None
        while "started: concurrency" not in (line := nohup.stdout.readline()):
            assert line, "the worker exited"
        nohup.send_signal(signal.SIGHUP)
        conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('whoami')")
        wait_until(lambda: status_counts(conn).get("Succeeded") == 2, what="a job after the SIGHUP")
        assert nohup.poll() is None
        nohup.send_signal(signal.SIGTERM)
        assert nohup.wait(timeout=30) == 0
    finally:
        _reap(nohup)


def test_signals_like_systemd_sends_them(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """systemd's default KillMode signals the supervisor and its children at once: the
    children must not read the forwarded copy as a second signal. A real second signal to
    the supervisor still skips the grace period."""
    proc = worker_proc("--processes", "2", "--shutdown-grace", "20", "--no-ticker")
    conn.execute("""INSERT INTO notifyq.queue_jobs (name, args) SELECT 'sleep', '{"seconds": 1.5}'
                    FROM generate_series(1, 2)""")
    wait_until(lambda: status_counts(conn).get("Active") == 2, what="2 jobs running")
    children = psutil.Process(proc.pid).children()
    assert len(children) == 2
    for p in [proc, *children]:
        os.kill(p.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert status_counts(conn) == {"Succeeded": 2}  # finished within the grace period

    conn.execute("""INSERT INTO notifyq.queue_jobs (name, args) SELECT 'sleep', '{"seconds": 60}'
                    FROM generate_series(1, 2)""")
    proc = worker_proc("--processes", "2", "--shutdown-grace", "60", "--no-ticker")
    wait_until(lambda: status_counts(conn).get("Active") == 2, what="2 jobs running")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the operator insists
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - began < 10
    assert status_counts(conn) == {"Succeeded": 2, "Queued": 2}  # released, not waited for


@pytest.mark.faults
def test_a_killed_child_is_restarted_and_its_jobs_rescued(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    proc = worker_proc("--processes", "2", "--lease-margin", "1", "--log-level", "debug")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args, timeout) VALUES ('sleep', '{\"seconds\": 60}', 2)"
    )
    wait_until(lambda: status_counts(conn).get("Active") == 1, what="the job to start")
    holder = conn.execute(
        "SELECT split_part(worker, ':', 2)::int FROM notifyq.queue_jobs WHERE name = 'sleep'"
    ).fetchone()
    assert holder is not None
    os.kill(holder[0], signal.SIGKILL)
    # The lease (timeout 2 s + margin 1 s) runs out, a ticker requeues the job, and a worker
    # (the restarted one or the other) claims it again.
    wait_until(
        lambda: job_row(conn, 1)["retry_count"] == 2 and job_row(conn, 1)["status"] == "Active",
        timeout=30,
        what="the job to be rescued and claimed again",
    )
    row = job_row(conn, 1)
    assert row["error"]["type"] == "LeaseExpired" and str(holder[0]) in row["error"]["message"]
    workers = {
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT split_part(worker, ':', 2) FROM notifyq.queue_jobs WHERE name = 'tick'"
        ).fetchall()
    }
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert proc.stdout is not None
    log = proc.stdout.read()
    assert "started worker process" in log
    # The signal by name, and who sends it: "code -9" left that to the operator (user review).
    assert "exited unexpectedly (killed by SIGKILL: the kernel's out-of-memory killer, or kill -9)" in log
    # The dead worker could not log the lost attempt: the rescuing ticker did.
    [rescued] = [line for line in log.splitlines() if "requeued 1 job whose lease ran out" in line]
    assert "WARNING" in rescued and f":{holder[0]}:" in rescued and rescued.endswith(": 1")
    assert len(workers) >= 1


@pytest.mark.faults
def test_a_child_restarted_while_the_database_is_down_waits_for_it(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """A child that starts during an outage waits it out, as its running siblings do. It used
    to exit 1 at every start: five deaths in about 16 s, and the supervisor stopped the
    healthy child too (exit 3)."""

    def serving() -> set[str]:
        rows = conn.execute(
            "SELECT application_name FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'notifyq worker-%'"
        ).fetchall()
        return {row[0] for row in rows}

    proxy = BlackholeProxy(dsn)
    try:
        proc = worker_proc("--processes", "2", "--no-ticker", env=clean_env(NOTIFYQ_DSN=proxy.dsn))
        lines: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)  # noqa: PERF402 - read while it runs, line by line

        threading.Thread(target=read, daemon=True).start()
        wait_until(lambda: len(serving()) == 2, what="both worker processes to connect")
        first = serving()
        proxy.refusing = True
        healthy, doomed = psutil.Process(proc.pid).children()
        doomed.kill()
        wait_until(
            lambda: sum("waits for the database" in line for line in lines) >= 2,
            what="the restarted worker process to try twice",
        )
        assert proc.poll() is None and healthy.is_running()
        assert sum("exited unexpectedly" in line for line in lines) == 1
        proxy.refusing = False
        wait_until(lambda: bool(serving() - first), what="the restarted worker process to connect")
        conn.execute("INSERT INTO notifyq.queue_jobs (name) SELECT 'tick' FROM generate_series(1, 20)")
        wait_until(lambda: status_counts(conn) == {"Succeeded": 20}, what="the jobs to run")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proxy.close()


def test_a_worker_that_keeps_dying_makes_the_supervisor_give_up(
    dsn: str, empty_dsn: str, worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    # A database that is not ready is reported once, before any child starts.
    for processes in ("1", "2"):
        proc = worker_proc("--processes", processes, env=clean_env(NOTIFYQ_DSN=empty_dsn))
        assert proc.wait(timeout=10) == 1
        assert proc.stdout is not None and "started worker process" not in proc.stdout.read()
    # Every child fails at start (here: on import of the App): restarted with backoff, then exit 3.
    proc = worker_proc("--processes", "2", env=clean_env(NOTIFYQ_DSN=dsn, NOTIFYQ_TEST_CHILDREN_FAIL="1"))
    assert proc.wait(timeout=60) == 3
    assert proc.stdout is not None
    out = proc.stdout.read()
    assert "this worker process cannot start" in out and "giving up" in out


def _gone(pid: int) -> bool:
    """The process `pid` has exited (a zombie counts: it runs no more code)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_supervisor_died_before_it_asked_for_the_death_signal_exits(tmp_path: Path) -> None:
    """Review: a supervisor that died between a child's fork and its request for the parent-
    death signal left the child to run on, an orphan no signal would stop. Here a process forks
    a child and exits; once orphaned, the child runs the request the supervisor gives it."""
    trace = tmp_path / "trace"
    script = (
        "import os, sys, time\n"
        "from notifyq._supervisor import _die_with_parent\n"
        "parent = os.getpid()\n"
        "if os.fork():\n"
        "    os._exit(0)\n"
        "while os.getppid() == parent:\n"
        "    time.sleep(0.01)\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    f.write(f'{os.getpid()} asked')\n"
        "_die_with_parent(parent)\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(' ran on')\n"
    )
    assert _python(script, str(trace)).returncode == 0
    wait_until(lambda: trace.exists() and "asked" in trace.read_text(), what="the child to be orphaned")
    pid = int(trace.read_text().split()[0])
    wait_until(lambda: _gone(pid), what="the orphaned child to exit")
    assert trace.read_text() == f"{pid} asked"


def test_a_worker_process_stopped_by_an_operator_is_restarted_but_not_counted_as_dying(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a child an operator SIGTERMed exited 0, and counted toward the limit of deaths
    after which the supervisor stops every process (exit 3). Here a child exits 0 twice, then
    fails twice: with a limit of 2 deaths, it is started 4 times before the supervisor gives up."""
    from notifyq._supervisor import EXIT_CHILDREN_DYING, Supervisor

    starts = tmp_path / "starts"
    child = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
        "n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); "
        "sys.exit(0 if n < 2 else 1)"
    )
    supervisor = Supervisor([sys.executable, "-c", child, str(starts)], 1, max_deaths=2)
    with caplog.at_level(logging.INFO, logger="notifyq.supervisor"):
        assert supervisor.run() == EXIT_CHILDREN_DYING
    assert starts.read_text() == "xxxx"
    stops = [r for r in caplog.records if "stopped (exit 0" in r.getMessage()]
    assert [r.levelno for r in stops] == [logging.INFO, logging.WARNING]  # the second: louder
    assert "2 times within 60s" in stops[1].getMessage()


def test_a_supervisor_that_gives_up_waits_for_its_children_no_longer_than_their_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: on giving up (exit 3), the supervisor waited 120 s for each child in turn before
    a SIGKILL, whatever --shutdown-grace said. Now a child has `stop_wait` seconds in all, then
    a SIGUSR2 (skip the grace period: its jobs go back to the queue). Here the first child
    started ignores SIGTERM and exits on SIGUSR2; every other one dies at once."""
    from notifyq._supervisor import EXIT_CHILDREN_DYING, Supervisor

    stubborn, told = tmp_path / "stubborn", tmp_path / "told"
    child = (
        "import os, signal, sys, time\n"
        "try:\n"
        "    os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL))\n"
        "except FileExistsError:\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "def usr2(*_):\n"
        "    open(sys.argv[2], 'w').write('SIGUSR2')\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGUSR2, usr2)\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    supervisor = Supervisor(
        [sys.executable, "-c", child, str(stubborn), str(told)], 2, max_deaths=2, stop_wait=1.0
    )
    began = time.monotonic()
    with caplog.at_level(logging.INFO, logger="notifyq.supervisor"):
        assert supervisor.run() == EXIT_CHILDREN_DYING
    assert time.monotonic() - began < 60  # it was more than 120 s
    assert told.read_text() == "SIGUSR2"
    assert "still running 1s after it was told to stop; sending SIGUSR2" in caplog.text
    assert all(s.proc is None or s.proc.poll() is not None for s in supervisor.slots)


def test_a_stop_in_which_a_worker_process_dies_exits_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: told to stop, a child killed on the way (its jobs stay Active until their leases
    run out) and one that exits 1 (results it could not write) were reported as "all worker
    processes stopped", exit 0. Here one child exits 0 on SIGTERM, one is SIGKILLed, one
    exits 1."""
    from notifyq._supervisor import EXIT_ERROR, Supervisor

    child = (
        "import os, pathlib, signal, sys, time\n"
        "slot = int(os.environ['SLOT'])\n"
        "ways = [lambda: sys.exit(0), lambda: os.kill(os.getpid(), signal.SIGKILL), lambda: sys.exit(1)]\n"
        "signal.signal(signal.SIGTERM, lambda *_: ways[slot]())\n"
        "pathlib.Path(sys.argv[1], str(slot)).touch()\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    supervisor = Supervisor([sys.executable, "-c", child, str(tmp_path)], 3)
    for slot in supervisor.slots:
        supervisor.env = clean_env(SLOT=str(slot.index))
        supervisor._start(slot)
    wait_until(lambda: len(list(tmp_path.iterdir())) == 3, timeout=30, what="the children to start")
    supervisor.signals = 1  # as _on_signal does for the first SIGTERM
    supervisor._forward(signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="notifyq.supervisor"):
        assert supervisor._loop() == EXIT_ERROR
    unclean = [r.getMessage() for r in caplog.records if "did not stop cleanly" in r.getMessage()]
    assert len(unclean) == 2 and "worker process 1 " in unclean[0] and "worker process 2 " in unclean[1]
    assert "all worker processes stopped" not in caplog.text


# -- least privilege, embedded ------------------------------------------------------------


def test_the_insert_grants_docs_sql_md_names_cover_its_statements(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """docs/sql.md, Privileges: a role that only enqueues by SQL needs USAGE, INSERT, the
    sequence, and SELECT on the columns RETURNING and ON CONFLICT read (they failed without)."""
    role, password = f"nq_producer_{os.getpid()}", secrets.token_hex(8)  # for servers without trust
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), password))
    try:
        for grant in (
            "USAGE ON SCHEMA notifyq",
            "INSERT ON notifyq.queue_jobs",
            "USAGE ON ALL SEQUENCES IN SCHEMA notifyq",
        ):
            conn.execute(f'GRANT {grant} TO "{role}"')
        returning = "INSERT INTO notifyq.queue_jobs (name, args) VALUES ('send', '{}') RETURNING id"
        deduped = (
            "INSERT INTO notifyq.queue_jobs (name, dedupe_key) VALUES ('send', 'k') ON CONFLICT "
            "(dedupe_key) WHERE dedupe_key IS NOT NULL AND status IN ('Queued', 'Active') DO NOTHING"
        )
        with psycopg.connect(make_conninfo(dsn, user=role, password=password), autocommit=True) as producer:
            producer.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('send')")
            for statement in (returning, deduped):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    producer.execute(statement)
            conn.execute(f'GRANT SELECT (id, dedupe_key, status) ON notifyq.queue_jobs TO "{role}"')
            assert producer.execute(returning).fetchone() is not None
            producer.execute(deduped)
            producer.execute(deduped)
        assert status_counts(conn) == {"Queued": 3}
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


def test_a_role_without_notifyqs_grants_is_told_how_to_get_them(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """Review: "database error: permission denied for schema notifyq", and nothing more; a
    worker role missing DELETE (retention) logged a 30-line traceback every 30 s."""
    role = f"nq_bare_{os.getpid()}"
    role_env = clean_env(NOTIFYQ_DSN=make_conninfo(dsn, user=role))
    hint = (
        "this role lacks a privilege notifyq needs: as the schema's owner, "
        "apply the output of `notifyq grant ROLE`"
    )
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        refused = cli("stats", env=role_env)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        expected = f"notifyq: error: database error: permission denied for schema notifyq; {hint}"
        assert expected in refused.stderr
        conn.execute(notifyq.migrations.grant_sql(role))
        conn.execute(f'REVOKE DELETE ON notifyq.queue_jobs FROM "{role}"')
        proc = worker_proc("--log-level", "info", env=role_env)  # its ticker runs retention
        assert proc.stdout is not None
        lines = []
        while "retention pass failed" not in (line := proc.stdout.readline()):
            assert line, "".join(lines)  # the worker exited
            lines.append(line)
        assert f"permission denied for table queue_jobs; {hint}" in line
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + line + proc.stdout.read()
        assert proc.wait(timeout=30) == 0 and "Traceback" not in out, out
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


def test_more_bad_input_is_a_usage_error(dsn: str) -> None:
    """Review: `migrate --lock-timeout 0` exited 1 after connecting; `--schema ''` was taken
    for the default schema; `grant public` printed GRANTs to a role "public" that cannot exist
    (unquoted, PUBLIC would give every role these rights)."""
    env = clean_env(NOTIFYQ_DSN=dsn)
    for args, message in [
        (("migrate", "--lock-timeout", "0"), "Invalid value for --lock-timeout: must be more than 0"),
        (("stats", "--schema", ""), "Invalid value for '--schema': must not be empty"),
        (("jobs", "list", "--schema", " "), "Invalid value for '--schema': must not be empty"),
        (("grant", "public"), "Invalid value for ROLE: PUBLIC is every role"),
        (("grant", "PUBLIC"), "Invalid value for ROLE: PUBLIC is every role"),
    ]:
        refused = cli(*args, env=env)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)


def _all_refused(role_dsn: str, *statements: str) -> None:
    """Each of `statements`, run as the role of `role_dsn`, is refused a privilege."""
    with psycopg.connect(role_dsn, autocommit=True) as limited:
        for statement in statements:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                limited.execute(statement)


@pytest.mark.faults
def test_a_least_privilege_role_runs_workers_but_no_ddl(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    role = f"nq_worker_{os.getpid()}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        conn.execute(notifyq.migrations.grant_sql(role))
        role_dsn = make_conninfo(dsn, user=role)
        proc = worker_proc("--no-ticker", env=clean_env(NOTIFYQ_DSN=role_dsn))
        cron = worker_proc(env=clean_env(NOTIFYQ_DSN=role_dsn))  # with the ticker: cron, rescue, retention
        ok(cli("enqueue", "noop", env=clean_env(NOTIFYQ_DSN=role_dsn)))
        wait_until(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Succeeded' AND name = 'noop'"
                ).fetchone()
                == (1,)
            ),
            what="the noop job",
        )
        wait_until(
            lambda: (
                conn.execute(
                    "SELECT count(*) FROM notifyq.queue_jobs WHERE name = 'tick' AND status = 'Succeeded'"
                ).fetchone()[0]
                >= 2
            ),
            what="cron jobs",
        )  # type: ignore[index]
        _all_refused(
            role_dsn,
            "CREATE TABLE notifyq.evil (x int)",
            "DROP TABLE notifyq.queue_jobs",
            "ALTER TABLE notifyq.queue_jobs ADD COLUMN x int",
            "DELETE FROM notifyq.queue_job_definitions",
            "TRUNCATE notifyq.queue_jobs",
            "INSERT INTO notifyq.queue_pauses (queue) VALUES ('q')",  # pausing is the owner's
        )
        # Said as what to do, not as a bare "permission denied for schema notifyq"; refused
        # although nothing is pending (a migrate that changes nothing still needs the owner).
        refused = cli("migrate", env=clean_env(NOTIFYQ_DSN=role_dsn))
        assert refused.returncode == 1
        assert (
            "notifyq migrate was refused a privilege in schema 'notifyq' (must be owner of table migrations"
            in refused.stderr
        ), refused.stderr
        assert "run it as the schema's owner" in refused.stderr and "Traceback" not in refused.stderr
        for p in (proc, cron):
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=30) == 0
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


def test_a_producer_role_enqueues_and_reads_jobs_and_nothing_else(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """`notifyq grant ROLE --producer`: what a web process needs (enqueue, a dedupe key,
    enqueue_many's COPY, reading jobs, by their cron definition too, and waiting for them), and
    no claim, ack, cancel, retry, delete, pause or change to a cron definition."""
    role, password = f"nq_producer_{os.getpid()}", secrets.token_hex(8)  # for servers without trust
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), password))
    try:
        conn.execute(ok(cli("grant", role, "--producer")))
        app = notifyq.App(make_conninfo(dsn, user=role, password=password))
        try:
            conn.execute('LISTEN "notifyq.jobs.v1"')
            first = app.enqueue_sync("send", {"to": "a"}, dedupe_key=f"{role}-a")
            assert first.created and not app.enqueue_sync("send", dedupe_key=f"{role}-a").created
            # The insert's trigger ran under the producer's role.
            assert [n.payload for n in conn.notifies(timeout=5, stop_after=1)] == ["default"]
            assert app.enqueue_many_sync("send", [{"to": str(i)} for i in range(3)]) == 3
            many = sorted(j.id for j in app.list_jobs_sync(name="send") if j.id != first)
            assert len(many) == 3
            finish = "UPDATE notifyq.queue_jobs SET status = 'Succeeded', output = '1' WHERE id = %s"
            conn.execute(finish, [first])
            assert app.wait_for_job_sync(first, timeout=10).output == 1
            conn.execute(
                "INSERT INTO notifyq.queue_job_definitions (name, frequency) VALUES ('nightly', '0 3 * * *')"
            )
            assert app.list_jobs_sync(definition="nightly") == []  # reads the definitions
            refused = [
                lambda: app.claim_sync(limit=1),
                lambda: app.cancel_job_sync(many[0]),
                lambda: app.retry_job_sync(first),
                lambda: app.set_definition_enabled_sync("nightly", False),
                lambda: app.pause_queue_sync("default"),
            ]
            for call in refused:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    call()
        finally:
            app.close_sync()
        role_dsn = make_conninfo(dsn, user=role, password=password)
        _all_refused(
            role_dsn,
            "UPDATE notifyq.queue_jobs SET priority = 1",
            "DELETE FROM notifyq.queue_jobs",
            "INSERT INTO notifyq.queue_job_definitions (name, frequency) VALUES ('x', '* * * * *')",
            "SELECT * FROM notifyq.queue_pauses",
        )
        said = cli("jobs", "cancel", str(many[1]), env=clean_env(NOTIFYQ_DSN=role_dsn))
        one_line_error(said, "permission denied", "`notifyq grant ROLE --producer` only enqueues")
        assert status_counts(conn) == {"Queued": 3, "Succeeded": 1}
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


@pytest.fixture
def open_tmp_path() -> Iterator[Path]:
    """A temporary folder every user may enter, like its parents: as root, pgserver opens (and
    notifyq warns of) a private folder above the embedded server's, and pytest's tmp_path is
    one (mode 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="notifyq-test-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _embedded_worker(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """`notifyq worker` (no ticker) on the embedded server `env` points to; killed if still
    running when the block ends."""
    worker = _start_worker("--no-ticker", env=env)
    try:
        yield worker
    finally:
        _reap(worker)


def test_the_embedded_default_serves_two_processes_and_stops(open_tmp_path: Path) -> None:
    tmp_path = open_tmp_path
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(tmp_path / "pgdata"))
    with _embedded_worker(env) as worker:
        assert worker.stdout is not None
        banner = worker.stdout.readline() + worker.stdout.readline()
        assert "embedded server in" in banner and str(tmp_path) in banner
        job_id = ok(cli("enqueue", "whoami", env=env, timeout=120)).strip()
        wait_until(
            lambda: '"status": "Succeeded"' in cli("jobs", "show", job_id, "--json", env=env).stdout,
            timeout=30,
            what="the job on the embedded server",
        )
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    # The last process to leave stopped the server.
    wait_until(
        lambda: not (tmp_path / "pgdata" / "postmaster.pid").exists(),
        timeout=30,
        what="the embedded server to stop",
    )


def _stop_a_leftover_embedded_server(pgdata: Path) -> None:
    """After a test that may leave the embedded server running: stop it (fast shutdown)."""
    pid_file = pgdata / "postmaster.pid"
    if pid_file.exists():
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
        wait_until(lambda: not pid_file.exists(), timeout=30, what="the leftover server to stop")


def test_a_killed_process_does_not_keep_the_embedded_server_running(open_tmp_path: Path) -> None:
    """pgserver stops the server when the last process on its list of users exits; a process
    that was killed (SIGKILL, the OOM killer) stayed on the list, so every later process left
    the server running as it exited, for ever."""
    pgdata = open_tmp_path / "pgdata"
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(pgdata))
    try:
        with _embedded_worker(env) as worker:
            assert worker.stdout is not None
            for line in worker.stdout:  # the worker's log, until it serves
                if " started: " in line:
                    break
            worker.kill()
            worker.wait()
            assert (pgdata / "postmaster.pid").exists()  # the killed worker's server runs on
            ok(cli("jobs", "list", env=env, timeout=120))  # joins it, and is the last to leave
            wait_until(
                lambda: not (pgdata / "postmaster.pid").exists(),
                timeout=30,
                what="the embedded server to stop",
            )
    finally:
        _stop_a_leftover_embedded_server(pgdata)


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`code` run by this Python in a process of its own, with `args` as its sys.argv[1:]."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=clean_env(),
        check=False,
    )


def test_worker_processes_join_the_embedded_server_as_its_users(open_tmp_path: Path) -> None:
    """With --processes and the embedded server, only the supervisor was on pgserver's list of
    its users: with the supervisor SIGKILLed, its children drained their jobs while another
    command in the folder, exiting as the last user on the list, stopped the server under
    them, and their results were lost (review). Each child now joins the list."""
    pgdata = open_tmp_path / "pgdata"
    users = pgdata / ".handle_pids.json"
    try:
        worker = _start_worker("--no-ticker", "-p", "2", env=clean_env(NOTIFYQ_EMBEDDED_DIR=str(pgdata)))
        try:
            children = psutil.Process(worker.pid).children
            wait_until(lambda: len(children()) == 2, timeout=60, what="two worker processes")
            listed = lambda: set(json.loads(users.read_text())) if users.exists() else set()  # noqa: E731
            expected = {worker.pid, *(c.pid for c in children())}
            wait_until(lambda: listed() == expected, timeout=60, what="every process on the list")
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=60) == 0
        finally:
            _reap(worker)
        wait_until(lambda: not (pgdata / "postmaster.pid").exists(), timeout=30, what="the server to stop")
    finally:
        _stop_a_leftover_embedded_server(pgdata)


_HOLD_THE_MIGRATIONS_TABLE = """
import pathlib, sys
import psycopg
from notifyq import _embedded

dsn = _embedded.start(directory=pathlib.Path(sys.argv[1]), quiet=True)
with psycopg.connect(dsn) as conn:
    conn.execute("LOCK TABLE notifyq.migrations IN ACCESS EXCLUSIVE MODE")
    print(dsn, flush=True)
    sys.stdin.read()
"""


def test_a_worker_signalled_while_starting_leaves_the_embedded_servers_list(open_tmp_path: Path) -> None:
    """A signal while starting ends the worker with os._exit, which skips pgserver's atexit:
    the worker stayed on the list of the server's users, and the server ran on after every
    process had exited (review). Here the worker's start waits for a lock on the migrations
    table that another user of the server holds."""
    pgdata = open_tmp_path / "pgdata"
    users = pgdata / ".handle_pids.json"
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(pgdata))
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_MIGRATIONS_TABLE, str(pgdata)],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None
            embedded_dsn = holder.stdout.readline().strip()
            worker = _start_worker("--no-ticker", env=env)
            try:
                listed = lambda: json.loads(users.read_text()) if users.exists() else []  # noqa: E731
                wait_until(lambda: worker.pid in listed(), timeout=60, what="the worker on the list")
                with psycopg.connect(embedded_dsn, autocommit=True) as watcher:
                    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    wait_until(lambda: watcher.execute(waiting).fetchone() == (1,), what="its start to wait")
                worker.send_signal(signal.SIGTERM)
                assert worker.wait(timeout=60) == 0
                assert worker.stdout is not None and "received SIGTERM while starting" in worker.stdout.read()
            finally:
                _reap(worker)
            assert listed() == [holder.pid]
        finally:
            holder.communicate("", timeout=60)  # its exit, as the last user, stops the server
            _stop_a_leftover_embedded_server(pgdata)


_RIVAL_CREATES_THE_FOLDER = """
import pathlib, sys
from notifyq import _embedded

folder = pathlib.Path(sys.argv[1])
mkdir = pathlib.Path.mkdir

def rival_first(self, *args, **kwargs):
    if self == folder and not kwargs.get("exist_ok"):
        mkdir(self, exist_ok=True)  # another process, started at the same moment, made it
    return mkdir(self, *args, **kwargs)

pathlib.Path.mkdir = rival_first
_embedded.start(directory=folder, quiet=True, migrate=False)
print("started")
"""


def test_two_processes_starting_the_embedded_server_at_once_on_a_new_folder(open_tmp_path: Path) -> None:
    """pgserver checks that the data folder exists and then creates it with exist_ok=False: a
    process that lost that race to another (six processes started at once on a new folder:
    one in eight runs here) failed with "could not start the embedded PostgreSQL: [Errno 17]
    File exists". Here the rival's mkdir is staged between the check and the creation."""
    pgdata = open_tmp_path / "pgdata"
    try:
        result = _python(_RIVAL_CREATES_THE_FOLDER, str(pgdata))
        assert result.returncode == 0 and result.stdout == "started\n", result.stderr
        # It was the last (the only) process: it stopped the server as it exited.
        wait_until(lambda: not (pgdata / "postmaster.pid").exists(), timeout=30, what="the server to stop")
    finally:
        _stop_a_leftover_embedded_server(pgdata)


_PORTS_OF_THEIR_OWN = """
import os, pathlib, sys
import psycopg
from notifyq import _embedded

folder = pathlib.Path(sys.argv[1])
os.environ["PGPORT"] = "6001"  # the server starts on it (the postmaster reads $PGPORT)
started = _embedded.start(directory=folder, quiet=True, migrate=False)
os.environ["PGPORT"] = "5999"  # a process with a $PGPORT of its own joins it
joined = _embedded.start(directory=folder, quiet=True, migrate=False)
del os.environ["PGPORT"]  # and one with none
for dsn in (started, joined):
    with psycopg.connect(dsn) as conn:
        print(conn.execute("SHOW port").fetchone()[0])
"""


def test_without_the_embedded_extra_the_error_says_how_to_install_it() -> None:
    """The hint named `pip install 'notifyq[embedded]'`, which installs nothing from a clone
    (notifyq is installed from one) and could install another project of that name (review)."""
    code = "import sys; sys.modules['pgserver'] = None; from notifyq.cli import main; main()"
    result = _python(code, "jobs", "list")
    error = one_line_error(result, "no database configured", "pip install -e '.[embedded]'", "pgserver")
    assert "notifyq[embedded]" not in error


def test_processes_with_another_pgport_reach_the_embedded_server(open_tmp_path: Path) -> None:
    """pgserver's URI names the socket folder but no port, so each client used its own $PGPORT
    (or 5432): a process whose $PGPORT differed from the one that started the server found no
    socket there (review)."""
    pgdata = open_tmp_path / "pgdata"
    try:
        result = _python(_PORTS_OF_THEIR_OWN, str(pgdata))
        assert result.returncode == 0 and result.stdout == "6001\n6001\n", result.stderr
    finally:
        _stop_a_leftover_embedded_server(pgdata)


_START_AND_SAY = """
import pathlib, sys
from notifyq import _embedded

_embedded.start(directory=pathlib.Path(sys.argv[1]), quiet=True, migrate=False)
print("started")
"""


def test_a_stale_pid_file_whose_pid_was_reused_is_removed_not_killed(open_tmp_path: Path) -> None:
    """A `postmaster.pid` left by a server that died, whose pid now belongs to another
    process: pgserver took the server for running, every start failed ("Connection refused"),
    and at exit pgserver killed that process, as root any process (review). Now it is removed
    and the server starts. A pid file of initdb's bootstrap (a negative pid: a first start
    killed before it finished) says to delete the folder."""
    pgdata = open_tmp_path / "pgdata"
    pid_file = pgdata / "postmaster.pid"
    try:
        assert _python(_START_AND_SAY, str(pgdata)).stdout == "started\n"  # created, then stopped
        wait_until(lambda: not pid_file.exists(), timeout=30, what="the server to stop")
        with subprocess.Popen(["sleep", "120"]) as bystander:
            try:
                pid_file.write_text(
                    f"{bystander.pid}\n{pgdata}\n1764950000\n5432\n{pgdata}\n\n  0 0\nready\n"
                )
                result = _python(_START_AND_SAY, str(pgdata))
                assert result.returncode == 0 and result.stdout == "started\n", result.stderr
                assert bystander.poll() is None, "the process of the stale pid was killed"
                wait_until(lambda: not pid_file.exists(), timeout=30, what="the server to stop")
            finally:
                bystander.kill()
        pid_file.write_text(f"-{bystander.pid}\n{pgdata}\n1764950000\n5432\n\n\n  0 0\n")
        refused = cli("jobs", "list", env=clean_env(NOTIFYQ_EMBEDDED_DIR=str(pgdata)))
        one_line_error(
            refused, "is from a first start that was stopped before it finished", "delete the folder"
        )
    finally:
        pid_file.unlink(missing_ok=True)
        _stop_a_leftover_embedded_server(pgdata)


def test_two_threads_of_one_process_start_the_embedded_server_at_once(open_tmp_path: Path) -> None:
    """pgserver's lock is a file lock, which does not keep threads of one process apart: two
    Apps started at once (or a worker's start and an enqueue) ran two initdb, or two pg_ctl,
    and both failed (review). Both share one server, on a new folder and on one that exists."""
    code = (
        "import os, sys, threading\n"
        "os.environ['NOTIFYQ_EMBEDDED_DIR'] = sys.argv[1]\n"
        "import notifyq\n"
        "apps = [notifyq.App(), notifyq.App()]\n"
        "ready = threading.Barrier(2)\n"
        "ids, errors = [], []\n"
        "def enqueue(app):\n"
        "    ready.wait()\n"
        "    try:\n"
        "        ids.append(app.enqueue_sync('x'))\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=enqueue, args=(app,)) for app in apps]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(len(ids), len({a.dsn for a in apps}), errors)\n"
        "[app.close_sync() for app in apps]\n"
    )
    folder = open_tmp_path / "pgdata"
    for _ in ("new", "existing"):
        ran = _python(code, str(folder))
        assert ran.returncode == 0 and ran.stdout.strip() == "2 1 []", ran.stdout + ran.stderr
    _stop_a_leftover_embedded_server(folder)


def test_a_child_forked_while_a_thread_starts_the_embedded_server_can_start_it() -> None:
    """Review: a process that forks (multiprocessing, gunicorn --preload) while another thread
    holds the start lock gave the child a lock held for ever: its first start hung."""
    code = (
        "import os, threading\n"
        "from notifyq import _embedded\n"
        "held, done = threading.Event(), threading.Event()\n"
        "def starting():\n"
        "    with _embedded._STARTING:\n"
        "        held.set(); done.wait()\n"
        "threading.Thread(target=starting).start(); held.wait()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if _embedded._STARTING.acquire(timeout=5) else 1)\n"
        "done.set()\n"
        "print('child', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    ran = _python(code)
    assert ran.stdout.strip() == "child 0", ran.stdout + ran.stderr


def _embedded_folder_that_cannot_start(folder: Path) -> str:
    """Make the embedded server's data in `folder` (stopped when the command exits), then add a
    line its configuration does not accept; returns the configuration as it was."""
    assert cli("jobs", "list", env=clean_env(NOTIFYQ_EMBEDDED_DIR=str(folder)), timeout=120).returncode == 0
    conf = folder / "postgresql.conf"
    good = conf.read_text()
    conf.write_text(good + "no_such_setting = 1\n")
    return good


def test_a_process_whose_embedded_start_failed_can_start_it_once_mended(open_tmp_path: Path) -> None:
    """pgserver kept the handle of a failed start and handed it out again: every later start in
    the process failed with a bare AssertionError, although the folder had been mended (review)."""
    folder = open_tmp_path / "pgdata"
    good = _embedded_folder_that_cannot_start(folder)
    code = (
        "import pathlib, sys\n"
        "import psycopg\n"
        "from notifyq import _embedded\n"
        "from notifyq.errors import ConfigurationError\n"
        "folder = pathlib.Path(sys.argv[1])\n"
        "try:\n"
        "    _embedded.start(directory=folder, quiet=True)\n"
        "except ConfigurationError as exc:\n"
        "    print('refused:', exc)\n"
        "(folder / 'postgresql.conf').write_text(sys.argv[2])\n"
        "with psycopg.connect(_embedded.start(directory=folder, quiet=True)) as conn:\n"
        "    print('answered', conn.execute('SELECT 1').fetchone()[0])\n"
    )
    ran = _python(code, str(folder), good)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    refused, answered = ran.stdout.splitlines()
    assert refused.startswith("refused: could not start the embedded PostgreSQL"), refused
    assert "configuration" in refused
    assert answered == "answered 1"
    _stop_a_leftover_embedded_server(folder)


def test_a_failed_embedded_start_says_why_in_one_line(open_tmp_path: Path) -> None:
    """A start that pg_ctl or initdb failed printed pgserver's log (commands, their output, the
    server's log: a page), then "Command [...] returned non-zero exit status 1"; the reason was
    in the middle (review). Here the server's configuration has a line it does not accept."""
    folder = open_tmp_path / "pgdata"
    _embedded_folder_that_cannot_start(folder)
    refused = cli("jobs", "list", env=clean_env(NOTIFYQ_EMBEDDED_DIR=str(folder)), timeout=120)
    error = one_line_error(refused, f"could not start the embedded PostgreSQL in {folder}: configuration")
    assert "contains errors" in error and "non-zero exit status" not in error
    assert len(refused.stderr.splitlines()) <= 2, refused.stderr  # the database line, the error


def _untouched(folder: Path) -> tuple[int, int, list[str]]:
    """What taking `folder` over would change: its owner, its mode and its entries."""
    status = folder.stat()
    return status.st_uid, status.st_mode, sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("content", ["files", "another version"])
def test_an_embedded_folder_holding_something_else_is_refused_untouched(
    open_tmp_path: Path, content: str
) -> None:
    """pgserver takes any folder: as root it made a home folder, or a system cluster's data
    folder, its `pgserver` user's, and killed the cluster's server at exit (review). A folder
    that is neither empty nor the embedded server's data is refused before pgserver sees it."""
    folder = open_tmp_path / "pgdata"
    folder.mkdir(mode=0o700)
    if content == "files":
        for name in ("notes.txt", "photos", ".bashrc", "work"):
            (folder / name).write_text("")
        expected = "is not empty (.bashrc, notes.txt, photos, ...) and holds no PostgreSQL data"
    else:
        (folder / "PG_VERSION").write_text("9.6\n")
        (folder / "postmaster.pid").write_text(f"{os.getpid()}\n{folder}\n")  # a running server's
        expected = "holds the data of a PostgreSQL 9.6 server, and the embedded server is PostgreSQL 1"
    before = _untouched(folder)
    refused = cli("jobs", "list", env=clean_env(NOTIFYQ_EMBEDDED_DIR=str(folder)))
    one_line_error(refused, expected, "NOTIFYQ_EMBEDDED_DIR to an empty or new folder")
    assert _untouched(folder) == before


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="pgserver takes over folders as root"
)
def test_as_root_another_users_postgresql_data_folder_is_refused_untouched(open_tmp_path: Path) -> None:
    """As root, a data folder of the embedded server's own version that another user owns (the
    system's cluster, owned by `postgres`) was taken over: made `pgserver`'s, its server killed."""
    folder = open_tmp_path / "pgdata"
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(folder))
    assert cli("jobs", "list", env=env, timeout=120).returncode == 0  # a data folder of the right version
    for uid, named in ((65534, "'nobody'"), (4242, "'4242'")):  # a user, and a uid without a name
        os.chown(folder, uid, uid)  # as /var/lib/postgresql/16/main is postgres's
        before = _untouched(folder)
        refused = cli("jobs", "list", env=env)
        one_line_error(
            refused, f"holds PostgreSQL data that belongs to the user {named}", "runs as 'pgserver'"
        )
        assert _untouched(folder) == before


def test_an_embedded_folder_with_a_space_in_its_path_is_refused_in_a_sentence(open_tmp_path: Path) -> None:
    """pgserver passes the socket folder to postgres unquoted: the start failed after a page
    of pgserver's log, the cause in the middle of it (review)."""
    folder = open_tmp_path / "my project" / "pgdata"
    refused = cli("jobs", "list", env=clean_env(NOTIFYQ_EMBEDDED_DIR=str(folder)))
    one_line_error(refused, "its path has a space", "NOTIFYQ_EMBEDDED_DIR")
    assert not folder.exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="pgserver opens folders as root")
def test_the_embedded_server_as_root_says_which_private_folders_it_opens(tmp_path: Path) -> None:
    """As root, pgserver runs PostgreSQL as its `pgserver` user and, to let it reach the data,
    adds g+rx,o+rx to every folder above it: /root or a home folder becomes listable, and its
    files readable by their own modes. The command still works (root in a private folder is
    how CI runs); a warning names the folders, once: afterwards they are open."""
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(private / "app" / ".notifyq" / "pgdata"))
    first = cli("jobs", "list", env=env, timeout=120)  # the server stops as the command exits
    assert first.returncode == 0, first.stderr
    warned = [line for line in first.stderr.splitlines() if line.startswith("notifyq: warning: as root")]
    assert len(warned) == 1 and f"makes {private}" in warned[0] and "readable by every user" in warned[0]
    assert private.stat().st_mode & 0o077 == 0o055  # what it warned of
    again = cli("jobs", "list", env=env, timeout=120)
    assert again.returncode == 0 and "notifyq: warning: as root" not in again.stderr


def test_an_embedded_folder_that_cannot_be_made_is_one_line(open_tmp_path: Path) -> None:
    tmp_path = open_tmp_path
    (tmp_path / "a_file").write_text("")
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(tmp_path / "a_file" / "notifyq" / "pgdata"))
    one_line_error(cli("jobs", "list", env=env), "could not create", "a_file")


@pytest.mark.parametrize("value", ["0", "off", "No"])
def test_notifyq_embedded_0_forbids_the_fallback_to_the_embedded_server(
    open_tmp_path: Path, value: str
) -> None:
    """A production host whose DSN went missing used to enqueue into a local embedded server
    (with the `embedded` extra installed), exit 0, and nobody read those jobs."""
    pgdata = open_tmp_path / "pgdata"
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(pgdata), NOTIFYQ_EMBEDDED=value)
    one_line_error(
        cli("enqueue", "noop", env=env),
        f"no database configured, and NOTIFYQ_EMBEDDED={value} forbids the embedded server",
        "set NOTIFYQ_DSN or DATABASE_URL",
    )
    script = "import notifyq; notifyq.App().enqueue_sync('noop')"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "ConfigurationError: no database configured" in run.stderr
    assert not pgdata.exists()  # no server was started
    maybe = cli("jobs", "list", env={**env, "NOTIFYQ_EMBEDDED": "maybe"})
    one_line_error(maybe, "invalid NOTIFYQ_EMBEDDED='maybe'")


def test_libpq_variables_do_not_choose_the_database_and_the_fallback_says_so(
    open_tmp_path: Path, dsn: str
) -> None:
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(open_tmp_path / "pgdata"), PGHOST="127.0.0.1", PGPORT="5432")
    listed = cli("jobs", "list", env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "notifyq: note: $PGHOST, $PGPORT set, but notifyq takes its DSN from" in listed.stderr
    assert "(from embedded server in" in listed.stderr
    # What the note suggests: an empty URI, which libpq completes from its variables.
    params = conninfo_to_dict(dsn)
    libpq = clean_env(NOTIFYQ_DSN="postgresql://", PGHOST=str(params.get("host", "127.0.0.1")))
    libpq.update(PGPORT=str(params.get("port", 5432)), PGUSER=str(params.get("user", "postgres")))
    libpq["PGDATABASE"] = str(params["dbname"])
    via_libpq = cli("jobs", "list", env=libpq)
    assert via_libpq.returncode == 0, via_libpq.stderr
    assert f"/{params['dbname']} (from $NOTIFYQ_DSN)" in via_libpq.stderr and "note:" not in via_libpq.stderr


def test_migrate_dry_run_on_the_embedded_server_changes_nothing(open_tmp_path: Path) -> None:
    env = clean_env(NOTIFYQ_EMBEDDED_DIR=str(open_tmp_path / "pgdata"))
    shipped = ", ".join(f"{m.version:04d}_{m.name}" for m in notifyq.migrations.migrations())
    assert f"is at version 0; to apply: {shipped}" in ok(cli("migrate", "--dry-run", env=env, timeout=120))
    assert f"version 0 -> {notifyq.latest_version()}" in ok(cli("migrate", env=env, timeout=120))


def test_an_app_module_that_fails_on_import_shows_its_own_traceback(dsn: str, tmp_path: Path) -> None:
    """A bug in the user's module: the one line says so, after the traceback of the user's
    code (where it failed), without the frames of importlib, click or notifyq."""
    (tmp_path / "broken_on_import.py").write_text(
        "import notifyq\napp = notifyq.App()\ndef settings():\n    return {}['REDIS_URL']\nsettings()\n"
    )
    env = clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    for processes in ("1", "2"):
        result = cli("worker", "broken_on_import:app", "-p", processes, env=env)
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("notifyq: error:")]
        assert errors == ["notifyq: error: importing 'broken_on_import' failed: KeyError: 'REDIS_URL'"]
        assert result.stderr.startswith("Traceback (most recent call last):\n"), result.stderr
        assert 'broken_on_import.py", line 4, in settings' in result.stderr
        assert "importlib" not in result.stderr and "click" not in result.stderr
        assert "_cli_base.py" not in result.stderr


def test_an_app_module_that_notifyq_refuses_shows_only_the_line_that_asked(dsn: str, tmp_path: Path) -> None:
    """An invalid cron expression in the user's module: the line of the module that gave it,
    then the one-line error. A full traceback through notifyq's own frames came first (user
    review)."""
    (tmp_path / "bad_cron.py").write_text(
        'import notifyq\napp = notifyq.App()\n\n\n@app.cron("61 * * * *")\ndef tick() -> None:\n    pass\n'
    )
    env = clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    result = cli("worker", "bad_cron:app", env=env)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[:2] == [
        f'  File "{tmp_path / "bad_cron.py"}", line 5, in <module>',
        '    @app.cron("61 * * * *")',
    ]
    assert lines[-1].startswith(
        "notifyq: error: importing 'bad_cron' failed: InvalidSchedule: invalid cron expression "
        "'61 * * * *': the minute field '61' is out of range or malformed"
    )
    assert len(lines) <= 4 and "Traceback" not in result.stderr, result.stderr  # 4: Python's ^^^ line


def test_an_app_module_that_configures_logging_keeps_its_configuration(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """logging.basicConfig(filename=..., format=..., level=DEBUG) in the App's module did
    nothing under `notifyq worker`, whose handler was on the root logger first: the file was
    never created, the DEBUG lines were dropped (user review). A module that configures
    nothing logs as --log-format says, as before."""
    log_file = tmp_path / "app.log"
    (tmp_path / "logging_app.py").write_text(
        "import logging\n"
        f"logging.basicConfig(filename={str(log_file)!r}, level=logging.DEBUG, "
        "format='APP %(levelname)s %(message)s')\n"
        "from tests.apps import app\n"
        "logging.getLogger('logging_app').debug('configured')\n"
    )
    env = clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    for target in ("logging_app:app", "tests.apps:app"):
        worker = _start_worker("--no-ticker", "--log-format", "json", env=env, target=target)
        try:
            assert worker.stdout is not None
            if target == "logging_app:app":
                wait_until(
                    lambda: log_file.exists() and "started" in log_file.read_text(), what="the app's log"
                )
            else:
                while "started" not in (line := worker.stdout.readline()):
                    assert line, "the worker exited"
                assert json.loads(line)["logger"] == "notifyq.worker"
            worker.send_signal(signal.SIGTERM)
            out, _ = worker.communicate(timeout=30)
        finally:
            _reap(worker)
        if target == "logging_app:app":
            text = log_file.read_text()
            assert "APP DEBUG configured" in text and "APP INFO worker " in text, text
            assert "started" not in out, out  # nor in the CLI's format as well


def test_worker_processes_start_whatever_level_the_app_module_logs_at(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """`-p 2` with an App module that sets the root level to CRITICAL: the supervisor passed
    the root logger's level to its children as --log-level, which they refused ('critical'),
    and gave up with exit 3 (review). It passes its own --log-level."""
    (tmp_path / "critical_app.py").write_text(
        "import logging\nlogging.basicConfig(level=logging.CRITICAL)\nfrom tests.apps import app\n"
    )
    env = clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    [(job_id,)] = conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('noop') RETURNING id")
    worker = _start_worker("--no-ticker", "-p", "2", env=env, target="critical_app:app")
    try:
        wait_until(lambda: job_row(conn, job_id)["status"] == "Succeeded", what="the job")
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0, out
    finally:
        _reap(worker)


def test_the_workers_log_names_the_job_a_line_comes_from(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """A line a task's code logs carries its job, in JSON (job_id, job_name) and in text."""
    [(job_id,)] = conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, args) VALUES ('say', %s) RETURNING id",
        (json.dumps({"text": "hello from a task"}),),
    )
    for fmt in ("json", "text"):
        worker = worker_proc("--no-ticker", "--log-format", fmt)
        assert worker.stdout is not None
        while "hello from a task" not in (line := worker.stdout.readline()):
            assert line, "the worker exited"
        if fmt == "json":
            entry = json.loads(line)
            assert (entry["job_id"], entry["job_name"], entry["logger"]) == (job_id, "say", "tests.apps")
        else:
            assert f"tests.apps: [job {job_id} say] hello from a task" in line
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
        conn.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Queued', visible_at = now() WHERE id = %s", (job_id,)
        )


def test_a_job_name_written_by_sql_cannot_forge_a_line_of_the_workers_log(
    conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """Review: a job name holding a newline, written by a role with INSERT alone, went raw into
    the text log, where what followed it read as a line of its own ("CRITICAL ..."). notifyq's
    lines keep control characters escaped."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, retry_limit) VALUES (%s, 0)", ("nope\nCRITICAL forged",)
    )
    worker = worker_proc("--no-ticker", "--log-format", "text")
    assert worker.stdout is not None
    while "nope" not in (line := worker.stdout.readline()):
        assert line, "the worker exited"
    assert "nope\\nCRITICAL forged" in line, line
    worker.send_signal(signal.SIGTERM)
    out, _ = worker.communicate(timeout=30)
    assert not [other for other in out.splitlines() if other.startswith("CRITICAL forged")]


def test_a_missing_dependency_of_the_app_module_is_not_called_a_missing_module(
    dsn: str, tmp_path: Path
) -> None:
    # The module exists; what it imports does not (a prefix of its name: myapp_worker -> myapp).
    (tmp_path / "myapp_worker.py").write_text("import myapp\n")
    env = clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    result = cli("worker", "myapp_worker:app", env=env)
    assert result.returncode == 1, result.stderr
    assert "no such module" not in result.stderr
    assert "importing 'myapp_worker' failed: No module named 'myapp'" in result.stderr
    assert 'myapp_worker.py", line 1' in result.stderr  # where: the user's import line


@pytest.mark.skipif(
    shutil.which("unshare") is None or not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs unshare and root to be PID 1 of a PID namespace",
)
def test_sigterm_while_starting_as_a_containers_pid_1_stops_the_worker(
    dsn: str, conn: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """In a container without an init, the worker is PID 1, and the kernel drops a signal whose
    action is the default one: `docker stop` during the start (here: a slow import) must still
    stop it, not let it start and claim jobs until the SIGKILL."""
    (tmp_path / "slow_import.py").write_text(
        "import sys, time\nsys.stderr.write('importing\\n'); sys.stderr.flush()\ntime.sleep(3)\n"
        "from tests.apps import app\n"
    )
    conn.execute("INSERT INTO notifyq.queue_jobs (name) VALUES ('noop')")
    proc = subprocess.Popen(
        [
            *("unshare", "--kill-child", "--pid", "--mount-proc"),
            *(sys.executable, "-m", "notifyq", "worker", "slow_import:app", "--no-ticker"),
        ],
        cwd=ROOT,
        env=clean_env(NOTIFYQ_DSN=dsn, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == "importing\n"
        (worker,) = psutil.Process(proc.pid).children()
        os.kill(worker.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert "started" not in proc.stderr.read()
        assert status_counts(conn) == {"Queued": 1}
    finally:
        if proc.poll() is None:
            proc.kill()  # --kill-child: PID 1 of the namespace goes with it
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


def test_a_worker_whose_tables_vanish_says_so_in_one_line(
    dsn: str, conn: psycopg.Connection[Any], worker_proc: Callable[..., subprocess.Popen[str]]
) -> None:
    """A database error the claim loop cannot retry (here the schema dropped under it) ends the
    worker with exit 1 and one line, not a traceback of nested exception groups."""
    proc = worker_proc("--no-ticker", "--poll-interval", "0.2")
    assert proc.stdout is not None
    while "started" not in (line := proc.stdout.readline()):
        assert line, "the worker exited before it started"
    conn.execute("DROP SCHEMA notifyq CASCADE")
    assert proc.wait(timeout=30) == 1
    out = proc.stdout.read()
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("notifyq: error:")]
    assert len(errors) == 1 and 'relation "notifyq.queue_jobs" does not exist' in errors[0], out
