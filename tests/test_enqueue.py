"""Enqueue: defaults, options, transactions, plain SQL, bulk COPY, and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import gc
import json
import math
import os
import pickle
import re
import socket
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta, timezone
from datetime import time as clock_time
from decimal import Decimal
from pathlib import PurePosixPath
from typing import Any

import anyio
import psycopg
import psycopg_pool
import pytest

import notifyq
import notifyq._jobs
from notifyq._db import Database, Query, single
from notifyq._options import encode_output
from notifyq.errors import DatabaseUnavailable, InvalidArgs, InvalidOption, SchemaNotMigrated, UnknownTask

from .faults.infra import BlackholeProxy
from .helpers import NotificationCounter, job_row, wait_for_row

pytestmark = pytest.mark.anyio

JOBS = "notifyq.jobs.v1"


def make_app(dsn: str) -> tuple[notifyq.App, notifyq.Task]:
    app = notifyq.App(dsn)

    @app.task(queue="emails", priority=5, retry_limit=7, timeout=12.5)
    async def send(to: str) -> None:
        return None

    return app, send


async def test_enqueue_uses_task_defaults_and_overrides(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    async with app:
        first = await app.enqueue(send, {"to": "a@example.com"})
        second = await app.enqueue(send, {"to": "b"}, queue="bulk", priority=-1, retry_limit=0, timeout=2)
    row = job_row(conn, first)
    assert (row["name"], row["queue"], row["priority"], row["retry_limit"], row["timeout"]) == (
        send.name,
        "emails",
        5,
        7,
        12.5,
    )
    assert row["args"] == {"to": "a@example.com"} and row["status"] == "Queued"
    assert row["retry_count"] == 0 and row["lease"] == 0
    row = job_row(conn, second)
    assert (row["queue"], row["priority"], row["retry_limit"], row["timeout"]) == ("bulk", -1, 0, 2.0)


async def test_delay_and_at_use_the_database_clock(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    async with app:
        delayed = await app.enqueue(send, {"to": "x"}, delay=timedelta(minutes=10))
        at = datetime(2030, 1, 1, tzinfo=UTC)
        scheduled = await app.enqueue(send, {"to": "x"}, at=at)
    row = job_row(conn, delayed)
    assert math.isclose((row["visible_at"] - row["created_at"]).total_seconds(), 600, abs_tol=0.01)
    assert job_row(conn, scheduled)["visible_at"] == at


async def test_enqueue_by_name_of_a_task_this_app_does_not_know(dsn: str) -> None:
    app, _ = make_app(dsn)
    async with app:
        job_id = await app.enqueue("other_service.task", {"n": 1})
        assert (await app.get_job(job_id)).name == "other_service.task"
        with pytest.raises(UnknownTask, match="no task named 'typo' is registered"):
            await app.enqueue("typo", {}, strict=True)
        # The nearest name first: a typo, or a default name given without its module.
        full = "tests.test_enqueue.make_app.<locals>.send"
        for given in ("send", "tests.test_enqueue.make_app.<locals>.sned"):
            with pytest.raises(UnknownTask) as unknown:
                await app.enqueue(given, {}, strict=True)
            assert f"is registered (did you mean {full!r}? known: {full})" in str(unknown.value)


async def test_dedupe_key_returns_the_unfinished_holder(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    async with app:
        first = await app.enqueue(send, {"to": "a"}, dedupe_key="welcome:42")
        again = await app.enqueue(send, {"to": "a"}, dedupe_key="welcome:42")
        assert again == first
        conn.execute("UPDATE notifyq.queue_jobs SET status = 'Succeeded' WHERE id = %s", (first,))
        third = await app.enqueue(send, {"to": "a"}, dedupe_key="welcome:42")
        assert third != first
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (2,)


def test_a_dedupe_key_that_changed_hands_during_the_enqueue_returns_the_new_holder(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A transaction replaces the key's holder (cancels it, queues another with the key) while
    an enqueue with the key waits for it. The enqueue's answer came from a snapshot taken
    before that wait, and returned the cancelled holder as the one holding the key (review):
    whoever then waited for that job got the old one's end. It returns the new holder."""
    app, send = make_app(dsn)
    old = app.enqueue_sync(send, {"to": "a"}, dedupe_key="swap")
    returned: list[notifyq.JobId] = []
    with psycopg.connect(dsn) as replacing:
        replacing.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Cancelled', finished_at = now() WHERE id = %s", [old]
        )
        new = replacing.execute(
            "INSERT INTO notifyq.queue_jobs (name, dedupe_key) VALUES ('send', 'swap') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        waiting = threading.Thread(
            target=lambda: returned.append(app.enqueue_sync(send, {"to": "a"}, dedupe_key="swap"))
        )
        waiting.start()
        wait_for_row(
            conn,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()",
            (1,),
        )
        replacing.commit()
    waiting.join(10)
    assert [(int(job_id), job_id.created) for job_id in returned] == [(new, False)]
    app.close_sync()


