"""A rank's worker tells the manager it attached (the ATTACHED frame) only once its session's
executor is in place: an engine thread that announces a stream (``RankWorker.begin_stream``) as
soon as the group reports every rank attached gets its mark recorded.

Regression (a full CPU run under load): the worker wrote ATTACHED inside ``_attach`` and set its
executor after ``_attach`` returned, on its own thread. A worker thread descheduled between the two
(here: held 0.5 s right after the frame is written) answered the engine's announcements STALE, as if
no pool were attached, while the manager already served the group.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, new_pool

from aiokv import KVLayout
from aiokv.tp import RankGroup, RankWorkerThread
from aiokv.tp import worker as worker_module
from aiokv.tp.endpoint import SOCKET_NAME
from aiokv.tp.wire import FrameKind, frame

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
BOUND_S = 30.0


@pytest.mark.asyncio
async def test_an_announcement_right_after_the_group_attached_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attached_frames: set[int] = set()

    def spy_frame(kind: FrameKind, payload: bytes) -> bytes:
        data = frame(kind, payload)
        if kind is FrameKind.ATTACHED:
            attached_frames.add(id(data))
        return data

    original_write = worker_module._WorkerLink.write

    def slow_after_attached(self: worker_module._WorkerLink, data: bytes) -> None:
        original_write(self, data)
        if id(data) in attached_frames:
            time.sleep(0.5)  # the worker's thread descheduled right after the frame went out

    monkeypatch.setattr(worker_module, "frame", spy_frame)
    monkeypatch.setattr(worker_module._WorkerLink, "write", slow_after_attached)
    pool = await new_pool(LAYOUT, 8)
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    try:
        with RankWorkerThread(tmp_path / SOCKET_NAME, 0, 1, LAYOUT, kv, CONFIG) as thread:
            async with RankGroup(LAYOUT, 1, pool.name, pool.num_pages, CONFIG, tmp_path) as group:
                async with asyncio.timeout(BOUND_S):
                    await group.wait_attached()
                stream = group.begin_stream()
                recorded = await asyncio.to_thread(thread.begin_stream, stream + 1, group.epoch)
                stats = await asyncio.to_thread(thread.statistics)
                assert attached_frames, "the worker never wrote ATTACHED through the spied frame()"
                assert recorded, stats
                assert stats.stream_marks_announced == 1 and stats.stream_announces_ignored == 0, stats
    finally:
        await pool.aclose()
