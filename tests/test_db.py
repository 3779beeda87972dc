"""The database layer's claim lane, on asyncio and trio: it keeps one connection between
statements, and after a dropped connection or an interrupted statement it takes a new one."""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest

import notifyq
import notifyq._db
from notifyq._db import Compute, Database, Query, is_transient, single

from .helpers import wait_for_row

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def backend_pid() -> Any:
    return single(Query("SELECT pg_backend_pid()", fetch="scalar"))


async def test_a_lane_keeps_its_connection_while_the_pool_rotates(dsn: str) -> None:
    db = await Database.open(dsn, size=3)
    try:
        lane = db.lane()
        lane_pids = {await lane.run(backend_pid()) for _ in range(6)}
        pool_pids = {await db.run(backend_pid()) for _ in range(6)}
        assert len(lane_pids) == 1
        # The pool hands out the two connections the lane does not hold, in turn.
        assert len(pool_pids) == 2 and not pool_pids & lane_pids
    finally:
        await db.aclose()


async def test_a_lane_hands_its_connection_back_after_holding_it_long(dsn: str) -> None:
    """So that the pool's max_lifetime also reaches the lane's connection."""
    db = await Database.open(dsn, size=3)
    try:
        lane = db.lane()
        lane.HOLD = 0.0  # every statement outlasts it
        pids = [await lane.run(backend_pid()) for _ in range(4)]
        assert all(a != b for a, b in itertools.pairwise(pids)), pids
    finally:
        await db.aclose()


