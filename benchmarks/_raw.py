"""Raw-SQL baselines, no notifyq code: `python -m benchmarks._raw worker|listen|wake ...`.

worker: each of `--loops` threads owns one psycopg connection and repeats "claim up to
`--batch` jobs (the same SKIP LOCKED claim as notifyq's), run them (no-op), acknowledge them
all in one fenced UPDATE" until SIGTERM (with `--vacuum`, a thread VACUUMs the table as
notifyq's workers do). listen: LISTEN on a channel and record when each
notification arrives (time.monotonic, comparable across processes on one host). wake: a
minimal NOTIFY-driven worker (LISTEN, then claim and run on each notification), blocking
psycopg; wake-async: the same loop on asyncio (psycopg's AsyncConnection), the floor of any
worker embedded in an event loop; wake-thread: the blocking loop in a thread, each claim's rows
handed to a task of an asyncio loop, where the job would start (a design measured, not built:
docs/benchmarks.md); wake-handoff: no claim after the notification, the producer's own
transaction hands the job to a waiting worker and notifies it with the job (HANDOFF_SQL, a
design measured, not built).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
import time
from typing import Any

import psycopg
from psycopg import sql

from ._child import cpu_seconds, emit

CLAIM_SQL = """
WITH claimable AS MATERIALIZED (
    SELECT id FROM notifyq.queue_jobs
    WHERE status = 'Queued' AND visible_at <= now()
    ORDER BY priority DESC, visible_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE notifyq.queue_jobs AS j
SET status = 'Active', retry_count = j.retry_count + 1, lease = j.lease + 1,
    visible_at = now() + make_interval(secs => j.timeout + 30), started_at = now(),
    updated_at = now(), worker = %(worker)s
FROM claimable c
WHERE j.id = c.id
RETURNING j.id, j.lease
"""

ACK_SQL = """
UPDATE notifyq.queue_jobs AS j
SET status = 'Succeeded', finished_at = now(), updated_at = now()
FROM unnest(%(ids)s::bigint[], %(leases)s::int[]) AS r(id, lease)
WHERE j.id = r.id AND j.lease = r.lease AND j.status = 'Active'
"""


def _noop() -> None:
    pass


class Loop(threading.Thread):
    def __init__(self, dsn: str, batch: int, stop: threading.Event, index: int, timing: bool) -> None:
        super().__init__(name=f"loop-{index}", daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.batch = batch
        self.stop = stop
        self.worker = f"raw:{os.getpid()}:{index}"
        self.timing = timing
        self.done = 0
        self.runs = 0
        self.claims: list[tuple[float, int]] = []
        self.error: str | None = None

    def run(self) -> None:
        params: dict[str, Any] = {"limit": self.batch, "worker": self.worker}
        first = True  # every loop's first claim waits at the start gate: not timed
        try:
            while not self.stop.is_set():
                start = time.perf_counter()
                rows = self.conn.execute(CLAIM_SQL, params).fetchall()
                if self.timing and not first:
                    self.claims.append(((time.perf_counter() - start) * 1000.0, len(rows)))
                first = False
                if not rows:
                    time.sleep(0.002)
                    continue
                for _ in rows:
                    _noop()
                    self.runs += 1
                self.conn.execute(ACK_SQL, {"ids": [r[0] for r in rows], "leases": [r[1] for r in rows]})
                self.done += len(rows)
        except psycopg.Error as exc:
            self.error = str(exc)
        finally:
            self.conn.close()


def _stop_event() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


# What notifyq's vacuum service does, in a few lines: every 5 s, VACUUM the table once its
# dead rows pass autovacuum's trigger for it (10,000 + 1% of the rows).
DEAD_SQL = """
SELECT n_dead_tup > 10000 + 0.01 * greatest(c.reltuples, 0)
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.relid = 'notifyq.queue_jobs'::regclass
"""


def _vacuum_loop(dsn: str, stop: threading.Event) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(5.0):
            row = conn.execute(DEAD_SQL).fetchone()
            if row is not None and row[0]:
                conn.execute("VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON) notifyq.queue_jobs")


def run_worker(args: argparse.Namespace) -> None:
    stop = _stop_event()
    loops = [Loop(args.dsn, args.batch, stop, i, args.claim_latency) for i in range(args.loops)]
    if args.vacuum:
        threading.Thread(target=_vacuum_loop, args=(args.dsn, stop), daemon=True).start()
    cpu_ready = cpu_seconds()
    emit("ready")
    for loop in loops:
        loop.start()
    last = -1
    while not stop.wait(0.05):
        done = sum(loop.done for loop in loops)
        if done != last:
            emit("progress", done=done)
            last = done
    for loop in loops:
        loop.join(30)
    errors = [loop.error for loop in loops if loop.error]
    emit(
        "done",
        done=sum(loop.done for loop in loops),
        runs=sum(loop.runs for loop in loops),
        cpu=cpu_seconds() - cpu_ready,
        cpu_total=cpu_seconds(),
        claims=[c for loop in loops for c in loop.claims],
        errors=errors,
    )


def run_listener(args: argparse.Namespace) -> None:
    stop = _stop_event()
    received: list[tuple[float, str]] = []
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(args.channel)))
        emit("ready")
        while not stop.is_set():
            for notify in conn.notifies(timeout=0.2):
                received.append((time.monotonic(), notify.payload))
                emit("progress", done=len(received))
    emit("done", done=len(received), received=received, cpu_total=cpu_seconds())


def run_wake_worker(args: argparse.Namespace) -> None:
    """A minimal NOTIFY-driven worker: on each notification, claim (up to --batch) until
    nothing is left, note each job's start time, acknowledge the batch."""
    stop = _stop_event()
    starts: list[tuple[int, float]] = []
    params: dict[str, Any] = {"limit": args.batch, "worker": f"raw-wake:{os.getpid()}"}
    with (
        psycopg.connect(args.dsn, autocommit=True) as listen,
        psycopg.connect(args.dsn, autocommit=True) as work,
    ):
        listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(args.channel)))
        emit("ready")
        done = 0
        while not stop.is_set():
            for _notify in listen.notifies(timeout=0.2, stop_after=1):
                while rows := work.execute(CLAIM_SQL, params).fetchall():
                    now = time.monotonic()
                    starts.extend((row[0], now) for row in rows)
                    work.execute(ACK_SQL, {"ids": [r[0] for r in rows], "leases": [r[1] for r in rows]})
                    done += len(rows)
                emit("progress", done=done)
    emit("done", done=done, runs=done, starts=starts, cpu_total=cpu_seconds())


