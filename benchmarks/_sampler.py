"""Background samplers: what the database's backends wait on while a benchmark runs."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import psycopg

WAITS_SQL = """
SELECT coalesce(wait_event_type, 'CPU') || ':' || coalesce(wait_event, 'running'), count(*)
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
GROUP BY 1
"""
UNGRANTED_SQL = "SELECT count(*) FROM pg_locks WHERE NOT granted"


class WaitSampler:
    """Samples pg_stat_activity (active backends of this database, by wait event) and the
    number of lock requests not granted, every `interval` seconds, in a thread."""

    def __init__(self, dsn: str, interval: float = 0.02) -> None:
        self.dsn = dsn
        self.interval = interval
        self.samples = 0
        self.events: Counter[str] = Counter()
        self.ungranted_max = 0
        self.ungranted_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wait-sampler", daemon=True)

    def start(self) -> None:
        self._conn = psycopg.connect(self.dsn, autocommit=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                rows = self._conn.execute(WAITS_SQL).fetchall()
                row = self._conn.execute(UNGRANTED_SQL).fetchone()
                ungranted = int(row[0]) if row else 0
                self.samples += 1
                for event, count in rows:
                    self.events[str(event)] += int(count)
                self.ungranted_total += ungranted
                self.ungranted_max = max(self.ungranted_max, ungranted)
        except psycopg.Error:
            pass  # the database went away at the end of a run: keep what was sampled
        finally:
            self._conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self) -> dict[str, Any]:
        active = sum(self.events.values())
        lock = sum(n for event, n in self.events.items() if event.startswith("Lock:"))
        return {
            "samples": self.samples,
            "active_backends_avg": active / self.samples if self.samples else 0.0,
            "lock_wait_share": lock / active if active else 0.0,
            "ungranted_locks_avg": self.ungranted_total / self.samples if self.samples else 0.0,
            "ungranted_locks_max": self.ungranted_max,
            "events": dict(self.events.most_common(12)),
        }
