"""Settings and keys refused at the edge with an error naming them (helper-158's report, 27th session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiokv import CacheConfig, KVCache, KVLayout
from aiokv.storage import DiskConfig

LAYOUT = KVLayout.mha(2, 2, 16, torch.bfloat16, page_tokens=4)


def test_a_disk_directory_with_a_nul_character_is_refused_by_its_setting(tmp_path: Path) -> None:
    # Accepted before: the start failed with "embedded null byte", naming no setting.
    for bad in (str(tmp_path / "a\x00b"), tmp_path / "x\x00"):
        with pytest.raises(ValueError, match=r"DiskConfig\.directory must not contain a NUL"):
            DiskConfig(directory=bad)  # type: ignore[arg-type]  # a str: what a user passes
        with pytest.raises(ValueError, match=r"disk_dir must not contain a NUL"):
            CacheConfig(cpu_bytes=1 << 20, disk_dir=bad)
    assert DiskConfig(directory=tmp_path / "fine").directory == tmp_path / "fine"


def test_a_follow_interval_is_off_or_at_least_a_millisecond(tmp_path: Path) -> None:
    # 1e-300 was accepted: the follow thread would list the directory without pause.
    for bad in (1e-300, 5e-324, 0.0009):
        with pytest.raises(ValueError, match=r"DiskConfig\.follow_interval_s must be 0 \(off\) or at least"):
            DiskConfig(directory=tmp_path, follow_interval_s=bad)
    for good in (0, 0.0, 0.001, 0.005):
        assert DiskConfig(directory=tmp_path, follow_interval_s=good).follow_interval_s == good


@pytest.mark.asyncio
async def test_every_key_derivation_refuses_a_bad_salt_by_name() -> None:
    # The manager's keys() (TPCache.offload's path, which has no edge check of its own) looked the
    # salt up in its seed cache first: "unhashable type: 'bytearray'", naming no argument.
    kv = torch.zeros(LAYOUT.num_layers, 64, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    config = CacheConfig(cpu_bytes=16 * LAYOUT.page_bytes, disk_dir=None, namespace="salt-edge")
    async with KVCache(config, LAYOUT, kv) as cache:
        for bad in (bytearray(b"s"), ["s"], {"s": 1}, 3, 1.5):
            with pytest.raises(TypeError, match="salt must be str, bytes or None"):
                cache.manager.keys(list(range(8)), bad)  # type: ignore[arg-type]
        assert cache.manager.keys(list(range(8)), "s") == cache.manager.keys(list(range(8)), "s")
        assert cache.manager.keys(list(range(8)), "s") != cache.manager.keys(list(range(8)), None)
