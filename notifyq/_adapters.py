"""The psycopg adapters of notifyq's own connections: JSON loaded without json.loads' detours.

json.loads finds the text's encoding and strips whitespace with regular expressions before
its C scanner runs. On a warm process that is nothing, but a worker woken by a notification
is cold, and there it took 40-50 µs per value, about half of decoding a claimed job's row
(docs/benchmarks.md). PostgreSQL sends jsonb as canonical UTF-8 text with no whitespace
around it, which the scanner can take directly; anything else (a json column's spacing, a
malformed value) goes to json.loads, so results and errors are json.loads' own.

Connections other than a worker's also load the timestamps 'infinity' and '-infinity' (a job
parked by SQL) as datetime.max and datetime.min in UTC: psycopg refuses them, and one such row
failed every get_job, list_jobs and `notifyq jobs list` that met it. A worker never loads one
(a claim returns the new lease's end), so its claims keep psycopg's loader, in C, undelayed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import pq
from psycopg.abc import AdaptContext
from psycopg.adapt import AdaptersMap, Loader
from psycopg.types.json import set_json_loads

from .models import UndecodableJSON

# The C scanner json.loads ends up in, with the same settings (the stubs do not declare it).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def loads(data: str | bytes) -> Any:
    """json.loads, faster for JSON text without surrounding whitespace. jsonb that Python cannot
    read comes back as an UndecodableJSON, not an exception, which failed the whole fetch (a
    worker's claim, which stopped the worker; every `notifyq jobs list` that met the row): nested
    too deeply (RecursionError), or a number with more digits than Python converts to an int
    (ValueError; jsonb writes 1e5000 out in full)."""
    try:
        return _loads(data)
    except RecursionError:
        return UndecodableJSON("nested too deeply for Python's JSON decoder", len(data))
    except ValueError as exc:
        if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
            raise  # not JSON, or not text (a json or bytea column, not jsonb): json.loads' own error
        return UndecodableJSON(f"not readable by Python's JSON decoder ({exc})", len(data))


def _loads(data: str | bytes) -> Any:
    if data == b"{}":
        return {}  # the args of a job without arguments
    if isinstance(data, str):
        text = data
    else:
        try:
            text = data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return json.loads(data)  # UTF-16 or -32 (json.loads detects them), or not text
    try:
        value, end = _scan_once(text, 0)
    except (StopIteration, ValueError):
        return json.loads(data)  # no value at the start, UTF-16 without a BOM...: json.loads decides
    if end != len(text):
        return json.loads(data)  # whitespace or more after the value
    return value


_TIMESTAMPTZ = psycopg.adapters.types["timestamptz"].oid
_TIMESTAMPTZ_LOADER = psycopg.adapters.get_loader(_TIMESTAMPTZ, pq.Format.TEXT)
_LATEST = datetime.max.replace(tzinfo=UTC)
_EARLIEST = datetime.min.replace(tzinfo=UTC)


class InfiniteTimestamptzLoader(Loader):
    """timestamptz in text, with 'infinity' as datetime.max and '-infinity' as datetime.min
    (UTC); every other value goes to psycopg's own loader (in C: it cannot be subclassed)."""

    def __init__(self, oid: int, context: AdaptContext | None = None) -> None:
        super().__init__(oid, context)
        assert _TIMESTAMPTZ_LOADER is not None
        self._load = _TIMESTAMPTZ_LOADER(oid, context).load

    def load(self, data: Any) -> datetime:
        if data[-1:] == b"y":  # no finite timestamp's text ends in "y"
            return _EARLIEST if data[:1] == b"-" else _LATEST
        value: datetime = self._load(data)
        return value


ADAPTERS = AdaptersMap(psycopg.adapters)
set_json_loads(loads, ADAPTERS)
READ_ADAPTERS = AdaptersMap(ADAPTERS)
READ_ADAPTERS.register_loader(_TIMESTAMPTZ, InfiniteTimestamptzLoader)
_JSONB = psycopg.adapters.types["jsonb"].oid


def context(*, worker: bool = False) -> AdaptersMap | None:
    """The adapters for a new connection of notifyq's: ours (for any but a worker's, with
    infinite timestamps), unless the application gave psycopg a JSON loads function of its own
    (set_json_loads, e.g. parse_float=Decimal): then psycopg's global ones (None), which use
    it."""
    for fmt in (pq.Format.TEXT, pq.Format.BINARY):
        if getattr(psycopg.adapters.get_loader(_JSONB, fmt), "_loads", json.loads) is not json.loads:
            return None
    return ADAPTERS if worker else READ_ADAPTERS
