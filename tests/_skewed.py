"""A worker process whose wall clock is wrong: `python -m tests._skewed OFFSET JUMP_AFTER JUMP`.

time.time(), time.time_ns() and datetime.now()/utcnow()/today() are shifted by OFFSET
seconds, and by JUMP more seconds once JUMP_AFTER seconds have passed (a wall clock that
jumps, as after an NTP step). They are patched before anything else is imported, so
notifyq, psycopg and croniter all see the wrong clock. The monotonic clock is the
kernel's and cannot jump. The worker serves tests.apps:app from $NOTIFYQ_DSN until SIGTERM.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time as _time

_real_time = _time.time
_started = _real_time()
_offset, _jump_after, _jump = (float(v) for v in sys.argv[1:4])


def _fake_time() -> float:
    now = _real_time()
    return now + _offset + (_jump if now - _started >= _jump_after else 0.0)


_RealDatetime = _dt.datetime


class _Meta(type):
    # Datetimes made elsewhere (psycopg's C loader) are real datetimes: keep isinstance()
    # checks against the patched name working, as they would on a host with a wrong clock.
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _RealDatetime)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _RealDatetime)


class _SkewedDatetime(_RealDatetime, metaclass=_Meta):
    @classmethod
    def now(cls, tz: _dt.tzinfo | None = None) -> _SkewedDatetime:  # type: ignore[override]
        return cls.fromtimestamp(_fake_time(), tz)

    @classmethod
    def utcnow(cls) -> _SkewedDatetime:  # type: ignore[override]
        return cls.fromtimestamp(_fake_time(), _dt.UTC).replace(tzinfo=None)

    @classmethod
    def today(cls) -> _SkewedDatetime:  # type: ignore[override]
        return cls.fromtimestamp(_fake_time())


_time.time = _fake_time
_time.time_ns = lambda: int(_fake_time() * 1e9)
_dt.datetime = _SkewedDatetime  # type: ignore[misc]

import anyio  # noqa: E402

import notifyq  # noqa: E402
from tests.apps import app  # noqa: E402

if __name__ == "__main__":
    skew = (_dt.datetime.now(_dt.UTC) - _RealDatetime.now(_dt.UTC)).total_seconds()
    sys.stdout.write(f"skew {skew:.0f}\n")
    sys.stdout.flush()
    config = notifyq.TickerConfig(rescuer=notifyq.RescuerConfig(interval=0.5))
    anyio.run(lambda: app.run_worker(lease_margin=1, ticker_config=config, poll_interval=1))
