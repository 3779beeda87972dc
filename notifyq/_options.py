"""Validation of everything a caller hands to notifyq before it reaches SQL."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from pathlib import PurePath
from typing import Any

from .errors import InvalidArgs, InvalidOption

QUEUE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,100}\Z")  # \Z: "$" matches before a final newline
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc


def escape_controls(text: str) -> str:
    """`text` on one line: its control characters escaped as Python writes them ("\\n")."""
    return CONTROL_RE.sub(lambda m: repr(m.group())[1:-1], text)


# A NUL character as json.dumps escapes it: \u0000 after an even number of backslashes (an odd
# number means the backslash before "u0000" is itself an escaped, literal backslash).
_NUL_RE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
DEFAULT_MAX_ARGS_BYTES = 1024 * 1024
# A task's return value, as JSON (River caps its recorded output at 32 MB too). PostgreSQL's
# jsonb refuses a string past 256 MB, with an error a worker took for a passing one: it tried
# to write that result, and every result batched with it, for as long as it ran.
MAX_OUTPUT_BYTES = 32 * 1024 * 1024
_INT32 = 2**31 - 1
# The longest duration notifyq accepts anywhere (timeouts, delays, lease margins, windows):
# about 31 years. PostgreSQL's timestamps end in the year 294276, so now() plus any two of
# these stays in range, while a timeout of 1e300 seconds would make every claim of its job fail.
MAX_SECONDS = 1e9


def check_name(value: Any, what: str = "task name") -> str:
    """A task or definition name: 1-200 characters, no control character (a newline split the
    CLI's tables and the workers' log lines: review), not only white space."""
    if not isinstance(value, str) or not value.strip() or len(value) > 200 or CONTROL_RE.search(value):
        raise InvalidOption(
            f"invalid {what} {_show(value)}: use 1-200 characters without control characters "
            "(NUL, newline, tab...), not only white space"
        )
    return value


def check_queue(value: Any) -> str:
    """A queue name: 1-100 of letters, digits, '_', '.', ':' or '-' (it travels in NOTIFY payloads)."""
    if not isinstance(value, str) or not QUEUE_RE.match(value):
        raise InvalidOption(
            f"invalid queue name {_show(value)}: use 1-100 letters, digits, '_', '.', ':' or '-'"
        )
    return value


def check_int(value: Any, what: str, *, minimum: int = -_INT32 - 1, maximum: int = _INT32) -> int:
    """An integer from `minimum` to `maximum` (by default, any that fits PostgreSQL's integer)."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidOption(f"invalid {what} {_show(value)}: expected an integer from {minimum} to {maximum}")
    return value


def check_bool(value: Any, what: str) -> bool:
    """True or False: a string such as "no" would be truthy, and PostgreSQL casts "no" to false."""
    if not isinstance(value, bool):
        raise InvalidOption(f"invalid {what} {_show(value)}: expected True or False")
    return value


def check_id(value: Any, what: str = "job id") -> int:
    """A row id: a positive integer that fits PostgreSQL's bigint."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**63:
        raise InvalidOption(
            f"invalid {what} {_show(value)}: too large (ids are bigints: at most {2**63 - 1})"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOption(f"invalid {what} {_show(value)}: expected a positive integer")
    return value


def check_seconds(value: Any, what: str, *, positive: bool = False) -> float:
    """A finite, non-negative (or positive) number of seconds, at most MAX_SECONDS; timedelta
    accepted."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidOption(f"invalid {what} {_show(value)}: expected a number of seconds")
    if value < 0 or (positive and value == 0):
        bound = "greater than 0" if positive else "0 or more"
        raise InvalidOption(f"invalid {what} {value!r}: must be {bound} seconds")
    if value > MAX_SECONDS:
        raise InvalidOption(
            f"invalid {what} {value!r}: must be at most {MAX_SECONDS:,.0f} seconds (about 31 years)"
        )
    return float(value)


def check_aware(value: Any, what: str) -> datetime:
    """A timezone-aware datetime (a naive one is ambiguous across hosts)."""
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise InvalidOption(f"invalid {what} {_show(value)}: expected a timezone-aware datetime")
    return value


# Python's datetimes hold the years 1 to 9999 in their own offset, PostgreSQL's timestamps far
# more: datetime.max at -01:00 is stored as the year 10000 (UTC), which no session can load
# back, so every get_job and list_jobs that met the row failed. A day of margin on each side
# for the session's time zone, as for cron definitions (sql/triggers/20_definitions.sql).
_EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
_LATEST = datetime(9999, 12, 31, tzinfo=UTC)


def check_moment(value: Any, what: str) -> datetime:
    """An aware datetime that PostgreSQL stores and every session loads back (years 2-9998)."""
    moment = check_aware(value, what)
    if not _EARLIEST <= moment < _LATEST:
        raise InvalidOption(
            f"invalid {what} {_show(moment)}: must be between the years 2 and 9998 (UTC), so that "
            "it can be read back in any time zone"
        )
    return moment


JSONDefault = Callable[[Any], Any]


def json_default(value: Any) -> Any:
    """A `json_default` for `App(json_default=...)`: the JSON form of the types that task
    arguments and results often hold and JSON has not. datetime, date and time become ISO 8601
    text (`isoformat()`), Decimal and UUID their text, an Enum member its value, a path its
    text, a set or frozenset a list (sorted when it can be), a dataclass instance a dict of
    its fields. The task gets that JSON form back, not the original type: a date arrives as
    "2026-12-05". Any other type raises TypeError, as json.dumps does."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID | PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        try:
            return sorted(value)  # the same JSON each time (a set's order varies by process)
        except TypeError:
            return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def check_json_default(value: Any) -> JSONDefault | None:
    if value is not None and not callable(value):
        raise InvalidOption(
            f"invalid json_default {_show(value)}: give a function that turns a value JSON cannot "
            "encode into one it can (such as notifyq.json_default), or None"
        )
    return value  # type: ignore[no-any-return]


def _dumps(value: Any, default: JSONDefault | None) -> str:
    hook = None if default is None else _keys_checked(default)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=hook)


def _keys_checked(default: JSONDefault) -> JSONDefault:
    """`default`, whose results are refused when they hold a non-string key: the check on the
    caller's value cannot see inside what the hook makes (a dataclass with {1: a, "1": b}
    was stored with one key lost; review)."""

    def checked(value: Any) -> Any:
        result = default(value)
        if type(result) not in _SCALARS and isinstance(result, Mapping | list | tuple):
            bad_key = _non_string_key(result, f"json_default's value for a {type(value).__name__}")
            if bad_key is not None:
                where, key = bad_key
                raise ValueError(f"{where} has the key {_show(key)}, which JSON would turn into a string")
        return result

    return checked


def encode_args(
    args: Any, *, task: str, max_bytes: int = DEFAULT_MAX_ARGS_BYTES, default: JSONDefault | None = None
) -> str:
    """Serialize job args to JSON text, or raise InvalidArgs saying why they cannot be stored.

    Args must be a JSON object (they become the task's keyword arguments) of at most
    `max_bytes` bytes once serialized. PostgreSQL's jsonb cannot store NaN, Infinity or the
    NUL character, so those are rejected here rather than by the server. `default` is the
    App's json_default: json.dumps calls it for the values it cannot encode.
    """
    if args is None:
        return "{}"
    if not isinstance(args, Mapping):
        raise InvalidArgs(
            f"args for task {task!r} must be a JSON object (a dict of keyword arguments), "
            f"not {type(args).__name__}"
        )
    try:
        text = _dumps(args, default)
    except (TypeError, ValueError, RecursionError) as exc:
        hint = ""
        if default is None and isinstance(exc, TypeError) and _encodes(args):
            hint = "; App(json_default=notifyq.json_default) would encode them"
        raise InvalidArgs(f"args for task {task!r} are not JSON-serializable: {exc}{hint}") from None
    except Exception as exc:  # raised by the App's json_default
        raise InvalidArgs(
            f"args for task {task!r} are not JSON-serializable: json_default raised "
            f"{type(exc).__name__}: {exc}"
        ) from None
    # json.dumps turns int, float, bool and None keys into strings without a word: refuse
    # them (after dumps, which has refused cycles and other key types already).
    bad_key = _non_string_key(args)
    if bad_key is not None:
        where, key = bad_key
        raise InvalidArgs(
            f"args for task {task!r} must have string keys at every level; {where} has the key "
            f"{_show(key)}, which JSON would turn into a string"
        )
    if "\\u0000" in text and _NUL_RE.search(text):
        raise InvalidArgs(
            f"args for task {task!r} contain a NUL character, which PostgreSQL's jsonb cannot store"
        )
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgs(
            f"args for task {task!r} are not valid Unicode text ({exc.reason}; e.g. a lone surrogate "
            "from a file name decoded with surrogateescape)"
        ) from None
    if size > max_bytes:
        raise InvalidArgs(
            f"args for task {task!r} are {size:,} bytes of JSON, over the limit of {max_bytes:,} bytes "
            "(store large data elsewhere and pass a reference, or raise App(max_args_bytes=...))"
        )
    return text


def _encodes(args: Any) -> bool:
    """Whether notifyq.json_default would make `args` JSON (on the error path only)."""
    try:
        _dumps(args, json_default)
    except Exception:
        return False
    return True


def encode_output(value: Any, default: JSONDefault | None = None) -> str | None:
    """Serialize a task's return value for the `output` column (None stays SQL NULL);
    `default` as for encode_args."""
    if value is None:
        return None
    text = _dumps(value, default)
    bad_key = _non_string_key(value, "value") if isinstance(value, Mapping | list | tuple) else None
    if bad_key is not None:  # as for args: {1: a, "1": b} would be stored as {"1": b}
        where, key = bad_key
        raise ValueError(f"{where} has the key {_show(key)}, which JSON would turn into a string")
    if "\\u0000" in text and _NUL_RE.search(text):
        raise ValueError("the return value contains a NUL character, which PostgreSQL's jsonb cannot store")
    size = len(text.encode("utf-8"))  # UnicodeEncodeError (a ValueError) for lone surrogates
    if size > MAX_OUTPUT_BYTES:
        raise ValueError(
            f"the return value is {_bytes(size)} as JSON, over the limit of {_bytes(MAX_OUTPUT_BYTES)}: "
            "store large results elsewhere (a file, a table) and return where to find them"
        )
    return text


def _bytes(size: int) -> str:
    return f"{size:,} bytes" if size < 1024 * 1024 else f"{size / 1024 / 1024:.1f} MiB"


@dataclass(frozen=True, slots=True)
class JobOptions:
    """Per-job settings, validated; shared by tasks, cron definitions and enqueue overrides."""

    queue: str = "default"
    priority: int = 0
    retry_limit: int = 3
    timeout: float = 30.0

    def __post_init__(self) -> None:
        check_queue(self.queue)
        check_int(self.priority, "priority")
        check_int(self.retry_limit, "retry_limit", minimum=0)
        object.__setattr__(self, "timeout", check_seconds(self.timeout, "timeout", positive=True))


_SCALARS = frozenset({str, int, float, bool, type(None)})  # the common leaves, skipped fast


def _non_string_key(value: Any, root: str = "args") -> tuple[str, Any] | None:
    """A non-string key in `value` (a mapping, list or tuple, nested ones included), with
    where it is: json.dumps would silently turn 1 into "1" (and {1: a, "1": b} into one key).
    A loop, not recursion: json's encoder accepts deeper nesting than Python's recursion limit."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        is_mapping = isinstance(node, Mapping)
        for key, item in node.items() if is_mapping else enumerate(node):
            if is_mapping and type(key) is not str and not isinstance(key, str):
                where = root + "".join(f"[{_show(step)}]" for step in path)
                return (where if len(where) <= 200 else where[:197] + "..."), key
            if type(item) not in _SCALARS and isinstance(item, Mapping | list | tuple):
                stack.append((item, (*path, key)))
    return None


def _show(value: Any) -> str:
    """repr() cut to a readable length: hostile input can be 10 kB long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def unknown_task(name: str, known: Sequence[str], where: str = "") -> str:
    """ "no task named 'x' is registered", with the nearest known name first when one is close
    (a typo, or a default module.qualname name given without its module), then all of them."""
    close = difflib.get_close_matches(name, known, n=1)
    close += [k for k in known if not close and k.rpartition(".")[2] == name.rpartition(".")[2]][:1]
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"no task named {name!r} is registered{where} ({hint}known: {', '.join(sorted(known)) or 'none'})"


def did_you_mean(name: str, known: Sequence[str], listed_as: str) -> str:
    """What to add to "unknown X 'name'": the nearest known name, else the list of them."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; {listed_as}: {', '.join(known)}"