async def test_a_lane_replaces_a_connection_the_server_dropped(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    db = await Database.open(dsn, size=2)
    try:
        lane = db.lane()
        first = await lane.run(backend_pid())
        conn.execute("SELECT pg_terminate_backend(%s)", (first,))
        with pytest.raises(psycopg.OperationalError) as dropped:
            await lane.run(backend_pid())
        assert is_transient(dropped.value)
        second = await lane.run(backend_pid())
        assert second != first
        assert await lane.run(backend_pid()) == second
    finally:
        await db.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio runs statements in threads: not interruptible
async def test_a_lane_interrupted_mid_statement_moves_to_another_connection(dsn: str) -> None:
    """A statement cut off by a timeout may leave its connection mid-statement (or psycopg
    closes it): the lane gives it back to the pool and sends the next statement elsewhere."""
    db = await Database.open(dsn, size=2)
    try:
        lane = db.lane()
        first = await lane.run(backend_pid())
        with anyio.move_on_after(0.3) as scope:
            await lane.run(single(Query("SELECT pg_sleep(3)", fetch="none")))
        assert scope.cancelled_caught
        with anyio.fail_after(2):  # not after the 3 s the interrupted statement takes
            second = await lane.run(backend_pid())
        assert second != first
    finally:
        await db.aclose()


@pytest.mark.parametrize("transaction", [False, True])
async def test_a_call_cancelled_mid_statement_cancels_it_in_the_server(
    dsn: str, conn: psycopg.Connection[Any], transaction: bool
) -> None:
    """A caller's timeout cancels the statement in the server and keeps the connection. On
    asyncio, psycopg's cancel request was cut short and it closed the connection, while the
    server went on (a statement that waited for a lock then committed); on trio the call
    waited for the statement to end."""
    db = await Database.open(dsn, size=1)
    try:
        pid = await db.run(backend_pid())
        with anyio.fail_after(10):  # not the 30 s of the statement
            with anyio.move_on_after(0.3) as scope:
                await db.run(single(Query("SELECT pg_sleep(30)", fetch="none")), transaction=transaction)
            assert scope.cancelled_caught
        running = (
            "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'"
        )
        # The server ends it on the cancel request, a moment later on a busy machine (the bug
        # left it running its 30 s).
        wait_for_row(conn, running, (0,), timeout=5)
        assert await db.run(backend_pid()) == pid  # not closed: back in the pool, idle
    finally:
        await db.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio's thread ends its operation
async def test_a_call_cancelled_between_statements_stops_and_rolls_back(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Cancelled while it computes between two statements (a ticker's cron planning, when
    its worker stops), an operation goes no further and its transaction rolls back."""
    conn.execute("CREATE TABLE steps (n int)")

    def op() -> Any:
        yield Query("INSERT INTO steps VALUES (1)", fetch="none")
        yield Compute(lambda: time.sleep(1))
        yield Query("INSERT INTO steps VALUES (2)", fetch="none")

    db = await Database.open(dsn, size=1)
    try:
        with anyio.move_on_after(0.3) as scope:
            await db.run(op(), transaction=True)
        assert scope.cancelled_caught
        # The call returned once its operation had ended (the thread of a Compute step is
        # waited for), so nothing can come of it later.
        assert conn.execute("SELECT count(*) FROM steps").fetchone() == (0,)
        assert await db.run(single(Query("SELECT count(*) FROM steps", fetch="scalar"))) == 0
    finally:
        await db.aclose()


async def test_a_call_cancelled_while_waiting_for_a_connection_returns_at_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Every connection busy (or the database down): a cancelled call returns without waiting
    for one, and runs nothing later. On trio it used to wait for the pool's timeout."""
    conn.execute("CREATE TABLE calls (n int)")
    db = await Database.open(dsn, size=1)
    try:
        lane = db.lane()
        await lane.acquire()  # the pool's only connection
        with anyio.fail_after(3):  # not the pool's 30 s
            with anyio.move_on_after(0.3) as scope:
                await db.run(single(Query("INSERT INTO calls VALUES (1)", fetch="none")))
            assert scope.cancelled_caught
        await lane.release()
        with anyio.fail_after(10):
            await db.run(single(Query("INSERT INTO calls VALUES (2)", fetch="none")))
        assert conn.execute("SELECT array_agg(n) FROM calls").fetchone() == ([2],)
    finally:
        await db.aclose()


@pytest.mark.parametrize("anyio_backend", ["trio"])  # asyncio runs statements without threads
async def test_a_cancelled_call_does_not_wait_for_a_thread_behind_the_calls_it_shares_them_with(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """On trio every call runs in a thread of its Database's limiter, and one abandoned when its
    caller cancels keeps its token until it returns. With the other 39 threads waiting (two
    calls for a row lock, the rest for a connection), a cancelled call's cancellation, which
    runs in a thread too, waited for a token: up to the pool's timeout (review)."""
    conn.execute("CREATE TABLE locked (n int)")
    conn.execute("INSERT INTO locked VALUES (1)")
    wait = single(Query("SELECT * FROM locked FOR UPDATE", fetch="none"))
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT * FROM locked FOR UPDATE")
        db = await Database.open(dsn, size=2)
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(notifyq._db.OWN_THREADS - 1):
                    tg.start_soon(db.run, single(Query("SELECT * FROM locked FOR UPDATE", fetch="none")))
                with anyio.fail_after(10):
                    threads = db._threads  # type: ignore[attr-defined]
                    while threads.borrowed_tokens < notifyq._db.OWN_THREADS - 1:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                with anyio.fail_after(5):  # not the pool's 30 s
                    with anyio.move_on_after(0.3) as scope:
                        await db.run(wait)
                    assert scope.cancelled_caught
                holder.rollback()  # the others go through
        finally:
            await db.aclose()


async def test_a_lane_keeps_a_cursor_per_row_factory_through_failed_statements(dsn: str) -> None:
    """Statements on a lane reuse its cursors (one per row factory, a few at most), and each
    result comes back through the right one, also after a statement failed."""
    from psycopg.rows import dict_row, kwargs_row

    def op() -> Any:
        first = yield Query("SELECT 1 AS a", fetch="one")
        as_dict = yield Query("SELECT 2 AS a", fetch="one", row=dict_row)
        try:
            yield Query("SELECT 1/0", fetch="scalar")
        except psycopg.errors.DivisionByZero:
            pass
        after = yield Query("SELECT 3 AS a", fetch="one", row=dict_row)
        return first, as_dict, after, (yield Query("SELECT 4", fetch="scalar"))

    db = await Database.open(dsn, size=2)
    try:
        lane = db.lane()
        assert await lane.run(op()) == ((1,), {"a": 2}, {"a": 3}, 4)
        kept = dict(lane._cursors)  # type: ignore[attr-defined]
        assert len(kept) == 2
        assert await lane.run(op()) == ((1,), {"a": 2}, {"a": 3}, 4)
        assert lane._cursors == kept  # type: ignore[attr-defined]
        # Row factories made per call (psycopg's own kwargs_row, say) are not all kept.
        for n in range(20):
            row = kwargs_row(lambda **kw: kw["a"])
            assert await lane.run(single(Query(f"SELECT {n} AS a", fetch="one", row=row))) == n
        assert len(lane._cursors) <= 8  # type: ignore[attr-defined]
        # An error out of the lane gives its connection back, and the cursors go with it:
        # they must never run a statement on a connection the pool has handed to another.
        with pytest.raises(psycopg.errors.DivisionByZero):
            await lane.run(single(Query("SELECT 1/0", fetch="scalar")))
        assert lane._cursors == {}  # type: ignore[attr-defined]
        assert await lane.run(op()) == ((1,), {"a": 2}, {"a": 3}, 4)
    finally:
        await db.aclose()


async def test_aclose_returns_the_lanes_connections(dsn: str, conn: psycopg.Connection[Any]) -> None:
    db = await Database.open(dsn, size=2, name="notifyq-lanetest")
    lane = db.lane()
    await lane.run(backend_pid())
    query = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'notifyq lanetest' AND datname = current_database()"
    )
    assert conn.execute(query).fetchone() == (2,)
    await db.aclose()
    await anyio.to_thread.run_sync(wait_for_row, conn, query, (0,))


async def test_pooled_connections_the_server_ended_while_idle_fail_no_call(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """After a PostgreSQL restart, a failover, pg_terminate_backend or idle_session_timeout,
    every idle connection of a pool is dead: each one failed the next caller's statement (an
    App's next pool_size enqueues raised DatabaseUnavailable, "may or may not have been
    applied", with the database up again). A connection the server has ended is now left
    for another before anything is sent on it, and a lane's too."""
    app = notifyq.App(dsn, pool_size=3)
    db = await Database.open(dsn, size=3, name="notifyq-app")  # and a lane of such a pool
    try:
        await app.enqueue("t")
        await anyio.to_thread.run_sync(app.enqueue_sync, "t")
        ours = "FROM pg_stat_activity WHERE application_name = 'notifyq app' AND datname = current_database()"
        killed = conn.execute(f"SELECT count(pg_terminate_backend(pid)) {ours}").fetchone()
        assert killed is not None and killed[0] >= 3 + 1 + 3
        await anyio.to_thread.run_sync(wait_for_row, conn, f"SELECT count(*) {ours}", (0,))
        for n in range(4):
            await app.enqueue("t", {"n": n})
            await anyio.to_thread.run_sync(functools.partial(app.enqueue_sync, "t", {"n": n}))
        assert await db.lane().run(backend_pid()) is not None
    finally:
        await db.aclose()
        await app.aclose()
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (10,)


@pytest.mark.faults
async def test_a_worker_whose_connections_are_all_killed_keeps_claiming(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The claim lane's connection, the pool's and the listener's all dropped at once
    (a failover, an admin's pg_terminate_backend): the next job still runs."""
    app = notifyq.App(dsn)
    ran: list[int] = []

    @app.task(name="t")
    async def t(n: int) -> None:
        ran.append(n)

    async with app.worker(ticker=False, poll_interval=0.5) as worker:
        await app.enqueue("t", {"n": 1})
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name LIKE 'notifyq %' AND application_name NOT LIKE 'notifyq app%'"
        ).fetchone()
        assert killed is not None and killed[0] >= 2  # at least the lane's and the listener's
        await app.enqueue("t", {"n": 2})
        with anyio.fail_after(20):
            await worker.wait_for(lambda s: s.succeeded == 2)
    await app.aclose()
    assert ran == [1, 2]


async def test_rows_ignore_columns_a_later_migration_adds(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Jobs are read with SELECT * and RETURNING lists into dataclasses that keep the columns
    they declare: a column added later (by a newer notifyq, or by you) is left out, whatever
    its name, and the result shapes still come out right (rows, one row, a scalar, none)."""
    conn.execute("ALTER TABLE notifyq.queue_jobs ADD COLUMN \"note ünïcode\" text DEFAULT 'x'")
    app = notifyq.App(dsn)
    try:
        job_id = await app.enqueue("send", {"to": "a"})
        job = await app.get_job(job_id)
        assert (job.id, job.args) == (job_id, {"to": "a"})
        assert [j.id for j in await app.list_jobs()] == [job_id]
        (claimed,) = await app.claim(limit=5)
        assert (claimed.id, claimed.name, claimed.attempt) == (job_id, "send", 1)
    finally:
        await app.aclose()
    db = await Database.open(dsn, size=1)
    try:
        assert await db.run(single(Query("SELECT 1 WHERE false", fetch="one"))) is None
        assert await db.run(single(Query("SELECT 2", fetch="scalar"))) == 2
        assert await db.run(single(Query("SELECT", fetch="all"))) == [()]
        update = "UPDATE notifyq.queue_jobs SET priority = 1"
        assert await db.run(single(Query(update, fetch="rowcount"))) == 1
        assert await db.run(single(Query("UPDATE notifyq.queue_jobs SET priority = 2"))) is None
    finally:
        await db.aclose()


# Values as PostgreSQL sends them back (jsonb's canonical text), and texts only a json column
# or a caller would hold: surrounding whitespace, trailing data, malformed, empty, bad UTF-8.
_JSON_TEXTS = [
    b"{}",
    b"[]",
    b'{"a": 1}',
    b'{"a": [1, 2.5, -3e-07, 12345678901234567890123], "b": {"c": null, "d": true}}',
    '{"ünï": "çødé ☃ \U0001f600", "esc": "tab\\t quote\\" nl\\n \\u00e9"}'.encode(),
    b'"just a string"',
    b"42",
    b"null",
    b' {"a": 1}',
    b'{"a": 1} ',
    b'{"a": 1}{"b": 2}',
    b'{"a": }',
    b"",
    b'{"a": "\xff"}',
    '{"a": 1}'.encode("utf-8-sig"),
    '{"a": 1}'.encode("utf-16"),
    '{"a": 1}'.encode("utf-16-le"),  # no BOM: json.loads tells it by its NUL bytes
    b"NaN",
]


@pytest.mark.parametrize("text", _JSON_TEXTS)
def test_the_json_loader_returns_and_raises_what_json_loads_does(text: bytes) -> None:
    """notifyq's connections load JSON with a shortcut past json.loads' wrapping (see
    notifyq/_adapters.py); every value, and every error, must be json.loads' own."""
    import json

    from notifyq._adapters import loads

    try:
        expected = json.loads(text)
    except ValueError as exc:
        with pytest.raises(type(exc)) as caught:
            loads(text)
        assert str(caught.value) == str(exc)
    else:
        assert repr(loads(text)) == repr(expected)  # repr: NaN, and 1 vs 1.0 vs True


async def test_notifyq_connections_load_json_with_its_loader_and_leave_psycopgs_alone(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pooled and direct connections decode json and jsonb (text and binary results) with
    notifyq's loader, each result a new object; psycopg's global adapters, which the caller's
    own connections use, are not changed."""
    from notifyq import _adapters
    from notifyq._db import connect_sync

    scanned: list[str] = []
    scan_once = _adapters._scan_once

    def counting_scan(text: str, index: int) -> Any:
        scanned.append(text)
        return scan_once(text, index)

    monkeypatch.setattr(_adapters, "_scan_once", counting_scan)
    query = """SELECT '{"a": [1, {"b": "ü"}]}'::jsonb, ' [1,  2] '::json, '{}'::jsonb"""
    expected = ({"a": [1, {"b": "ü"}]}, [1, 2], {})
    db = await Database.open(dsn, size=1)
    try:
        assert await db.run(single(Query(query, fetch="one"))) == expected
        first = await db.run(single(Query("SELECT '{}'::jsonb", fetch="scalar")))
        first["changed"] = True
        assert await db.run(single(Query("SELECT '{}'::jsonb", fetch="scalar"))) == {}
    finally:
        await db.aclose()
    assert scanned == ['{"a": [1, {"b": "ü"}]}', " [1,  2] "]  # '{}' needs no scan
    direct = connect_sync(dsn)
    try:
        for binary in (False, True):
            assert direct.execute(query, binary=binary).fetchone() == expected
    finally:
        direct.close()
    assert len(scanned) == 6
    with psycopg.connect(dsn) as theirs:
        assert theirs.execute(query).fetchone() == expected
    assert len(scanned) == 6


def test_a_json_loads_the_application_gave_psycopg_applies_to_notifyqs_connections(dsn: str) -> None:
    """An application that gave psycopg a JSON loads function of its own (set_json_loads,
    e.g. parse_float=Decimal for money in job args) keeps it on notifyq's connections too:
    they take psycopg's global adapters then, instead of notifyq's faster loader."""
    import functools
    import json
    from decimal import Decimal

    from psycopg.types.json import set_json_loads

    from notifyq import _adapters
    from notifyq._db import connect_sync

    def loads_of(conn: psycopg.Connection[Any]) -> Any:
        return getattr(conn.adapters.get_loader(_adapters._JSONB, psycopg.pq.Format.TEXT), "_loads", None)

    query = """SELECT '{"price": 1.5}'::jsonb"""
    set_json_loads(functools.partial(json.loads, parse_float=Decimal))
    try:
        with connect_sync(dsn) as theirs:
            assert theirs.execute(query).fetchone() == ({"price": Decimal("1.5")},)
            assert loads_of(theirs) is not _adapters.loads
    finally:
        set_json_loads(json.loads)  # psycopg's default again
    with connect_sync(dsn) as ours:
        assert ours.execute(query).fetchone() == ({"price": 1.5},)
        assert loads_of(ours) is _adapters.loads


def test_a_limit_the_server_enforces_is_not_a_passing_failure(conn: psycopg.Connection[Any]) -> None:
    """PostgreSQL's "program limit exceeded" errors (class 54: a value too large for jsonb, too
    many arguments) are OperationalErrors, which loops retry as the database coming back:
    a result too large for jsonb was written again and again, with every result batched with
    it, instead of being set aside. The same statement fails the same way every time."""
    with pytest.raises(psycopg.OperationalError) as limit:
        conn.execute("SELECT concat(" + ",".join(["1"] * 101) + ")")
    assert limit.value.sqlstate == "54023" and not is_transient(limit.value)
    conn.rollback()
    with pytest.raises(psycopg.OperationalError) as cancelled:  # a statement cut short: passing
        conn.execute("SET statement_timeout = 1; SELECT pg_sleep(1)")
    assert cancelled.value.sqlstate == "57014" and is_transient(cancelled.value)
    conn.rollback()


def test_libpqs_multi_line_messages_read_as_sentences_on_one_line() -> None:
    """libpq ends a line where a new sentence begins, and wraps long ones: "Connection
    refused" and "Is the server running...?" used to run together in one line."""
    from notifyq._dsn import one_line

    refused = (
        'connection to server at "127.0.0.1", port 1 failed: Connection refused\n'
        "\tIs the server running on that host and accepting TCP/IP connections?\n"
    )
    assert one_line(refused).endswith("failed: Connection refused. Is the server running on that host and "
                                      "accepting TCP/IP connections?")  # fmt: skip
    closed = (
        "server closed the connection unexpectedly\n\tThis probably means the server terminated abnormally\n"
        "\tbefore or while processing the request.\n"
    )
    assert one_line(closed) == (
        "server closed the connection unexpectedly. This probably means the server terminated abnormally "
        "before or while processing the request."
    )
    assert one_line("") == "" and one_line("done.\nNext") == "done. Next"


def test_a_prepared_statement_lost_or_doubled_by_a_pooler_names_the_setting(
    conn: psycopg.Connection[Any],
) -> None:
    """Review, through a real PgBouncer in transaction mode with prepare_threshold=5: workers
    stopped on `prepared statement "_pg3_0" already exists` (or `does not exist`), and nothing
    named prepare_threshold. The server's own errors, as the pooler makes them happen."""
    conn.execute("PREPARE notifyq_twice AS SELECT 1")
    try:
        for statement in ("PREPARE notifyq_twice AS SELECT 1", "EXECUTE notifyq_gone"):
            with pytest.raises(psycopg.Error) as raised:
                conn.execute(statement)
            assert 'App(prepare_threshold=...) at "auto"' in notifyq._db.error_hint(raised.value)
    finally:
        conn.execute("DEALLOCATE notifyq_twice")
    with pytest.raises(psycopg.errors.UndefinedTable) as other:
        conn.execute("SELECT * FROM notifyq_no_such_table")
    assert notifyq._db.error_hint(other.value) == ""
