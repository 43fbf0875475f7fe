"""A layered stream none of whose copies was sent (a rank missing when it started: every copy
fails before it is sent): the live rank's engine waiting on its layers is told False
(``LayeredLoad.unsent``). Before, ``layered_load()`` held no job at all and every layer's
``wait_layer`` answered True at once: an engine trusting it ran attention over slots nothing was
loaded into (helper-143's chaos driver)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_tp_submit_room import LAYOUT, START_S, T, _assert_released, _cache, _tokens
from tp_helpers import RankProcesses

from aiokv.tp import LayeredLoad

REPLY_S = 60.0


@pytest.mark.asyncio
@pytest.mark.parametrize("dead", [1, 0], ids=["thread-runner-lives", "async-worker-lives"])
async def test_a_stream_with_unsent_copies_answers_false_on_the_live_rank(tmp_path: Path, dead: int) -> None:
    live = 1 - dead
    layers = LAYOUT.num_layers
    tokens = _tokens(31000, 3)
    slots = torch.arange(40, 40 + 3 * T)
    async with _cache(tmp_path) as cache:
        ranks = RankProcesses(Path(cache.address), LAYOUT, 2, seed=43, fill=True)
        ranks.start_all()
        try:
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            assert (await cache.offload(tokens, torch.arange(3 * T))).stored == 3
            # Both ranks here: the control, a stream whose copies were all sent.
            sent = cache.start_load(await cache.match(tokens), slots, layered=True)
            await sent.launched()
            load = sent.layered_load()
            assert load.jobs and not load.unsent
            ranks.send(live, ("layers", load, slots))
            assert (await sent.finish()).tokens == 3 * T
            async with asyncio.timeout(REPLY_S):
                answers = await ranks.reply(live)
            assert [ok for ok, _ in answers] == [True] * layers
            # A rank dies; once the group saw it go, a stream's copies cannot be sent.
            ranks.kill(dead)
            await ranks.reap(dead)
            async with asyncio.timeout(REPLY_S):
                while dead in cache.group.attached:
                    await cache.group.wait_change()
            stream = cache.start_load(await cache.match(tokens), slots, layered=True)
            await stream.launched()
            load = stream.layered_load()
            assert load.unsent and load.jobs == ()
            ranks.send(live, ("layers", load, slots))
            async with asyncio.timeout(REPLY_S):
                answers = await ranks.reply(live)
            assert [ok for ok, _ in answers] == [False] * layers, answers
            result = await stream.finish()  # what the engine learns on the scheduler too: nothing loaded
            assert result.loaded_from == result.tokens and result.pool_pages == result.disk_pages == 0, result
        finally:
            await ranks.kill_all()
        _assert_released(cache)


def test_unsent_is_a_bool() -> None:
    assert not LayeredLoad(1, (2,)).unsent and LayeredLoad(1, (), unsent=True).unsent
    with pytest.raises(ValueError, match="unsent must be a bool"):
        LayeredLoad(1, (), unsent=1)  # type: ignore[arg-type]
