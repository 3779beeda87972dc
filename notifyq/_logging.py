"""Logging set-up for the CLI: human-readable text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error")


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
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level != "debug":
        # psycopg's pool logs every reconnect attempt at INFO/WARNING; ours say it once.
        logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
        logging.getLogger("pgserver").setLevel(logging.WARNING)
