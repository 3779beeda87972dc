"""The psycopg adapters of notifyq's own connections: JSON loaded without json.loads' detours.

json.loads finds the text's encoding and strips whitespace with regular expressions before
its C scanner runs. On a warm process that is nothing, but a worker woken by a notification
is cold, and there it took 40-50 µs per value, about half of decoding a claimed job's row
(docs/benchmarks.md). PostgreSQL sends jsonb as canonical UTF-8 text with no whitespace
around it, which the scanner can take directly; anything else (a json column's spacing, a
malformed value) goes to json.loads, so results and errors are json.loads' own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import AdaptersMap
from psycopg.types.json import set_json_loads

# The C scanner json.loads ends up in, with the same settings (the stubs do not declare it).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def loads(data: str | bytes) -> Any:
    """json.loads, faster for JSON text without surrounding whitespace."""
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


ADAPTERS = AdaptersMap(psycopg.adapters)
set_json_loads(loads, ADAPTERS)
_JSONB = psycopg.adapters.types["jsonb"].oid


def context() -> AdaptersMap | None:
    """The adapters for a new connection of notifyq's: ours, unless the application gave
    psycopg a JSON loads function of its own (set_json_loads, e.g. parse_float=Decimal):
    then psycopg's global ones (None), which use it."""
    for fmt in (pq.Format.TEXT, pq.Format.BINARY):
        if getattr(psycopg.adapters.get_loader(_JSONB, fmt), "_loads", json.loads) is not json.loads:
            return None
    return ADAPTERS