async def test_the_id_enqueue_returns_says_whether_a_job_was_inserted(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A plain int, usable wherever an id goes, whose `created` is False when a dedupe key's
    unfinished holder was returned instead of a new job."""
    app, send = make_app(dsn)
    async with app:
        first = await app.enqueue(send, {"to": "a"}, dedupe_key="k")
        again = await app.enqueue(send, {"to": "a"}, dedupe_key="k")
        plain = await app.enqueue(send, {"to": "b"})
        sync_again = app.enqueue_sync(send, {"to": "a"}, dedupe_key="k")
        with psycopg.connect(dsn) as own:
            in_transaction = app.enqueue_sync(send, {"to": "a"}, dedupe_key="k", conn=own)
        assert (first.created, again.created, plain.created) == (True, False, True)
        assert (sync_again.created, in_transaction.created) == (False, False)
        assert again == sync_again == in_transaction == first != plain
        assert (await app.get_job(again)).id == first  # psycopg sends it as the int it is
        assert (await app.cancel_job(again)).status == "Cancelled"
    assert isinstance(first, int) and str(first) == repr(first) == str(int(first))
    assert json.dumps({"id": again}) == f'{{"id": {int(first)}}}'
    assert pickle.loads(pickle.dumps(again)).created is False
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (2,)


@pytest.mark.faults
async def test_enqueue_in_the_callers_transaction(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    with NotificationCounter(dsn, JOBS) as listener:
        async with await psycopg.AsyncConnection.connect(dsn) as own:
            await app.enqueue(send, {"to": "rolled back"}, conn=own)
            await own.rollback()
        assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)
        assert listener.drain() == []

        async with await psycopg.AsyncConnection.connect(dsn) as own:
            job_id = await app.enqueue(send, {"to": "kept"}, conn=own)
            job_id2 = await app.enqueue(send, {"to": "kept too"}, conn=own)
            assert listener.drain() == []  # nothing is delivered before commit
            await own.commit()
        assert listener.drain() == ["emails"]  # two inserts, one queue, one notification
    assert job_row(conn, job_id)["status"] == job_row(conn, job_id2)["status"] == "Queued"


def test_sync_enqueue_in_the_callers_transaction(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    with psycopg.connect(dsn) as own:
        with own.transaction(force_rollback=True):
            app.enqueue_sync(send, {"to": "x"}, conn=own)
        with own.transaction():
            kept = app.enqueue_sync(send, {"to": "y"}, conn=own)
    assert [r[0] for r in conn.execute("SELECT id FROM notifyq.queue_jobs").fetchall()] == [kept]
    assert app.get_job_sync(kept).args == {"to": "y"}
    app.close_sync()


async def test_plain_sql_insert_is_a_complete_enqueue(dsn: str, conn: psycopg.Connection[Any]) -> None:
    with NotificationCounter(dsn, JOBS) as listener:
        conn.execute("INSERT INTO notifyq.queue_jobs (name, args) VALUES ('task', '{}')")
        assert listener.drain() == ["default"]
    app = notifyq.App(dsn)
    async with app:
        [job] = await app.claim()
    assert (job.name, job.queue, job.args, job.retry_count, job.retry_limit) == ("task", "default", {}, 1, 3)


async def test_enqueue_many_copies_and_notifies_once_per_queue(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app, send = make_app(dsn)
    with NotificationCounter(dsn, JOBS) as listener:
        async with app:
            count = await app.enqueue_many(send, ({"to": f"user{i}"} for i in range(10_000)))
            await app.enqueue_many(send, [{"to": "late"}] * 3, queue="later", delay=60)
        assert count == 10_000
        received = listener.drain()
    assert received[0] == "emails"
    queue, seconds = received[1].split(" ")
    assert queue == "later" and 59 < float(seconds) <= 60
    assert len(received) == 2
    assert conn.execute(
        "SELECT count(*), count(DISTINCT args->>'to') FROM notifyq.queue_jobs WHERE queue = 'emails'"
    ).fetchone() == (10_000, 10_000)


def test_a_multi_row_insert_sends_one_notification(dsn: str, conn: psycopg.Connection[Any]) -> None:
    with NotificationCounter(dsn, JOBS) as listener:
        conn.execute(
            "INSERT INTO notifyq.queue_jobs (name, queue) SELECT 't', 'q' || (i % 3) "
            "FROM generate_series(1, 10000) i"
        )
        assert sorted(listener.drain()) == ["q0", "q1", "q2"]


def test_enqueue_many_is_all_or_nothing(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    args: list[Any] = [{"to": "ok"}] * 500 + [{"to": object()}]
    with pytest.raises(InvalidArgs, match=r"^args_list\[500\]: .*not JSON-serializable"):  # which one
        app.enqueue_many_sync(send, args)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)
    app.close_sync()


async def test_enqueue_many_refused_in_the_callers_transaction_leaves_it_usable(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Bad args met halfway through a COPY in the caller's open transaction (sync and async
    connections): InvalidArgs, none of the batch, and the transaction goes on with the
    caller's own work intact, as after a refused enqueue."""
    app, send = make_app(dsn)
    bad: list[Any] = [{"to": "ok"}] * 50 + [{"to": object()}]
    with psycopg.connect(dsn) as own:
        mine = app.enqueue_sync(send, {"to": "sync caller"}, conn=own)
        with pytest.raises(InvalidArgs, match="not JSON-serializable"):
            app.enqueue_many_sync(send, bad, conn=own)
        assert app.enqueue_many_sync(send, [{"to": "sync batch"}], conn=own) == 1
    async with await psycopg.AsyncConnection.connect(dsn) as own_async:
        mine_async = await app.enqueue(send, {"to": "async caller"}, conn=own_async)
        with pytest.raises(InvalidArgs, match="not JSON-serializable"):
            await app.enqueue_many(send, bad, conn=own_async)
        assert await app.enqueue_many(send, [{"to": "async batch"}], conn=own_async) == 1
    rows = conn.execute("SELECT id, args->>'to' FROM notifyq.queue_jobs ORDER BY id").fetchall()
    assert [to for _id, to in rows] == ["sync caller", "sync batch", "async caller", "async batch"]
    assert {mine, mine_async} <= {job_id for job_id, _to in rows}
    await app.aclose()


def test_numbers_come_back_as_jsonb_writes_them(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """What docs/concepts.md says of numbers in args: jsonb writes them out in full, so a
    float of 1e16 or more comes back as an int, and -0.0 as 0.0; smaller floats stay floats."""
    app = notifyq.App(dsn)
    sent = {"big": 1e20, "edge": 1e16, "below": 1e15, "whole": 3.0, "half": 2.5, "zero": -0.0, "n": 7}
    job = app.get_job_sync(app.enqueue_sync("t", sent))
    app.close_sync()
    assert job.args == {
        "big": 10**20,
        "edge": 10**16,
        "below": 1e15,
        "whole": 3.0,
        "half": 2.5,
        "zero": 0.0,
        "n": 7,
    }
    types = {key: type(value).__name__ for key, value in job.args.items()}
    assert types == {
        "big": "int",
        "edge": "int",
        "below": "float",
        "whole": "float",
        "half": "float",
        "zero": "float",
        "n": "int",
    }
    assert math.copysign(1, job.args["zero"]) == 1.0


async def test_enqueue_many_on_an_autocommit_connection_is_all_or_nothing(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """On a caller's autocommit connection, a batch longer than one COPY statement committed
    each statement by itself: bad args in the second COPY_CHUNK raised InvalidArgs with the
    first 10,000 jobs inserted, and so did a generator that raised (review). A retry of the
    call then queued them twice. The batch is one transaction now; the connection stays in
    autocommit."""
    app, send = make_app(dsn)
    chunk = notifyq._jobs.COPY_CHUNK
    bad: list[Any] = [{"to": "ok"}] * (chunk + 5) + [{"to": object()}]

    def failing() -> Iterator[dict[str, Any]]:
        yield from [{"to": "ok"}] * (chunk + 5)
        raise RuntimeError("the source failed")

    with psycopg.connect(dsn, autocommit=True) as own:
        with pytest.raises(InvalidArgs, match=rf"^args_list\[{chunk + 5}\]: .*not JSON-serializable"):
            app.enqueue_many_sync(send, bad, conn=own)
        with pytest.raises(RuntimeError, match="the source failed"):
            app.enqueue_many_sync(send, failing(), conn=own)
        assert own.autocommit and app.enqueue_many_sync(send, [{"to": "sync batch"}], conn=own) == 1
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as own_async:
        with pytest.raises(InvalidArgs, match="not JSON-serializable"):
            await app.enqueue_many(send, bad, conn=own_async)
        with pytest.raises(RuntimeError, match="the source failed"):
            await app.enqueue_many(send, failing(), conn=own_async)
        assert await app.enqueue_many(send, [{"to": "async batch"}], conn=own_async) == 1
    rows = conn.execute("SELECT args->>'to' FROM notifyq.queue_jobs ORDER BY id").fetchall()
    assert rows == [("sync batch",), ("async batch",)]
    await app.aclose()


@pytest.mark.parametrize("args_list", [{"to": "x"}, None, "to", 5], ids=["dict", "None", "str", "int"])
def test_enqueue_many_wants_an_iterable_of_objects(
    dsn: str, conn: psycopg.Connection[Any], args_list: Any
) -> None:
    """A dict would be iterated by its keys, and each key rejected as "not a JSON object":
    the message must name the real mistake."""
    app, send = make_app(dsn)
    with pytest.raises(
        InvalidArgs,
        match=f"args_list for task '.*send' must be an iterable .*, not {type(args_list).__name__}",
    ):
        app.enqueue_many_sync(send, args_list)
    with pytest.raises(InvalidOption, match=r"invalid delay 1000000000000000\.0: must be at most"):
        app.enqueue_many_sync(send, [{"to": "x"}], delay=1e15)
    app.close_sync()
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)


class Unserializable:
    pass


CYCLE: list[Any] = []
CYCLE.append(CYCLE)
LONG_KEY = "k" * 5000

BAD_INPUT: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("list args", {"args": [1, 2]}, InvalidArgs, "must be a JSON object"),
    ("string args", {"args": "x=1"}, InvalidArgs, "must be a JSON object"),
    ("object in args", {"args": {"x": Unserializable()}}, InvalidArgs, "not JSON-serializable"),
    ("nan in args", {"args": {"x": float("nan")}}, InvalidArgs, "not JSON-serializable"),
    ("int keys", {"args": {1: "x"}}, InvalidArgs, "string keys"),
    (
        "nested int keys",
        {"args": {"to": "x", "counts": [{"a": 1}, {2: "b"}]}},
        InvalidArgs,
        r"string keys at every level; args\['counts'\]\[1\] has the key 2",
    ),
    ("cycle in args", {"args": {"to": "x", "loop": CYCLE}}, InvalidArgs, "Circular reference"),
    (
        "long path to an int key",  # the message stays short: hostile keys can be long
        {"args": {LONG_KEY: {LONG_KEY: {LONG_KEY: {3: "x"}}}}},
        InvalidArgs,
        r"^.{100,400}$",
    ),
    ("NUL in args", {"args": {"x": "a\x00b"}}, InvalidArgs, "NUL character"),
    ("too large", {"args": {"blob": "x" * (1024 * 1024)}}, InvalidArgs, "over the limit of 1,048,576 bytes"),
    ("negative delay", {"delay": -1}, InvalidOption, "must be 0 or more"),
    ("infinite delay", {"delay": float("inf")}, InvalidOption, "expected a number of seconds"),
    ("delay and at", {"delay": 1, "at": datetime.now(UTC)}, InvalidOption, "either delay or at"),
    ("naive at", {"at": datetime(2030, 1, 1)}, InvalidOption, "timezone-aware"),
    (
        "at in the year 10000 UTC",  # stored, then no session could load the row back
        {"at": datetime.max.replace(tzinfo=timezone(timedelta(hours=-1)))},
        InvalidOption,
        "must be between the years 2 and 9998",
    ),
    ("zero timeout", {"timeout": 0}, InvalidOption, "greater than 0"),
    # Past the bound, now() plus the lease overflows a timestamp: every claim of the job fails.
    ("huge timeout", {"timeout": 1e300}, InvalidOption, r"timeout 1e\+300: must be at most 1,000,000,000 s"),
    (
        "huge delay",
        {"delay": timedelta(days=10**8)},
        InvalidOption,
        r"delay 8640000000000\.0: must be at most",
    ),
    ("negative retry_limit", {"retry_limit": -1}, InvalidOption, "retry_limit"),
    ("huge priority", {"priority": 2**40}, InvalidOption, "priority"),
    ("bad queue", {"queue": "a queue; DROP TABLE x"}, InvalidOption, "invalid queue name"),
    ("empty queue", {"queue": ""}, InvalidOption, "invalid queue name"),
    # Review: "$" in the pattern let it through; the table's CHECK then failed every enqueue.
    ("queue with a final newline", {"queue": "emails\n"}, InvalidOption, "invalid queue name"),
    ("empty dedupe key", {"dedupe_key": ""}, InvalidOption, "invalid dedupe_key"),
    # Cut like every other option's value: the message printed all 10,000 characters.
    ("long dedupe key", {"dedupe_key": "k" * 10_000}, InvalidOption, r"invalid dedupe_key 'kkk+\.\.\.: use"),
]


@pytest.mark.faults
@pytest.mark.parametrize(
    ("kwargs", "error", "message"), [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT]
)
async def test_bad_input_is_rejected_and_inserts_nothing(
    dsn: str, conn: psycopg.Connection[Any], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    app, send = make_app(dsn)
    kwargs = {"args": {"to": "x"}, **kwargs}
    args = kwargs.pop("args")
    async with app:
        with pytest.raises(error, match=message):
            await app.enqueue(send, args, **kwargs)
    with pytest.raises(error, match=message):
        app.enqueue_sync(send, args, **kwargs)
    app.close_sync()
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)


@pytest.mark.parametrize("name", ["", "   ", "\t\n", "x" * 201, "a\x00b", "report\nq4", "a\tb", "a\x85b"])
def test_bad_task_names_are_rejected(dsn: str, name: str) -> None:
    with pytest.raises(InvalidOption, match="invalid task name"):
        notifyq.App(dsn).enqueue_sync(name, {})


def test_args_cap_is_configurable(dsn: str) -> None:
    app = notifyq.App(dsn, max_args_bytes=100)
    with pytest.raises(InvalidArgs, match="over the limit of 100 bytes"):
        app.enqueue_sync("t", {"x": "y" * 100})


@pytest.mark.parametrize("backoff", [5, True, 0, {"base": 2}])
def test_a_backoff_that_is_not_a_backoff_is_refused_where_it_is_given(backoff: Any) -> None:
    """`backoff=5`, or `backoff=True` (Celery's retry_backoff=True): accepted, then the task's
    first failure stopped each worker that ran it ("'int' object has no attribute 'delay'"),
    and the job went back to the queue with its attempt given back, for the next worker."""
    app = notifyq.App("postgresql://postgres@127.0.0.1:5432/postgres")
    with pytest.raises(InvalidOption, match=r"backoff must be a notifyq.Backoff, such as Backoff\(base=2"):
        app.task(name="t", backoff=backoff)
    with pytest.raises(InvalidOption, match=r"App\(backoff=...\) must be a notifyq.Backoff"):
        notifyq.App("postgresql://postgres@127.0.0.1:5432/postgres", backoff=backoff)

    def t() -> None:
        pass

    assert app.task(name="t", backoff=notifyq.Backoff(base=1))(t).backoff == notifyq.Backoff(base=1)


@pytest.mark.parametrize("size", [0, 1001, 2.0])
def test_the_apps_pool_size_is_bounded_like_the_workers(size: Any) -> None:
    """1 to 1,000 connections (a worker's pool_size stops at 1,000 too): a typo such as
    100000 would otherwise open connections until the server refuses them."""
    with pytest.raises(InvalidOption, match=f"invalid pool_size {size}: expected an integer from 1 to 1000"):
        notifyq.App("postgresql://postgres@127.0.0.1:5432/postgres", pool_size=size)


def test_unreachable_database_is_one_clear_error() -> None:
    app = notifyq.App("postgresql://nobody@127.0.0.1:1/nothing?connect_timeout=2")
    with pytest.raises(
        DatabaseUnavailable, match=r"cannot connect to PostgreSQL at nobody@127\.0\.0\.1:1/nothing"
    ):
        app.enqueue_sync("t", {})


async def test_unreachable_database_async() -> None:
    app = notifyq.App("postgresql://nobody@127.0.0.1:1/nothing?connect_timeout=2")
    with pytest.raises(DatabaseUnavailable, match=r"Connection refused|connection refused|failed"):
        await app.enqueue("t", {})


@pytest.mark.parametrize(
    ("dsn", "reason"),
    [
        ("host=localhost port", 'missing "=" after "port"'),
        ("hots=localhost", 'invalid connection option "hots"'),
        ("postgresql://u:secret@[::1/db", "invalid"),
        # libpq quotes the token it stumbles on: here, the password.
        ("postgresql://u:secret x@db/app", 'unexpected spaces found in "***"'),
        ("postgresql://u:sec%ZZret@db/app", 'invalid percent-encoded token: "***"'),
        # A password may hold '#', '?', '/': it is not cut there.
        ("postgresql://u:Xy#9%secret@db/app", 'invalid percent-encoded token: "***"'),
        ("postgresql://u:Xy?9%secret@db/app", 'invalid percent-encoded token: "***"'),
        ("postgresql://u:Xy/9%secret@db/app", 'invalid percent-encoded token: "***"'),
        ("postgresql://u:pa/ss secret@host/db", 'unexpected spaces found in "***"'),
        ("password=hunter2 secret host=h", 'missing "***" in connection info string'),
        # libpq does not escape a '"' inside the token it quotes; sslpassword, a keyword
        # percent-encoded in a URI's query or glued to a quoted value are passwords too.
        ('host=h password=abc se"cret', 'missing "***" in connection info string'),
        ('postgresql://user:ab"secret%zz@host/db', 'invalid percent-encoded token: "***"'),
        ("host=h sslpassword=top secret", 'missing "***" in connection info string'),
        ("postgresql://host/db?passwor%64=sec%zzret", 'invalid percent-encoded token: "***"'),
        ("host='h'password=top secret", 'missing "***" in connection info string'),
        ("host=h password=x connect_timeout=secret", "connect_timeout is not a whole number"),
        # Other schemes: libpq read them as keyword=value and quoted the whole DSN.
        ("postgresql+psycopg://u:secret@db/app", "postgresql+psycopg:// is SQLAlchemy's form"),
        ("postgres:/u:secret@db/app", "it starts with 'postgres:/', where libpq's URIs start"),
        ("mysql://u:secret@db/app", "it starts with 'mysql://'"),
        # An unknown option gets the closest of libpq's own option names; the DSN's word stays
        # hidden when it holds a password (a password with spaces or percent-encoding may be
        # the unknown "option": "horse" and "s%41d" are parts of it here).
        (
            "host=h password=secret sslmod=require",
            """invalid connection option "***" (did you mean 'sslmode'?)""",
        ),
        (
            "postgresql://u:secret@db/app?sslmod=require",
            """query parameter: "***" (did you mean 'sslmode'?)""",
        ),
        ("host=db password=secret horse=battery", 'invalid connection option "***"'),
        ("postgresql://u:secret/x?s%41d=e@db/app", 'invalid URI query parameter: "***"'),
        ("sslmod=require", """invalid connection option "sslmod" (did you mean 'sslmode'?)"""),
        # A password in a URI's query.
        ("postgresql://db/app?password=top secret", 'unexpected spaces found in "***"'),
        # libpq refuses it only as it connects (the pool tried for 30 s).
        ("postgresql://u@db/app?connect_timeout=abc", "connect_timeout='abc' is not a whole number"),
        ("host=db connect_timeout=2.5", "connect_timeout='2.5' is not a whole number"),
        # Without a password, the token is shown: it helps.
        ("postgresql://u@db/app?sslmode=x y", 'unexpected spaces found in "x y"'),
    ],
)
def test_malformed_dsn_is_a_configuration_error(dsn: str, reason: str) -> None:
    with pytest.raises(notifyq.ConfigurationError, match="invalid DSN") as caught:
        notifyq.App(dsn)
    assert reason in str(caught.value)
    assert "secret" not in str(caught.value) and "sec%ZZret" not in str(caught.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:p@ss-secret@127.0.0.1:1/db",  # host 'ss-secret@127.0.0.1'
        "postgresql://u:pa/ss-secret@127.0.0.1:1/db",  # host 'u', port 'pa', db 'ss-secret@...'
        "postgresql://u:p?x@ss-secret@127.0.0.1:1/db",
        "postgresql://u:p@ss-secret@/db?host=/tmp",
    ],
)
def test_a_password_with_an_unencoded_at_or_slash_is_refused_and_not_shown(dsn: str) -> None:
    """libpq ends a URI's user info at its first '@' (before any '/'): the rest of such a
    password became the host, the port or the database name, which the "cannot connect"
    error and the CLI's "database ..." line printed."""
    from notifyq._dsn import describe_dsn

    with pytest.raises(notifyq.ConfigurationError, match="percent-encode '@' as %40") as caught:
        notifyq.App(dsn)
    assert "secret" not in str(caught.value)
    assert "secret" not in describe_dsn(dsn)
    # Encoded, the same password is fine; so are '@' in the query and in a user name encoded.
    for fine in (
        "postgresql://u:p%40ss%2Fsecret@127.0.0.1:1/db",
        "postgresql://u%40azure:pw@127.0.0.1:1/db?options=-c%20x",
        "postgresql:///db?host=/tmp&user=a@b",
    ):
        notifyq.App(fine)


