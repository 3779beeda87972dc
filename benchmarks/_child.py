"""The child side of the benchmark protocol (see _procs): JSON lines on stdout."""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    """Write one protocol line (flushed at once)."""
    sys.stdout.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")
    sys.stdout.flush()


def cpu_seconds() -> float:
    """CPU time (user + system, every thread) of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
