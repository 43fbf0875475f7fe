"""The vLLM tier's page identity names the model build, not only its path (helper-149).

vLLM's normalized ``OffloadingConfig`` names the model path and the KV dtype. An engine restarted
over the same ``disk_dir`` with another revision of that path, a RoPE override, online weight
quantization, dummy weights or other KV-quantization skip layers (same geometry) had the same
identity and served the old KV as its own: wrong KV with valid checksums. The tier now reads these
from the engine's ``VllmConfig``, which vLLM 0.33 does not hand to tiers and does not set as the
current config where the scheduler builds them: it is found in the connector scheduler's frame.

Built as vLLM builds it: a real ``VllmConfig`` (a tiny model class registered with vLLM's
``ModelRegistry``; vLLM inspects its interfaces, never runs it), a ``KVCacheConfig``, and vLLM's
``OffloadingConnector`` in the scheduler role, whose ``OffloadingConnectorScheduler`` builds the
``TieringOffloadingSpec`` manager and the aiokv tier.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec",
                    reason="vLLM is not installed (make test installs requirements-engines.txt)")

import torch
from huggingface_hub import ResolvedRevision
from vllm import ModelRegistry
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    VllmConfig,
    get_current_vllm_config_or_none,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm_helpers import CHUNK_BYTES, keys_of, load, lookup_all, make_manager, on_disk, payload, store, tier_of

import aiokv.adapters.vllm as aiokv_vllm
from aiokv.adapters.vllmidentity import model_facts

ARCH = "AiokvRev149ForCausalLM"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCKS = 8


class _Model(torch.nn.Module):
    """What vLLM's registry inspects of a generative model class (never built here)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: Any = None) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


ModelRegistry.register_model(ARCH, _Model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({
        "architectures": [ARCH], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 2,
        "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "rope_theta": 10000.0}))
    return path


@contextlib.contextmanager
def _einops_placeholder() -> Iterator[None]:
    """vLLM's quantization modules import einops (a vLLM dependency the engines' --no-deps install
    leaves out) at module level; building a config only imports them. A placeholder stands in
    while the config is made, if einops is absent."""
    if importlib.util.find_spec("einops") is not None:
        yield
        return
    sys.modules["einops"] = types.ModuleType("einops")
    try:
        yield
    finally:
        sys.modules.pop("einops", None)


def engine_config(model_dir: Path, model: dict[str, Any] | None = None, cache: dict[str, Any] | None = None,
                  load_format: str = "auto") -> VllmConfig:
    """The VllmConfig of `vllm serve <model_dir>` with the given ModelConfig / CacheConfig options."""
    with _einops_placeholder():
        model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", **(model or {}))
        return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=16, **(cache or {})),
                          kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both"),
                          device_config=DeviceConfig(device="cpu"), load_config=LoadConfig(load_format=load_format))


def start(disk_dir: Path, vllm_config: VllmConfig, managers: list[Any]) -> TieringOffloadingManager:
    """vLLM's scheduler-side connector over `disk_dir`, as the engine core builds it; its manager."""
    vllm_config.kv_transfer_config.kv_connector_extra_config.update({
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * CHUNK_BYTES,
        "secondary_tiers": [{"type": "AiokvTier", "module_path": "aiokv.adapters.vllm", "disk_dir": str(disk_dir),
                             "disk_bytes": 64 * CHUNK_BYTES, "namespace": "tests", "queue_depth": 4}]})
    fp8 = str(vllm_config.cache_config.cache_dtype).startswith("fp8")
    # One chunk = one block of both layers, CHUNK_BYTES whatever the KV dtype (fp8: twice the heads).
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4 if fp8 else 2, head_size=256,
                             dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    page = spec.page_size_bytes
    assert page * len(LAYERS) == CHUNK_BYTES
    kv_cache_config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=BLOCKS * page * len(LAYERS), layers=LAYERS,
                                        layer_stride=BLOCKS * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)])
    connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    manager = connector.scheduler.manager
    assert isinstance(manager, TieringOffloadingManager)
    managers.append(manager)
    return manager


def stop(manager: TieringOffloadingManager, managers: list[Any]) -> None:
    managers.remove(manager)
    manager.shutdown()


