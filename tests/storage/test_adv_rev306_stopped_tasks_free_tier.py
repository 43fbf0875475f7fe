"""Review 306: the close cancels the tier's own background tasks — the looks of a follower
(``_follow``), the lock checks of the writer (``_watch``) — and waited for them without
retrieving their end. CPython 3.11 keeps a cancelled task's ``CancelledError`` until then, and its traceback's frames
held the tier: a closed tier was kept by its own stopped tasks' frames (until a collection), not
only by whoever still referenced it. Now each such task lets go of its error as it ends (a done
callback): after the close no frame holds the tier, and once dropped one collection frees it.
(``_wait_writable`` drops its own task as it ends: nothing kept it.)

Real: a writer and a follower over one directory (every backend), their tasks cut by the close."""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import types
import weakref
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config
from loop_probes import until_thread, waiting_in

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly


def _frames_holding(obj: object) -> list[str]:
    """The frames that refer to ``obj``, the caller's own left out."""
    caller = sys._getframe(1)
    return [frame.f_code.co_qualname for frame in gc.get_referrers(obj)
            if isinstance(frame, types.FrameType) and frame is not caller]


def _all_waiting(tasks: tuple[asyncio.Task[None], ...]) -> bool:
    return all(waiting_in(task, "wait") for task in tasks)


@pytest.mark.asyncio
async def test_a_closed_writer_and_follower_are_held_by_no_frame_of_their_stopped_tasks(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)  # looks and checks wait
    writer = DiskTier(cfg, layout, pool)
    follower = DiskTier(cfg, layout, pool)
    try:
        await writer.start()
        await follower.start()
        assert writer.read_only is None and writer._watch_task is not None
        assert follower.read_only is ReadOnly.LOCKED and follower._follow_task is not None
        # Each between two looks or checks (the first look ran): the close's cancel ends it there.
        tasks = (writer._watch_task, follower._follow_task)
        await until_thread(functools.partial(_all_waiting, tasks), "both tasks waiting")
    finally:
        await follower.aclose()
        await writer.aclose()
    assert all(task.cancelled() for task in tasks)
    # Still referenced here (as an engine keeps a closed tier): before, each was held by the frame
    # of its task's coroutine ('FollowPath._watch', 'FollowPath._follow') as well.
    assert _frames_holding(writer) == []
    assert _frames_holding(follower) == []
    refs = [weakref.ref(writer), weakref.ref(follower)]
    del writer, follower
    gc.collect()
    # (Their tasks still referenced here: they hold nothing of the tiers now.)
    assert [ref() for ref in refs] == [None, None], "a closed tier outlived one collection"
    assert_clean(pool)
