"""The adversarial soak (test_tp_adversarial_soak.py) over the layouts where ranks do not all write:
MLA (one latent, rank 0 writes, every rank reads) and replicated heads (tp 4 over 2 KV heads: two
ranks hold each head, one of them writes it). A kill of a reader rank must not fail the offload
it never took part in, and no rank may ever be served another part's bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from adv_helpers import AdvRanks
from test_tp_adversarial_soak import SEED, soak

from aiokv import KVLayout


@pytest.mark.slow(seconds=15)
@pytest.mark.asyncio
async def test_mla_soak(tmp_path: Path, ranks_left: list[AdvRanks]) -> None:
    await soak(tmp_path, KVLayout.mla(2, 16, torch.bfloat16, page_tokens=4), 2, 2, SEED + 1, 1024, ranks_left)


@pytest.mark.slow(seconds=8)
@pytest.mark.asyncio
async def test_replicated_heads_tp4_soak(tmp_path: Path, ranks_left: list[AdvRanks]) -> None:
    await soak(tmp_path, KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4), 4, 2, SEED + 2, 4, ranks_left)
