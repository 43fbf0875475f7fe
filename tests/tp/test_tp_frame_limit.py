"""``TPConfig.max_frame_bytes`` and the frames the link must carry.

Regression (adversarial repro): ``TPConfig(max_frame_bytes=16)`` was accepted (only "positive" was
checked); the link's first frame (the worker's hello) never fit, so every connection ended in a
protocol error and the workers reconnected forever (``wait_ranks()`` never returned, no call
raised). Now ``TPConfig`` refuses a limit below the protocol's longest control frame
(``wire.CONTROL_FRAME_BYTES``: a WELCOME naming its pool), and a spec longer than the limit is
refused before it is sent (sent, the ranks' parsers would end the link at it). Real spawned ranks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from tp_helpers import CONFIG, SLOTS, RankProcesses, new_pool

from aiokv import KVLayout
from aiokv.tp import Direction, RankGroup, TPConfig
from aiokv.tp.transfers import GroupTransfers
from aiokv.tp.wire import CONTROL_FRAME_BYTES

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)
T = LAYOUT.page_tokens
START_S = 120.0


def test_a_frame_limit_below_the_control_frames_is_refused() -> None:
    # Old code: accepted; every connection then ended at its first frame, and workers reconnected forever.
    for value in (16, CONTROL_FRAME_BYTES - 1):
        with pytest.raises(ValueError, match=f"max_frame_bytes must be at least {CONTROL_FRAME_BYTES}"):
            TPConfig(max_frame_bytes=value)
    assert TPConfig(max_frame_bytes=CONTROL_FRAME_BYTES).max_frame_bytes == CONTROL_FRAME_BYTES


@pytest.mark.asyncio
async def test_the_smallest_frame_limit_serves_and_refuses_longer_specs(tmp_path: Path) -> None:
    # At the bound the link works; a spec that would not fit a frame is refused before it is sent
    # (sent, the ranks' parsers would have ended the link at it).
    config = dataclasses.replace(CONFIG, max_frame_bytes=CONTROL_FRAME_BYTES)
    pool = await new_pool(LAYOUT.for_tp(2), 64)
    group = RankGroup(LAYOUT, 2, pool.name, pool.num_pages, config, tmp_path / "g")
    await group.start()
    ranks = RankProcesses(group.address, LAYOUT, 2, seed=44, fill=True, config=config)
    try:
        ranks.start_all()
        async with asyncio.timeout(START_S):
            await group.wait_attached()
        assert (await group.submit_nowait(group.spec(Direction.OFFLOAD, [0], range(T)))).ok
        long = group.spec(Direction.OFFLOAD, range(64), [s % SLOTS for s in range(64 * T)])
        assert long.encoded_bytes + 1 > CONTROL_FRAME_BYTES
        with pytest.raises(ValueError, match="does not fit a frame"):
            group.submit_nowait(long)
        copy = GroupTransfers(group).offload(torch.arange(64 * T) % SLOTS, list(range(64)))
        with pytest.raises(ValueError, match="does not fit a frame"):
            await copy.future
        assert [(await ranks.ask(r, "stats")).specs for r in range(2)] == [1, 1]
        stats = group.statistics()
        assert stats.link_errors == 0 and stats.attached == {0, 1}
    finally:
        await group.aclose()
        await ranks.kill_all()
        await pool.aclose()
