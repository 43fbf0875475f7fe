"""An offload captures its token ids when called: an engine that rewrites its token buffer while
the call waits (a CUDA read-back of the slots, the kernels' warm-up) stores nothing under the
rewritten prompt's keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from cache_helpers import LAYOUT, SLOTS, config, make_kv, prompt
from loop_probes import until, waiting_in

from aiokv import KVCache

T = LAYOUT.page_tokens
N = 4 * T


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["numpy", "tensor"])
async def test_tokens_rewritten_while_an_offload_waits_are_not_its_keys(tmp_path: Path, kind: str) -> None:
    kv = make_kv(3)
    first = np.array(prompt(11, N), dtype=np.int64)
    second = np.array(prompt(12, N), dtype=np.int64)
    buffer = first.copy()
    tokens: np.ndarray | torch.Tensor = buffer if kind == "numpy" else torch.from_numpy(buffer)
    async with KVCache(config(None), LAYOUT, kv) as cache:
        # The warm-up still running: the offload waits for it (an await the engine's loop goes on
        # through) after it validated its arguments.
        warm: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cache._warm_ready = warm  # type: ignore[assignment]
        offload = asyncio.ensure_future(cache.offload(tokens, torch.arange(N)))
        await until(lambda: waiting_in(offload, "_kernels_ready"))
        buffer[:] = second  # the engine's next step reuses its token buffer
        warm.set_result(None)
        async with asyncio.timeout(30):
            result = await offload
        assert result.stored == N // T, result
        wrong = await cache.match(second.tolist())
        assert wrong.tokens == 0, "KV of one prompt stored under another prompt's keys"
        wrong.release()
        hit = await cache.match(first.tolist())
        assert hit.tokens == N, hit
        target = torch.arange(SLOTS - N, SLOTS)
        kv[:, target] = 0
        assert (await cache.load(hit, target)).tokens == N
        assert torch.equal(kv[:, target], kv[:, :N])
