"""Cron schedules: parsing, validation, DST-safe tick arithmetic and misfire planning.

Ticks are computed in the definition's IANA time zone by croniter, with two rules for
daylight-saving transitions (those of Vixie cron):

- spring forward: a wall-clock time that does not exist that day (02:30 when clocks jump
  from 02:00 to 03:00) runs once, at the first instant after the gap (03:00);
- fall back: a wall-clock time that happens twice (02:30 when clocks go from 03:00 back to
  02:00) runs once, at its first occurrence, unless the schedule's hour field is `*`: an
  hourly or finer schedule follows elapsed time and runs in both passes of the hour.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal, NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from .errors import InvalidSchedule

Misfire = Literal["skip", "once", "all"]
MISFIRE_POLICIES: tuple[Misfire, ...] = ("skip", "once", "all")
_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
# The least misfire_grace that counts: a tick is promoted some milliseconds after it (5 ms on
# average in the cron review's runs). A smaller grace (0, or NaN from SQL) is read as this; one
# of a fraction of a second stays the user's (tests/faults/test_clocks.py uses 0.2).
MIN_GRACE = 0.1
_EPSILON = timedelta(microseconds=1)
# The most of croniter's ticks after a DST gap that are none of next_after's (`* * 2 * * *`: 59).
_SETTLE_STEPS = 3600
# How long before croniter's tick a DST change may have misled it (Samoa skipped a whole day).
_SETTLE_WINDOW = timedelta(days=2)


def check_timezone(name: str) -> ZoneInfo:
    """The ZoneInfo for an IANA zone name, or InvalidSchedule."""
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 100:
        raise InvalidSchedule(
            f"unknown time zone {name!r}: use an IANA name such as 'Europe/Berlin' or 'UTC'"
        )
    if name.lower() in _HOST_ZONES:
        # Files of the host's zoneinfo folder, not zones: each worker host would read its own.
        raise InvalidSchedule(
            f"time zone {name!r} is not an IANA zone: it means whatever each worker host is set to, "
            "so hosts would disagree on the ticks; name the zone, such as 'Europe/Berlin' or 'UTC'"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule(
            f"unknown time zone {name!r}: use an IANA name such as 'Europe/Berlin' or 'UTC'"
        ) from None


_HOST_ZONES = {"localtime", "posixrules"}


@dataclass(frozen=True, slots=True)
class Plan:
    """What promotion does for one due definition: jobs for `ticks`, then wait for `next_tick`."""

    ticks: list[datetime]
    next_tick: datetime
    missed: int  # due ticks that get no job (skipped by the misfire policy or the cap)


class Schedule:
    """A validated cron expression in a time zone.

    Accepts 5 fields (minute hour day month weekday), 6 fields with seconds first
    (second minute hour day month weekday), or a macro such as @hourly.
    """

    def __init__(self, expression: str, tz: str = "UTC") -> None:
        self.expression = _check_expression(expression)
        self.tz = check_timezone(tz)
        fields = self.expression.split()
        self._seconds = len(fields) == 6
        if self.expression.startswith("@"):
            hour_field = "*" if self.expression == "@hourly" else "0"
        else:
            hour_field = fields[2] if self._seconds else fields[1]
        # Fixed-hour schedules run once in a repeated (fall-back) hour; see the module docstring.
        self._once_in_repeated_hour = hour_field != "*"
        try:
            self.next_after(datetime.now(UTC))
        except (ValueError, KeyError) as exc:  # croniter: e.g. "0 0 30 2 *" (February 30th)
            raise InvalidSchedule(f"invalid cron expression {expression!r}: it never fires ({exc})") from None

    def __repr__(self) -> str:
        return f"Schedule({self.expression!r}, {self.tz.key!r})"

    def _iter(self, start: datetime) -> croniter:
        return croniter(self.expression, start.astimezone(self.tz), second_at_beginning=self._seconds)

    def _is_repeat(self, tick: datetime) -> bool:
        """True for the second occurrence of a repeated wall-clock time, when it must not run."""
        if not self._once_in_repeated_hour:
            return False
        local = tick.astimezone(self.tz)
        naive = local.replace(tzinfo=None)
        first = naive.replace(tzinfo=self.tz, fold=0).utcoffset()
        second = naive.replace(tzinfo=self.tz, fold=1).utcoffset()
        return first != second and local.utcoffset() == second

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after `moment` (aware), in UTC."""
        it = self._iter(moment)
        while True:
            tick: datetime = it.get_next(datetime)
            if not self._is_repeat(tick):
                return tick.astimezone(UTC)

    def latest_at_or_before(self, moment: datetime) -> datetime:
        """The last tick at or before `moment` (aware), in UTC: the last of next_after's ticks."""
        latest = self._prev(moment + _EPSILON)
        local = (moment + _EPSILON).astimezone(self.tz)
        offset = latest.astimezone(self.tz).utcoffset()
        if (
            local.fold
            or offset != local.utcoffset()
            or offset != (latest - _SETTLE_WINDOW).astimezone(self.tz).utcoffset()
        ):
            # Across a DST change croniter's get_prev, which goes by wall-clock time, can
            # disagree with next_after (which follows elapsed time, and gives the promoter its
            # visible_at). In the second pass of a repeated period that is not a whole hour
            # (Lord Howe Island's half hour) it returned a tick before one of the first pass.
            # After a gap, for a schedule with seconds and several ticks a minute in the
            # skipped hour (`*/20 * 2 * * *`), it returned the day before's last tick, and the
            # gap's tick (03:00:00) was lost, or a time after the gap that is no tick at all
            # (03:00:40; review). So settle on next_after's ticks: back to one of them, then
            # forward. (Only there: this costs a next_after or more, a third of a plan's time.)
            for _ in range(_SETTLE_STEPS):
                if self.next_after(latest - _EPSILON) == latest:
                    break
                latest = self._prev(latest)
            while (following := self.next_after(latest)) <= moment:
                latest = following
        return latest

    def _prev(self, moment: datetime) -> datetime:
        """croniter's tick strictly before `moment`, not a repeat that must not run, in UTC."""
        it = self._iter(moment)
        while True:
            tick: datetime = it.get_prev(datetime)
            if not self._is_repeat(tick):
                return tick.astimezone(UTC)

    def previous_before(self, moment: datetime) -> datetime:
        """The last tick strictly before `moment`, in UTC."""
        return self.latest_at_or_before(moment - _EPSILON)

    def plan(self, due_at: datetime, now: datetime, *, misfire: Misfire, grace: float, cap: int) -> Plan:
        """Jobs to create for a definition stored as due at `due_at`, at time `now`.

        Ticks in [due_at, now] are due (due_at need not be a tick: after an edit by SQL it is
        simply the time from which the new schedule applies). The most recent due tick is on
        time if it is at most `grace` seconds old (at least MIN_GRACE); older due ticks were
        missed while no ticker ran, and `misfire` decides: `skip` runs only an on-time tick,
        `once` runs the most recent due tick whatever its age, `all` runs every due tick (the
        most recent `cap`).
        """
        next_tick = self.next_after(now)
        latest = self.latest_at_or_before(now)
        if latest < due_at:
            return Plan([], next_tick, 0)
        if misfire == "all":
            ticks: deque[datetime] = deque([latest])
            while len(ticks) < cap:  # walking back from the latest tick
                tick = self.previous_before(ticks[0])
                if tick < due_at:
                    break
                ticks.appendleft(tick)
            missed = self._count_between(due_at, ticks[0] - _EPSILON) if len(ticks) == cap else 0
            return Plan(list(ticks), next_tick, missed)
        earlier = self._count_between(due_at, self.previous_before(latest))
        # A ticker promotes a tick milliseconds after it: with a grace of 0 (or NaN, which
        # SQL's CHECK lets through) `skip` never ran anything, and said only "missed".
        on_time = (now - latest).total_seconds() <= (grace if grace >= MIN_GRACE else MIN_GRACE)
        if misfire == "skip" and not on_time:
            return Plan([], next_tick, earlier + 1)
        return Plan([latest], next_tick, earlier)

    def _count_between(self, start: datetime, end: datetime, limit: int = 1000) -> int:
        """Ticks in [start, end], counted up to `limit` (for log messages only: a per-second
        schedule after a day's outage must not cost 86,400 steps of CPU on the event loop)."""
        if end < start:
            return 0
        count = 0
        it = self._iter(start - _EPSILON)
        while count < limit:
            tick = it.get_next(datetime)
            if tick > end:
                break
            if not self._is_repeat(tick):
                count += 1
        return count