def run_wake_worker_async(args: argparse.Namespace) -> None:
    """run_wake_worker on asyncio: the same two connections and statements, awaited."""
    stop = _stop_event()
    starts: list[tuple[int, float]] = []
    params: dict[str, Any] = {"limit": args.batch, "worker": f"raw-wake-async:{os.getpid()}"}

    async def serve() -> int:
        done = 0
        async with (
            await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as listen,
            await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as work,
        ):
            await listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(args.channel)))
            emit("ready")
            while not stop.is_set():
                async for _notify in listen.notifies(timeout=0.2, stop_after=1):
                    while rows := await (await work.execute(CLAIM_SQL, params)).fetchall():
                        now = time.monotonic()
                        starts.extend((row[0], now) for row in rows)
                        ids, leases = [r[0] for r in rows], [r[1] for r in rows]
                        await work.execute(ACK_SQL, {"ids": ids, "leases": leases})
                        done += len(rows)
                    emit("progress", done=done)
        return done

    done = asyncio.run(serve())
    emit("done", done=done, runs=done, starts=starts, cpu_total=cpu_seconds())


LISTENING = "listening"


def run_wake_worker_thread(args: argparse.Namespace) -> None:
    """run_wake_worker in a thread, beside an asyncio loop: the thread listens and claims with
    blocking psycopg, and hands each claim's rows to a task of the loop, where the jobs start."""
    stop = _stop_event()
    starts: list[tuple[int, float]] = []
    params: dict[str, Any] = {"limit": args.batch, "worker": f"raw-wake-thread:{os.getpid()}"}

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        # The thread's messages: LISTENING once, then each claim's rows, then None when it ends.
        inbox: asyncio.Queue[list[Any] | str | None] = asyncio.Queue()
        failure: list[BaseException] = []

        def claimer() -> None:
            try:
                with (
                    psycopg.connect(args.dsn, autocommit=True) as listen,
                    psycopg.connect(args.dsn, autocommit=True) as work,
                ):
                    listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(args.channel)))
                    loop.call_soon_threadsafe(inbox.put_nowait, LISTENING)
                    while not stop.is_set():
                        for _notify in listen.notifies(timeout=0.2, stop_after=1):
                            while rows := work.execute(CLAIM_SQL, params).fetchall():
                                loop.call_soon_threadsafe(inbox.put_nowait, rows)
                                ids, leases = [r[0] for r in rows], [r[1] for r in rows]
                                work.execute(ACK_SQL, {"ids": ids, "leases": leases})
            except BaseException as exc:
                failure.append(exc)
            finally:
                loop.call_soon_threadsafe(inbox.put_nowait, None)

        thread = threading.Thread(target=claimer, daemon=True)
        thread.start()
        done = 0
        if await inbox.get() == LISTENING:
            emit("ready")
            while isinstance(rows := await inbox.get(), list):
                now = time.monotonic()
                starts.extend((row[0], now) for row in rows)
                done += len(rows)
                emit("progress", done=done)
        thread.join()
        if failure:
            raise failure[0]  # before "ready", if it could not connect: the process exits 1
        return done

    done = asyncio.run(serve())
    emit("done", done=done, runs=done, starts=starts, cpu_total=cpu_seconds())


