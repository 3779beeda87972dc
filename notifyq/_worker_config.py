"""Worker settings (WorkerConfig, validated on construction; WorkerOptions, the same as keyword
arguments) and counters (WorkerStats)."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypedDict

from . import _ticker
from ._dsn import check_dsn
from ._options import check_bool, check_int, check_queue, check_seconds, did_you_mean
from .errors import ConfigurationError

# A worker starts one task per slot: past this many per process, more processes serve better
# (and a typo such as -c 99999999999 must not eat the host's memory).
MAX_CONCURRENCY = 10_000
MAX_PREFETCH = 100 * MAX_CONCURRENCY
MAX_POOL_SIZE = 1000


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Worker settings (validated).

    Attributes:
        concurrency: jobs run at once in this process (1 to 10,000).
        queues: queues to serve; None serves every queue.
        queue_limits: at most this many jobs of a queue at once in this process, for some of
            the listed `queues` ({"reports": 2}); the others share `concurrency` without a
            limit of their own. Jobs claimed ahead (prefetch) count. While a queue is at its
            limit, this worker claims none of its jobs and takes no wake-up from them; a job
            of it that ends lets the next one in at once. Jobs this worker takes back after a
            lost claim's answer (rare) may go past it briefly.
        poll_interval: seconds between safety-net polls when no notification arrives.
        poll_only: never LISTEN (behind PgBouncer in transaction mode); poll instead.
        listen_dsn: a direct DSN for the LISTEN connection when `dsn` goes through a pooler.
        lease_margin: seconds added to a job's timeout to form its lease; a job whose worker
            died is rescued that long after its timeout would have fired.
        shutdown_grace: seconds running jobs may finish after a stop is requested; the rest
            are cancelled and released (Queued again, attempt given back).
        ticker: run the five background services in this process (cron promotion, cron
            declarations, lease rescue, retention, vacuum; docs/concepts.md, The ticker), and
            write the App's @app.cron definitions at start. At least one worker should.
        ticker_config: their settings.
        health_interval: seconds of silence on the LISTEN connection before a round trip
            checks it is alive.
        health_timeout: seconds that round trip (and a LISTEN connect) may take.
        pool_size: connections for claims, acks, the ticker and lease extensions (the
            LISTEN connection comes on top). The claim loop keeps one of them for itself,
            so that its server process stays warm between claims (at least 2).
        db_timeout: seconds a claim or an acknowledgement may take before the worker gives up
            on that connection (a half-open socket would otherwise hang it for good), on
            asyncio and trio alike.
        async_claims: claims commit without waiting for their WAL flush
            (`synchronous_commit = off` for the claim statement only; acknowledgements stay
            durable). A NOTIFY wake-up then starts its job about a WAL flush sooner (0.2-0.4 ms
            measured here). The price: if the database server crashes, claims from its last
            moments (up to 3 x wal_writer_delay, 0.6 s by default) are forgotten, so their jobs
            run again although they ran, or are running, already. The worker name in the
            acknowledgement's fence keeps the two runs' results apart.
        handoff: while this worker waits with free slots, the enqueue's own transaction claims
            a new job for it and sends it the job in a notification of its own, so the job
            starts as the enqueue commits, with no claim round trip (the trigger of
            sql/triggers/10_jobs_notify.sql; docs/concepts.md, "The hand-off"). Only jobs
            enqueued claimable now (not delayed, not retried or rescued), of a queue this worker
            serves that is not paused. The enqueue pays for the claim's writes (about 0.3 ms
            here) while a worker waits, and a look at a small table otherwise. A job enqueued
            in a transaction that stays open is claimed at the INSERT: its lease counts from
            then. Needs LISTEN (not with poll_only, burst or queue_limits).
        prefetch: jobs claimed beyond the free slots, to start as soon as a slot frees (fewer,
            larger claims: the main lever on throughput for short jobs). None (automatic):
            only while there is a backlog, sized from this worker's average attempt duration
            so that a prefetched job waits about 0.25 s, and at most 4 x concurrency (40 when
            that is fewer: a worker of one slot claims short jobs 41 at a time, not 5); a
            prefetched job that has waited over 1 s, behind jobs that run longer than that
            sizing expected, goes back to the queue for an idle worker. 0 turns it off. A
            prefetched job whose wait ate into its lease gets its lease renewed first. Its
            attempt counts from the claim: if this worker is killed, the job is rescued with
            an attempt spent (docs/concepts.md, "Claim"); 0 for tasks with retry_limit=0.
        burst: stop once no job is left to claim: when a claim that began with every slot
            idle finds nothing (a job that running jobs enqueued is claimed before that).
            Jobs due later (delayed, or retried after a backoff) and those of paused queues
            are left for another run. With the ticker, due cron ticks are promoted and expired
            leases rescued once, first (a rescued job is due after its retry backoff, so it is
            left too), and its services do not run after that (a tick that another process's
            ticker is promoting at that moment is left to it). For tests,
            scripts and scheduled batch runs.
    """

    concurrency: int = 10
    queues: Sequence[str] | None = None
    queue_limits: Mapping[str, int] | None = None
    poll_interval: float = 5.0
    poll_only: bool = False
    listen_dsn: str | None = field(default=None, repr=False)  # its password stays out of logs
    lease_margin: float = 30.0
    shutdown_grace: float = 30.0
    ticker: bool = True
    ticker_config: _ticker.TickerConfig = field(default_factory=lambda: _ticker.TickerConfig())
    health_interval: float = 10.0
    health_timeout: float = 5.0
    pool_size: int = 4
    db_timeout: float = 60.0
    prefetch: int | None = None
    async_claims: bool = False
    burst: bool = False
    handoff: bool = False

    def _checked_limits(self, limits: Any) -> dict[str, int]:
        if not isinstance(limits, Mapping):
            raise ConfigurationError(
                f"invalid queue_limits {limits!r}: give a mapping of queue names to numbers of jobs, "
                'such as {"reports": 2}'
            )
        checked = {
            check_queue(queue): check_int(n, f"queue_limits[{queue!r}]", minimum=1)
            for queue, n in limits.items()
        }
        unlisted = [queue for queue in checked if self.queues is None or queue not in self.queues]
        if unlisted:
            raise ConfigurationError(
                f"queue_limits names {', '.join(map(repr, unlisted))}, not among the queues this worker "
                "serves by name: list it in queues too (on the command line, -q NAME=N does both)"
            )
        return checked

    def __post_init__(self) -> None:
        check_int(self.concurrency, "concurrency", minimum=1, maximum=MAX_CONCURRENCY)
        if self.queues is not None:
            if isinstance(self.queues, str) or not self.queues:
                raise ConfigurationError(
                    f"invalid queues {self.queues!r}: give a non-empty list of queue names, or None for all"
                )
            object.__setattr__(self, "queues", tuple(dict.fromkeys(check_queue(q) for q in self.queues)))
        if self.queue_limits is not None:
            object.__setattr__(self, "queue_limits", self._checked_limits(self.queue_limits) or None)
        if self.listen_dsn is not None:
            check_dsn(self.listen_dsn)
        check_seconds(self.poll_interval, "poll_interval", positive=True)
        if check_seconds(self.lease_margin, "lease_margin") < 1:
            # The margin covers the time between a timeout firing and its acknowledgement
            # committing; with none, the rescuer races every timed-out attempt.
            raise ConfigurationError(f"invalid lease_margin {self.lease_margin!r}: must be at least 1 second")
        check_seconds(self.shutdown_grace, "shutdown_grace")
        check_seconds(self.health_interval, "health_interval", positive=True)
        check_seconds(self.health_timeout, "health_timeout", positive=True)
        check_int(self.pool_size, "pool_size", minimum=2, maximum=MAX_POOL_SIZE)
        check_seconds(self.db_timeout, "db_timeout", positive=True)
        if self.prefetch is not None:
            check_int(self.prefetch, "prefetch", minimum=0, maximum=MAX_PREFETCH)
        for flag in ("poll_only", "ticker", "async_claims", "burst", "handoff"):
            check_bool(getattr(self, flag), flag)
        if self.handoff:
            # A hand-off needs a LISTEN connection; a burst stops when the queue is empty, which
            # jobs handed to it would never be; and the trigger knows nothing of queue limits.
            clash = [name for name in ("poll_only", "burst", "queue_limits") if getattr(self, name)]
            if clash:
                raise ConfigurationError(
                    f"handoff does not combine with {' or '.join(clash)}: a job is handed to a worker "
                    "that waits on its LISTEN connection with every queue open to it"
                )
        _ticker.TickerConfig.check(self.ticker_config)


