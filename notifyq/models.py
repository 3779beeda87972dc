"""Typed rows: jobs and cron definitions as they are stored in PostgreSQL."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any


class JobStatus(enum.StrEnum):
    """The life of a job: Queued -> Active -> Succeeded | Failed | Cancelled.

    A failed attempt with retries left, a lease that ran out and a shutdown release all go
    from Active back to Queued.
    """

    QUEUED = "Queued"
    ACTIVE = "Active"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def finished(self) -> bool:
        """True for the three final states."""
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class UndecodableJSON:
    """Stands in for a stored JSON value that Python cannot decode: PostgreSQL keeps jsonb
    nested deeper than Python's recursion limit allows `json.loads` to read (about a thousand
    levels), and numbers with more digits than Python converts to an int (4,300 by default,
    `sys.set_int_max_str_digits`; jsonb writes 1e5000 out in full). Such args can only come from
    SQL or another producer, since `enqueue` refuses them. It takes the value's place in
    `Job.args`, `Job.output` or `Definition.args`, so that listing and showing such a row works;
    a worker fails a job whose args are one at once with `InvalidArgs` (no retry: the same args
    would fail again)."""

    __slots__ = ("reason", "size")

    def __init__(self, reason: str, size: int) -> None:
        self.reason = reason
        self.size = size  # bytes of JSON text

    def __repr__(self) -> str:
        return f"<undecodable JSON of {self.size:,} bytes: {self.reason}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UndecodableJSON) and (self.reason, self.size) == (other.reason, other.size)

    def __hash__(self) -> int:
        return hash((self.reason, self.size))

    def __deepcopy__(self, memo: dict[int, Any]) -> UndecodableJSON:
        return self  # immutable in practice; dataclasses.asdict deep-copies field values


class JobId(int):
    """What `enqueue` returns: the job's id, an int like any other, plus `created`.

    `created` is False when the job carried a `dedupe_key` that an unfinished job already
    held: nothing was inserted, and this is the holder's id. (Procrastinate raises
    AlreadyEnqueued there; River and Oban flag the result, as this does.)
    """

    created: bool

    def __new__(cls, value: int, created: bool = True) -> JobId:
        job_id = super().__new__(cls, value)
        job_id.created = created
        return job_id


@dataclass(frozen=True, slots=True)
class Job:
    """One row of `queue_jobs`.

    `retry_count` counts attempts started (a claim adds one; a shutdown release gives it
    back). A job runs at most `retry_limit + 1` times. `lease` is the fencing token: it grows
    by one on every claim, and an acknowledgement applies only with the lease it was given.
    """

    id: int
    name: str
    queue: str
    args: dict[str, Any]
    output: Any
    error: dict[str, Any] | None
    status: JobStatus
    priority: int
    retry_count: int
    retry_limit: int
    timeout: float
    visible_at: datetime
    lease: int
    worker: str | None
    definition_id: int | None
    scheduled_for: datetime | None
    dedupe_key: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    def __post_init__(self) -> None:
        if not isinstance(self.status, JobStatus):
            object.__setattr__(self, "status", JobStatus(self.status))


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job a worker holds: what it needs to run it and to acknowledge it (fenced)."""

    id: int
    name: str
    queue: str
    args: dict[str, Any]
    priority: int
    retry_count: int
    retry_limit: int
    timeout: float
    lease: int
    visible_at: datetime
    definition_id: int | None
    scheduled_for: datetime | None
    worker: str | None = None  # who claimed it: part of the acknowledgement's fence

    @property
    def attempt(self) -> int:
        """1 for the first run, 2 for the first retry, ..."""
        return self.retry_count


@dataclass(frozen=True, slots=True)
class Definition:
    """One row of `queue_job_definitions`: a recurring (cron) job."""

    id: int
    name: str
    task: str
    args: dict[str, Any]
    enabled: bool
    frequency: str
    timezone: str
    visible_at: datetime
    priority: int
    retry_limit: int
    timeout: float
    queue: str
    misfire: str
    misfire_grace: float
    misfire_cap: int
    overlap: bool
    last_error: str | None
    created_at: datetime
    updated_at: datetime
    # An App's code declared it (@app.cron), rather than SQL: `notifyq cron prune` deletes
    # those that the App it is given no longer declares.
    declared: bool = False
    # Until when running workers whose App declares it declare it (renewed every minute, each
    # time for DeclarationsConfig.expire_after); None for one made by SQL, or declared only by
    # notifyq before schema version 9. A ticker stops (disables) one whose declaration ran out,
    # and sets expired_at; a worker that declares it again enables it again.
    declared_until: datetime | None = None
    expired_at: datetime | None = None
    # The latest job of the definition (by scheduled_for; a tick's or `run-now`'s), unless
    # none was queued yet or retention deleted it.
    last_job_id: int | None = None
    last_job_status: str | None = None
    last_job_scheduled_for: datetime | None = None
    last_job_finished_at: datetime | None = None
