"""Adversarial (review 276): ``close_timeout=0`` for aiokv's vLLM tier was accepted, and then every
``shutdown()`` raised ``RuntimeError`` ("transfers of vLLM's region are still in flight after
close_timeout (0.0 s)") on an idle tier: it waits that long for its loop thread to confirm nothing is
in flight, which it cannot in no time. The tier never closed (its thread and directory lock kept,
vLLM's region held). Now refused when the tier is made, before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

from vllm_helpers import CHUNK_BYTES, CPU_CHUNKS, bare_tier, offloading_spec, tier_threads

from aiokv.adapters.vllm import AiokvTier


def test_a_close_timeout_of_zero_is_refused_before_the_tier_starts(tmp_path: Path) -> None:
    spec = offloading_spec(tmp_path / "source")
    threads = tier_threads()
    region = memoryview(bytearray(CPU_CHUNKS * CHUNK_BYTES))
    with pytest.raises(ValueError, match="close_timeout must be > 0"):
        AiokvTier(spec, region, "aiokv", disk_dir=str(tmp_path / "disk"), disk_bytes=64 * CHUNK_BYTES, queue_depth=4,
                  close_timeout=0)
    assert not (tmp_path / "disk").exists() and tier_threads() == threads
    # Nothing was left behind: a tier over the same region and directory starts and shuts down.
    tier: Any = bare_tier(spec, region, tmp_path / "disk")
    tier.shutdown()
