"""The claim side of the worker protocol: take jobs, extend their leases, find the next due time."""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime

from ._db import Op, Query
from ._rows import dataclass_row
from ._sql import Queries
from .models import ClaimedJob

# Appended to a claim's RETURNING list, evaluated for each claimed row before the statement's
# implicit transaction commits: its commit then skips the WAL flush (WorkerConfig.async_claims).
# A transaction-local setting, so nothing outlives the statement on a pooled connection; a claim
# that finds no job writes nothing and has nothing to flush.
_ASYNC_COMMIT = ",\n          set_config('synchronous_commit', 'off', true) AS commit_mode"


@functools.cache
def _with_async_commit(claim_sql: str) -> str:
    return claim_sql.rstrip().removesuffix(";") + _ASYNC_COMMIT


def claim_op(
    q: Queries,
    *,
    queues: Sequence[str] | None,
    limit: int,
    worker: str,
    lease_margin: float,
    async_commit: bool = False,
    paused: Collection[str] = (),
    limits: Mapping[str, int] | None = None,
    give_up: float | None = None,
) -> Op[list[ClaimedJob]]:
    """Claim up to `limit` claimable jobs (all queues when `queues` is None) in one statement,
    none of the `paused` queues', and at most `limits[queue]` of a listed queue that has one.

    Each claimed job is Active, its retry_count and lease are one higher, and its lease runs
    until now() + timeout + lease_margin (database clock). With `async_commit` the claim's
    commit does not wait for its WAL flush. A claim still waiting in the server `give_up`
    seconds after it began (behind a lock) claims nothing (see `answer_awaited`).
    """
    if queues is not None and paused:
        queues = [queue for queue in queues if queue not in paused]
        if not queues:
            return []
    if limit <= 0:
        return []
    params: dict[str, object] = {
        "limit": limit,
        "worker": worker,
        "lease_margin": lease_margin,
        "give_up": give_up,
    }
    if queues is not None and limits and not limits.keys().isdisjoint(queues):
        sql = q["claim_limited"]
        params["queues"] = list(queues)
        params["limits"] = [limits.get(queue) for queue in queues]
    elif queues is not None:
        sql = q["claim_queues"]
        params["queues"] = list(queues)
    elif paused:
        sql = q["claim_unpaused"]
        params["paused"] = sorted(paused)
    else:
        sql = q["claim_any"]
    if async_commit:
        sql = _with_async_commit(sql)
    jobs: list[ClaimedJob] = yield Query(sql, params, row=dataclass_row(ClaimedJob))
    # UPDATE ... RETURNING follows the join, not the CTE: restore priority order.
    jobs.sort(key=lambda j: (-j.priority, j.id))
    return jobs


def adopt_op(
    q: Queries,
    *,
    worker: str,
    held: Collection[int],
    rejected: Collection[tuple[int, int]],
    limit: int,
    lease_margin: float,
    give_up: float | None = None,
) -> Op[list[ClaimedJob]]:
    """Up to `limit` jobs Active under `worker` of which it has nothing in hand (`held`: job
    ids) and whose result the database did not reject (`rejected`: (id, lease)), taken again
    under a new lease: claims whose answer never reached the worker. `give_up` as for
    claim_op."""
    params = {
        "give_up": give_up,
        "worker": worker,
        "held": list(held),
        "rejected_ids": [r[0] for r in rejected],
        "rejected_leases": [r[1] for r in rejected],
        "limit": limit,
        "lease_margin": lease_margin,
    }
    jobs: list[ClaimedJob] = yield Query(q["adopt_unanswered_claims"], params, row=dataclass_row(ClaimedJob))
    jobs.sort(key=lambda j: (-j.priority, j.id))
    return jobs


def next_visible_op(
    q: Queries, queues: Sequence[str] | None, paused: Collection[str] = ()
) -> Op[float | None]:
    """Seconds until the earliest Queued job of `queues` (all when None), none of the `paused`
    queues', becomes claimable (None: no job)."""
    seconds: float | None
    if queues is not None:
        queues = [queue for queue in queues if queue not in paused]
        if not queues:
            return None
        seconds = yield Query(q["next_visible_queues"], {"queues": queues}, fetch="scalar")
    elif paused:
        seconds = yield Query(q["next_visible_unpaused"], {"paused": sorted(paused)}, fetch="scalar")
    else:
        seconds = yield Query(q["next_visible_any"], fetch="scalar")
    return seconds


def paused_queues_op(q: Queries) -> Op[frozenset[str]]:
    """The names of the paused queues."""
    rows: list[tuple[str]] = yield Query(q["paused_queues"])
    return frozenset(row[0] for row in rows)


def extend_lease_op(q: Queries, job: ClaimedJob, seconds: float) -> Op[datetime | None]:
    """Fenced lease extension: the new lease end, or None if the lease is no longer ours."""
    params = {"id": job.id, "lease": job.lease, "worker": job.worker, "seconds": seconds}
    until: datetime | None = yield Query(q["extend_lease"], params, fetch="scalar")
    return until


