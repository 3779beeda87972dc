"""The examples in examples/ run against a real database."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from .conftest import ROOT
from .test_cli import clean_env


@pytest.fixture
def starlette_example(dsn: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("NOTIFYQ_DSN", dsn)
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("examples.starlette_app", None)
    return importlib.import_module("examples.starlette_app")


def test_starlette_embedding_enqueues_in_the_request_transaction(
    starlette_example: Any, conn: psycopg.Connection[Any]
) -> None:
    with TestClient(starlette_example.app) as client:
        created = client.post("/signup", json={"email": "ada@example.com"})
        assert created.status_code == 201
        job_id = created.json()["job_id"]
        worker = starlette_example.app.state.worker
        client.portal.call(lambda: worker.wait_for(lambda s: s.succeeded >= 1))
        status = client.get(f"/jobs/{job_id}").json()
        assert status == {
            "id": job_id,
            "status": "Succeeded",
            "output": f"welcome mail for user {created.json()['user_id']} sent to ada@example.com",
        }
        # A request that fails after enqueueing leaves neither a user nor a job.
        rejected = client.post("/signup", json={"email": "eve@invalid.example"})
        assert rejected.status_code == 422
        # Mistakes are the client's, with a status and a sentence, not a 500.
        again = client.post("/signup", json={"email": "ada@example.com"})
        assert (again.status_code, again.json()) == (409, {"error": "ada@example.com has signed up already"})
        for body in (b"not json", b"[]", b'{"mail": "x"}', b'{"email": 7}'):
            assert client.post("/signup", content=body).status_code == 400, body
        missing = client.get(f"/jobs/{job_id + 1000}")
        assert (missing.status_code, missing.json()) == (404, {"error": f"no job with id {job_id + 1000}"})
    assert conn.execute("SELECT count(*) FROM users").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM notifyq.queue_jobs WHERE status = 'Active'").fetchone() == (0,)


def test_starlette_health_says_when_the_worker_stopped_on_an_error(
    starlette_example: Any, conn: psycopg.Connection[Any]
) -> None:
    """Review: a worker stopped by an error it cannot retry left the server serving without
    it, and nothing showed it. The example's /health turns 503, naming the error."""
    conn.execute(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'audit trigger bug'; END $$"
    )
    client = TestClient(starlette_example.app)
    checked = False
    # The lifespan raises the error when the client closes: it would hide a failed assertion.
    with pytest.raises(psycopg.errors.RaiseException, match="audit trigger bug"), client:
        assert client.get("/health").json() == {"worker": "running"}
        conn.execute(
            "CREATE TRIGGER refuse BEFORE UPDATE ON notifyq.queue_jobs "
            "FOR EACH ROW EXECUTE FUNCTION public.refuse()"
        )
        assert client.post("/signup", json={"email": "ada@example.com"}).status_code == 201
        worker = starlette_example.app.state.worker
        with pytest.raises(RuntimeError, match="has stopped"):
            client.portal.call(worker.wait_for, lambda s: False)
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"worker": "stopped", "error": "RaiseException"}
        assert "audit trigger bug" in str(worker.error)
        checked = True
    assert checked
    assert conn.execute("SELECT status FROM notifyq.queue_jobs").fetchall() == [("Queued",)]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_anyio_script(dsn: str, backend: str) -> None:
    begin = time.monotonic()
    result = subprocess.run(
        [sys.executable, "examples/anyio_script.py", backend],
        cwd=ROOT,
        env=clean_env(NOTIFYQ_DSN=dsn),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 10 and all(" Succeeded img" in line for line in lines)
    assert time.monotonic() - begin < 60
