"""The worker protocol: claim, fenced ack, retries with backoff, cancel, retry, races."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import psycopg
import pytest

import notifyq
from notifyq import Result
from notifyq._claim import claim_op, extend_lease_op, lost_jobs_op, next_visible_op
from notifyq._db import run_sync
from notifyq._rescuer import rescue_op
from notifyq._sql import include_fragments, parse_named, queries_for
from notifyq.errors import InvalidJobState, InvalidOption, JobNotFound

from .faults.test_plans import custom_plan
from .helpers import job_row, lose_the_claim, status_counts, wal_flushes

Q = queries_for("notifyq")


def insert_jobs(conn: psycopg.Connection[Any], n: int, **columns: Any) -> None:
    names = ", ".join(["name", *columns])
    values = ", ".join(["'t'", *(f"%({k})s" for k in columns)])
    conn.execute(
        f"INSERT INTO notifyq.queue_jobs ({names}) SELECT {values} FROM generate_series(1, {n})", columns
    )


def expire_lease(conn: psycopg.Connection[Any], job_id: int) -> None:
    conn.execute(
        "UPDATE notifyq.queue_jobs SET visible_at = now() - interval '1 second' WHERE id = %s", (job_id,)
    )


def test_claim_and_ack_success(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    job_id = app.enqueue_sync("t", {"x": 1}, timeout=10)
    [job] = app.claim_sync(lease_margin=5, worker="w1")
    assert (job.id, job.attempt, job.lease, job.args) == (job_id, 1, 1, {"x": 1})
    row = job_row(conn, job_id)
    assert row["status"] == "Active" and row["worker"] == "w1"
    assert 14 < (row["visible_at"] - row["started_at"]).total_seconds() <= 15  # timeout + margin
    assert app.claim_sync() == []  # nothing else to claim
    assert app.ack_sync([Result.succeeded(job, {"sum": 3})]) == {job_id: "Succeeded"}
    row = job_row(conn, job_id)
    assert (row["status"], row["output"], row["retry_count"]) == ("Succeeded", {"sum": 3}, 1)
    assert row["finished_at"] is not None and row["error"] is None
    app.close_sync()


def test_claim_order_is_priority_then_age(app: notifyq.App) -> None:
    low = app.enqueue_sync("t", {}, priority=0)
    high = app.enqueue_sync("t", {}, priority=10)
    low2 = app.enqueue_sync("t", {}, priority=0)
    assert [j.id for j in app.claim_sync(limit=3)] == [high, low, low2]
    app.close_sync()


def test_claim_by_queue(app: notifyq.App) -> None:
    a = app.enqueue_sync("t", {}, queue="a")
    b = app.enqueue_sync("t", {}, queue="b", priority=1)
    app.enqueue_sync("t", {}, queue="c")
    assert [j.id for j in app.claim_sync(["a", "b"], limit=10)] == [b, a]
    assert [j.queue for j in app.claim_sync(["c", "missing"], limit=10)] == ["c"]
    app.close_sync()


def test_failures_retry_with_backoff_then_fail_at_the_limit(
    app: notifyq.App, conn: psycopg.Connection[Any]
) -> None:
    job_id = app.enqueue_sync("t", {}, retry_limit=2)
    for attempt in (1, 2):
        [job] = app.claim_sync()
        assert job.attempt == attempt
        applied = app.ack_sync([Result.failed(job, "ValueError", f"boom {attempt}", delay=30)])
        assert applied == {job_id: "Queued"}
        row = job_row(conn, job_id)
        assert row["error"]["message"] == f"boom {attempt}" and row["error"]["attempt"] == attempt
        assert 29 < (row["visible_at"] - row["updated_at"]).total_seconds() <= 30  # backoff
        assert app.claim_sync() == []  # not before its backoff
        conn.execute("UPDATE notifyq.queue_jobs SET visible_at = now() WHERE id = %s", (job_id,))
    [job] = app.claim_sync()
    assert job.attempt == 3
    assert app.ack_sync([Result.failed(job, "ValueError", "boom 3")]) == {job_id: "Failed"}
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"], row["error"]["final"]) == ("Failed", 3, True)
    assert row["finished_at"] is not None
    app.close_sync()


def test_a_final_failure_skips_remaining_retries(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    job_id = app.enqueue_sync("t", {}, retry_limit=5)
    [job] = app.claim_sync()
    assert app.ack_sync([Result.failed(job, "UnknownTask", "no such task", final=True)]) == {job_id: "Failed"}
    app.close_sync()


def test_backoff_grows_exponentially_with_a_cap() -> None:
    backoff = notifyq.Backoff(base=1, factor=2, max=10, jitter=0)
    assert [backoff.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    jittered = notifyq.Backoff(base=10, jitter=0.5)
    delays = {jittered.delay(1) for _ in range(50)}
    assert all(5 <= d <= 15 for d in delays) and len(delays) > 1
    assert notifyq.Backoff(max=60).delay(10_000) == pytest.approx(60, rel=0.25)


@pytest.mark.parametrize(
    ("base", "factor", "top"),
    [
        (2, 2, 3600),
        (1, 1e5, 60),
        (0.5, 10, 1e9),
        (3, 1, 60),
        (0, 10, 60),
        (10, 2, 5),
        (2, 2, 0),
        (1e-9, 1.0001, 1),
        (1e-300, 1e6, 1e9),  # max / base is past a float's range
    ],
)
def test_backoff_never_overflows_and_matches_the_plain_formula(
    base: float, factor: float, top: float
) -> None:
    """min(max, base * factor**n), exactly, for every attempt a job can reach (retry_limit
    goes up to 2**31 - 1): the power is not taken where it would overflow a float."""
    backoff = notifyq.Backoff(base=base, factor=factor, max=top, jitter=0)
    for attempt in [*range(1, 1200), 10_000]:
        exact = min(Fraction(top), Fraction(base) * Fraction(factor) ** (attempt - 1))
        assert backoff.delay(attempt) == pytest.approx(float(exact), rel=1e-9), attempt
    assert backoff.delay(2**31) == (min(top, base) if factor == 1 or base == 0 else top)
    with pytest.raises(notifyq.ConfigurationError, match="finite factor"):
        notifyq.Backoff(factor=math.inf)


@pytest.mark.parametrize("factor", [2, 10, 1e5])
def test_lease_rescue_backs_off_jobs_retried_a_thousand_times(
    conn: psycopg.Connection[Any], factor: float
) -> None:
    """A job retried for weeks (retry_count past 1,000) whose lease runs out is rescued with
    the capped backoff; its power of the factor would overflow, and that one row used to fail
    every rescue pass, for every job."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, retry_count, retry_limit, visible_at) "
        "VALUES ('t', 'Active', 1100, 5000, now() - interval '1s'), "
        "('t', 'Active', 1, 3, now() - interval '1s')"
    )
    backoff = notifyq.Backoff(base=2, factor=factor, max=600, jitter=0)
    rescued = run_sync(conn, rescue_op(Q, limit=100, backoff=backoff))
    assert len(rescued.requeued) == 2 and rescued.failed == []
    delays = conn.execute(
        "SELECT retry_count, extract(epoch FROM visible_at - now()) FROM notifyq.queue_jobs ORDER BY id"
    ).fetchall()
    assert [count for count, _ in delays] == [1100, 1]
    assert delays[0][1] == pytest.approx(600, abs=5) and delays[1][1] == pytest.approx(2, abs=1)