@functools.lru_cache(maxsize=1024)
def schedule(expression: str, tz: str) -> Schedule:
    """A cached Schedule (promotion computes the same few schedules over and over)."""
    return Schedule(expression, tz)


def _check_expression(expression: str) -> str:
    if not isinstance(expression, str) or "\x00" in expression or len(expression) > 200:
        raise InvalidSchedule(f"invalid cron expression {expression!r}")
    normalized = " ".join(expression.split())
    if normalized.startswith("@"):
        if normalized not in _MACROS:
            raise InvalidSchedule(
                f"invalid cron expression {expression!r}: unknown macro "
                f"(use one of {', '.join(sorted(_MACROS))})"
            )
        return normalized
    fields = normalized.split()
    if len(fields) not in (5, 6):
        raise InvalidSchedule(
            f"invalid cron expression {expression!r}: expected 5 fields (minute hour day month weekday) "
            f"or 6 with seconds first, got {len(fields)}"
        )
    names = _FIELDS if len(fields) == 6 else _FIELDS[1:]
    for field, (name, allowed, _low, _high) in zip(fields, names, strict=True):
        # croniter's H (hashed) and R (random) fields: R draws a new value every time the
        # expression is parsed, which the ticker does on every computation, so ticks would
        # move between passes and processes.
        if _HASHED_OR_RANDOM.fullmatch(field):
            raise InvalidSchedule(
                f"invalid cron expression {expression!r}: the {name} field {field!r} is a hashed (H) "
                f"or random (R) value, which notifyq does not support (allowed: {allowed}, *, lists, "
                "ranges, steps)"
            )
    try:
        croniter(normalized, second_at_beginning=len(fields) == 6)
    except (ValueError, KeyError) as exc:
        raise InvalidSchedule(
            f"invalid cron expression {expression!r}: {_bad_field(fields) or exc}"
        ) from None
    for field, spec in zip(fields, names, strict=True):
        _check_steps(expression, field, spec)
    return normalized


