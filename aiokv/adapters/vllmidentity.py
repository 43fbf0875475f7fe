"""vLLM 0.33: what a chunk's bytes mean, for the page identity of :class:`~aiokv.adapters.vllm.AiokvTier`.

vLLM hands a secondary tier its normalized ``OffloadingConfig`` (``offloading_spec.config``), which
names the model path, the KV dtype, the geometry and the parallel layout. What else decides the
KV a chunk holds for the same model path and geometry lives only in the engine's ``VllmConfig``:
the checkpoint revision, ``hf_overrides`` (RoPE and the like), online weight quantization... vLLM
does not pass it to tiers, and none of its scheduler-side code runs under
``set_current_vllm_config``: the connector (``OffloadingConnector.__init__``) builds the spec, and
its ``OffloadingConnectorScheduler.__init__`` calls ``spec.get_manager()``, which builds the tiers,
with the ``VllmConfig`` a local of both frames. :func:`engine_config` takes it from there (or from
``get_current_vllm_config_or_none()`` should a vLLM set it), only where its engine id and model
match the spec's.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from vllm.config import VllmConfig, get_current_vllm_config_or_none

log = logging.getLogger(__name__)

CALLER_FRAMES = 16
"""How many caller frames :func:`engine_config` looks through (vLLM 0.33 builds the tier 3 below the
connector scheduler's ``__init__``)."""

_UNQUANTIZED_KV = ("auto", "float16", "bfloat16", "half", "float", "float32")
"""KV cache dtypes that store the model's own dtype (vLLM requires an explicit one to match it)."""


def spec_facts(offloading_spec: Any, chunk_bytes: int, vllm_config: VllmConfig | None = None) -> dict[str, object]:
    """What decides the meaning of a chunk's bytes: vLLM's normalized ``OffloadingConfig``, plus
    :func:`model_facts` of the engine's ``vllm_config`` where it was found."""
    config = offloading_spec.config
    model, cache, parallel = config.model, config.cache, config.parallel
    facts: dict[str, object] = {
        "model": model.name,
        "dtype": model.dtype,
        "chunk_bytes": chunk_bytes,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "groups": tuple(
            (g.group_id, g.tokens_per_block, g.sliding_window_size_in_chunks, tuple(g.layer_names))
            for g in config.groups
        ),
        "tokens_per_hash": cache.tokens_per_hash,
        "blocks_per_chunk": cache.blocks_per_chunk,
        "parallel": (parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size,
                     parallel.dcp_size, parallel.is_parallelism_agnostic),
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
    }
    if parallel.data_parallel_size > 1:
        # Each DP replica is an engine of its own with a tier of its own: one directory each (in a
        # shared one the first to start held the lock and the others ran read-only, their index
        # frozen at start: they stored nothing and never saw the first one's new pages).
        facts["data_parallel_index"] = parallel.data_parallel_index
    if vllm_config is not None:
        facts.update(model_facts(vllm_config, cp=parallel.dcp_size > 1 or parallel.pcp_size > 1))
    return facts


def model_facts(vllm_config: VllmConfig, cp: bool = False) -> dict[str, object]:
    """What changes the KV of one model path and geometry, from the engine's ``VllmConfig``, by
    fact name, each only where it differs from vLLM's default (a run setting none of them keeps
    the identity it had). ``cp``: context parallelism is on (DCP or PCP > 1).

    - ``revision``: the checkpoint revision loaded; for a Hub model the commit vLLM resolved it to
      (``ResolvedRevision.resolved``: a branch moved to other weights is another model);
      ``code_revision`` (remote model code); ``model_weights`` (the weights' URI when ``model`` is
      the local copy); ``hf_config`` (another config's path, and its revision).
    - ``hf_overrides``: HF config overrides (RoPE scaling, ``rope_theta``... rotate every stored K).
    - ``quantization``: online weight quantization of an unquantized checkpoint (K/V come from the
      quantized projections; a checkpoint's own quantization is its path's), and
      ``quantization_config`` (its arguments).
    - ``load_format``: ``dummy`` (random weights, benchmarks).
    - ``kv_skip_layers`` (layers kept out of KV quantization, padded to the same page size),
      ``mamba_dtypes`` (conv / SSM state dtypes of a model with Mamba-like state), and
      ``model_dtype`` where the KV dtype is not the model's but skipped layers or such states at
      ``auto`` are stored in it.
    - ``cp_interleave``: tokens per context-parallel rank in turn (which tokens a rank's bytes hold).
    - ``draft``: a speculative draft model of its own (EAGLE...; its layers' KV is in the chunks)
      and its revision; ``draft_kv_dtype``.
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    facts: dict[str, object] = {}
    revision = _revision(model.revision)
    if revision is not None:
        facts["revision"] = revision
    if model.code_revision:
        facts["code_revision"] = str(model.code_revision)
    if model.model_weights:
        facts["model_weights"] = model.model_weights
    if model.hf_config_path and model.hf_config_path != model.model:
        facts["hf_config"] = (model.hf_config_path, _revision(getattr(model, "_hf_config_revision", None)))
    if model.hf_overrides:
        facts["hf_overrides"] = _canonical(model.hf_overrides)
    if model.quantization is not None and _declared_quantization(model) is None:
        facts["quantization"] = str(model.quantization)
    if model.quantization_config is not None:
        facts["quantization_config"] = _canonical(model.quantization_config)
    if str(vllm_config.load_config.load_format) == "dummy":
        facts["load_format"] = "dummy"
    # With KV quantized (fp8, nvfp4...), the KV dtype fact is not the model dtype, which still
    # decides the bytes of layers skipped from quantization and of Mamba states at "auto".
    quantized_kv = str(cache.cache_dtype) not in _UNQUANTIZED_KV
    skipped = list(cache.kv_cache_dtype_skip_layers) if quantized_kv else []
    if skipped:
        # A set to vLLM (membership tests only): order and repeats of the list change no byte.
        facts["kv_skip_layers"] = tuple(sorted({str(s) for s in skipped}))
    mamba = (str(cache.mamba_cache_dtype), str(cache.mamba_ssm_cache_dtype)) if _has_state(model) else None
    if mamba is not None and mamba != ("auto", "auto"):
        facts["mamba_dtypes"] = mamba
    if quantized_kv and (skipped or (mamba is not None and mamba[0] == "auto")):
        facts["model_dtype"] = str(model.dtype).removeprefix("torch.")
    interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
    if cp and interleave != 1:
        facts["cp_interleave"] = interleave
    speculative = vllm_config.speculative_config
    draft = getattr(speculative, "draft_model_config", None)
    if draft is not None and (draft.model, _revision(draft.revision)) != (model.model, revision):
        facts["draft"] = (draft.model, _revision(draft.revision))
    if getattr(speculative, "kv_cache_dtype", None) is not None:
        facts["draft_kv_dtype"] = str(speculative.kv_cache_dtype)
    return facts


def engine_config(offloading_spec: Any) -> VllmConfig | None:
    """The ``VllmConfig`` of the engine whose connector built ``offloading_spec``: the current one
    (``set_current_vllm_config``) or one in vLLM's frames among the callers (vLLM 0.33: the
    connector scheduler's), where its engine id and model are the spec's. None when there is none (a spec
    built outside vLLM's connector: tests, tools, another engine's set-up)."""
    config = offloading_spec.config

    def ours(candidate: object) -> bool:
        if not isinstance(candidate, VllmConfig):
            return False
        transfer, model = candidate.kv_transfer_config, candidate.model_config
        return (transfer is not None and model is not None and transfer.engine_id == config.engine_id
                and model.model == config.model.name)

    current = get_current_vllm_config_or_none()
    if ours(current):
        return current
    frame: FrameType | None = sys._getframe(1)
    try:
        for _ in range(CALLER_FRAMES):
            if frame is None:
                break
            # Only vLLM's own frames are read: before Python 3.13 reading ``f_locals`` leaves a
            # snapshot on the frame that keeps every local it saw alive until the frame returns,
            # even one its code deletes or rebinds meanwhile (a caller's model or buffers, when a
            # tier is built outside vLLM's connector and the walk reaches the caller's frames).
            if frame.f_globals.get("__name__", "").startswith("vllm."):
                for value in frame.f_locals.values():
                    if ours(value):
                        found: VllmConfig = value
                        return found
            frame = frame.f_back
    finally:
        del frame  # a frame kept here would keep every caller's locals alive
    return None


def _revision(revision: object) -> str | None:
    """The revision as loaded: a Hub ``ResolvedRevision`` (whose string is the branch asked for,
    ``main`` when none was) by its commit, any other by its string; None when not given."""
    if revision is None:
        return None
    resolved = getattr(revision, "resolved", None)
    return str(resolved) if resolved else str(revision)


def _declared_quantization(model: Any) -> object:
    """The checkpoint's own quantization config as vLLM read it (None: an unquantized checkpoint)."""
    return getattr(getattr(model, "model_arch_config", None), "quantization_config", None)


def _has_state(model: Any) -> bool:
    """Whether the model keeps Mamba-like state (its dtypes then decide bytes of the chunks)."""
    try:
        return bool(model.has_inner_state or model.is_hybrid)
    except Exception:  # a model vLLM cannot classify: count it stateful (names more, never less)
        return True


def _canonical(value: object) -> str:
    """A stable text of a configuration value (sorted keys; a callable by its qualified name, never
    by a ``repr`` that carries an address: that would change the identity at every start)."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text
