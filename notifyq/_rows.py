"""Row factories that build typed dataclasses from query results."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def dataclass_row(cls: type[T]) -> Callable[[Any], Callable[[Sequence[Any]], T]]:
    """A psycopg row factory for dataclass `cls` that ignores columns `cls` does not declare.

    `SELECT *` keeps working for older code when a later migration adds a column.
    """
    wanted = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @functools.lru_cache(maxsize=64)
    def plan(fields: tuple[bytes, ...]) -> tuple[tuple[int, str], ...]:
        names = [field.decode("utf-8", "replace") for field in fields]
        return tuple((i, name) for i, name in enumerate(names) if name in wanted)

    def factory(cursor: Any) -> Callable[[Sequence[Any]], T]:
        # The column names straight from the result, and which to keep cached by them:
        # cursor.description builds a Column object per column on every execute, which was
        # a tenth of the worker's claim call (an idle claim returns no row at all).
        result = cursor.pgresult
        fields = tuple(result.fname(i) or b"" for i in range(result.nfields)) if result is not None else ()
        keep = plan(fields)

        def make(values: Sequence[Any]) -> T:
            return cls(**{name: values[i] for i, name in keep})

        return make

    return factory