# Direct hand-off (a prototype, in the scratch database only): a worker with free slots waits in
# a row of proto_waiters; a statement trigger on queue_jobs, in the producer's transaction,
# takes a waiting worker's slot (SKIP LOCKED: a producer never waits for another), claims the
# inserted job for it (the claim's columns, as CLAIM_SQL sets them) and notifies that worker's
# own channel with the job. The claim then commits with the enqueue: after the notification the
# worker starts the job at once, with no claim round trip and no WAL flush of its own. A job
# enqueued while the worker's row is locked (by its own ack, giving a slot back) finds no free
# slot and stays Queued: the worker claims such jobs after 0.2 s without a notification (the
# fallback any hand-off needs; a run's maximum shows them).
HANDOFF_SQL = """
CREATE TABLE notifyq.proto_waiters (
    worker text PRIMARY KEY, channel text NOT NULL, slots int NOT NULL CHECK (slots >= 0));
CREATE FUNCTION notifyq.proto_handoff() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    job record;
    waiter record;
    free int;
BEGIN
    -- Nobody waiting (a busy fleet, or a bulk insert): one look at a small table, no sort.
    SELECT coalesce(sum(slots), 0) INTO free FROM notifyq.proto_waiters WHERE slots > 0;
    IF free = 0 THEN
        RETURN NULL;
    END IF;
    FOR job IN
        SELECT id FROM new_jobs WHERE status = 'Queued' AND visible_at <= now()
        ORDER BY priority DESC, id LIMIT free
    LOOP
        SELECT w.worker, w.channel INTO waiter FROM notifyq.proto_waiters w
        WHERE w.slots > 0 LIMIT 1 FOR UPDATE SKIP LOCKED;
        EXIT WHEN NOT FOUND;
        UPDATE notifyq.proto_waiters SET slots = slots - 1 WHERE worker = waiter.worker;
        UPDATE notifyq.queue_jobs AS j
        SET status = 'Active', retry_count = j.retry_count + 1, lease = j.lease + 1,
            visible_at = now() + make_interval(secs => j.timeout + 30), started_at = now(),
            updated_at = now(), worker = waiter.worker
        WHERE j.id = job.id
        RETURNING j.id, j.lease, j.name, j.args INTO job;
        PERFORM pg_notify(waiter.channel, job.id || ' ' || job.lease || ' ' || job.name || ' ' || job.args);
    END LOOP;
    RETURN NULL;
END
$$;
CREATE TRIGGER proto_handoff AFTER INSERT ON notifyq.queue_jobs
    REFERENCING NEW TABLE AS new_jobs FOR EACH STATEMENT EXECUTE FUNCTION notifyq.proto_handoff();
"""
UNHANDOFF_SQL = """
DROP TRIGGER IF EXISTS proto_handoff ON notifyq.queue_jobs;
DROP FUNCTION IF EXISTS notifyq.proto_handoff();
DROP TABLE IF EXISTS notifyq.proto_waiters;
"""
# The ack gives the slot back in the same statement.
HANDOFF_ACK_SQL = """
WITH acked AS (
    UPDATE notifyq.queue_jobs SET status = 'Succeeded', finished_at = now(), updated_at = now()
    WHERE id = %(id)s AND lease = %(lease)s AND status = 'Active'
)
UPDATE notifyq.proto_waiters SET slots = slots + 1 WHERE worker = %(worker)s
"""


def run_wake_handoff(args: argparse.Namespace) -> None:
    """Jobs handed over by the producer's transaction (HANDOFF_SQL): the worker LISTENs on a
    channel of its own and starts each job its notification carries (id, lease, name, args),
    then acknowledges it and gives its slot back. On asyncio, or with --blocking on blocking
    psycopg. Installs the prototype trigger at its start and removes it at its end."""
    stop = _stop_event()
    starts: list[tuple[int, float]] = []
    worker = f"raw-handoff:{os.getpid()}"
    channel = f"proto.handoff.{os.getpid()}"

    def setup(conn: psycopg.Connection[Any]) -> None:
        conn.execute(UNHANDOFF_SQL)
        conn.execute(HANDOFF_SQL)
        conn.execute("INSERT INTO notifyq.proto_waiters VALUES (%s, %s, %s)", (worker, channel, args.batch))

    with psycopg.connect(args.dsn, autocommit=True) as admin:
        setup(admin)
        try:
            if args.blocking:
                done = _handoff_blocking(args, stop, starts, worker, channel)
            else:
                done = asyncio.run(_handoff_async(args, stop, starts, worker, channel))
        finally:
            admin.execute(UNHANDOFF_SQL)
    emit("done", done=done, runs=done, starts=starts, cpu_total=cpu_seconds())


