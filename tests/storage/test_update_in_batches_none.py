"""A registration call that pins nothing and reports no error ends the registration (OSError)
instead of retrying the same batch forever on the pool's preparation thread (the kernel answers
"done ? done : err"; a zero would otherwise never advance)."""

from __future__ import annotations

import threading

import pytest

from aiokv.storage import uring
from aiokv.storage.memory import update_in_batches


class _PinsNothing:
    """The one call ``update_in_batches`` makes on the engine, answering 0 (a misbehaving kernel)."""

    def __init__(self) -> None:
        self.calls = 0

    def update_buffers(self, regions: list[uring.Region]) -> int:
        self.calls += 1
        if self.calls > 3:
            raise AssertionError("retried a batch that pinned nothing")
        return 0


def test_a_call_pinning_nothing_raises() -> None:
    engine = _PinsNothing()
    regions = [uring.Region(i, 4096 * i, 4096) for i in range(3)]
    with pytest.raises(OSError, match="registered none"):
        list(update_in_batches(engine, regions, threading.Event(), lambda _: None))  # type: ignore[arg-type]
    assert engine.calls == 1
