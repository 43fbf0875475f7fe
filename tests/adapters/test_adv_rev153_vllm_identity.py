"""The vLLM tier's page identity: stable across runs of one build, and its search for the engine's
``VllmConfig`` keeps nothing of its callers alive (helper-153).

- ``kv_cache_dtype_skip_layers`` is a set to vLLM (``str(layer) in skip_layers``): a launcher that
  lists the same layers in another order (one built from a Python set: string hashes differ per
  process) or repeats one named another identity, and every restart was cold.
- ``engine_config`` walks the caller frames for the connector scheduler's ``VllmConfig``. Before
  Python 3.13 reading a frame's ``f_locals`` leaves a snapshot on it that keeps every local it saw
  alive until the frame returns: a tier built outside vLLM's connector (no config found) walked up
  into its caller's frames and kept an object the caller deleted afterwards. Only vLLM's frames are
  read now.
"""

from __future__ import annotations

import gc
import types
import weakref
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

import test_adv_rev149_vllm_model_identity as rev149

from aiokv.adapters.vllmidentity import engine_config as find_engine_config
from aiokv.adapters.vllmidentity import model_facts

engine_config = rev149.engine_config
model_dir = rev149.model_dir  # the fixture: a tiny model's directory


@pytest.mark.parametrize("listed", [["1", "0"], ["0", "1", "0"], ["0", "0", "1"]])
def test_skip_layers_in_another_order_or_repeated_keep_the_identity(model_dir: Path, listed: list[str]) -> None:
    fp8 = {"cache_dtype": "fp8"}
    base = model_facts(engine_config(model_dir, cache={**fp8, "kv_cache_dtype_skip_layers": ["0", "1"]}))
    assert base["kv_skip_layers"] == ("0", "1")
    same = engine_config(model_dir, cache={**fp8, "kv_cache_dtype_skip_layers": listed})
    assert model_facts(same) == base
    other = engine_config(model_dir, cache={**fp8, "kv_cache_dtype_skip_layers": ["0"]})
    assert model_facts(other) != base  # other layers skipped: another build still


class _Big:
    """Stands for what a caller holds while it builds a tier (a model, a buffer)."""


def _spec() -> types.SimpleNamespace:
    """An offloading spec as far as ``engine_config`` reads it (built outside vLLM's connector)."""
    config = types.SimpleNamespace(engine_id="rev153", model=types.SimpleNamespace(name="m"))
    return types.SimpleNamespace(config=config)


def _caller_that_deletes_its_local() -> weakref.ref[_Big]:
    big = _Big()
    held = weakref.ref(big)
    assert find_engine_config(_spec()) is None  # no VllmConfig anywhere: the walk goes all the way up
    del big  # the caller is done with it; its frame is still running
    gc.collect()
    assert held() is None, "the walk for the VllmConfig kept a caller's deleted local alive"
    return held


def test_the_walk_keeps_no_callers_local_alive() -> None:
    _caller_that_deletes_its_local()
