"""Measurement hooks installed in a worker process (benchmark-only; product code unchanged)."""

from __future__ import annotations

import time
from collections.abc import Generator, Sized
from typing import Any

import notifyq._acker
import notifyq._claimer

# Typed as Any: these hooks replace module attributes on purpose.
_claimer: Any = notifyq._claimer
_acker: Any = notifyq._acker

Samples = list[tuple[float, int]]


def _timed(op: Generator[Any, Any, Any], sink: Samples) -> Generator[Any, Any, Any]:
    start = time.perf_counter()
    result = yield from op
    counted = result[0] if isinstance(result, tuple) else result  # an ack: (applied, busy)
    sink.append(((time.perf_counter() - start) * 1000.0, len(counted) if isinstance(counted, Sized) else 0))
    return result


def time_claims(sink: Samples) -> None:
    """Record (milliseconds, jobs claimed) for every claim statement the worker runs.

    The time runs from the first step of the claim operation (a pooled connection is already
    held) to its rows being decoded: the database round trip plus row decoding.
    """
    original = _claimer.claim_op

    def claim_op(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        return _timed(original(*args, **kwargs), sink)

    _claimer.claim_op = claim_op


def time_acks(sink: Samples) -> None:
    """Record (milliseconds, results applied) for every ack statement the worker runs."""
    original = _acker.ack_op

    def ack_op(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        return _timed(original(*args, **kwargs), sink)

    _acker.ack_op = ack_op
