"""Adversarial (review 293): malformed calls to aiokv's SGLang backend, drawn by Hypothesis beyond
the table of ``test_sglang_bad_input.py``: keys (not a list, elements not str, lone surrogates,
one string, None) and host indices of every bad type, dtype, layout, shape, count and value, for
``batch_get_v1``/``batch_set_v1``/``batch_exists``/``batch_exists_v2``/``exists``.

Each call must raise ``TypeError``/``ValueError`` whose message names the argument ("key" or
"host indices"), and change nothing: the store's statistics, every host pool page and the keys
stored. Afterwards a valid read serves bit-exact pages. Real SGLang host pool and factory
(sglang_helpers.py), real page files.

Before the fix: host indices of the right count but 2-D raised SGLang's ``AssertionError``, a
sparse tensor torch's ``RuntimeError``, a meta tensor ``NotImplementedError`` (and keys that were
None raised a ``TypeError`` naming nothing: ``test_adv_rev293_sglang_keys.py``).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_helpers import PAGE, attach, fill, host_pool, indices, page

PAGES = 4
EXAMPLES = 10
CALLS_PER_EXAMPLE = 25
_dirs = itertools.count()
STORE_COUNTS = ("pages", "bytes_stored", "reads", "writes", "bytes_read", "bytes_written", "hits", "misses", "corrupt",
                "dropped", "errors", "in_flight", "write_behind_queued", "evictions", "writes_refused")


def _nested(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        return torch.nested.nested_tensor([values])


def _quantized(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in torch, not gone
        return torch.quantize_per_tensor(values.float(), 1.0, 0, torch.qint32)


def bad_keys() -> st.SearchStrategy[object]:
    """Keys every call must refuse."""
    bad_key = st.one_of(st.integers(), st.binary(max_size=3), st.none(), st.floats(), st.just(["a"]),
                        st.text(max_size=3).map(lambda text: text + "\ud800"))
    listed = st.tuples(st.lists(st.text(max_size=4), max_size=3), bad_key, st.integers(0, 3)).map(
        lambda drawn: [*drawn[0][: drawn[2]], drawn[1], *drawn[0][drawn[2] :]])
    return st.one_of(listed, st.sampled_from([None, "ab", b"ab", 3, {"a", "b"}, iter(["a"]), {"a": 1}]))


@st.composite
def bad_indices(draw: st.DrawFn, pages: int, slots: int) -> object:
    """Host indices that a call naming ``pages`` pages must refuse (the host pool has ``slots``)."""
    base = indices(list(range(pages)))
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return draw(st.sampled_from([None, base.tolist(), base.numpy(), 3, np.int64(0)]))
    if kind == 1:
        return base.to(draw(st.sampled_from([torch.float32, torch.float64, torch.bool, torch.complex64])))
    if kind == 2:  # the right count, a wrong shape
        return draw(st.sampled_from([base.view(1, -1), base.view(-1, 1), base.view(pages, PAGE)]))
    if kind == 3:  # sparse, nested, meta, quantized
        return draw(st.sampled_from([torch.Tensor.to_sparse, _nested, lambda t: t.to("meta"), _quantized]))(base)
    if kind == 4:  # a wrong count
        return torch.arange(pages * PAGE + draw(st.sampled_from([-pages * PAGE, -1, 1, PAGE])))
    if kind == 5:  # a page outside the pool, not aligned, or not consecutive
        page_index = draw(st.integers(0, pages - 1))
        shift = draw(st.sampled_from([-PAGE * (page_index + 1), slots - page_index * PAGE, 1 << 36, PAGE // 2]))
        bad = base.clone()
        bad[page_index * PAGE : (page_index + 1) * PAGE] += shift
        return bad
    bad = base.clone()  # one index inside a page off its run
    bad[draw(st.integers(0, pages * PAGE - 1))] += draw(st.sampled_from([1, -1, PAGE]))
    if bool((bad == base).all()):
        bad[1] = bad[0]
    return bad


def _state(backend: Any, pool: Any) -> tuple[object, ...]:
    # What a call could change (others move in the background: the registration's backend, the
    # directory follower's looks).
    stats = {name: value for name, value in backend.statistics().items() if name in STORE_COUNTS}
    pages = [page(pool, i) for i in range(PAGES)]
    return stats, backend.batch_exists(["p0", "p1", "new"]), pages


def _same(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    return (before[:2] == after[:2]
            and all(torch.equal(a, b) for a, b in zip(before[2], after[2], strict=True)))


def _refused(backend: Any, pool: Any, what: str, names: tuple[str, ...], call: Callable[[], Any]) -> None:
    before = _state(backend, pool)
    try:
        outcome = call()
    except (TypeError, ValueError) as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # what the contract forbids, reported as such
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), not TypeError/ValueError") from exc
    else:
        raise AssertionError(f"{what}: accepted ({outcome!r:.80})")
    assert any(name in refusal for name in names), f"{what}: names none of {names}: {refusal}"
    assert _same(before, _state(backend, pool)), f"{what}: refused, but the store or the host pool changed"


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_bad_keys_and_host_indices_are_refused_by_name_and_change_nothing(
        data: st.DataObject, tmp_path: Path, backends: list[Any]) -> None:
    pool = host_pool(PAGES)
    for i in range(PAGES):
        fill(pool, i, seed=i + 1)
    backend = attach(backends, tmp_path / f"d{next(_dirs)}", pool, interface_v1=True)
    try:
        assert backend.batch_set_v1(["p0", "p1"], indices([0, 1])) == [True, True]
        original = [page(pool, i) for i in range(PAGES)]
        for _ in range(CALLS_PER_EXAMPLE):
            entry = data.draw(st.sampled_from(["get_keys", "set_keys", "exists", "exists_v2", "exists_one",
                                               "get_indices", "set_indices"]), label="entry")
            if entry in ("get_keys", "set_keys"):
                keys = data.draw(bad_keys(), label="keys")
                count = len(keys) if isinstance(keys, (list, str, bytes, set, dict)) else 1
                call = backend.batch_get_v1 if entry == "get_keys" else backend.batch_set_v1
                target = indices(list(range(2, 2 + min(count, 2))))
                _refused(backend, pool, f"{entry}({keys!r:.60})", ("key",),
                         lambda call=call, keys=keys, target=target: call(keys, target))
            elif entry in ("exists", "exists_v2"):
                keys = data.draw(bad_keys(), label="keys")
                call = backend.batch_exists if entry == "exists" else backend.batch_exists_v2
                _refused(backend, pool, f"{entry}({keys!r:.60})", ("key",), lambda call=call, keys=keys: call(keys))
            elif entry == "exists_one":
                key = data.draw(st.sampled_from([None, 3, b"p0", ["p0"], "p\ud800"]), label="key")
                _refused(backend, pool, f"exists({key!r})", ("key",), lambda key=key: backend.exists(key))
            else:
                pages = data.draw(st.integers(1, 2), label="pages")
                bad = data.draw(bad_indices(pages, pool.size), label="host indices")
                keys = ["p0", "p1"][:pages] if entry == "get_indices" else [f"new{i}" for i in range(pages)]
                call = backend.batch_get_v1 if entry == "get_indices" else backend.batch_set_v1
                _refused(backend, pool, f"{entry}({bad!r:.80})", ("host indices", "host page"),
                         lambda call=call, keys=keys, bad=bad: call(keys, bad))
        # A valid read afterwards: bit-exact.
        assert backend.batch_get_v1(["p0", "p1"], indices([2, 3])) == [True, True]
        assert torch.equal(page(pool, 2), original[0]) and torch.equal(page(pool, 3), original[1])
        assert backend.batch_exists(["new0"]) == 0
    finally:
        backend.close()


# -- the defect, alone (failed before the fix) -------------------------------------------------------


@pytest.mark.parametrize("form", ["2-D", "sparse", "meta"])
def test_host_indices_of_a_wrong_form_are_refused_by_name(tmp_path: Path, backends: list[Any], form: str) -> None:
    pool = host_pool(PAGES)
    for i in range(PAGES):
        fill(pool, i, seed=i + 1)
    backend = attach(backends, tmp_path, pool, interface_v1=True)
    assert backend.batch_set_v1(["p0"], indices([0])) == [True]
    bad = {"2-D": indices([1]).view(1, -1), "sparse": indices([1]).to_sparse(), "meta": indices([1]).to("meta")}[form]
    for call, key in ((backend.batch_get_v1, "p0"), (backend.batch_set_v1, "new")):
        # Was SGLang's AssertionError (2-D), RuntimeError (sparse), NotImplementedError (meta).
        with pytest.raises((TypeError, ValueError), match="host indices"):
            call([key], bad)
    assert backend.batch_exists(["new"]) == 0
    assert backend.batch_get_v1(["p0"], indices([2])) == [True]
    assert torch.equal(page(pool, 2), page(pool, 0))