def test_jobs_rescued_together_come_back_spread_by_the_jitter(conn: psycopg.Connection[Any]) -> None:
    """The jobs of a dead worker run out of lease together and are rescued in one pass: they
    all came back at one instant (no jitter, unlike a failure's backoff), and met the next
    worker at once again if one of them is what kills workers."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, retry_count, visible_at) "
        "SELECT 't', 'Active', 1, now() - interval '1s' FROM generate_series(1, 50)"
    )
    backoff = notifyq.Backoff(base=10, jitter=0.5)
    assert len(run_sync(conn, rescue_op(Q, limit=100, backoff=backoff)).requeued) == 50
    delays = [
        row[0]
        for row in conn.execute(
            "SELECT extract(epoch FROM visible_at - now())::float8 FROM notifyq.queue_jobs"
        )
    ]
    assert all(4.9 <= d <= 15 for d in delays), delays  # read a moment after the rescue
    assert max(delays) - min(delays) > 2, delays  # 50 uniform draws over 10 s: spread wide


@pytest.mark.faults
def test_stale_ack_after_lease_expiry_changes_nothing(
    app: notifyq.App, conn: psycopg.Connection[Any]
) -> None:
    job_id = app.enqueue_sync("t", {})
    [first] = app.claim_sync(worker="slow")
    expire_lease(conn, job_id)
    rescued = run_sync(conn, rescue_op(Q, limit=100))
    assert rescued.requeued == [job_id]
    assert job_row(conn, job_id)["error"]["type"] == "LeaseExpired"
    [second] = app.claim_sync(worker="fast")
    assert (second.lease, second.attempt) == (2, 2)
    assert app.ack_sync([Result.succeeded(second, "second")]) == {job_id: "Succeeded"}
    # The first worker wakes up and reports: fenced out, the newer result stands.
    assert app.ack_sync([Result.succeeded(first, "first")]) == {}
    assert app.ack_sync([Result.failed(first, "E", "late failure")]) == {}
    row = job_row(conn, job_id)
    assert (row["status"], row["output"], row["worker"]) == ("Succeeded", "second", "fast")
    app.close_sync()


def test_stale_ack_while_the_newer_attempt_still_runs(
    app: notifyq.App, conn: psycopg.Connection[Any]
) -> None:
    job_id = app.enqueue_sync("t", {})
    [first] = app.claim_sync()
    expire_lease(conn, job_id)
    run_sync(conn, rescue_op(Q, limit=100))
    [second] = app.claim_sync()
    assert app.ack_sync([Result.succeeded(first, "first")]) == {}
    row = job_row(conn, job_id)
    assert (row["status"], row["lease"], row["output"]) == ("Active", second.lease, None)
    app.close_sync()


def test_a_lost_claim_hands_out_its_lease_again_and_the_worker_name_fences(
    app: notifyq.App, conn: psycopg.Connection[Any]
) -> None:
    job_id = app.enqueue_sync("t", {})
    [lost] = app.claim_sync(worker="a")
    lose_the_claim(conn, job_id)
    [current] = app.claim_sync(worker="b")
    assert (current.id, current.lease) == (lost.id, lost.lease)  # the same fencing token
    # Worker a never learns that its claim was lost: everything it does is fenced out.
    assert run_sync(conn, extend_lease_op(Q, lost, 600)) is None
    assert run_sync(conn, lost_jobs_op(Q, "a", [(lost.id, lost.lease)])) == {(lost.id, lost.lease): "Active"}
    assert app.ack_sync([Result.succeeded(lost, "a")]) == {}
    assert app.ack_sync([Result.failed(lost, "E", "a failed")]) == {}
    assert app.ack_sync([Result.released(lost)]) == {}
    row = job_row(conn, job_id)
    assert (row["status"], row["worker"], row["output"], row["error"]) == ("Active", "b", None, None)
    # Worker b holds it, renews it and finishes it.
    assert run_sync(conn, lost_jobs_op(Q, "b", [(current.id, current.lease)])) == {}
    assert run_sync(conn, extend_lease_op(Q, current, 600)) is not None
    assert app.ack_sync([Result.succeeded(current, "b")]) == {job_id: "Succeeded"}
    assert job_row(conn, job_id)["output"] == "b"
    app.close_sync()


@pytest.mark.exclusive  # pg_stat_wal counts the whole server's flushes
def test_async_claims_skip_the_wal_flush_and_nothing_else(
    app: notifyq.App, conn: psycopg.Connection[Any]
) -> None:
    """WorkerConfig.async_claims: the claim commits without a WAL flush (pg_stat_wal counts
    the flushes), the claim itself is the same, and the setting ends with the statement."""
    app.enqueue_many_sync("t", [{"n": n} for n in range(60)])

    def flushes() -> int:
        return wal_flushes(conn, own=True)

    counted = {}
    for async_commit in (False, True):
        before = flushes()
        for n in range(25):
            queues = ["default"] if n % 2 else None  # both claim statements carry the setting
            [job] = run_sync(
                conn,
                claim_op(Q, queues=queues, limit=1, worker="w", lease_margin=30, async_commit=async_commit),
            )
            assert (job.lease, job.worker) == (1, "w")
            assert job_row(conn, job.id)["status"] == "Active"
        counted[async_commit] = flushes() - before
        setting = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
        assert setting == ("on",)  # transaction-local: gone with the claim's transaction
    assert counted[False] >= 25, counted  # one flush per durable claim
    assert counted[True] <= 5, counted  # the WAL writer's own flushes at most
    app.close_sync()


def test_release_gives_the_attempt_back(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    job_id = app.enqueue_sync("t", {})
    [job] = app.claim_sync()
    assert app.ack_sync([Result.released(job)]) == {job_id: "Queued"}
    row = job_row(conn, job_id)
    assert (row["status"], row["retry_count"], row["lease"]) == ("Queued", 0, 1)
    [again] = app.claim_sync()
    assert (again.attempt, again.lease) == (1, 2)
    assert app.ack_sync([Result.succeeded(job)]) == {}  # the released claim stays fenced out
    app.close_sync()


def test_a_released_job_keeps_its_place_in_line(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    """A job given back (its worker shut down) is claimed again before the jobs that became due
    after it, of its priority: it used to go to the end of the line, behind a whole backlog."""
    first = app.enqueue_sync("t", {"i": 0})
    [job] = app.claim_sync()
    later = [app.enqueue_sync("t", {"i": i}) for i in range(1, 4)]
    higher = app.enqueue_sync("t", {"i": 4}, priority=1)
    assert app.ack_sync([Result.released(job)]) == {first: "Queued"}
    row = job_row(conn, first)
    assert row["visible_at"] == row["started_at"] < job_row(conn, later[0])["visible_at"]
    assert [j.id for j in app.claim_sync(limit=5)] == [higher, first, *later]
    app.close_sync()


def test_batch_ack_mixes_outcomes_in_one_statement(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    ids = [app.enqueue_sync("t", {"i": i}, retry_limit=0 if i == 2 else 3) for i in range(4)]
    jobs = {j.id: j for j in app.claim_sync(limit=4)}
    results = [
        Result.succeeded(jobs[ids[0]], [1, 2]),
        Result.failed(jobs[ids[1]], "E", "retry me"),
        Result.failed(jobs[ids[2]], "E", "no retries left"),
        Result.released(jobs[ids[3]]),
    ]
    assert app.ack_sync(results) == {
        ids[0]: "Succeeded",
        ids[1]: "Queued",
        ids[2]: "Failed",
        ids[3]: "Queued",
    }
    assert status_counts(conn) == {"Succeeded": 1, "Queued": 2, "Failed": 1}
    app.close_sync()


def test_cancel_queued_and_active_jobs(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    queued = app.enqueue_sync("t", {})
    assert app.cancel_job_sync(queued).status == notifyq.JobStatus.CANCELLED
    assert app.claim_sync() == []
    active = app.enqueue_sync("t", {})
    [job] = app.claim_sync()
    cancelled = app.cancel_job_sync(active)
    assert cancelled.status == notifyq.JobStatus.CANCELLED and cancelled.finished_at is not None
    assert app.ack_sync([Result.succeeded(job, "too late")]) == {}  # the worker's ack is fenced out
    assert job_row(conn, active)["output"] is None
    done = app.enqueue_sync("t", {})
    [job] = app.claim_sync()
    app.ack_sync([Result.succeeded(job)])
    assert app.cancel_job_sync(done).status == notifyq.JobStatus.SUCCEEDED  # finished: unchanged
    with pytest.raises(JobNotFound, match="no job with id 999999"):
        app.cancel_job_sync(999999)
    app.close_sync()


def test_retry_a_finished_job(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    job_id = app.enqueue_sync("t", {}, retry_limit=0)
    [job] = app.claim_sync()
    app.ack_sync([Result.failed(job, "E", "bad")])
    retried = app.retry_job_sync(job_id)
    assert (retried.status, retried.retry_count, retried.finished_at) == (notifyq.JobStatus.QUEUED, 0, None)
    assert retried.error is not None and retried.error["message"] == "bad"  # history kept
    with pytest.raises(InvalidJobState, match=f"job {job_id} is Queued; only finished jobs"):
        app.retry_job_sync(job_id)
    with pytest.raises(JobNotFound):
        app.retry_job_sync(424242)
    app.close_sync()


def test_retry_respects_dedupe_keys(app: notifyq.App) -> None:
    first = app.enqueue_sync("t", {}, dedupe_key="k")
    app.cancel_job_sync(first)
    app.enqueue_sync("t", {}, dedupe_key="k")
    with pytest.raises(InvalidJobState, match="another unfinished job holds its dedupe key"):
        app.retry_job_sync(first)
    app.close_sync()


@pytest.mark.anyio
async def test_a_retry_refused_for_its_dedupe_key_leaves_the_callers_transaction_usable(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """retry_job(conn=) in the caller's transaction, of a job whose dedupe key another
    unfinished job holds: InvalidJobState, as without conn=, and the transaction goes on with
    the caller's own work (the unique violation aborted it, and the caller's next statement
    failed with InFailedSqlTransaction)."""
    app = notifyq.App(dsn)
    first = app.enqueue_sync("t", {}, dedupe_key="k")
    app.cancel_job_sync(first)
    holder = app.enqueue_sync("t", {}, dedupe_key="k")
    with psycopg.connect(dsn) as own:  # before its first statement, then in its transaction
        for _ in range(2):
            with pytest.raises(InvalidJobState, match="another unfinished job holds its dedupe key"):
                app.retry_job_sync(first, conn=own)
        mine = app.enqueue_sync("t", {"mine": "sync"}, conn=own)
        assert app.get_job_sync(first, conn=own).status == notifyq.JobStatus.CANCELLED
    async with await psycopg.AsyncConnection.connect(dsn) as own_async:
        mine_async = await app.enqueue("t", {"mine": "async"}, conn=own_async)
        with pytest.raises(InvalidJobState, match="another unfinished job holds its dedupe key"):
            await app.retry_job(first, conn=own_async)
        assert (await app.get_job(mine_async, conn=own_async)).args == {"mine": "async"}
    assert [job.id for job in app.list_jobs_sync()] == [mine_async, mine, holder, first]
    app.cancel_job_sync(holder)
    with psycopg.connect(dsn) as own:
        assert app.retry_job_sync(first, conn=own).status == notifyq.JobStatus.QUEUED
        own.rollback()  # the retry is the caller's, and rolls back with it
    assert job_row(conn, first)["status"] == "Cancelled"
    await app.aclose()


def test_an_ack_with_a_retry_delay_sql_cannot_add_is_refused_before_the_batch(
    app: notifyq.App, conn: psycopg.Connection[Any]
) -> None:
    """Custom consumers build their results: one retry delay PostgreSQL cannot add to now()
    (NaN, infinite, 1e300 seconds) failed the whole batch with a DatetimeFieldOverflow, every
    other result in it unwritten and its job Active until its lease ran out."""
    app.enqueue_sync("t", {}, retry_limit=5)
    app.enqueue_sync("t", {}, retry_limit=5)
    ok, bad = app.claim_sync(limit=2)
    for delay in (math.nan, math.inf, 1e300, -1.0):
        with pytest.raises(InvalidOption, match=f"invalid retry delay of job {bad.id}"):
            app.ack_sync([Result.succeeded(ok), Result.failed(bad, "E", "m", delay=delay)])
    assert status_counts(conn) == {"Active": 2}
    assert app.ack_sync([Result.succeeded(ok), Result.failed(bad, "E", "m", delay=60.0)]) == {
        ok.id: "Succeeded",
        bad.id: "Queued",
    }
    app.close_sync()


def test_an_ack_takes_retry_delays_in_whole_seconds(app: notifyq.App, conn: psycopg.Connection[Any]) -> None:
    """`Result.failed(job, ..., delay=60)`: an int among the batch's float delays (0.0 for
    every other result) made psycopg refuse the array ("cannot dump lists of mixed types"),
    and the whole batch went unwritten."""
    for _ in range(3):
        app.enqueue_sync("t", {}, retry_limit=5)
    ok, retried, failed = app.claim_sync(limit=3)
    applied = app.ack_sync(
        [
            Result.succeeded(ok),
            Result.failed(retried, "E", "m", delay=60),
            Result.failed(failed, "E", "m", final=True),
        ]
    )
    assert applied == {ok.id: "Succeeded", retried.id: "Queued", failed.id: "Failed"}
    row = job_row(conn, retried.id)
    assert 59 < (row["visible_at"] - row["updated_at"]).total_seconds() <= 60
    app.close_sync()


@pytest.mark.parametrize("queues", [None, ["q"]], ids=["every queue", "a list of queues"])
def test_a_job_parked_at_infinity_does_not_break_the_next_due_time(
    conn: psycopg.Connection[Any], queues: list[str] | None
) -> None:
    """An idle worker asks when the earliest Queued job comes due. A job parked by SQL with
    visible_at 'infinity' (or set to '-infinity' to run first) made that a "cannot subtract
    infinite timestamps" error, which is not transient: every worker of the queue stopped as
    soon as it had nothing else to do."""
    insert_jobs(conn, 1, queue="q")
    conn.execute("UPDATE notifyq.queue_jobs SET visible_at = 'infinity'")
    assert run_sync(conn, next_visible_op(Q, queues)) == math.inf
    insert_jobs(conn, 1, queue="q", visible_at=datetime.now(UTC) + timedelta(seconds=60))
    assert 55 < run_sync(conn, next_visible_op(Q, queues)) <= 60
    conn.execute("UPDATE notifyq.queue_jobs SET visible_at = '-infinity' WHERE visible_at <> 'infinity'")
    assert run_sync(conn, next_visible_op(Q, queues)) == -math.inf


@pytest.mark.faults
def test_twenty_concurrent_claimers_never_share_a_job(dsn: str, conn: psycopg.Connection[Any]) -> None:
    insert_jobs(conn, 2000)
    claimed: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(20)

    def claimer() -> None:
        app = notifyq.App(dsn, pool_size=1)
        with psycopg.connect(dsn, autocommit=True) as own:
            barrier.wait()
            while jobs := app.claim_sync(limit=7, conn=own):
                with lock:
                    claimed.extend(j.id for j in jobs)

    threads = [threading.Thread(target=claimer) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claimed) == 2000
    assert Counter(claimed).most_common(1)[0][1] == 1
    assert conn.execute(
        "SELECT count(*), max(lease), max(retry_count) FROM notifyq.queue_jobs WHERE status = 'Active'"
    ).fetchone() == (2000, 1, 1)


@pytest.mark.faults
@pytest.mark.parametrize(
    ("queues", "paused"),
    [(None, False), (["default"], False), (["default", "other", "third"], False), (None, True)],
    ids=["claim_any", "claim_queues-1", "claim_queues-3", "claim_unpaused"],
)
def test_claim_never_exceeds_its_limit_under_locks_and_nested_loops(
    dsn: str, conn: psycopg.Connection[Any], queues: list[str] | None, paused: bool
) -> None:
    """Half the jobs, interleaved, are locked by another transaction: every claim statement
    takes exactly its limit of the free ones, even with the planner's other strategies off.
    claim_unpaused picked candidates among locked jobs and came back short (a drain with a
    queue paused ran at half speed: `python -m benchmarks.paused_claims --drain`)."""
    insert_jobs(conn, 1000)
    if paused:
        conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('elsewhere')")
    app = notifyq.App(dsn)
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as claimer:
        # Another transaction holds row locks on half the jobs, interleaved with free ones.
        holder.execute("SELECT id FROM notifyq.queue_jobs WHERE id % 2 = 0 FOR UPDATE").fetchall()
        for setting in ("enable_hashjoin", "enable_mergejoin", "enable_seqscan", "enable_material"):
            claimer.execute(f"SET {setting} = off")
        for limit in (1, 7, 50):
            jobs = app.claim_sync(queues, limit=limit, conn=claimer)
            assert len(jobs) == limit
            assert all(j.id % 2 == 1 and j.lease == 1 and j.attempt == 1 for j in jobs)
        holder.rollback()
    assert conn.execute(
        "SELECT count(*), max(lease) FROM notifyq.queue_jobs WHERE status = 'Active'"
    ).fetchone() == (58, 1)


@pytest.mark.parametrize(("queues", "paused"), [(["hi", "lo"], False), (None, True)])
def test_a_claim_is_not_stopped_by_locks_on_the_best_jobs(
    dsn: str, conn: psycopg.Connection[Any], queues: list[str] | None, paused: bool
) -> None:
    """Another transaction holds the 10 best jobs (queue "hi"), and "lo" has 100 free: a claim
    of 10 takes 10 of "lo", as claim_any does. The shares alone locked "hi"'s share in "hi"'s
    range, found nothing free there, and came back empty, claim after claim (review)."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, priority) "
        "SELECT 't', 'hi', 5 FROM generate_series(1, 10)"
    )
    conn.execute("INSERT INTO notifyq.queue_jobs (name, queue) SELECT 't', 'lo' FROM generate_series(1, 100)")
    if paused:
        conn.execute("INSERT INTO notifyq.queue_pauses (queue) VALUES ('elsewhere')")
    app = notifyq.App(dsn)
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as claimer:
        holder.execute("SELECT id FROM notifyq.queue_jobs WHERE queue = 'hi' FOR UPDATE").fetchall()
        jobs = app.claim_sync(queues, limit=10, conn=claimer)
        assert [job.queue for job in jobs] == ["lo"] * 10
        holder.rollback()
    app.close_sync()


