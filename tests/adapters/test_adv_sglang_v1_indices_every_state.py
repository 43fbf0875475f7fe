"""Bad host indices given to SGLang's v1 calls are refused by name in every state: before the
first call (which opens the pool's files) and after ``close()``.

Before: v1 checked the indices only once its pool was open, so a first call with bad indices
opened (created) the pool's files before refusing, and a closed backend answered bad indices
all False, as a miss of the close (counted in ``closed_misses``), where v2 refuses them (32830cf).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang_helpers import PAGE, attach, fill, host_pool, indices, page

BAD: list[tuple[object, type[Exception], str]] = [
    (torch.arange(-PAGE, 0), ValueError, "host indices"),  # outside the pool
    (indices([0, 1]), ValueError, "host indices"),  # two pages for one key
    (indices([0]).to(torch.float32), TypeError, "host indices"),  # not integers
    (indices([0]).reshape(1, -1), ValueError, "host indices"),  # 2-D
]


@pytest.mark.parametrize(("bad", "error", "named"), BAD, ids=["negative", "count", "float", "2-D"])
def test_bad_v1_indices_are_refused_before_the_pool_opens(tmp_path: Path, backends: list[Any], bad: object,
                                                          error: type[Exception], named: str) -> None:
    pool = host_pool(4)
    fill(pool, 0, seed=3)
    before = page(pool, 1).clone()
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    for call in (backend.batch_get_v1, backend.batch_set_v1):
        with pytest.raises(error, match=named):
            call(["a"], bad)  # type: ignore[arg-type]
    assert backend.statistics() == {} and not any(tmp_path.iterdir()), "a refused call opened the pool"
    assert torch.equal(page(pool, 1), before)
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    assert backend.batch_get_v1(["a"], indices([1])) == [True] and torch.equal(page(pool, 1), page(pool, 0))


@pytest.mark.parametrize(("bad", "error", "named"), BAD, ids=["negative", "count", "float", "2-D"])
def test_bad_v1_indices_are_refused_after_close(tmp_path: Path, backends: list[Any], bad: object,
                                                error: type[Exception], named: str) -> None:
    pool = host_pool(4)
    fill(pool, 0, seed=3)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["a"], indices([0])) == [True]
    backend.close()
    for call in (backend.batch_get_v1, backend.batch_set_v1):
        with pytest.raises(error, match=named):  # answered [False], counted a closed miss
            call(["a"], bad)  # type: ignore[arg-type]
    assert backend.closed_misses == 0
    assert backend.batch_get_v1(["a"], indices([1])) == [False] and backend.closed_misses == 1  # a valid call: a miss
