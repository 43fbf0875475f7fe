"""The slots a call validated are the slots it uses: the caller may reuse its index tensor as soon
as the call returned (an engine's persistent slot-mapping buffer), before a streaming load launched."""

from __future__ import annotations

import pytest
import torch
from cache_helpers import LAYOUT, SLOTS, config, make_kv, prompt

from aiokv import KVCache
from aiokv.slots import check_host_slots


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("change", ["move", "duplicate", "out-of-range"])
async def test_start_load_copies_the_slots_it_validated(dtype: torch.dtype, change: str) -> None:
    src = make_kv(0)
    kv = src.clone()
    tokens = prompt(1, 4 * LAYOUT.page_tokens)
    n = len(tokens)
    async with KVCache(config(None, pool_pages=16), LAYOUT, kv) as cache:
        assert (await cache.offload(tokens, torch.arange(n))).stored == 4
        kv[:, 100:].zero_()
        slots = torch.arange(100, 100 + n, dtype=dtype)
        stream = await cache.start_load(await cache.match(tokens), slots)
        # Before: an int64 CPU tensor was kept as is, and the loader launched from whatever it held.
        if change == "move":
            slots[:] = torch.arange(200, 200 + n, dtype=dtype)
        elif change == "duplicate":
            slots[:] = 150
        else:
            slots[0] = SLOTS + 5
        result = await stream.finish()
        assert result.loaded_from == 0 and result.tokens == n  # the whole prefix loaded
        assert torch.equal(kv[:, 100 : 100 + n], src[:, :n]), "the validated slots did not get the prefix"
        assert not kv[:, 100 + n :].any(), "the load wrote slots it never validated"
        assert not any(cache.stats().errors.values())


def test_host_slots_are_a_copy_of_the_callers() -> None:
    slots = torch.arange(8, dtype=torch.int64)
    checked = check_host_slots(slots, 8, 16)
    slots[:] = 99
    assert checked.tolist() == list(range(8))