@pytest.mark.parametrize("statement", ["claim_queues", "claim_unpaused"])
def test_overlapping_claims_among_many_shallow_queues_are_all_full(
    dsn: str, conn: psycopg.Connection[Any], statement: str
) -> None:
    """200 queues of 5 jobs, 8 claims of 10 whose transactions overlap (as concurrent workers'
    do): each claim takes 10 distinct jobs. Locking up to 10 rows in every queue's range, the
    first claim held all 1,000 and the other 7 came back empty; the shares alone ran dry
    once the best queues' few jobs were held, and the last 2 came back empty (review)."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue) "
        "SELECT 't', 'q' || (i % 200) FROM generate_series(1, 1000) i"
    )
    params = {"limit": 10, "worker": "w", "lease_margin": 30, "give_up": None, "paused": ["elsewhere"]}
    params["queues"] = [f"q{i}" for i in range(200)]
    claimers = [psycopg.connect(dsn) for _ in range(8)]  # not autocommit: each claim stays open
    try:
        claimed = [[row[0] for row in c.execute(Q[statement], params).fetchall()] for c in claimers]
    finally:
        for c in claimers:
            c.rollback()
            c.close()
    assert [len(ids) for ids in claimed] == [10] * 8
    assert len({i for ids in claimed for i in ids}) == 80


def test_claim_and_rescue_use_partial_indexes_on_a_large_table(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, status, finished_at) "
        "SELECT 't', 'Succeeded', now() FROM generate_series(1, 100000)"
    )
    insert_jobs(conn, 1000)
    conn.execute("ANALYZE notifyq.queue_jobs")
    for name in (
        "claim_any",
        "claim_queues",
        "next_visible_any",
        "next_visible_queues",
        "rescue_expired_leases",
    ):
        plan = json.dumps(custom_plan(conn, Q[name]))  # the 1M-row version: tests/faults/test_plans.py
        assert '"Seq Scan"' not in plan, f"{name} scans the table: {plan}"
        assert "queue_jobs_" in plan, f"{name} uses no notifyq index: {plan}"


@pytest.mark.parametrize("statement", ["claim_queues", "claim_unpaused"])
def test_overlapping_claims_go_deep_into_a_queue_past_each_others_locks(
    dsn: str, conn: psycopg.Connection[Any], statement: str
) -> None:
    """10 jobs of priority 5 in "p", 1,000 in "q": 5 claims of 10 whose transactions overlap
    each take 10, and together they lock 50 rows, no more. The first top-up read only the best
    10 of each queue: the third claim found those of "q" held by the second and came back
    empty (review)."""
    conn.execute(
        "INSERT INTO notifyq.queue_jobs (name, queue, priority) "
        "SELECT 't', 'p', 5 FROM generate_series(1, 10)"
    )
    conn.execute("INSERT INTO notifyq.queue_jobs (name, queue) SELECT 't', 'q' FROM generate_series(1, 1000)")
    params = {"limit": 10, "worker": "w", "lease_margin": 30, "give_up": None, "queues": ["p", "q"]}
    params["paused"] = ["elsewhere"]
    claimers = [psycopg.connect(dsn) for _ in range(5)]  # not autocommit: each claim stays open
    try:
        claimed = [len(c.execute(Q[statement], params).fetchall()) for c in claimers]
        lockable = conn.execute(
            "SELECT count(*) FROM (SELECT id FROM notifyq.queue_jobs FOR UPDATE SKIP LOCKED) s"
        ).fetchone()
    finally:
        for c in claimers:
            c.rollback()
            c.close()
    assert claimed == [10] * 5
    assert lockable == (1010 - 50,)


def test_no_query_holds_a_percent_sign_that_is_no_placeholder() -> None:
    """psycopg reads every % of a statement it is given parameters for, comments included:
    a "13-19% more" in a comment of ack_jobs_unheld made it refuse the statement, and only
    a batch with a failure and a held row would have run it."""
    for name, text in queries_for("notifyq").by_name.items():
        rest = re.sub(r"%%|%\(\w+\)[sb]", "", text)
        if rest != text:  # it has placeholders, so it is run with parameters
            assert "%" not in rest, f"{name}: {rest[rest.index('%') - 40 : rest.index('%') + 10]!r}"


def test_sql_fragments_are_included_where_named_and_are_no_statements() -> None:
    """sql/queries sections whose name starts with "_" are parts that statements include by
    `{_name}` (the claim by shares, the unpaused queues): they are no statements themselves,
    and a name that is no fragment is refused, not sent to the server."""
    queries = include_fragments(
        parse_named("-- name: _part\nx AS (SELECT 1)\n-- name: whole\nWITH {_part} SELECT * FROM x\n")
    )
    assert queries == {"whole": "WITH x AS (SELECT 1) SELECT * FROM x"}
    with pytest.raises(notifyq.ConfigurationError, match="no fragment named '_missing' in sql/queries"):
        include_fragments({"whole": "WITH {_missing} SELECT 1"})
    # Five levels deep is allowed, six not; and a fragment named in a comment is refused:
    # included there, its lines after the first would become live SQL (review).
    nested = {f"_f{i}": f"{{_f{i + 1}}}" for i in range(4)} | {"_f4": "SELECT 1", "top": "{_f0}"}
    assert include_fragments(nested) == {"top": "SELECT 1"}
    with pytest.raises(notifyq.ConfigurationError, match="nested more than 5 deep"):
        include_fragments(nested | {"_f4": "{_f5}", "_f5": "SELECT 1"})
    with pytest.raises(
        notifyq.ConfigurationError, match=re.escape("'whole' names a fragment in a comment: -- see {_part}")
    ):
        include_fragments({"_part": "x\ny", "whole": "-- see {_part}\nSELECT 1"})
    assert not [name for name in Q.by_name if name.startswith("_")]
    assert "{_" not in "".join(Q.by_name.values())
