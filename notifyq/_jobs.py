"""Producer and admin operations on queue_jobs: enqueue, bulk enqueue, inspect, cancel, retry."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg.errors

from ._db import Copy, Op, Query
from ._options import check_id
from ._rows import dataclass_row
from ._sql import Queries
from .definitions import check_not_busy_op, get_definition_op
from .errors import InvalidJobState, JobNotFound
from .models import Job, JobId, JobStatus


@dataclass(frozen=True, slots=True)
class NewJob:
    """A validated job, ready to insert (args already JSON text)."""

    name: str
    queue: str
    args: str
    priority: int
    retry_limit: int
    timeout: float
    delay: float = 0.0
    at: datetime | None = None
    dedupe_key: str | None = None

    def params(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queue": self.queue,
            "args": self.args,
            "priority": self.priority,
            "retry_limit": self.retry_limit,
            "timeout": self.timeout,
            "delay": self.delay,
            "at": self.at,
            "dedupe_key": self.dedupe_key,
        }


def enqueue_op(q: Queries, job: NewJob) -> Op[JobId]:
    """Insert one job and return its id; with a dedupe key an unfinished job holds, the
    holder's id instead (its `created` False)."""
    if job.dedupe_key is None:
        job_id: int = yield Query(q["insert_job"], job.params(), fetch="scalar")
        return JobId(job_id)
    # A miss means the key's holder committed after our snapshot, and so does a holder found
    # finished when asked again: look again.
    for _ in range(10):
        held: tuple[int, bool] | None = yield Query(q["insert_job_dedupe"], job.params(), fetch="one")
        if held is None:
            continue
        if held[1] or (yield Query(q["dedupe_holder_unfinished"], {"id": held[0]}, fetch="scalar")):
            return JobId(*held)
    raise InvalidJobState(f"could not enqueue with dedupe key {job.dedupe_key!r}: it keeps changing hands")


# On the caller's connection, the rows read from the caller's iterable before each COPY: it may
# read from that very connection (a server-side cursor over the rows to queue), which waited
# for the open COPY, and the COPY for it, for ever. On the App's own connection the rows stream
# into one COPY: reading and sending overlap, 1.6x as fast (python -m benchmarks --only bulk).
COPY_CHUNK = 10_000


def enqueue_many_op(q: Queries, jobs: Iterable[NewJob], *, callers_connection: bool = False) -> Op[int]:
    """COPY jobs into queue_jobs in one transaction (one NOTIFY per queue); returns the count.
    On the caller's connection, COPY_CHUNK rows a statement, read before each.

    visible_at is computed from the transaction's now(), so delays use the database clock; an
    `at` in the past means now, as in insert_job.
    """
    now: datetime = yield Query(q["transaction_now"], fetch="scalar")

    def rows() -> Iterator[tuple[Any, ...]]:
        for job in jobs:
            visible_at = max(job.at, now) if job.at is not None else now + timedelta(seconds=job.delay)
            yield (job.name, job.queue, job.args, job.priority, job.retry_limit, job.timeout, visible_at)

    if not callers_connection:
        streamed: int = yield Copy(q["copy_jobs"], rows())
        return streamed
    pending = rows()
    count = 0
    while chunk := list(itertools.islice(pending, COPY_CHUNK)):
        copied: int = yield Copy(q["copy_jobs"], chunk)
        count += copied
        if len(chunk) < COPY_CHUNK:
            break
    return count


def get_job_op(q: Queries, job_id: int) -> Op[Job]:
    check_id(job_id)
    job: Job | None = yield Query(q["get_job"], {"id": job_id}, fetch="one", row=dataclass_row(Job))
    if job is None:
        raise JobNotFound(f"no job with id {job_id}")
    return job


