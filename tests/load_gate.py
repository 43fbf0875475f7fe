"""A disk tier's page reads held in front of its backend (:class:`LoadGate`), and a page file
damaged under such a read (:func:`flip_payload`): shared by the storage and the cache tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from aiokv.storage import DiskTier
from aiokv.storage.pagefile import HEADER_BYTES


class LoadGate:
    """Holds the backend's page loads (a read's open and read) until :meth:`open`: the reads are
    launched and counted by the tier, but no file is opened yet. ``limit``: only the first so many
    are held, later ones go through. Set ``closed`` again to hold the loads that come next."""

    def __init__(self, tier: DiskTier, monkeypatch: pytest.MonkeyPatch,
                 request: pytest.FixtureRequest | None = None, limit: int | None = None) -> None:
        self.held: list[tuple[Any, ...]] = []
        self.closed = True
        self._left = limit
        backend = tier.backend
        self._load: Callable[..., None] = backend.start_load
        monkeypatch.setattr(backend, "start_load", self._start_load)
        if request is not None:
            # Opened at the test's teardown too, before the tier fixture's close (a finalizer added
            # later runs earlier), on the test's loop (the backend starts a load on the running loop):
            # pytest-timeout's signal ends a slow test out of the loop, so the test's own
            # ``finally: gate.open()`` never runs, and the close then waited for the held loads for
            # ever (review 228: a run under load hung 580 s past the 300 s timeout).
            loop = asyncio.get_running_loop()
            request.addfinalizer(lambda: loop.is_closed() or loop.call_soon(self.open))

    def _start_load(self, *args: Any) -> None:
        if self.closed and self._left != 0:
            self.held.append(args)
            if self._left is not None:
                self._left -= 1
        else:
            self._load(*args)

    def load(self, *args: Any) -> None:
        """One held load (its arguments, taken out of :attr:`held`) let through now."""
        self._load(*args)

    def open(self) -> None:
        self.closed = False
        held, self.held = self.held, []
        for args in held:
            self._load(*args)


def flip_payload(path: str) -> None:
    """The payload's first bytes flipped in place: the checksum refuses the file."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES)
        data = f.read(64)
        f.seek(HEADER_BYTES)
        f.write(bytes(b ^ 0xFF for b in data))