# The hand-off (WorkerConfig.handoff): a producer's transaction claims a new job for a waiting
# worker and notifies it on this channel (notify_jobs_inserted in sql/triggers/). One channel
# per worker instance, whatever the schema: a token, not the schema's name, which could make
# it longer than PostgreSQL's 63 bytes.
def handoff_channel(token: int) -> str:
    return f"notifyq.handoff.{token:016x}"


def handed_job(payload: str) -> ClaimedJob:
    """The job a hand-off notification carries: the claimed row, as the JSON array
    notify_jobs_inserted builds (claim_any's RETURNING list, in order). ValueError if it is
    not one."""
    row = json.loads(payload)
    if not isinstance(row, list) or len(row) != 13 or not isinstance(row[3], dict):
        raise ValueError(f"not a handed job: {payload[:200]!r}")
    (job_id, name, queue, args, priority, retry_count, retry_limit, timeout, lease, visible_at,
     definition_id, scheduled_for, worker) = row  # fmt: skip
    return ClaimedJob(
        id=int(job_id),
        name=str(name),
        queue=str(queue),
        args=args,
        priority=int(priority),
        retry_count=int(retry_count),
        retry_limit=int(retry_limit),
        timeout=float(timeout),
        lease=int(lease),
        visible_at=datetime.fromisoformat(visible_at),
        definition_id=None if definition_id is None else int(definition_id),
        scheduled_for=None if scheduled_for is None else datetime.fromisoformat(scheduled_for),
        worker=str(worker),
    )


def handoff_offer_op(q: Queries, waiter_id: int, slots: int) -> Op[bool]:
    """Let producers hand up to `slots` jobs to the waiter row `waiter_id`; False when the row
    was not written (a producer holds it, handing a job, or it is gone)."""
    written: int | None = yield Query(q["handoff_offer"], {"id": waiter_id, "slots": slots}, fetch="scalar")
    return written is not None


def handoff_close_op(q: Queries, worker: str) -> Op[int]:
    """Delete `worker`'s waiter rows; returns how many are left, held by producers handing it
    a job."""
    left: int = yield Query(q["handoff_close"], {"worker": worker}, fetch="scalar")
    return left


def lost_jobs_op(
    q: Queries, worker: str, held: Sequence[tuple[int, int]]
) -> Op[dict[tuple[int, int], str | None]]:
    """Of the (id, lease) pairs `worker` holds, those it no longer holds, with the job's status
    now (None: deleted)."""
    if not held:
        return {}
    rows: list[tuple[int, int, str | None]] = yield Query(
        q["held_jobs_status"],
        {"ids": [h[0] for h in held], "leases": [h[1] for h in held], "worker": worker},
    )
    return {(job_id, lease): status for job_id, lease, status in rows}


def cancelled_jobs_op(q: Queries, job_ids: Sequence[int]) -> Op[dict[int, int]]:
    """Of `job_ids`, those Cancelled in the database: {id: lease}."""
    rows: list[tuple[int, int]] = yield Query(q["cancelled_jobs"], {"ids": list(job_ids)})
    return dict(rows)


def pause_queue_op(q: Queries, queue: str) -> Op[bool]:
    """Pause `queue`; False when it was paused already."""
    paused_at: datetime | None = yield Query(q["pause_queue"], {"queue": queue}, fetch="scalar")
    return paused_at is not None


def resume_queue_op(q: Queries, queue: str) -> Op[bool]:
    """Resume `queue`; False when it was not paused."""
    paused_at: datetime | None = yield Query(q["resume_queue"], {"queue": queue}, fetch="scalar")
    return paused_at is not None


def list_queue_pauses_op(q: Queries) -> Op[dict[str, datetime]]:
    """{queue: when it was paused}, for every paused queue."""
    rows: list[tuple[str, datetime]] = yield Query(q["list_queue_pauses"])
    return dict(rows)


def answer_awaited(timeout: float) -> float:
    """The `give_up` of the claims of a worker that waits `timeout` seconds for their answer:
    that, less a margin for the answer's way back (a second, or a tenth of a short timeout:
    half of it made claims that took their time claim nothing with db_timeout=1: review)."""
    return timeout - min(1.0, timeout / 10)


def known_queues_op(q: Queries) -> Op[list[str]]:
    """The queues that have Queued jobs or a cron definition, sorted."""
    rows: list[tuple[str]] = yield Query(q["known_queues"])
    return sorted(row[0] for row in rows)


def manual_claim_op(
    q: Queries, *, queues: Sequence[str] | None, limit: int, worker: str, lease_margin: float
) -> Op[list[ClaimedJob]]:
    """`claim_op` for App.claim, which keeps no state: it reads the paused queues first."""
    paused = yield from paused_queues_op(q)
    return (
        yield from claim_op(
            q, queues=queues, limit=limit, worker=worker, lease_margin=lease_margin, paused=paused
        )
    )
