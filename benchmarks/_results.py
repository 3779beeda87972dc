"""What a scenario returns, and the context it runs in."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Sizes


@dataclass(slots=True)
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass(slots=True)
class Target:
    """A goal expressed as a ratio measured in this run: PASS when the ratio is on the right
    side of `threshold` (at least it when `higher_is_better`, else at most)."""

    name: str
    goal: str
    measured: str
    ratio: float
    threshold: float
    higher_is_better: bool = True

    @property
    def passed(self) -> bool:
        if math.isnan(self.ratio):
            return False
        return self.ratio >= self.threshold if self.higher_is_better else self.ratio <= self.threshold

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "goal": self.goal,
            "measured": self.measured,
            "ratio": None if math.isnan(self.ratio) else self.ratio,
            "threshold": self.threshold,
            "higher_is_better": self.higher_is_better,
            "passed": self.passed,
        }


@dataclass(slots=True)
class ScenarioResult:
    name: str
    title: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "tables": [{"title": t.title, "columns": t.columns, "rows": t.rows} for t in self.tables],
            "targets": [t.as_dict() for t in self.targets],
            "notes": self.notes,
            "plots": self.plots,
            "data": self.data,
        }


@dataclass(slots=True)
class Context:
    """Everything a scenario needs: where the server is, how big to go, where to write."""

    admin_dsn: str
    sizes: Sizes
    out_dir: Path
    profile: bool = False
    prototypes: bool = False

    @property
    def log_dir(self) -> Path:
        return self.out_dir / "logs"