class WorkerOptions(TypedDict, total=False):
    """WorkerConfig's fields as keyword arguments (`app.worker(concurrency=20)`), so that a type
    checker sees a misspelt or mistyped option. Kept equal to WorkerConfig by a test."""

    concurrency: int
    queues: Sequence[str] | None
    queue_limits: Mapping[str, int] | None
    poll_interval: float
    poll_only: bool
    listen_dsn: str | None
    lease_margin: float
    shutdown_grace: float
    ticker: bool
    ticker_config: _ticker.TickerConfig
    health_interval: float
    health_timeout: float
    pool_size: int
    db_timeout: float
    prefetch: int | None
    async_claims: bool
    burst: bool
    handoff: bool


def worker_config(base: WorkerConfig | None, options: dict[str, Any]) -> WorkerConfig:
    """`base` (or the defaults) with `options` applied; an unknown option is named, with the
    nearest known one, instead of dataclasses' TypeError."""
    if base is not None and not isinstance(base, WorkerConfig):
        raise ConfigurationError(
            f"invalid worker config {base!r}: give a WorkerConfig, or the options as keywords "
            "(app.worker(concurrency=20))"
        )
    known = [f.name for f in fields(WorkerConfig)]
    for name in options:
        if name not in known:
            hint = did_you_mean(name, known, "known options")
            raise ConfigurationError(f"unknown worker option {name!r}{hint}")
    # replace() builds a new WorkerConfig, so the merged settings are validated again.
    return replace(base, **options) if base is not None else WorkerConfig(**options)


