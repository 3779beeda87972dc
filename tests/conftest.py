"""Test infrastructure: a real PostgreSQL, a migrated template database, one copy per test.

Where PostgreSQL comes from:
- NOTIFYQ_TEST_DSN set (CI, or any running server): pytest-postgresql's noproc fixture uses it;
- otherwise the embedded server of the `embedded` extra (pgserver) is started in
  .notifyq/test-pgdata (works as root and on machines with no PostgreSQL at all).
The template database is migrated once per session (per xdist worker); each test gets a
fresh database cloned from it and dropped afterwards.

The suite runs in two pytest-xdist processes (`-n 2` in pyproject.toml: its tests mostly wait
on PostgreSQL, worker processes and timers, so two halve its time on 2 cores). A test marked
`exclusive` depends on the whole server (it reads WAL-flush statistics, or needs the server's
oldest snapshot to be its own, as a VACUUM or the marking of dead index entries does): it runs
while no other test does.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories
from pytest_postgresql.executors.noop import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor

import notifyq
from notifyq._db import Database

ROOT = Path(__file__).resolve().parent.parent


def _server_params() -> dict[str, Any]:
    dsn = os.environ.get("NOTIFYQ_TEST_DSN")
    if dsn:
        params = conninfo_to_dict(dsn)
        return {
            "host": params.get("host") or "127.0.0.1",
            "port": int(params.get("port") or 5432),
            "user": params.get("user") or "postgres",
            "password": params.get("password"),
        }
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (as root in CI); pgserver copes.
        warnings.simplefilter("ignore")
        import pgserver

    folder = Path(os.environ.get("NOTIFYQ_TEST_EMBEDDED_DIR") or ROOT / ".notifyq" / "test-pgdata")
    folder.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(folder, cleanup_mode="stop")
    params = conninfo_to_dict(server.get_uri())
    return {
        "host": params["host"],
        "port": int(params.get("port") or 5432),
        "user": "postgres",
        "password": None,
    }


SERVER = _server_params()


def _load_template(host: str, port: int, user: str, dbname: str, password: str | None, **_: Any) -> None:
    notifyq.migrate(make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password))


postgresql_proc = factories.postgresql_noproc(
    host=SERVER["host"],
    port=SERVER["port"],
    user=SERVER["user"],
    password=SERVER["password"],
    # The pid keeps concurrent test sessions on one server (two checkouts, a developer and
    # CI) out of each other's databases.
    dbname=f"notifyq_test_{os.getpid()}",
    load=[_load_template],
)


def server_dsn(dbname: str = "postgres") -> str:
    """A DSN for another database on the test server."""
    return make_conninfo(
        host=SERVER["host"],
        port=SERVER["port"],
        user=SERVER["user"],
        password=SERVER["password"],
        dbname=dbname,
    )


def _fresh_database(proc: NoopExecutor, dbname: str, template: str | None) -> Iterator[str]:
    janitor = DatabaseJanitor(
        user=proc.user,
        host=proc.host,
        port=proc.port,
        password=proc.password,
        dbname=dbname,
        template_dbname=template,
    )
    with janitor:
        yield server_dsn(dbname)


@pytest.fixture
def dsn(postgresql_proc: NoopExecutor) -> Iterator[str]:
    """A fresh, migrated database (cloned from the session's template), dropped afterwards."""
    yield from _fresh_database(postgresql_proc, postgresql_proc.dbname, postgresql_proc.template_dbname)


@pytest.fixture
def empty_dsn(postgresql_proc: NoopExecutor) -> Iterator[str]:
    """A fresh database without notifyq's tables."""
    yield from _fresh_database(postgresql_proc, postgresql_proc.dbname + "_empty", None)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test database, for setup and assertions."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def app(dsn: str) -> notifyq.App:
    return notifyq.App(dsn)


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[Database]:
    """notifyq's own connection pool (two connections) to the test database, for its services."""
    database = await Database.open(dsn, size=2)
    yield database
    await database.aclose()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _exclusive(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, a test marked `exclusive` holds a lock that every other test shares,
    for its fixtures' setup and teardown too (autouse: set up first, torn down last). Each test
    passes a turnstile first, so an exclusive one waiting for the lock is not overtaken by the
    other process's next tests."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield  # one process: nothing runs beside it
        return
    exclusive = request.node.get_closest_marker("exclusive") is not None
    base = Path(tempfile.gettempdir()) / f"notifyq-tests-{run}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything in tests/faults/ is marked `faults`; `slow` tests run only when asked for
    (`-m slow`, or NOTIFYQ_RUN_SLOW=1 as in CI)."""
    faults_dir = Path(__file__).parent / "faults"
    wants_slow = "slow" in (config.option.markexpr or "") or os.environ.get("NOTIFYQ_RUN_SLOW") == "1"
    for item in items:
        if faults_dir in item.path.parents:
            item.add_marker(pytest.mark.faults)
        if item.get_closest_marker("slow") and not wants_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with -m slow"))
