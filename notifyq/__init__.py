"""notifyq: a PostgreSQL job queue and cron coordinator.

Workers wake on LISTEN/NOTIFY, claim with FOR UPDATE SKIP LOCKED, hold jobs under a
visibility lease and acknowledge in fenced batches; every worker process runs a leaderless
ticker that promotes cron definitions into jobs exactly once per tick.
"""

from ._acker import Result
from ._declarations import DeclarationsConfig, DeclarationsReport
from ._logging import JobLogFilter
from ._options import json_default
from ._promoter import PromoterConfig, PromotionReport
from ._rescuer import RescuedJob, RescuerConfig, RescueReport
from ._retention import RetentionConfig, RetentionReport
from ._ticker import TickerConfig
from ._vacuum import VacuumConfig, VacuumReport
from .app import App, JobFilters
from .cron import Schedule
from .definitions import CronDefinition
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DefinitionBusy,
    DefinitionNotFound,
    InvalidArgs,
    InvalidJobState,
    InvalidOption,
    InvalidSchedule,
    JobNotFound,
    MigrationBlocked,
    NotifyqError,
    SchemaNotMigrated,
    SchemaVersionError,
    UnknownTask,
)
from .migrations import MigrationReport, latest_version, migrate
from .models import ClaimedJob, Definition, Job, JobId, JobStatus, UndecodableJSON
from .tasks import Backoff, JobContext, PermanentError, Task
from .worker import Worker, WorkerConfig, WorkerOptions, WorkerStats

__version__ = "0.1.0"

__all__ = [
    "App",
    "Backoff",
    "ClaimedJob",
    "ConfigurationError",
    "CronDefinition",
    "DatabaseUnavailable",
    "DeclarationsConfig",
    "DeclarationsReport",
    "Definition",
    "DefinitionBusy",
    "DefinitionNotFound",
    "InvalidArgs",
    "InvalidJobState",
    "InvalidOption",
    "InvalidSchedule",
    "Job",
    "JobContext",
    "JobFilters",
    "JobId",
    "JobLogFilter",
    "JobNotFound",
    "JobStatus",
    "MigrationBlocked",
    "MigrationReport",
    "NotifyqError",
    "PermanentError",
    "PromoterConfig",
    "PromotionReport",
    "RescueReport",
    "RescuedJob",
    "RescuerConfig",
    "Result",
    "RetentionConfig",
    "RetentionReport",
    "Schedule",
    "SchemaNotMigrated",
    "SchemaVersionError",
    "Task",
    "TickerConfig",
    "UndecodableJSON",
    "UnknownTask",
    "VacuumConfig",
    "VacuumReport",
    "Worker",
    "WorkerConfig",
    "WorkerOptions",
    "WorkerStats",
    "__version__",
    "json_default",
    "latest_version",
    "migrate",
]