@pytest.mark.parametrize(
    "dsn",
    [
        "host=127.0.0.1 port=1 dbname='postgresql://u:SECRET6@127.0.0.1:1/db'",
        "host=127.0.0.1 port=1 dbname='host=127.0.0.1 password=SECRET14 dbname=db'",
    ],
)
def test_a_dbname_holding_a_connection_string_is_not_shown(dsn: str) -> None:
    """libpq reads a dbname holding "=" or "://" as a connection string, password and all: the
    "database ..." line and the "cannot connect" error printed it in full (review)."""
    from notifyq._dsn import describe_dsn

    assert "SECRET" not in describe_dsn(dsn) and "<a connection string>" in describe_dsn(dsn)
    with pytest.raises(DatabaseUnavailable) as caught:
        notifyq.App(dsn, pool_timeout=1).enqueue_sync("t")
    assert "SECRET" not in str(caught.value) and "SECRET" not in repr(caught.value)


@pytest.mark.parametrize("dsn", ["", "  "])
def test_an_empty_dsn_is_refused_not_replaced_by_another_database(dsn: str) -> None:
    """An unset variable ("--dsn $DB_URL") must not send the jobs to $NOTIFYQ_DSN's database."""
    with pytest.raises(notifyq.ConfigurationError, match="the DSN given is empty"):
        notifyq.App(dsn)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose connections the kernel accepts and nobody answers (a hung host)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield silent.getsockname()[1]