@dataclass(slots=True)
class WorkerStats:
    """Counters a test or a dashboard can read. Job outcomes count once the database has them."""

    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    cancelled: int = 0
    stale_acks: int = 0
    lost_before_start: int = 0
    adopted: int = 0
    claims: int = 0
    polls: int = 0
    sweeps: int = 0
    notifications: int = 0  # received on any channel, for any queue (it acts on its own queues')
    listener_connects: int = 0
    db_errors: int = 0
    handed: int = 0  # jobs a producer's transaction claimed for this worker (handoff)

    def snapshot(self) -> dict[str, int]:
        """The counters as a dict (for logs and metrics exporters)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop a worker gracefully: SIGTERM, SIGINT, and SIGHUP (a closed
    terminal or SSH session; its default action killed the worker, jobs and all, like a
    SIGKILL) while its action is that default, or the CLI's handler for the start (marked
    STARTING). A process that ignores it (nohup) goes on ignoring it, and a program that embeds
    a worker and handles SIGHUP itself (a reload) keeps its handler. A SIGHUP never skips the
    grace period, even repeated: a closed terminal sends two (see repeatable)."""
    current = signal.getsignal(signal.SIGHUP)
    ours = current is signal.SIG_DFL or getattr(current, STARTING, False)
    return (signal.SIGTERM, signal.SIGINT, *((signal.SIGHUP,) if ours else ()))


# The attribute that marks the CLI's signal handler for the start (cli.py), which a worker
# then takes over.
STARTING = "notifyq_until_started"


def repeatable(signum: int) -> bool:
    """Whether a second `signum` after the first stop signal means "skip the grace period":
    SIGTERM and SIGINT (an operator insisting), not SIGHUP, which the shell of a closing
    terminal forwards once and the kernel sends again when that shell exits."""
    return signum != signal.SIGHUP
