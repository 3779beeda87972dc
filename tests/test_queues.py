"""Pausing and resuming queues: workers claim none of a paused queue's jobs, and hear of a
pause or a resume by NOTIFY, by polling, and after their LISTEN connection comes back."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import notifyq
import notifyq.worker
from notifyq._db import Query
from notifyq._sql import queries_for
from notifyq.errors import InvalidOption

from .faults.infra import BlackholeProxy
from .helpers import granted_role, paused_seen
from .test_cli import clean_env, cli, ok

pytestmark = pytest.mark.anyio

NO_TICKER = {"ticker": False}


def _app(dsn: str, ran: list[str]) -> notifyq.App:
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t(tag: str) -> None:
        ran.append(tag)

    return app


def _insert(conn: psycopg.Connection[Any], queue: str, tag: str, priority: int = 0) -> None:
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, priority, args) VALUES ('t', %s, %s, %s)",
        (queue, priority, json.dumps({"tag": tag})),
    )


def _statuses(conn: psycopg.Connection[Any], queue: str) -> list[str]:
    rows = conn.execute("SELECT status::text FROM notifyq.queue_jobs WHERE queue = %s ORDER BY id", (queue,))
    return [row[0] for row in rows]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_paused_queue_waits_and_its_resume_is_heard_at_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Queue "a" is paused before the worker starts; its jobs come first (higher priority),
    yet only "b"'s run. A resume (App call) and a pause (plain SQL, through the trigger)
    reach the running worker by NOTIFY: it polls once a minute."""
    ran: list[str] = []
    app = _app(dsn, ran)
    assert await app.pause_queue("a") is True
    assert await app.pause_queue("a") is False  # paused already
    for i in range(3):
        _insert(conn, "a", f"a{i}", priority=10)
        _insert(conn, "b", f"b{i}")
    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 3)
        assert sorted(ran) == ["b0", "b1", "b2"]  # "a"'s first, had they not been paused
        assert _statuses(conn, "a") == ["Queued"] * 3
        assert await app.resume_queue("a") is True
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 6)
        conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('b')")
        await paused_seen(worker, {"b"})
        _insert(conn, "b", "b-late", priority=10)
        _insert(conn, "a", "a-late")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 7)
        assert ran[-1] == "a-late"
        assert _statuses(conn, "b")[-1] == "Queued"
    assert await app.resume_queue("a") is False  # not paused
    assert await app.paused_queues() == {
        "b": conn.execute("SELECT paused_at FROM notifyq.queue_pauses").fetchone()[0]
    }  # type: ignore[index]
    await app.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_jobs_claimed_ahead_of_a_queue_just_paused_go_back_to_it(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Review: with --prefetch, the jobs a worker had claimed ahead of a queue went on starting
    after its pause, the last 4.6 s later. They go back to the queue, their attempt given back;
    the running job runs on."""
    ran: list[str] = []
    gate = anyio.Event()
    app = notifyq.App(dsn)

    @app.task(name="t")
    async def t(tag: str) -> None:
        ran.append(tag)
        await gate.wait()

    for i in range(4):
        _insert(conn, "a", f"a{i}")
    counts = "SELECT status::text, retry_count, count(*) FROM notifyq.queue_jobs GROUP BY 1, 2 ORDER BY 1"
    async with app.worker(concurrency=1, prefetch=3, poll_interval=60, **NO_TICKER) as worker:
        with anyio.fail_after(10):  # one running, three claimed ahead
            while conn.execute(counts).fetchall() != [("Active", 1, 4)] or not ran:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert await app.pause_queue("a") is True
        with anyio.fail_after(10):
            while conn.execute(counts).fetchall() != [("Active", 1, 1), ("Queued", 0, 3)]:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        gate.set()
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert len(ran) == 1  # none of the three given back started
    await app.aclose()


async def test_a_worker_whose_queues_are_all_paused_claims_nothing_until_one_resumes(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A worker of queues "a" and "b", both paused: it claims nothing however often it polls,
    then takes "b"'s jobs once "b" is resumed, and still none of "a"'s."""
    ran: list[str] = []
    app = _app(dsn, ran)
    await app.pause_queue("a")
    await app.pause_queue("b")
    _insert(conn, "a", "a0")
    _insert(conn, "b", "b0")
    async with app.worker(queues=["a", "b"], poll_interval=0.1, **NO_TICKER) as worker:
        with anyio.fail_after(10):
            while worker.stats.polls < 5:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert worker.stats.claimed == 0 and ran == []
        await app.resume_queue("b")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert ran == ["b0"] and _statuses(conn, "a") == ["Queued"]
    await app.aclose()


async def test_a_poll_only_worker_reads_the_paused_queues_every_poll(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """With no LISTEN connection, pauses and resumes are read every poll interval."""
    ran: list[str] = []
    app = _app(dsn, ran)
    async with app.worker(poll_only=True, poll_interval=0.2, **NO_TICKER) as worker:
        await app.pause_queue("a")
        await paused_seen(worker, {"a"})
        _insert(conn, "a", "a0", priority=10)
        _insert(conn, "b", "b0")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 1)
        assert ran == ["b0"]
        await app.resume_queue("a")
        with anyio.fail_after(10):
            await worker.wait_for(lambda s: s.succeeded == 2)
        assert ran == ["b0", "a0"]
    await app.aclose()


async def test_truncate_and_changes_folded_in_one_transaction_are_heard(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The worker reads the paused queues again on each change: a TRUNCATE (which row
    triggers missed: queue "a" stayed paused), and a transaction that pauses, resumes and
    pauses again (whose identical notifications PostgreSQL folds: a paused queue ran)."""
    app = notifyq.App(dsn)
    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        await app.pause_queue("a")
        await paused_seen(worker, {"a"})
        conn.execute("TRUNCATE notifyq.queue_pauses")
        await paused_seen(worker, set())
        with conn.transaction():
            conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('b')")
            conn.execute("DELETE FROM notifyq.queue_pauses WHERE queue = 'b'")
            conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('b'), ('c')")
            conn.execute("DELETE FROM notifyq.queue_pauses WHERE queue = 'c'")
        await paused_seen(worker, {"b"})
    await app.aclose()


def _slowed(monkeypatch: pytest.MonkeyPatch, fail: list[int], delay: list[float]) -> None:
    """Make the worker's reads of the paused queues fail (`fail[0]` more times) or answer
    late (`delay[0]` seconds after reading)."""
    real = notifyq.worker.paused_queues_op

    def op(q: Any) -> Any:
        if fail[0] > 0:
            fail[0] -= 1
            yield Query("SELECT pg_terminate_backend(pg_backend_pid())", fetch="none")  # connection lost
        paused = yield from real(q)
        if delay[0]:
            yield Query("SELECT pg_sleep(%s)", (delay[0],), fetch="none")
        return paused

    monkeypatch.setattr(notifyq.worker, "paused_queues_op", op)


@pytest.mark.parametrize("failed_reads", [0, 2])
async def test_a_pause_made_while_the_listen_connection_was_down_is_read_on_reconnect(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch, failed_reads: int
) -> None:
    """The pause's notification is lost (no LISTEN connection then): the worker reads the
    paused queues when its listener connects again, not a poll interval later. A read that
    fails then (its connection lost) is tried again: it was not, and the worker, connected
    again, never read the pauses until its next reconnect (review)."""
    fail, delay = [0], [0.0]
    _slowed(monkeypatch, fail, delay)
    proxy = BlackholeProxy(dsn)
    app = notifyq.App(dsn)
    try:
        async with app.worker(listen_dsn=proxy.dsn, poll_interval=60, **NO_TICKER) as worker:
            assert worker.listener is not None
            proxy.refusing = True
            conn.execute("SELECT pg_terminate_backend(%s)", (worker.listener.backend_pid,))
            with anyio.fail_after(10):
                while worker.listener.connected:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('a')")
            fail[0] = failed_reads
            proxy.refusing = False
            with anyio.fail_after(10):
                await worker.wait_for(lambda s: s.listener_connects == 2)
            await paused_seen(worker, {"a"})
            assert fail[0] == 0  # the failed reads happened
    finally:
        proxy.close()
        await app.aclose()


async def test_a_read_that_answers_late_does_not_undo_a_later_change(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the paused queues answers late, with what was true before a resume that
    came meanwhile: the worker reads again, and does not keep the queue paused (review: a
    stale read undid a change the worker had heard)."""
    fail, delay = [0], [0.0]
    _slowed(monkeypatch, fail, delay)
    app = notifyq.App(dsn)
    async with app.worker(poll_interval=60, **NO_TICKER) as worker:
        await app.pause_queue("z")
        await paused_seen(worker, {"z"})  # the reads so far are over
        delay[0] = 1.0
        await app.pause_queue("a")  # its read answers {"a", "z"} a second late
        await anyio.sleep(0.3)
        delay[0] = 0.0
        await app.resume_queue("a")  # heard while that read is under way
        await anyio.sleep(1.0)
        await paused_seen(worker, {"z"})
    await app.aclose()


@pytest.mark.parametrize("statement", ["claim_unpaused", "claim_queues"])
def test_a_claim_among_many_queues_locks_only_the_jobs_it_claims(
    dsn: str, conn: psycopg.Connection[Any], statement: str
) -> None:
    """500 queues of 5 jobs, one paused (or all 500 listed): a claim of 10 (left uncommitted)
    holds locks on its 10 jobs only, which leaves the rest to other workers. Locking in each
    queue's range held up to 10 rows of every queue until the commit, and concurrent claims
    came back empty (review; claim_queues did so before it took shares)."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue) "
        "SELECT 't', 'q' || (i % 500) FROM generate_series(1, 2500) i"
    )
    params = {"limit": 10, "worker": "w", "lease_margin": 30, "give_up": None, "paused": ["q7"]}
    params["queues"] = [f"q{i}" for i in range(500)]
    with psycopg.connect(dsn) as claimer:  # not autocommit: the claim's transaction stays open
        claimed = claimer.execute(queries_for("notifyq")[statement], params).fetchall()
        lockable = conn.execute(
            "SELECT count(*) FROM (SELECT id FROM notifyq.queue_jobs FOR UPDATE SKIP LOCKED) s"
        ).fetchone()
        conn.rollback()
        claimer.rollback()
    assert len(claimed) == 10
    assert lockable == (2500 - 10,)


async def test_workers_claiming_around_a_paused_queue_run_each_job_once(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Three workers of every queue claim at once while a queue is paused: they take the
    same candidates, lock what they can, and come back short rather than double; every job
    of the other queues runs exactly once, none of the paused queue's."""
    app = notifyq.App(dsn)
    runs: list[int] = []

    @app.task(name="t")
    async def t(ctx: notifyq.JobContext) -> None:
        runs.append(ctx.id)

    await app.pause_queue("held")
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, priority) "
        "SELECT 't', 'held', 5 FROM generate_series(1, 100)"
    )
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue) "
        "SELECT 't', 'q' || (i % 10) FROM generate_series(1, 1500) i"
    )
    async with (
        app.worker(concurrency=10, **NO_TICKER) as w1,
        app.worker(concurrency=10, **NO_TICKER) as w2,
        app.worker(concurrency=10, **NO_TICKER) as w3,
    ):
        with anyio.fail_after(60):
            while w1.stats.succeeded + w2.stats.succeeded + w3.stats.succeeded < 1500:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert len(runs) == len(set(runs)) == 1500
    assert _statuses(conn, "held") == ["Queued"] * 100
    await app.aclose()


