"""A layered job held for room and then withdrawn unsent: the ranks' engines waiting on its layers
(its id was already in the stream's ``layered_load()``) are told (a WITHDRAWN frame) and their
waits end False, instead of lasting until a later job arrives — or forever on an idle group (the
rank's engine here bounds each layer's wait at 120 s; before, every layer ran into it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_tp_submit_room import LAYOUT, START_S, T, _assert_released, _cache, _tokens
from tp_helpers import RankProcesses

REPLY_S = 30.0
"""Bound on the ranks' answers for the withdrawn job's layers (each would wait 120 s if never told)."""


@pytest.mark.asyncio
async def test_waits_for_a_withdrawn_layered_job_end_false(tmp_path: Path) -> None:
    layers = LAYOUT.num_layers
    tokens = _tokens(23000, 3)
    source = torch.arange(3 * T)
    slots_a, slots_b = torch.arange(20, 20 + 3 * T), torch.arange(50, 50 + 3 * T)
    async with _cache(tmp_path, max_jobs=1) as cache:
        ranks = RankProcesses(Path(cache.address), LAYOUT, 2, seed=35, fill=True, gated=True)
        ranks.start_all()
        try:
            async with asyncio.timeout(START_S):
                await cache.wait_ranks()
            assert (await cache.offload(tokens, source)).stored == 3
            # A's layered copy holds the one job of room (its layers gated on both ranks); B's waits.
            stream_a = cache.start_load(await cache.match(tokens), slots_a, layered=True)
            await stream_a.launched()
            stream_b = cache.start_load(await cache.match(tokens), slots_b, layered=True)
            await stream_b.launched()
            load_b = stream_b.layered_load()
            assert len(load_b.jobs) == 1 and cache.group_statistics().waiting == 1
            for rank in range(2):  # each rank's engine waits for B's layers
                ranks.send(rank, ("layers", load_b, slots_b))
            await stream_b.aclose()  # B withdrawn while held: never sent
            assert cache.group_statistics().jobs.withdrawn == 1
            for gate in ranks.gates.values():
                for _ in range(layers):
                    gate.release()
            assert (await stream_a.finish()).tokens == 3 * T
            for rank in range(2):
                async with asyncio.timeout(REPLY_S):
                    answers = await ranks.reply(rank)
                assert [ok for ok, _ in answers] == [False] * layers, f"rank {rank}: {answers}"
            # The link still works: a later layered load lands on both ranks.
            stream_c = cache.start_load(await cache.match(tokens), slots_b, layered=True)
            for gate in ranks.gates.values():
                for _ in range(layers):
                    gate.release()
            assert (await stream_c.finish()).tokens == 3 * T
        finally:
            for gate in ranks.gates.values():
                for _ in range(4 * layers):
                    gate.release()
            await ranks.kill_all()
        _assert_released(cache)