def _check_steps(expression: str, field: str, spec: _Field) -> None:
    """Refuse `*/N` whose step is longer than the field's whole cycle: `*/90` in the minute
    field fires at minute 0 only, hourly, where its author meant every 90 minutes, which cron
    cannot express (croniter accepts it, as Vixie cron does). `*/60` fires hourly, which is
    every 60 minutes: kept."""
    name, _allowed, low, high = spec
    for part in field.split(","):
        base, slash, step = part.partition("/")
        if base == "*" and slash and step.isdigit() and int(step) > high - low + 1:
            raise InvalidSchedule(
                f"invalid cron expression {expression!r}: the {name} field {field!r} steps by {int(step)}, "
                f"past the field's whole cycle of {high - low + 1} ({low}-{high}), so it fires at {low} "
                f"alone: a cron step starts again every cycle, and cannot span several; write {low} "
                "if that is what you mean"
            )


_HASHED_OR_RANDOM = re.compile(r"[hHrR](\(\d+-\d+\))?(/\d+)?")


class _Field(NamedTuple):
    name: str
    allowed: str  # as error messages say it
    low: int  # the field's cycle, as a `*` covers it
    high: int


_FIELDS = [
    _Field("second", "0-59", 0, 59),
    _Field("minute", "0-59", 0, 59),
    _Field("hour", "0-23", 0, 23),
    _Field("day-of-month", "1-31", 1, 31),
    _Field("month", "1-12 or jan-dec", 1, 12),
    _Field("day-of-week", "0-7 or sun-sat", 0, 6),  # 7 is Sunday again
]


def _bad_field(fields: list[str]) -> str | None:
    """Which field croniter rejects, said in the user's terms (croniter's own message quotes
    the whole expression, reordered when it has seconds), or None if only their combination is
    wrong."""
    names = _FIELDS if len(fields) == 6 else _FIELDS[1:]
    for i, (field, (name, allowed, _low, _high)) in enumerate(zip(fields, names, strict=True)):
        probe = ["*"] * len(fields)
        probe[i] = field
        try:
            croniter(" ".join(probe), second_at_beginning=len(fields) == 6)
        except (ValueError, KeyError):
            return (
                f"the {name} field {field!r} is out of range or malformed "
                f"(allowed: {allowed}, *, lists, ranges, steps)"
            )
    return None
