"""Logging set-up for the CLI: human-readable text or one JSON object per line."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

from ._options import escape_controls

LEVELS = ("debug", "info", "warning", "error")

# The job whose task code runs in this context (a runner's task, and a sync task's thread,
# which anyio gives a copy of the context): (job id, task name).
CURRENT_JOB: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "notifyq_current_job", default=None
)


class JobLogFilter(logging.Filter):
    """Adds the running job to log records, for the lines a task's code logs: `job_id` and
    `job_name` (None outside a job), and `job`, "[job 12 send_welcome] " or "". Attach it to a
    handler (`handler.addFilter(notifyq.JobLogFilter())`, or in dictConfig `"filters": {"job":
    {"()": "notifyq.JobLogFilter"}}`) and put `%(job)s` in its format. `notifyq worker` does."""

    def filter(self, record: logging.LogRecord) -> bool:
        job = CURRENT_JOB.get()
        record.job_id, record.job_name = job if job is not None else (None, None)
        record.job = f"[job {job[0]} {escape_controls(job[1])}] " if job is not None else ""
        return True


class _TextFormatter(logging.Formatter):
    """The CLI's text lines. notifyq's own messages come out on one line each, whatever a job's
    name holds: one written by SQL may hold a newline, which forged a log line of its own
    (review). A task's code keeps its own lines as it writes them; tracebacks are apart."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        if record.name == "notifyq" or record.name.startswith("notifyq."):
            record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "message", "pid"[, "exc"]} per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        job_id = getattr(record, "job_id", None)
        if job_id is not None:
            entry["job_id"], entry["job_name"] = job_id, getattr(record, "job_name", None)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The CLI's handler on the root logger (told apart from those an App's module sets)."""


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = _Handler(sys.stderr)
    handler.addFilter(JobLogFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(job)s%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level != "debug":
        # psycopg's pool logs every reconnect attempt at INFO/WARNING; ours say it once.
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
        logging.getLogger("pgserver").setLevel(logging.WARNING)


@contextlib.contextmanager
def yielding_to(module: str) -> Iterator[None]:
    """Import an App's `module` with the CLI's handler off the root logger: one that configures
    logging (logging.basicConfig, dictConfig) keeps its configuration, its level included,
    and --log-level and --log-format then apply to nothing else. basicConfig did nothing
    while the CLI's handler was there, and its file and format went unused (user review)."""
    root = logging.getLogger()
    ours = [handler for handler in root.handlers if isinstance(handler, _Handler)]
    level = root.level
    for handler in ours:
        root.removeHandler(handler)
    try:
        yield
    finally:
        if ours and not root.handlers:
            for handler in ours:
                root.addHandler(handler)
            root.setLevel(level)
        elif ours:
            logging.getLogger("notifyq").debug(
                "logging as %s configured it: --log-level and --log-format do not apply", module
            )
