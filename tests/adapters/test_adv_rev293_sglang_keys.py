"""Adversarial (review 293): keys that are not a sequence (None, an int, an iterator) given to the
SGLang backend's batch calls are a ``TypeError`` naming ``keys`` with nothing moved. Before the fix:
``TypeError: 'NoneType' object is not iterable``, naming nothing. Real SGLang host pool and
factory (sglang_helpers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

from sglang_helpers import attach, host_pool, indices


def test_keys_that_are_not_a_sequence_are_refused_by_name(tmp_path: Path, backends: list[Any]) -> None:
    pool = host_pool(4)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    for keys in (None, 3, iter(["a"])):
        for call in (lambda k: backend.batch_get_v1(k, indices([0])), lambda k: backend.batch_set_v1(k, indices([0])),
                     backend.batch_exists, backend.batch_exists_v2):
            with pytest.raises(TypeError, match="keys must be a list of str"):  # was "... is not iterable"
                call(keys)
    assert backend.batch_exists(["a"]) == 0 and backend.statistics().get("writes", 0) == 0
