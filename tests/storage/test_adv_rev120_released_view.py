"""A payload view released before its inline hash ran (a caller's bug) is reported to that caller
alone: the other pages of the same inline batch still get their checksums. Before, ``len(view)``
raised out of the batch (it runs before the hash's own ``try``), and every page after it in the
batch was dropped: their reads never ended (a hang for their callers, ``close`` and the cancel path
that waits for a job's end). The batch runs at a ring wake-up's end too (#14): the same holds there,
and a raising batch must not leave the wake-up's state behind."""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable

import pytest

from aiokv.storage.checksum import Checksums
from aiokv.storage.pagefile import payload_checksum
from aiokv.storage.uring import OP_NOP, TURNS, UringEngine, sqe


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["queued", "wake-up"])
async def test_a_released_view_fails_alone_and_the_rest_of_the_batch_is_hashed(where: str) -> None:
    page = 16 << 10
    data = mmap.mmap(-1, 4 * page)
    data[:] = bytes(range(256)) * (4 * page // 256)
    whole = memoryview(data)
    views = [whole[i * page : (i + 1) * page] for i in range(4)]
    want = [payload_checksum(v) for v in views]
    checksums = Checksums(inline_bytes=page, threads=1, start=False)
    loop = asyncio.get_running_loop()
    got: dict[int, int | BaseException] = {}
    all_done: asyncio.Future[None] = loop.create_future()

    def done(i: int) -> Callable[[int | BaseException], None]:
        def record(value: int | BaseException) -> None:
            got[i] = value
            if len(got) == 4 and not all_done.done():
                all_done.set_result(None)
        return record

    def start_all() -> None:
        for i, view in enumerate(views):
            checksums.start(view, done(i))
        views[1].release()  # the caller's bug: released before the batch ran

    engine = UringEngine.open(8) if where == "wake-up" else None
    try:
        if engine is None:
            start_all()
        else:  # started by a completion: the batch runs at the wake-up's end
            engine.submit([sqe(OP_NOP)], None, lambda _r: start_all())
        await asyncio.wait({all_done}, timeout=5)
        assert sorted(got) == [0, 1, 2, 3], f"pages after the released view never got a checksum: {got}"
        assert isinstance(got[1], ValueError)
        assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]]
        assert not TURNS.waking and not TURNS.after_wake
    finally:
        checksums.close_nowait()
        if engine is not None:
            await engine.aclose()
        for view in views:
            view.release()
        whole.release()
        data.close()
