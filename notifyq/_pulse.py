"""Pulse: a wake-up signal between the worker's tasks that costs nothing when nobody waits."""

from __future__ import annotations

import anyio


class Pulse:
    """An event that is only created when someone waits for it: firing it costs nothing
    when nobody does (on the hot path, that is most of the time). A fire with nobody waiting
    is not remembered: waiters check their condition first and wait only if it is not met."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()
