"""Review 114: a planted rates file that passed every check made every hit's estimate raise.

The file is ours (0600, regular, this layout and device kind), its disk line's moments at the edge
of what ``decode_rates`` allowed (a mean call of 1e-300 bytes): the disk's marginal rate came out
at 2.8e-304 B/s, a page's read at inf, and ``KVCache.estimate`` and ``start_load`` raised
``ValueError: cannot convert float NaN to integer`` on every disk hit of every restart. Now the
file is refused (``rates_ignored``) and the hit loads bit-exact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv, prompt

from aiokv import KVCache
from aiokv.rates_file import RATES_FILE, RATES_FORMAT, RATES_VERSION

T = LAYOUT.page_tokens
N = 12 * T


def _planted() -> bytes:
    doc = {"format": RATES_FORMAT, "version": RATES_VERSION, "layout": LAYOUT.fingerprint.hex(),
           "device": DEVICE.type, "rates": {
               "disk": {"rate": 1e9, "samples": 100, "moments": [1e-300, 3600.0, 1e-300, 1e5], "fitted": 100},
               "pool": {"rate": 1e10, "samples": 100},
               "prefill": {"rate": 1000.0, "samples": 100}}}
    return json.dumps(doc).encode()


@pytest.mark.asyncio
async def test_a_planted_line_of_no_calls_is_ignored_and_the_hit_loads(tmp_path: Path) -> None:
    tokens = prompt(114, N)
    source = make_kv(1)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, source) as first:
        await first.pool.wait_ready()
        await first.offload(tokens, torch.arange(N))
        await first.flush()
    path = tmp_path / LAYOUT.fingerprint.hex() / RATES_FILE
    path.write_bytes(_planted())
    os.chmod(path, 0o600)
    target = make_kv(2)
    async with KVCache(config(tmp_path, pool_pages=32), LAYOUT, target) as cache:
        await cache.pool.wait_ready()
        match = await cache.match(tokens)
        assert match.disk_pages == N // T
        estimate = cache.estimate(match)  # raised ValueError before the fix
        assert estimate.split_token is None  # nothing known: the planted rates were not taken
        stream = await cache.start_load(match, torch.arange(N))
        result = await stream.finish()
        assert result.loaded_tokens == N
        assert torch.equal(target[:, :N], source[:, :N])
        assert cache.stats().errors["rates_ignored"] == 1
        await assert_quiescent(cache)