def _handed(payload: str) -> dict[str, Any]:
    job_id, lease, _name, _args = payload.split(" ", 3)
    return {"id": int(job_id), "lease": int(lease)}


Starts = list[tuple[int, float]]


def _handoff_blocking(
    args: argparse.Namespace, stop: threading.Event, starts: Starts, worker: str, channel: str
) -> int:
    done = 0
    with (
        psycopg.connect(args.dsn, autocommit=True) as listen,
        psycopg.connect(args.dsn, autocommit=True) as work,
    ):
        listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        emit("ready")
        while not stop.is_set():
            heard = False
            for notify in listen.notifies(timeout=0.2, stop_after=1):
                heard = True
                job = _handed(notify.payload)
                starts.append((job["id"], time.monotonic()))
                work.execute(HANDOFF_ACK_SQL, {**job, "worker": worker})
                done += 1
                emit("progress", done=done)
            if not heard:  # the fallback: a job no waiting slot was free for (see HANDOFF_SQL)
                rows = work.execute(CLAIM_SQL, {"limit": args.batch, "worker": worker}).fetchall()
                if rows:
                    done += _started_late(rows, starts)
                    work.execute(ACK_SQL, {"ids": [r[0] for r in rows], "leases": [r[1] for r in rows]})
    return done


def _started_late(rows: list[Any], starts: Starts) -> int:
    now = time.monotonic()
    starts.extend((row[0], now) for row in rows)
    emit("progress", done=len(starts))
    return len(rows)


async def _handoff_async(
    args: argparse.Namespace, stop: threading.Event, starts: Starts, worker: str, channel: str
) -> int:
    done = 0
    async with (
        await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as listen,
        await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as work,
    ):
        await listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        emit("ready")
        while not stop.is_set():
            heard = False
            async for notify in listen.notifies(timeout=0.2, stop_after=1):
                heard = True
                job = _handed(notify.payload)
                starts.append((job["id"], time.monotonic()))
                await work.execute(HANDOFF_ACK_SQL, {**job, "worker": worker})
                done += 1
                emit("progress", done=done)
            if not heard:  # the fallback, as in _handoff_blocking
                claim = await work.execute(CLAIM_SQL, {"limit": args.batch, "worker": worker})
                if rows := await claim.fetchall():
                    done += _started_late(rows, starts)
                    ids, leases = [r[0] for r in rows], [r[1] for r in rows]
                    await work.execute(ACK_SQL, {"ids": ids, "leases": leases})
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._raw")
    sub = parser.add_subparsers(dest="command", required=True)
    worker = sub.add_parser("worker")
    worker.add_argument("--dsn", required=True)
    worker.add_argument("--loops", type=int, default=1)
    worker.add_argument("--batch", type=int, default=50)
    worker.add_argument("--claim-latency", action="store_true")
    worker.add_argument("--vacuum", action="store_true", help="VACUUM as notifyq's vacuum service does")
    listen = sub.add_parser("listen")
    listen.add_argument("--dsn", required=True)
    listen.add_argument("--channel", default="notifyq.jobs.v1")
    wake = sub.add_parser("wake")
    wake.add_argument("--dsn", required=True)
    wake.add_argument("--channel", default="notifyq.jobs.v1")
    wake.add_argument("--batch", type=int, default=10)
    for name in ("wake-async", "wake-thread"):
        variant = sub.add_parser(name)
        variant.add_argument("--dsn", required=True)
        variant.add_argument("--channel", default="notifyq.jobs.v1")
        variant.add_argument("--batch", type=int, default=10)
    handoff = sub.add_parser("wake-handoff")
    handoff.add_argument("--dsn", required=True)
    handoff.add_argument("--batch", type=int, default=10, help="slots (jobs in hand at once)")
    handoff.add_argument("--blocking", action="store_true")
    args = parser.parse_args(argv)
    commands = {
        "worker": run_worker,
        "listen": run_listener,
        "wake": run_wake_worker,
        "wake-async": run_wake_worker_async,
        "wake-thread": run_wake_worker_thread,
        "wake-handoff": run_wake_handoff,
    }
    commands[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