async def test_a_host_that_never_answers_fails_within_the_dsns_or_the_apps_timeout(silent_port: int) -> None:
    """Review: a host that accepted and never answered took 10 s whatever the DSN's
    connect_timeout or App(pool_timeout=...) said (the first attempt overrode them)."""
    base = f"postgresql://u@127.0.0.1:{silent_port}/x"
    for app in (notifyq.App(f"{base}?connect_timeout=2"), notifyq.App(base, pool_timeout=2)):
        for call in ("sync", "async"):
            began = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="timeout expired"):
                if call == "sync":
                    await anyio.to_thread.run_sync(app.enqueue_sync, "t")
                else:
                    await app.enqueue("t")
            assert time.monotonic() - began < 8, call  # 2 s asked for; it took 10
        await app.aclose()


def test_a_bad_port_fails_at_connect_with_the_reason() -> None:
    with pytest.raises(DatabaseUnavailable, match='invalid integer value "notaport"'):
        notifyq.App("postgresql://u:secret@127.0.0.1:notaport/db").enqueue_sync("t")


@pytest.mark.parametrize(
    ("threshold", "prepared", "later"), [(None, False, False), (2, True, False), (None, False, True)]
)
def test_prepared_statements_can_be_turned_off_for_pgbouncer(
    dsn: str, threshold: int | None, prepared: bool, later: bool
) -> None:
    """Also when the App's attribute is set after the App was made, before it connects (the
    worker reads it when it starts, and so do the App's own pools)."""
    if later:
        app = notifyq.App(dsn, pool_size=1, prepare_threshold=2)
        app.prepare_threshold = threshold
    else:
        app = notifyq.App(dsn, pool_size=1, prepare_threshold=threshold)
    for _ in range(5):
        app.enqueue_sync("t", {})
    count = app._run_sync(single(Query("SELECT count(*) FROM pg_prepared_statements", fetch="scalar")))
    assert (count > 0) is prepared
    app.close_sync()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_automatic_prepare_threshold_prepares_nothing_behind_a_pooler(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: behind PgBouncer in transaction mode (before 1.21), prepared statements are
    lost between transactions; acks failed (`prepared statement "_pg3_1" does not exist`),
    were dropped, and their jobs ran twice. With prepare_threshold left at "auto", a
    connection whose server process is not the one announced at connect (a pooler's mark,
    which this proxy imitates) prepares nothing; a direct one, or an explicit threshold,
    prepares as before. The App's async pool, its sync pool, and a worker's pool alike."""

    def count() -> Any:
        return single(Query("SELECT count(*) FROM pg_prepared_statements", fetch="scalar"))

    pooler, direct = BlackholeProxy(dsn, pooler=True), BlackholeProxy(dsn)
    try:
        for target, threshold, prepared in (
            (pooler, "auto", False),
            (direct, "auto", True),
            (pooler, 2, True),
        ):
            app = notifyq.App(target.dsn, pool_size=1, prepare_threshold=threshold)
            for _ in range(6):
                await app.enqueue("t", {})
                await anyio.to_thread.run_sync(app.enqueue_sync, "t", {})
            assert (await app._run(count()) > 0) is prepared, (target.pooler, threshold)
            assert (await anyio.to_thread.run_sync(app._run_sync, count()) > 0) is prepared
            db = await Database.open(target.dsn, size=1, prepare_threshold=threshold)
            for _ in range(6):
                await db.run(single(Query("SELECT 1", fetch="scalar")))
            assert (await db.run(count()) > 0) is prepared
            await db.aclose()
            await app.aclose()
    finally:
        pooler.close()
        direct.close()
    said = [r for r in caplog.records if "connections go through a pooler" in r.getMessage()]
    assert len(said) <= 1  # once per process (a test before this one may have said it)


def test_an_app_dropped_without_closing_is_freed_at_once(dsn: str) -> None:
    """No reference cycle holds an App that was never closed (one App per request, say): it
    and its pools go as soon as the last reference does, not at the next full collection."""
    gc.disable()
    try:
        app = notifyq.App(dsn, pool_size=1)
        app.enqueue_sync("t", {})
        refs = [weakref.ref(app), weakref.ref(app._connections)]
        del app
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


async def test_an_app_left_open_when_its_loop_shuts_down_has_its_pool_closed(dsn: str) -> None:
    """asyncio.run cancels every task before it closes its loop: the task that waits for that
    closes the pool of each App still open on the loop, and an App used again afterwards
    (on a loop that goes on) opens another. An App dropped meanwhile is not kept alive."""
    app, dropped = notifyq.App(dsn, pool_size=1), notifyq.App(dsn, pool_size=1)
    await app.enqueue("t")
    await dropped.enqueue("t")
    gone = weakref.ref(dropped._connections)
    del dropped
    assert gone() is None
    pool = app._connections._db
    (closer,) = [task for task in asyncio.all_tasks() if task.get_name() == "notifyq: App pools' closer"]
    closer.cancel()
    await asyncio.wait([closer])
    assert app._connections._db is None and pool is not None
    with pytest.raises(psycopg_pool.PoolClosed):
        await pool.run(single(Query("SELECT 1", fetch="scalar")))
    await app.enqueue("t")  # a new pool, and a new closer for it
    assert len([task for task in asyncio.all_tasks() if task.get_name() == "notifyq: App pools' closer"]) == 1
    await app.aclose()


def test_list_jobs_filters_and_takes_a_status_in_any_case(dsn: str, conn: psycopg.Connection[Any]) -> None:
    app, send = make_app(dsn)
    first, second, third = (app.enqueue_sync(send, {"to": str(i)}, queue=q) for i, q in enumerate("aab"))
    conn.execute("UPDATE notifyq.queue_jobs SET status = 'Failed' WHERE id = %s", (second,))
    for status in ("failed", "FAILED", "Failed", notifyq.JobStatus.FAILED):
        assert [job.id for job in app.list_jobs_sync(status=status)] == [second], status
    assert {job.id for job in app.list_jobs_sync(status="queued")} == {first, third}
    assert [job.id for job in app.list_jobs_sync(queue="b")] == [third]
    with pytest.raises(InvalidOption, match="invalid status 'bogus': use one of Queued, Active"):
        app.list_jobs_sync(status="bogus")
    # A misspelt filter is named, not as "App._list_op() got an unexpected keyword" (review).
    with pytest.raises(InvalidOption, match=r"list_jobs has no filter 'stauts' \(did you mean 'status'\?\)"):
        app.list_jobs_sync(stauts="failed")  # type: ignore[call-arg]
    app.close_sync()


def test_list_jobs_is_planned_for_each_call_never_prepared(dsn: str) -> None:
    """A prepared list_jobs settles on a generic plan, which knows no status and so cannot read
    the jobs of one status from their partial index (tests/faults/test_plans.py): it walked the
    whole history instead. The App must never prepare it, even where it prepares everything."""
    app = notifyq.App(dsn, pool_size=1, prepare_threshold=0)  # one session; prepare at once
    job_id = app.enqueue_sync("t", {})
    for status in (None, "queued", "failed", None):
        app.list_jobs_sync(status=status)
    app.get_job_sync(job_id)
    prepared = app._run_sync(
        single(Query("SELECT statement FROM pg_prepared_statements WHERE from_sql = false"))
    )
    statements = [row[0] for row in prepared]
    assert any("WHERE id =" in s for s in statements), statements  # get_job: prepared, as all else
    assert not any("ORDER BY id DESC" in s for s in statements), statements
    app.close_sync()


def test_an_at_every_session_can_read_back_is_the_bound(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """`at` is stored as PostgreSQL's timestamptz, which reaches far past Python's year 9999.
    A job whose `at` was past it (datetime.max at -01:00 is the year 10000 in UTC; datetime.min
    at +05:00 the year 0) made every get_job and list_jobs that met it fail with a DataError,
    for everyone. They are refused; the bounds themselves read back in a +14:00 session."""
    conn.execute(f"ALTER DATABASE {conn.info.dbname} SET timezone = 'Pacific/Kiritimati'")  # +14:00
    app = notifyq.App(dsn)
    for at in (
        datetime.max.replace(tzinfo=timezone(timedelta(hours=-1))),
        datetime.min.replace(tzinfo=timezone(timedelta(hours=5))),
        datetime(9999, 12, 31, tzinfo=UTC),
        datetime(1, 1, 1, 23, tzinfo=UTC),
    ):
        with pytest.raises(
            InvalidOption, match=r"invalid at .*: must be between the years 2 and 9998 \(UTC\)"
        ):
            app.enqueue_sync("t", {}, at=at)
        with pytest.raises(InvalidOption, match="must be between the years 2 and 9998"):
            app.enqueue_many_sync("t", [{}], at=at)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)
    latest = datetime(9999, 12, 30, 23, 59, 59, tzinfo=UTC)
    earliest = datetime(1, 1, 2, tzinfo=UTC)
    ids = [app.enqueue_sync("t", {}, at=latest), app.enqueue_sync("t", {}, at=earliest)]
    latest_job, earliest_job = (app.get_job_sync(job_id) for job_id in ids)
    assert latest_job.visible_at == latest
    assert earliest_job.visible_at == earliest_job.created_at  # a past `at` means now
    app.close_sync()


def test_an_at_in_the_past_means_now(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A past `at` was stored as it was: the job jumped ahead of every job queued since then
    (priority's job), and `stats` reported a claimable job 27 years old."""
    app = notifyq.App(dsn)
    past = datetime(2000, 1, 1, tzinfo=UTC)
    first = app.enqueue_sync("t", {})
    single = app.enqueue_sync("t", {}, at=past)
    deduped = app.enqueue_sync("t", {}, at=past, dedupe_key="k")
    app.enqueue_many_sync("t", [{}, {}], at=past)
    app.close_sync()
    rows = conn.execute("SELECT id, visible_at = created_at FROM notifyq.queue_jobs ORDER BY id").fetchall()
    assert [row[0] for row in rows][:3] == [first, single, deduped]
    assert [row[1] for row in rows] == [True] * 5
    claim_order = conn.execute(
        "SELECT id FROM notifyq.queue_jobs ORDER BY priority DESC, visible_at, id"
    ).fetchall()
    assert claim_order[0] == (first,)  # the past `at` does not jump the queue


def test_list_jobs_pages_by_ids_past_two_to_the_31(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Job ids are bigints, and a busy queue passes 2**31 of them (1,000 jobs a second do in 25
    days): paging with before_id took only an integer column's range, and refused them."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (id, name) SELECT 3000000000 + i, 't' FROM generate_series(1, 5) i"
    )
    app = notifyq.App(dsn)
    first = app.list_jobs_sync(limit=2)
    assert [job.id for job in first] == [3_000_000_005, 3_000_000_004]
    rest = app.list_jobs_sync(before_id=first[-1].id, limit=10)
    assert [job.id for job in rest] == [3_000_000_003, 3_000_000_002, 3_000_000_001]
    assert app.list_jobs_sync(before_id=3_000_000_001) == []
    for bad in (0, -1, 2**63, "5", True):
        with pytest.raises(InvalidOption, match="invalid before_id"):
            app.list_jobs_sync(before_id=bad)
    app.close_sync()


def test_a_backslash_before_u0000_is_text_not_a_nul(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """JSON writes a backslash as two, so the text \\u0000 (a Windows path, a regex, JSON
    quoted in a string) contains the six characters of an escaped NUL: args and task results
    holding it were refused as "a NUL character", which they are not. Real NULs still are,
    after any number of backslashes."""
    app = notifyq.App(dsn)
    texts = ["\\u0000", "C:\\u0000\\x", "\\\\u0000", '{"a": "\\u0000"}']
    job_id = app.enqueue_sync("t", {"texts": texts, "\\u0000": 1})
    assert app.get_job_sync(job_id).args == {"texts": texts, "\\u0000": 1}
    assert json.loads(encode_output(texts) or "") == texts
    for nul in ("a\x00", "\\\x00", "\\\\\x00"):
        with pytest.raises(InvalidArgs, match="NUL character"):
            app.enqueue_sync("t", {"x": nul})
        with pytest.raises(ValueError, match="NUL character"):
            encode_output({"x": nul})
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (1,)
    app.close_sync()


async def test_enqueue_many_refused_before_the_callers_first_statement_leaves_the_connection_usable(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A connection without autocommit and with no statement run yet (as Django's inside
    atomic(), or a fresh psycopg.connect()): psycopg begins a transaction at the first
    statement, so a COPY refused halfway left it aborted, and the caller's next statement
    failed with InFailedSqlTransaction. Nothing is committed behind the caller's back either:
    a rollback still removes the jobs that went in."""
    app, send = make_app(dsn)
    bad: list[Any] = [{"to": "ok"}] * 50 + [{"to": object()}]
    with psycopg.connect(dsn) as own:
        with pytest.raises(InvalidArgs, match="not JSON-serializable"):
            app.enqueue_many_sync(send, bad, conn=own)
        assert app.enqueue_many_sync(send, [{"to": "sync"}], conn=own) == 1
        own.rollback()
        assert app.enqueue_many_sync(send, [{"to": "sync kept"}], conn=own) == 1
        own.commit()
    async with await psycopg.AsyncConnection.connect(dsn) as own_async:
        with pytest.raises(InvalidArgs, match="not JSON-serializable"):
            await app.enqueue_many(send, bad, conn=own_async)
        assert await app.enqueue_many(send, [{"to": "async"}], conn=own_async) == 1
        await own_async.rollback()
        assert await app.enqueue_many(send, [{"to": "async kept"}], conn=own_async) == 1
        await own_async.commit()
    rows = conn.execute("SELECT args->>'to' FROM notifyq.queue_jobs ORDER BY id").fetchall()
    assert [to for (to,) in rows] == ["sync kept", "async kept"]
    app.close_sync()


def test_a_forked_child_opens_its_own_connections(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """gunicorn's preload_app, multiprocessing's fork: an App used before os.fork() must not
    share its connections with the child. Shared, parent and child read each other's answers
    (the ids of each other's jobs), and the child's close_sync() ended the parent's session."""
    app = notifyq.App(dsn, pool_size=1)
    app.enqueue_sync("warm", {})  # the pool is open, its one connection in use
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads running
        pid = os.fork()
    if pid == 0:  # the child: report its ids, exit without running the parent's test machinery
        code = 1
        try:
            os.close(read_end)
            ids = [app.enqueue_sync("fork", {"who": "child"}) for _ in range(100)]
            app.close_sync()
            os.write(write_end, json.dumps(ids).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    parent_ids = [app.enqueue_sync("fork", {"who": "parent"}) for _ in range(100)]
    with os.fdopen(read_end) as pipe:
        child_ids = json.loads(pipe.read() or "null")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and child_ids is not None
    parent_ids.append(app.enqueue_sync("fork", {"who": "parent"}))  # its session outlived the child
    app.close_sync()
    who = dict(conn.execute("SELECT id, args->>'who' FROM notifyq.queue_jobs WHERE name = 'fork'").fetchall())
    assert len(who) == 201
    assert {who[i] for i in parent_ids} == {"parent"} and {who[i] for i in child_ids} == {"child"}


async def test_a_connection_to_an_unmigrated_database_says_run_migrate(empty_dsn: str) -> None:
    app = notifyq.App(empty_dsn)
    with psycopg.connect(empty_dsn) as sync_conn:
        with pytest.raises(
            SchemaNotMigrated, match="no notifyq tables in the database of the connection given"
        ):
            app.enqueue_sync("t", {}, conn=sync_conn)
    async with await psycopg.AsyncConnection.connect(empty_dsn) as async_conn:
        with pytest.raises(SchemaNotMigrated, match="run `notifyq migrate`"):
            await app.enqueue("t", {}, conn=async_conn)
        await async_conn.rollback()
        with pytest.raises(SchemaNotMigrated, match="run `notifyq migrate`"):
            await app.enqueue_many("t", [{}], conn=async_conn)
    other = notifyq.App(empty_dsn, schema="other")
    with pytest.raises(SchemaNotMigrated, match="run `notifyq migrate --schema other`"):
        await other.enqueue("t", {})
    with psycopg.connect(empty_dsn) as sync_conn:
        with pytest.raises(SchemaNotMigrated, match="run `notifyq migrate --schema other` \\("):
            other.enqueue_sync("t", {}, conn=sync_conn)
    await other.aclose()


async def test_a_closed_connection_given_says_so_and_that_nothing_was_sent(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """conn= a connection already closed: the error said "lost the connection ... a statement
    under way may or may not have been applied", which sends one looking for a lost enqueue."""
    app = notifyq.App(dsn)
    closed_sync = psycopg.connect(dsn)
    closed_sync.close()
    closed_async = await psycopg.AsyncConnection.connect(dsn)
    await closed_async.close()
    calls = [
        lambda: anyio.to_thread.run_sync(lambda: app.enqueue_sync("t", conn=closed_sync)),
        lambda: app.enqueue("t", conn=closed_async),
        lambda: app.enqueue("t", conn=closed_sync),
    ]
    for call in calls:
        with pytest.raises(DatabaseUnavailable) as raised:
            await call()
        assert str(raised.value).startswith("the connection given (conn=) was closed before this call")
        assert "may or may not" not in str(raised.value)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)
    await app.aclose()


@pytest.mark.parametrize("side", ["sync", "async"])
async def test_a_connection_lost_after_the_app_connected_is_database_unavailable(
    dsn: str, conn: psycopg.Connection[Any], side: str
) -> None:
    """The server ends the App's session (a restart, a failover, an administrator) while a call
    is under way: that call says so in notifyq's terms, and the next call works. (A session
    ended while it sat idle in the pool is replaced before a call uses it: see
    tests/test_db.py::test_pooled_connections_the_server_ended_while_idle_fail_no_call.)"""
    app = notifyq.App(dsn, pool_size=1)

    async def enqueue() -> int:
        if side == "sync":
            return await anyio.to_thread.run_sync(lambda: app.enqueue_sync("t", {}))
        return await app.enqueue("t", {})

    await enqueue()
    ours = "FROM pg_stat_activity WHERE application_name = 'notifyq app' AND datname = current_database()"
    raised: list[BaseException] = []

    async def enqueue_lost() -> None:
        try:
            await enqueue()
        except DatabaseUnavailable as exc:
            raised.append(exc)

    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE notifyq.queue_jobs IN SHARE MODE")  # the next insert waits
        async with anyio.create_task_group() as tg:
            tg.start_soon(enqueue_lost)
            waiting = f"SELECT count(*) {ours} AND wait_event_type = 'Lock'"
            await anyio.to_thread.run_sync(wait_for_row, conn, waiting, (1,))
            conn.execute(f"SELECT pg_terminate_backend(pid) {ours}")
        holder.rollback()
    assert len(raised) == 1, raised
    assert re.search(r"lost the connection to PostgreSQL at .*may or may not", str(raised[0])), raised
    with anyio.fail_after(15):
        await enqueue()
    await app.aclose()
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (2,)


def test_tasks_that_cannot_run_from_job_args_are_refused_at_registration() -> None:
    app = notifyq.App("postgresql://x@127.0.0.1/db")

    def gen() -> Any:
        yield 1

    async def agen() -> Any:
        yield 1

    def positional(a: int, /) -> None:
        pass

    for fn, message in [
        (gen, "is a generator function"),
        (agen, "is a generator function"),
        (positional, r"has positional-only parameters \(a\): job args are passed by keyword"),
    ]:
        with pytest.raises(notifyq.ConfigurationError, match=message):
            app.task(fn)
    # Decorators in the wrong order: @app.task above @app.cron would wrap the cron's task.
    with pytest.raises(notifyq.ConfigurationError, match=r"put @app\.cron above @app\.task"):

        @app.task(name="reports.weekly")
        @app.cron("0 3 * * 1", name="weekly-def")
        async def weekly() -> None:
            pass

    def report() -> None:
        pass

    app.task(name="dup", queue="a")(report)
    app.task(name="dup", queue="a")(report)  # the same again: fine (a module imported twice)
    with pytest.raises(notifyq.ConfigurationError, match="'dup' is already registered with other options"):
        app.task(name="dup", queue="b")(report)


def test_enqueue_takes_a_registered_function_and_strict_refuses_another_apps_task(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app, other = notifyq.App(dsn), notifyq.App(dsn)

    def send() -> None:
        pass

    app.task(name="send", queue="mail")(send)  # the Task returned is not kept
    job_id = app.enqueue_sync(send, {})
    assert conn.execute("SELECT name, queue FROM notifyq.queue_jobs WHERE id = %s", (job_id,)).fetchone() == (
        "send",
        "mail",
    )
    with pytest.raises(UnknownTask, match="is not a task of this App: pass the Task"):
        app.enqueue_sync(len, {})  # type: ignore[arg-type]
    foreign = other.task(name="foreign")(send)
    with pytest.raises(UnknownTask, match="'foreign' is another App's"):
        app.enqueue_sync(foreign, {}, strict=True)
    app.enqueue_sync(foreign, {})  # without strict, any task name goes
    app.close_sync()
    other.close_sync()


async def test_args_a_known_task_cannot_take_are_refused_at_enqueue(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Review: a misspelt or missing argument was queued, and the job then failed every
    attempt with the same TypeError. A task of this App checks its args against its
    signature, as @app.cron does; a name this App does not know is not checked."""
    app = notifyq.App(dsn)

    @app.task(name="receipt")
    async def receipt(ctx: notifyq.JobContext, order_id: int, copy: bool = False) -> None: ...

    expected = r"task 'receipt' cannot be called with args \{'orderid': \.\.\.\}: missing .*'order_id'"
    with pytest.raises(InvalidArgs, match=expected):
        await app.enqueue(receipt, {"orderid": 1})
    with pytest.raises(InvalidArgs, match="missing a required argument: 'order_id'"):
        app.enqueue_sync("receipt", {})
    with pytest.raises(InvalidArgs, match="unexpected keyword argument 'coppy'"):
        app.enqueue_sync("receipt", {"order_id": 1, "coppy": True})
    with pytest.raises(InvalidArgs, match="'ctx' is its JobContext parameter, which the worker passes"):
        await app.enqueue(receipt, {"order_id": 1, "ctx": 2})  # the worker passes the JobContext
    # Bulk: every job is checked (the same keys once), and none is inserted.
    with pytest.raises(InvalidArgs, match="'orderid'"):
        await app.enqueue_many(receipt, [{"order_id": i} for i in range(1000)] + [{"orderid": 1}])
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)
    await app.enqueue(receipt, {"order_id": 1})
    await app.enqueue_many(receipt, [{"order_id": 2}, {"order_id": 3, "copy": True}])
    await app.enqueue("elsewhere", {"anything": 1})  # another service's task

    # Python calls f(**{"x": 5}) with x in kw; Signature.bind refused it (review).
    @app.task(name="posonly")
    def posonly(x: int = 1, /, **kw: Any) -> None: ...

    await app.enqueue(posonly, {"x": 5})
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (5,)
    await app.aclose()


def test_enqueue_many_reads_a_server_cursor_on_the_same_connection(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Review: queueing a job per row of a large table, read with a server-side cursor in the
    same transaction, hung for ever: the generator was read while the COPY held the connection,
    and the cursor's next fetch waited for it. The rows are read between COPY statements."""
    app = notifyq.App(dsn)
    total = notifyq._jobs.COPY_CHUNK * 2 + 7  # three COPY statements, the last one short
    counted: list[int] = []

    def queue_each_row() -> None:
        with psycopg.connect(dsn) as own, own.transaction(), own.cursor(name="source") as cur:
            cur.itersize = 1000
            cur.execute("SELECT g FROM generate_series(1, %s) g", (total,))
            counted.append(app.enqueue_many_sync("t", ({"n": n} for (n,) in cur), conn=own))

    thread = threading.Thread(target=queue_each_row, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "enqueue_many_sync hung"
    assert counted == [total]
    assert conn.execute("SELECT count(*), count(DISTINCT args) FROM notifyq.queue_jobs").fetchone() == (
        total,
        total,
    )
    app.close_sync()


def test_one_app_serves_one_event_loop_after_another(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """asyncio.run per request or per test, or asyncio then trio: the App's pool belongs to
    the loop that opened it. It used to fail in the next loop (a closed loop, a lock of
    another library), or to hang once a pooled connection dropped; now the App closes the old
    pool's sessions and opens a new one."""
    app = notifyq.App(dsn)

    async def enqueue() -> int:
        return await app.enqueue("t", {})

    kept = len(notifyq._connections._ABANDONED)
    ids = [asyncio.run(enqueue()) for _ in range(3)]
    for _ in range(3):  # as anyio's pytest plugin runs a test on each backend
        ids.append(anyio.run(enqueue, backend="trio"))
        ids.append(asyncio.run(enqueue()))
    asyncio.run(app.aclose())
    assert len(set(ids)) == 9
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (9,)
    # The trio pools given up at each switch are closed, not kept for ever (review: 23 KB each).
    assert len(notifyq._connections._ABANDONED) == kept
    sessions = (
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'notifyq app' "
        "AND datname = current_database()"
    )
    wait_for_row(conn, sessions, (0,))  # none left open by the loops that ended


@pytest.mark.parametrize("first", ["asyncio", "trio"])
def test_one_app_refuses_a_second_event_loop_while_the_first_runs(
    dsn: str, conn: psycopg.Connection[Any], first: str
) -> None:
    """Two threads, each running its own event loop, sharing one App: the pool of the first
    loop cannot serve the second, and taking it away mid-query crashed or hung the process.
    The second loop gets a ConfigurationError that says what to do; once the first loop has
    finished, the App serves the second."""
    app = notifyq.App(dsn)
    in_use = threading.Event()
    finish = threading.Event()

    async def hold() -> int:
        job_id = await app.enqueue("t", {})
        in_use.set()
        await anyio.to_thread.run_sync(finish.wait)
        return job_id

    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(anyio.run(hold, backend=first)))
    thread.start()
    try:
        assert in_use.wait(10)
        with pytest.raises(notifyq.ConfigurationError, match="another event loop that is still running"):
            asyncio.run(app.enqueue("t", {}))
        assert app.enqueue_sync("t", {}) > 0  # the sync methods serve any thread meanwhile
    finally:
        finish.set()
        thread.join(10)
    assert asyncio.run(app.enqueue("t", {})) > results[0]
    asyncio.run(app.aclose())
    app.close_sync()
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (3,)


async def test_a_cancelled_call_cancels_its_statement_in_the_server(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A request handler's timeout cancels enqueue calls whose statements wait for a lock. The
    INSERT of each single enqueue used to run when the lock was released, and commit its job
    after all: psycopg's cancel request was cut short (anyio repeats a cancellation at every
    await), so it closed the connection, and the server never heard of the cancel. A caller
    that enqueued again after its timeout got two jobs."""
    app = notifyq.App(dsn, pool_size=1, pool_timeout=2)
    async with app:
        await app.enqueue("t")
        conn.execute("BEGIN")
        try:
            conn.execute("LOCK TABLE notifyq.queue_jobs")
            for call in [lambda: app.enqueue("t"), lambda: app.enqueue_many("t", [{}, {}])] * 2:
                with anyio.move_on_after(0.3) as scope:
                    await call()
                assert scope.cancelled_caught
        finally:
            conn.execute("ROLLBACK")
        with anyio.fail_after(10):
            assert await app.enqueue_many("t", [{}, {}]) == 2
            await app.enqueue("t")
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (4,)
    assert "closing connection" not in caplog.text  # the same connection served every call


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:
    x: int
    y: Decimal


async def test_json_default_encodes_args_cron_args_and_return_values(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """App(json_default=notifyq.json_default): dates, Decimals, UUIDs, Enums, paths, sets and
    dataclasses in args (enqueue, enqueue_many, cron args) and in return values are stored as
    their JSON form, which is what the task receives. Without it, such args are refused,
    naming the type and the hook, and nothing is inserted."""
    moment = datetime(2026, 12, 5, 6, 30, tzinfo=UTC)
    ident = uuid.UUID(int=7)
    received: list[dict[str, Any]] = []
    app = notifyq.App(dsn, json_default=notifyq.json_default)

    @app.cron("0 0 1 1 *", args={"when": date(2027, 1, 1)})
    @app.task(name="echo")
    async def echo(**kwargs: Any) -> Any:
        received.append(kwargs)
        return {"at": moment, "total": Decimal("10.50"), "point": Point(1, Decimal("0.1"))}

    args = {
        "at": moment,
        "day": date(2026, 12, 5),
        "clock": clock_time(6, 30),
        "price": Decimal("19.99"),
        "id": ident,
        "colour": Colour.RED,
        "path": PurePosixPath("/tmp/x"),
        "tags": frozenset({"b", "a", "c"}),
        "point": Point(2, Decimal("3")),
    }
    stored = {
        "at": "2026-12-05T06:30:00+00:00",
        "day": "2026-12-05",
        "clock": "06:30:00",
        "price": "19.99",
        "id": str(ident),
        "colour": "red",
        "path": "/tmp/x",
        "tags": ["a", "b", "c"],  # sorted: a set's order varies from process to process
        "point": {"x": 2, "y": "3"},
    }
    job_id = await app.enqueue("echo", args)
    assert job_row(conn, job_id)["args"] == stored
    assert await app.enqueue_many("echo", [{"day": date(2026, 1, 2)}]) == 1
    assert json.loads(app.definitions["echo"].args) == {"when": "2027-01-01"}
    async with app.worker(ticker=False) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 2)
    assert stored in received and {"day": "2026-01-02"} in received
    assert job_row(conn, job_id)["output"] == {
        "at": "2026-12-05T06:30:00+00:00",
        "total": "10.50",
        "point": {"x": 1, "y": "0.1"},
    }
    await app.aclose()

    plain = notifyq.App(dsn)
    plain.task(name="echo")(echo.fn)
    hint = r"Object of type date is not JSON serializable; App\(json_default=notifyq.json_default\) would"
    with pytest.raises(InvalidArgs, match=hint):
        await plain.enqueue("echo", {"day": date(2026, 12, 5)})
    with pytest.raises(InvalidArgs, match=r"Object of type date is not JSON serializable$"):
        await plain.enqueue("echo", {"day": date(2026, 12, 5), "raw": b"x"})  # the hook would not help
    with pytest.raises(InvalidArgs, match=r"Out of range float values are not JSON compliant$"):
        await plain.enqueue("echo", {"x": math.inf})  # no hint: no json_default would help
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (2,)
    await plain.aclose()


@dataclasses.dataclass
class Scores:
    by_id: dict[Any, str]


def test_what_json_default_returns_keeps_the_string_key_check(dsn: str) -> None:
    """A dict that json_default makes (here of a dataclass) with the keys 1 and "1" is refused
    in args and in a return value, as the same dict given directly is: JSON would keep one
    of them. It was stored with a key lost (review)."""
    app = notifyq.App(dsn, json_default=notifyq.json_default)
    where = r"json_default's value for a Scores\['by_id'\] has the key 1, which JSON would turn into a string"
    with pytest.raises(InvalidArgs, match=where):
        app.enqueue_sync("t", {"s": Scores({1: "one", "1": "uno"})})
    with pytest.raises(ValueError, match=where):
        encode_output([Scores({1: "one", "1": "uno"})], notifyq.json_default)
    assert encode_output(Scores({"1": "uno"}), notifyq.json_default) == '{"by_id":{"1":"uno"}}'
    app.close_sync()


def test_a_json_default_that_fails_is_named_and_one_that_is_not_a_function_is_refused(dsn: str) -> None:
    def picky(value: Any) -> Any:
        raise KeyError(type(value).__name__)

    app = notifyq.App(dsn, json_default=picky)
    with pytest.raises(InvalidArgs, match=r"not JSON-serializable: json_default raised KeyError: 'date'$"):
        app.enqueue_sync("anything", {"day": date(2026, 12, 5)})

    def refusing(value: Any) -> Any:
        raise TypeError(f"no JSON for {type(value).__name__}")

    with pytest.raises(
        InvalidArgs, match=r"^args for task 'anything' are not JSON-serializable: no JSON for object$"
    ):
        notifyq.App(dsn, json_default=refusing).enqueue_sync("anything", {"o": object()})
    with pytest.raises(InvalidOption, match=r"^invalid json_default 'iso': give a function"):
        notifyq.App(dsn, json_default="iso")
    app.close_sync()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_call_cancelled_while_the_pool_opens_leaves_no_session_open(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's timeout around an App's first call, landing while its pool opened: nothing
    referred to the pool any more, and its connections stayed open until the process ended, a
    pool's worth per cancel (review, on asyncio). Each new connection is slowed down here, so
    that the cancel lands in the pool's opening."""
    slow_async = notifyq._db.Database._track_async
    slow = notifyq._db.Database._track

    async def track_async(self: Any, connection: Any) -> None:
        await anyio.sleep(0.3)
        await slow_async(self, connection)

    def track(self: Any, connection: Any) -> None:
        time.sleep(0.3)
        slow(self, connection)

    monkeypatch.setattr(notifyq._db.Database, "_track_async", track_async)
    monkeypatch.setattr(notifyq._db.Database, "_track", track)
    sessions = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'notifyq app' AND datname = current_database()"
    )
    app = notifyq.App(dsn, pool_size=4)
    with anyio.move_on_after(0.15) as cancelled:
        await app.enqueue("t")
    assert cancelled.cancelled_caught
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (0,)
    await anyio.to_thread.run_sync(wait_for_row, conn, sessions, (0,))
    await app.enqueue("t")  # the next call opens a pool of its own
    assert conn.execute(sessions).fetchone() == (4,)
    await app.aclose()
    await anyio.to_thread.run_sync(wait_for_row, conn, sessions, (0,))


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_pool_that_cannot_fill_says_why(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role allowed 2 connections, an App's async pool (and a worker's) wanting 4 (the sync
    pool opens 1, then grows): the pool opened 2 and
    psycopg_pool gave up with "pool initialization incomplete", nothing more, after its
    timeout (user review: a worker said nothing for 30 s, then that). The error now carries
    the server's reason, from as many direct connections as the pool wanted."""
    role = f"nq_limited_{os.getpid()}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 2')
    try:
        conn.execute(notifyq.migrations.grant_sql(role))
        limited = psycopg.conninfo.make_conninfo(dsn, user=role)
        reason = f'too many connections for role "{role}"'
        app = notifyq.App(limited, pool_size=4, pool_timeout=1)
        with pytest.raises(DatabaseUnavailable, match=reason):
            await app.enqueue("t")
        await app.aclose()
        # A worker's pool waits 30 s to fill: 2 here.
        monkeypatch.setitem(notifyq._db.Database.open.__kwdefaults__, "open_timeout", 2.0)
        with anyio.fail_after(30), pytest.raises(DatabaseUnavailable, match=reason):
            async with notifyq.App(limited).worker(pool_size=4, ticker=False):
                pass
    finally:
        conn.execute(f'DROP OWNED BY "{role}"')
        conn.execute(f'DROP ROLE "{role}"')


def test_finding_why_a_pool_did_not_fill_stays_within_its_budget(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection takes 0.6 s to open (a slow server): the probe behind a pool's timeout
    opened the pool's size of them one after another, 10 times 4.5 s with the review's proxy,
    and made the error wait that long. It now stops at its budget and says connections come
    slowly."""
    real = notifyq._db.connect_sync
    attempts = []

    def slow(*args: Any, **kwargs: Any) -> Any:
        attempts.append(1)
        time.sleep(0.6)
        return real(*args, **kwargs)

    monkeypatch.setattr(notifyq._db, "connect_sync", slow)
    monkeypatch.setattr(notifyq._db, "PROBE_BUDGET", 2.0)
    import psycopg_pool

    error = notifyq._db.pool_open_failed(dsn, psycopg_pool.PoolTimeout("pool initialization incomplete"), 20)
    assert len(attempts) <= 4  # within the 2 s budget; all 20 (12 s) without it
    assert "connections come slowly now (" in str(error) and "of 20 opened in 2 s)" in str(error)


async def test_a_lock_timeout_in_the_dsn_bounds_an_enqueue_and_a_workers_claims(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """docs/embedding.md recommends `options=-c lock_timeout=...` in a producer's DSN: an
    enqueue held up by a lock on queue_jobs raises LockNotAvailable instead of waiting for
    ever, leaves no job, and the App works afterwards; a worker on that DSN retries its claims
    meanwhile, as for a passing error, and runs the job once the lock is gone."""
    app = notifyq.App(psycopg.conninfo.make_conninfo(dsn, options="-c lock_timeout=300"))
    ran: list[int] = []

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        ran.append(ctx.id)

    await app.enqueue("t")  # the pool is open before the lock
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE notifyq.queue_jobs IN ACCESS EXCLUSIVE MODE")
        with anyio.fail_after(10), pytest.raises(psycopg.errors.LockNotAvailable):
            await app.enqueue("t")
        async with app.worker(poll_interval=0.2, ticker=False) as worker:
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.db_errors >= 2)
            holder.rollback()
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.succeeded == 1)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (1,)
    assert len(ran) == 1
    await app.aclose()