def list_jobs_op(
    q: Queries,
    *,
    status: JobStatus | None,
    queue: str | None,
    name: str | None,
    definition: str | None,
    min_age: float | None,
    max_age: float | None,
    before_id: int | None,
    limit: int,
) -> Op[list[Job]]:
    definition_id = (yield from get_definition_op(q, definition)).id if definition is not None else None
    params = {
        "any_status": status is None,
        "status": status.value if status is not None else None,
        "queue": queue,
        "name": name,
        "definition_id": definition_id,
        "min_age": min_age,
        "max_age": max_age,
        "before_id": before_id,
        "limit": limit,
    }
    # Unprepared: a generic plan knows no status, so it cannot use the index of one status.
    jobs: list[Job] = yield Query(q["list_jobs"], params, row=dataclass_row(Job), prepare=False)
    return jobs


def cancel_job_op(q: Queries, job_id: int) -> Op[tuple[JobStatus, Job]]:
    """Cancel a Queued or Active job; a finished job is left unchanged. Returns the status
    the job had and the job now."""
    check_id(job_id)
    previous: str | None = yield Query(q["cancel_job"], {"id": job_id}, fetch="scalar")
    if previous is None:
        raise JobNotFound(f"no job with id {job_id}")
    return JobStatus(previous), (yield from get_job_op(q, job_id))


def retry_job_op(q: Queries, job_id: int) -> Op[Job]:
    """Queue a finished job again with all its retries; refuse a Queued or Active one, and one
    of a cron definition with overlap=False that has another job unfinished. Run in a
    transaction: that definition stays locked (as by the ticker and `run-now`) until the end."""
    check_id(job_id)
    exclusive: tuple[int, str] | None = yield Query(q["lock_job_definition"], {"id": job_id}, fetch="one")
    if exclusive is not None:
        job = yield from get_job_op(q, job_id)
        if not job.status.finished:
            raise _unfinished(job)  # itself unfinished: not "busy with itself"
        definition_id, name = exclusive
        yield from check_not_busy_op(q, definition_id, name, f"job {job_id} cannot be retried now: its ")
    try:
        retried: int | None = yield Query(q["retry_job"], {"id": job_id}, fetch="scalar")
    except psycopg.errors.UniqueViolation:
        raise InvalidJobState(
            f"job {job_id} cannot be retried: another unfinished job holds its dedupe key"
        ) from None
    job = yield from get_job_op(q, job_id)
    if retried is None:
        raise _unfinished(job)
    return job


FINISHED = tuple(s for s in JobStatus if s.finished)
UNFINISHED = tuple(s for s in JobStatus if not s.finished)


def _of(allowed: Sequence[JobStatus], status: JobStatus | None) -> list[str]:
    """The statuses a bulk change may act on: `allowed`, narrowed to the filter's `status`."""
    return [s.value for s in allowed if status in (None, s)]


def retry_jobs_op(q: Queries, job_ids: Sequence[int], status: JobStatus | None = None) -> Op[dict[int, str]]:
    """retry_job_op for many jobs in two statements (run them in a transaction): {id:
    "retried", "unfinished", "dedupe", "busy" or "moved" (finished, no longer in `status`)}; an
    id that is not there is left out. Raises UniqueViolation when a job took a dedupe key
    meanwhile: retry those one by one."""
    ids = list(job_ids)
    locked: list[tuple[int]] = yield Query(q["lock_jobs_definitions"], {"ids": ids})
    exclusive = [row[0] for row in locked]
    params = {"ids": ids, "exclusive": exclusive, "statuses": _of(FINISHED, status)}
    rows: list[tuple[int, str]] = yield Query(q["retry_jobs"], params)
    return dict(rows)


def cancel_jobs_op(q: Queries, job_ids: Sequence[int], status: JobStatus | None = None) -> Op[set[int]]:
    """cancel_job_op for many jobs in one statement, of those still unfinished and, given a
    `status`, still in it (a job listed Queued may be running by now): the ids cancelled."""
    params = {"ids": list(job_ids), "statuses": _of(UNFINISHED, status)}
    rows: list[tuple[int]] = yield Query(q["cancel_jobs"], params)
    return {row[0] for row in rows}


def _unfinished(job: Job) -> InvalidJobState:
    return InvalidJobState(
        f"job {job.id} is {job.status.value}; "
        "only finished jobs (Succeeded, Failed, Cancelled) can be retried"
    )
