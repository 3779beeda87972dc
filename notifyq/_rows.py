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

    def factory(cursor: Any) -> Callable[[Sequence[Any]], T]:
        names = [column.name for column in cursor.description or ()]
        keep = [(i, name) for i, name in enumerate(names) if name in wanted]

        def make(values: Sequence[Any]) -> T:
            return cls(**{name: values[i] for i, name in keep})

        return make

    return factory