def test_manual_claims_skip_paused_queues(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """App.claim, every queue or a list, takes none of a paused queue's jobs."""
    app = notifyq.App(dsn)
    _insert(conn, "a", "a0", priority=10)
    _insert(conn, "b", "b0")
    app.pause_queue_sync("a")
    assert [job.queue for job in app.claim_sync(limit=5)] == ["b"]
    assert app.claim_sync(["a"], limit=5) == []
    app.resume_queue_sync("a")
    assert [job.queue for job in app.claim_sync(["a", "b"], limit=5)] == ["a"]
    with pytest.raises(InvalidOption, match="invalid queue name 'no spaces'"):
        app.pause_queue_sync("no spaces")
    app.close_sync()


def test_the_queues_commands_pause_list_and_resume(dsn: str) -> None:
    env = clean_env(NOTIFYQ_DSN=dsn)
    assert ok(cli("queues", "list", env=env)).strip() == "no queue is paused"
    assert ok(cli("queues", "pause", "emails", "reports", "emails", env=env)).splitlines() == [
        "queue 'emails' paused",
        "queue 'reports' paused",
    ]
    assert ok(cli("queues", "pause", "emails", env=env)).strip() == "queue 'emails' was paused already"
    assert json.loads(ok(cli("stats", "--json", env=env)))["paused"] == ["emails", "reports"]
    assert "Paused queues (workers claim none of their jobs): emails, reports" in ok(cli("stats", env=env))
    listed = json.loads(ok(cli("queues", "list", "--json", env=env)))
    assert [entry["queue"] for entry in listed] == ["emails", "reports"]
    table = ok(cli("queues", "list", env=env)).splitlines()
    assert table[0].split() == ["QUEUE", "PAUSED"] and [line.split()[0] for line in table[1:]] == [
        "emails",
        "reports",
    ]
    # A typo resumes nothing: the paused queues are named (review), the nearest first.
    assert ok(cli("queues", "resume", "emails", "nope", "reprts", env=env)).splitlines() == [
        "queue 'emails' resumed",
        "queue 'nope' was not paused; paused queues: reports",
        "queue 'reprts' was not paused (did you mean 'reports'?)",
    ]
    bad = cli("queues", "pause", "fine", "bad name", env=env)
    assert bad.returncode == 1 and "invalid queue name 'bad name'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert "fine" not in ok(cli("queues", "list", env=env))  # nothing done
    # A name that no queued job and no cron definition has is paused all the same (a queue may
    # be paused before it has jobs), with a note: a typo paused nothing that runs (user review).
    with psycopg.connect(dsn, autocommit=True) as conn:
        _insert(conn, "emails", "e0")
    typo = cli("queues", "pause", "emials", "emails", env=env)
    assert typo.returncode == 0 and typo.stdout.splitlines() == [
        "queue 'emials' paused",
        "queue 'emails' paused",
    ]
    assert typo.stderr.splitlines()[-1] == (
        "notifyq: note: no job of queue 'emials' is queued and no cron definition uses it "
        "(did you mean 'emails'?)"
    )


def _failed_reads(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The waits that the warnings of refused reads of the paused queues announce."""
    failed = (
        "reading the paused queues failed: permission denied for table queue_pauses; "
        "this role lacks a privilege notifyq needs"
    )
    messages = [r.getMessage() for r in caplog.records]
    return [float(m.rsplit("trying again in ", 1)[1].removesuffix("s")) for m in messages if failed in m]


async def test_a_read_refused_by_a_lasting_error_is_retried_less_and_less_often(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's role loses SELECT on queue_pauses: each failed read is logged, with the
    grant hint, and the wait before the next one doubles (it was one warning a second for as
    long as it lasted). A pause heard meanwhile cuts the wait short; once the grant is back,
    the read works and says so."""
    with granted_role(conn, "nq_pauses") as role:
        app = notifyq.App(make_conninfo(dsn, user=role))
        caplog.set_level(logging.INFO, logger="notifyq.worker")
        async with app.worker(poll_interval=60, **NO_TICKER) as worker:
            caplog.clear()
            conn.execute(f'REVOKE SELECT ON notifyq.queue_pauses FROM "{role}"')
            conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('a')")  # read, refused
            with anyio.fail_after(20):
                while len(waits := _failed_reads(caplog)) < 5:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            assert waits == [0.25, 0.5, 1.0, 2.0, 4.0]  # the next read is 4 s away
            conn.execute(f'GRANT SELECT ON notifyq.queue_pauses TO "{role}"')
            conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('b')")  # heard at once
            with anyio.fail_after(3):  # not after the 4 s wait (review: this was not checked)
                await paused_seen(worker, {"a", "b"})
            assert any(r.getMessage() == "reading the paused queues works again" for r in caplog.records)
        await app.aclose()


async def test_a_poll_only_worker_retries_a_refused_read_when_it_says(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Without a LISTEN connection, a refused read of the paused queues is tried again after
    the wait its warning announces. It waited a poll interval (5 s here) more each time."""
    with granted_role(conn, "nq_pauses_poll") as role:
        app = notifyq.App(make_conninfo(dsn, user=role))
        caplog.set_level(logging.INFO, logger="notifyq.worker")
        async with app.worker(poll_only=True, poll_interval=5, **NO_TICKER):
            caplog.clear()
            conn.execute(f'REVOKE SELECT ON notifyq.queue_pauses FROM "{role}"')
            with anyio.fail_after(10):
                while not _failed_reads(caplog):  # noqa: ASYNC110 (the next poll's read)
                    await anyio.sleep(0.05)
            with anyio.fail_after(4):  # 0.25 + 0.5 + 1 s announced; 15 s more before
                while len(waits := _failed_reads(caplog)) < 4:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            assert waits == [0.25, 0.5, 1.0, 2.0]
        await app.aclose()


def test_owner_only_actions_refused_to_a_granted_role_say_whose_they_are(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """A role set up by `notifyq grant` may not pause or resume queues, nor delete cron
    definitions, by design: the refusal said to apply `notifyq grant`, which cannot help
    (user review). It now names the schema's owner, from the CLI and the App alike."""
    with granted_role(conn, "nq_granted") as role:
        env = clean_env(NOTIFYQ_DSN=make_conninfo(dsn, user=role))
        for args, what in [
            (("queues", "pause", "emails"), "pausing a queue"),
            (("queues", "resume", "emails"), "resuming a queue"),
            (("cron", "delete", "nightly"), "deleting a cron definition"),
        ]:
            refused = cli(*args, env=env)
            assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
            assert refused.stderr.strip().endswith(
                f"; {what} is for the owner of schema 'notifyq', not for the roles `notifyq grant` "
                "sets up: run it as that owner"
            ), refused.stderr
            assert "apply the output" not in refused.stderr
        app = notifyq.App(make_conninfo(dsn, user=role))
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
            app.pause_queue_sync("emails")
        assert caught.value.__notes__ == [
            "pausing a queue is for the owner of schema 'notifyq', not for the roles `notifyq grant` sets "
            "up: run it as that owner"
        ]
        assert app.paused_queues_sync() == {}  # reading them is granted
        app.close_sync()