# Each: (what, base run's options, the restarted run's options). One model path, one geometry.
BUILDS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("another revision", {}, {"model": {"revision": "v2"}}),
    ("the Hub branch moved to another commit", {"hub": "a"}, {"hub": "b"}),
    ("another model code revision", {}, {"model": {"code_revision": "c2"}}),
    ("a RoPE override", {}, {"model": {"hf_overrides": {"rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}}}),
    ("online fp8 weight quantization", {}, {"model": {"quantization": "fp8_per_tensor"}}),
    ("dummy weights", {}, {"load_format": "dummy"}),
    ("layer 0 kept out of fp8 KV quantization", {"cache": {"cache_dtype": "fp8"}},
     {"cache": {"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["0"]}}),
]


def _config(model_dir: Path, options: dict[str, Any]) -> VllmConfig:
    options = dict(options)
    hub = options.pop("hub", None)
    config = engine_config(model_dir, **options)
    if hub is not None:
        # What vLLM's ModelConfig holds for a Hub model (resolve_revision; a local directory, as
        # here, is not resolved): a str that reads "main", carrying the commit it resolved to.
        config.model_config.revision = ResolvedRevision(hub * 40)
        assert config.model_config.revision == "main"
    return config


@pytest.mark.parametrize(("what", "base", "changed"), BUILDS, ids=[b[0] for b in BUILDS])
def test_another_model_build_finds_none_of_the_old_pages(
        tmp_path: Path, model_dir: Path, managers: list[Any], what: str, base: dict[str, Any],
        changed: dict[str, Any]) -> None:
    keys = keys_of("prompt", 2)
    first = start(tmp_path, _config(model_dir, base), managers)
    store(first, "r1", keys, [1, 2])
    assert on_disk(first, keys) == [True, True]
    stop(first, managers)

    other = start(tmp_path, _config(model_dir, changed), managers)
    assert on_disk(other, keys) == [False, False], f"{what}: the old build's pages were served"
    ctx = ReqContext(req_id="r2")
    with other.lock:
        other.on_new_request(ctx)
    assert lookup_all(other, keys, ctx) == [LookupResult.MISS] * 2
    with other.lock:
        other.on_request_finished(ctx)
    stop(other, managers)

    again = start(tmp_path, _config(model_dir, base), managers)  # the first build again: its pages
    ctx = ReqContext(req_id="r3")
    with again.lock:
        again.on_new_request(ctx)
    assert lookup_all(again, keys, ctx) == [LookupResult.HIT] * 2
    assert load(again, keys, ctx) == [payload(1), payload(2)]
    with again.lock:
        again.on_request_finished(ctx)


def test_the_tier_reads_the_engines_config_in_vllms_call_path(
        tmp_path: Path, model_dir: Path, managers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 sets no current config where the scheduler builds tiers; the tier finds the
    connector's own VllmConfig (this engine's id and model), not another engine's."""
    seen: list[tuple[object, object]] = []
    real = aiokv_vllm.engine_config

    def spy(offloading_spec: Any) -> VllmConfig | None:
        found = real(offloading_spec)
        seen.append((get_current_vllm_config_or_none(), found))
        return found

    monkeypatch.setattr(aiokv_vllm, "engine_config", spy)
    decoy = engine_config(model_dir, model={"revision": "decoy"})  # another engine's config, in this frame
    config = engine_config(model_dir, model={"revision": "v2"})
    start(tmp_path, config, managers)
    assert decoy.kv_transfer_config.engine_id != config.kv_transfer_config.engine_id
    assert seen == [(None, config)]


@pytest.mark.parametrize("options", [
    {"model": {"seed": 7}},
    {"model": {"served_model_name": "alias"}},
    {"model": {"max_model_len": 512}},
    {"model": {"tokenizer": "TOKENIZER", "tokenizer_revision": "t2"}},
    {"model": {"enforce_eager": True}},
    {"cache": {"mamba_ssm_cache_dtype": "float32"}},  # no Mamba state in this model
    {"cache": {"kv_cache_dtype_skip_layers": ["0"]}},  # nothing to skip: the KV is not quantized
    {"cache": {"prefix_caching_hash_algo": "sha256_cbor"}},  # changes vLLM's keys, not the bytes
], ids=lambda o: next(iter(next(iter(o.values())))))
def test_what_does_not_change_the_kv_adds_nothing(model_dir: Path, options: dict[str, Any]) -> None:
    """Nothing is named for these (a plain run's identity is the one it had before helper-149):
    keys are token ids, so the tokenizer does not decide the KV of a key."""
    model = {k: (str(model_dir.parent) if v == "TOKENIZER" else v) for k, v in options.get("model", {}).items()}
    assert model_facts(engine_config(model_dir)) == {}
    assert model_facts(engine_config(model_dir, **{**options, "model": model})) == {}


def test_a_checkpoints_own_quantization_adds_nothing(model_dir: Path, tmp_path: Path) -> None:
    """A quantized checkpoint's method is its path's (vLLM reads it from its config.json); only
    online quantization of an unquantized checkpoint is named."""
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    quantized = engine_config(tmp_path)
    assert quantized.model_config.quantization == "fp8"
    assert model_facts(quantized) == {}


def test_a_tier_built_without_the_engines_config_says_so(tmp_path: Path, managers: list[Any],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aiokv.adapters.vllm"):
        manager = make_manager(tmp_path)  # OffloadingSpecFactory straight from an OffloadingConfig
    managers.append(manager)
    assert "VllmConfig was not found" in caplog.text
    assert tier_of(manager).statistics()["read_only"] is None
