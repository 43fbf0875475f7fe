"""The inline hashing budget holds per turn of the loop, whatever order callbacks start hashes in."""

from __future__ import annotations

import asyncio
import collections
import mmap
import selectors
import threading
from typing import Any

import pytest

from aiokv.storage import checksum as checksum_module
from aiokv.storage.checksum import Checksums
from aiokv.storage.pagefile import payload_checksum

PAGE = 64 << 10


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Counts the loop's turns: every turn of an asyncio selector loop polls its selector once."""

    turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.turns += 1
        result: list[tuple[selectors.SelectorKey, int]] = super().select(timeout)
        return result


def run_counted(scenario: Any) -> CountingSelector:
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        loop.run_until_complete(scenario(selector))
    finally:
        loop.close()
    return selector


def test_inline_hashes_of_one_turn_stay_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # #14 defect: the per-turn byte count was reset by a callback of the next turn. Pages started by
    # callbacks that ran in that turn before the reset counted against the previous turn, and those
    # after it had a whole budget again: one turn hashed up to twice the budget on the loop (here
    # 3 pages where the budget is 2).
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_BYTES_PER_TURN", 2 * PAGE)
    data = mmap.mmap(-1, 8 * PAGE)
    data.write(bytes(range(256)) * (8 * PAGE // 256))
    pages = [memoryview(data)[i * PAGE : (i + 1) * PAGE] for i in range(8)]
    loop_thread = threading.get_ident()
    per_turn: collections.Counter[int] = collections.Counter()
    in_thread: list[int] = []
    real = checksum_module.payload_checksum
    selector_ref: list[CountingSelector] = []

    def spy(view: memoryview) -> int:
        if threading.get_ident() == loop_thread:
            per_turn[selector_ref[0].turns] += len(view)
        else:
            in_thread.append(len(view))
        return real(view)

    monkeypatch.setattr(checksum_module, "payload_checksum", spy)
    results: dict[int, int | BaseException] = {}

    async def scenario(selector: CountingSelector) -> None:
        selector_ref.append(selector)
        sums = Checksums(inline_bytes=PAGE, inline_write_bytes=PAGE, threads=1)
        loop = asyncio.get_running_loop()
        all_done = loop.create_future()

        def done_for(i: int) -> Any:
            def done(value: int | BaseException) -> None:
                results[i] = value
                if len(results) == 6 and not all_done.done():
                    all_done.set_result(None)
            return done

        def start(i: int) -> None:
            sums.start(pages[i], done_for(i), writing=True)

        try:
            # This turn: a callback queued for the next turn first, then a write started, then two
            # more callbacks queued behind whatever the start scheduled.
            loop.call_soon(start, 1)
            start(0)
            loop.call_soon(start, 2)
            loop.call_soon(start, 3)
            loop.call_soon(loop.call_soon, start, 4)  # two turns later
            loop.call_soon(loop.call_soon, start, 5)
            await all_done
        finally:
            await sums.aclose()

    run_counted(scenario)
    for i in range(6):
        assert results[i] == payload_checksum(pages[i])
    assert per_turn, "nothing was hashed on the loop"
    assert max(per_turn.values()) <= 2 * PAGE, dict(per_turn)
    assert sum(per_turn.values()) + sum(in_thread) == 6 * PAGE
    for view in pages:
        view.release()
    data.close()


def test_small_pages_count_against_the_turn_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reads and writes at or below INLINE_CHECKSUM_BYTES were hashed inline without counting: 40
    # such pages started in one turn all ran on the loop in it.
    monkeypatch.setattr(checksum_module, "INLINE_WRITE_BYTES_PER_TURN", 4 * PAGE)
    data = mmap.mmap(-1, 40 * PAGE)
    view = memoryview(data)
    loop_thread = threading.get_ident()
    per_turn: collections.Counter[int] = collections.Counter()
    real = checksum_module.payload_checksum
    selector_ref: list[CountingSelector] = []

    def spy(v: memoryview) -> int:
        if threading.get_ident() == loop_thread:
            per_turn[selector_ref[0].turns] += len(v)
        return real(v)

    monkeypatch.setattr(checksum_module, "payload_checksum", spy)

    async def scenario(selector: CountingSelector) -> None:
        selector_ref.append(selector)
        sums = Checksums(inline_bytes=PAGE, inline_write_bytes=PAGE, threads=1)
        try:
            got = await asyncio.gather(*(sums.checksum(view[i * PAGE : (i + 1) * PAGE]) for i in range(40)))
            assert got == [real(view[i * PAGE : (i + 1) * PAGE]) for i in range(40)]
        finally:
            await sums.aclose()

    run_counted(scenario)
    assert per_turn and max(per_turn.values()) <= 4 * PAGE, dict(per_turn)
    view.release()
    data.close()
