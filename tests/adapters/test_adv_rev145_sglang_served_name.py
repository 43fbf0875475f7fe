"""Another model served under the same name never gets the first one's pages (helper-145).

SGLang's storage config names the model by ``--served-model-name`` (``get_serving()
.served_model_name``; the model path only when no alias is given). An operator who keeps one alias
(say ``assistant``) and moves it to another checkpoint of the same architecture (a fine-tune, a new
revision) restarted over the same ``disk_dir`` with the same page identity: the new model read the
old one's KV as its own (same geometry, verified checksums). Now the identity also names the model
path SGLang loads (where it differs from the served name) and its revision (where one is given).
Likewise the model-config overrides (``--json-model-override-args``: RoPE scaling changes every
stored K) and the fp8 KV scales file (``--quantization-param-path``), where given.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import sglang.srt.runtime_context as runtime_context
import sglang_helpers as sh


def serving(monkeypatch: pytest.MonkeyPatch, model_path: str, revision: str | None = None,
            overrides: str = "{}", kv_scales: str | None = None) -> None:
    """SGLang's scheduler process loading ``model_path`` (its resolved model bag): ``overrides`` is
    ``--json-model-override-args``, ``kv_scales`` ``--quantization-param-path``."""
    bag = SimpleNamespace(model_path=model_path, revision=revision, kv_cache_dtype="auto",
                          json_model_override_args=overrides, quantization_param_path=kv_scales)
    monkeypatch.setattr(runtime_context, "get_model", lambda: bag)


def run(backends: list[Any], disk_dir: Path, seed: int | None = None) -> Any:
    """A backend of a server started as ``--served-model-name assistant``; ``seed``: store a page."""
    pool = sh.host_pool(2)
    backend = sh.attach(backends, disk_dir, pool, True, model="assistant")
    backend.on_host_pools_registered()
    if seed is not None:
        sh.fill(pool, 0, seed=seed)
        assert backend.batch_set_v1(["page"], sh.indices([0])) == [True]
    return backend


def test_a_served_name_moved_to_another_model_finds_none_of_the_old_pages(
        tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    serving(monkeypatch, "/models/llama-3.1-8b-instruct")
    run(backends, tmp_path, seed=1).close()

    serving(monkeypatch, "/models/llama-3.1-8b-finetune")  # same alias, same geometry
    other = run(backends, tmp_path)
    assert other.batch_exists(["page"]) == 0
    assert other.batch_get_v1(["page"], sh.indices([1])) == [False]
    other.close()

    serving(monkeypatch, "/models/llama-3.1-8b-instruct", revision="v2")  # another revision of it
    assert run(backends, tmp_path).batch_exists(["page"]) == 0

    serving(monkeypatch, "/models/llama-3.1-8b-instruct")  # the first model again: still served
    assert run(backends, tmp_path).batch_exists(["page"]) == 1


def test_a_model_whose_rope_or_kv_scales_were_overridden_finds_none_of_the_old_pages(
        tmp_path: Path, backends: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # K is stored rotated by RoPE and fp8 KV is scaled: both change what the same bytes mean.
    serving(monkeypatch, "/models/llama")
    run(backends, tmp_path, seed=1).close()
    serving(monkeypatch, "/models/llama", overrides='{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}')
    assert run(backends, tmp_path).batch_exists(["page"]) == 0
    serving(monkeypatch, "/models/llama", kv_scales="/models/llama/kv_cache_scales.json")
    assert run(backends, tmp_path).batch_exists(["page"]) == 0
    serving(monkeypatch, "/models/llama")
    assert run(backends, tmp_path).batch_exists(["page"]) == 1
