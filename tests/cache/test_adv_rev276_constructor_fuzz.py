"""Adversarial (review 276): bad values for every setting of the public constructors, drawn by
Hypothesis: ``CacheConfig`` (its fields and disk shortcuts), ``DiskConfig``, ``TPConfig``,
``KVLayout.mha``/``mla``, ``KVCache``'s KV buffer, ``TPCache``, ``RankWorker``/``RankWorkerThread``
and the adapters' option parsing (``StoreConfig.from_options``).

Each must raise ``TypeError``/``ValueError`` (never ``OverflowError``, ``IndexError``,
``RuntimeError``, ``UnicodeEncodeError`` at a later start...) naming the setting, and create
nothing (no default disk directory, nothing under the test's directory). A valid cache afterwards
serves bit-exact bytes.

Before the fixes (each case below the fuzz failed): ``cpu_bytes=10**400`` and a store's
``staging_pages=10**400`` raised ``OverflowError`` at start; ``TPConfig`` fields too large for a
float ``OverflowError``; a KV buffer list of 0-D layers ``IndexError``, a nested one
``RuntimeError``; a directory with a lone surrogate was accepted and raised ``UnicodeEncodeError``
at start, naming nothing; a path-like returning bytes or an int, or a rank worker's address of a
wrong type, ``TypeError`` naming nothing; ``TPCache(directory="")`` was the working directory; the
adapters' ``disk_bytes=0`` and ``disk_dir`` with a NUL were refused naming ``capacity_bytes`` and
``directory``, options the user never wrote.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cache_helpers import LAYOUT, SLOTS, assert_quiescent, config, make_kv, prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.adapters.store import StoreConfig
from aiokv.storage import DiskConfig
from aiokv.tp import RankGroup, RankWorker, RankWorkerThread, TPCache, TPConfig

EXAMPLES = 40
CALLS_PER_EXAMPLE = 25
MAX = 2**63 - 1


class _PathLike:
    """An ``os.PathLike`` whose ``__fspath__`` returns whatever it was given."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __fspath__(self) -> Any:
        return self.value

    def __repr__(self) -> str:
        return f"_PathLike({self.value!r})"


def _nested(values: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        return torch.nested.nested_tensor([values, values])


# -- bad values by kind ---------------------------------------------------------------------------

_NOT_NUMBERS: list[object] = [None, "1", b"1", [1], {"a": 1}, object(), complex(1, 1), torch.tensor(3),
                              np.int64(4), np.bool_(True), Decimal(1), Fraction(1, 2), True, False]
"""Never an int or a float (``np.float64`` is a float: a valid number of seconds)."""


def not_int() -> st.SearchStrategy[object]:
    """Never an int setting's value (floats, bools, numpy scalars, strings, tensors...)."""
    return st.one_of(st.sampled_from([*_NOT_NUMBERS, np.float64(1.0)]), st.floats(allow_nan=True, allow_infinity=True))


def bad_int(least: int, most: int = MAX) -> st.SearchStrategy[object]:
    """Bad values of an int setting in ``[least, most]``."""
    return st.one_of(not_int(), st.integers(max_value=least - 1), st.integers(min_value=most + 1),
                     st.sampled_from([10**400, -(10**400), 2**63, 2**64]).filter(lambda v: not least <= v <= most))


def bad_seconds(finite: bool) -> st.SearchStrategy[object]:
    """Bad values of a non-negative number of seconds (``finite``: infinity refused too)."""
    values: list[st.SearchStrategy[object]] = [
        st.sampled_from(_NOT_NUMBERS), st.floats(max_value=-1e-300), st.integers(max_value=-1), st.just(math.nan),
        st.just(10**400)]
    if finite:
        values.append(st.just(math.inf))
    return st.one_of(*values)


def bad_bool(optional: bool) -> st.SearchStrategy[object]:
    return st.sampled_from([v for v in [None, 0, 1, "true", "false", np.bool_(True), 1.0, torch.tensor(True)]
                            if not (optional and v is None)])


def bad_path() -> st.SearchStrategy[object]:
    """Never a usable directory: wrong types, empty, NUL, a lone surrogate, path-likes giving bytes or ints."""
    return st.one_of(
        st.sampled_from([3, 1.5, b"/tmp/x", [], object(), True, "", "/tmp/a\x00b", _PathLike(b"/tmp/x"), _PathLike(3),
                         _PathLike(None), _PathLike("/tmp/\x00")]),
        st.text(max_size=6).map(lambda text: "/tmp/aiokv-rev276/" + text + "\ud800"),
    )


# -- the constructors and their settings ----------------------------------------------------------

CACHE_FIELDS: dict[str, st.SearchStrategy[object]] = {
    **{name: bad_int(1) for name in ("cpu_bytes", "seen_window", "staging_pages", "launch_pages", "launch_bytes",
                                     "pool_chunk_bytes", "pool_workers", "tp_size", "read_group_bytes",
                                     "stream_readahead_bytes")},
    "tp_rank": bad_int(0, 0),
    "namespace": st.one_of(st.sampled_from([None, 3, b"m", ["m"]]), st.text(max_size=3).map(lambda t: t + "\udc00")),
    "admission": st.sampled_from(["all", "seen_twice", 0, None, True]),
    "transfer_path": st.sampled_from(["staging", "reference", 0, True]),
    "prefill_tokens_per_s": st.one_of(st.sampled_from([0, 0.5, 1e10, math.inf, math.nan, -1.0, 10**400, "1e3", True]),
                                      st.floats(max_value=0.999), st.floats(min_value=1.001e9)),
    **{name: bad_seconds(finite=True) for name in ("offload_wait", "commit_wait", "close_timeout")},
    "launch_turn_s": bad_seconds(finite=False),
    "disk": st.sampled_from(["/tmp", 3, {"directory": "/tmp"}, Path("/tmp")]),
}
SHORTCUTS: dict[str, st.SearchStrategy[object]] = {
    "disk_dir": bad_path(),
    "disk_bytes": st.one_of(not_int(), st.integers(max_value=0)),  # (no upper bound: a budget, never allocated)
    "disk_backend": st.sampled_from(["auto", "uring", 1, True]),
    "disk_direct_io": bad_bool(optional=True),
    "disk_queue_depth": bad_int(1, 4096),
    "write_behind_depth": bad_int(1, 1 << 20),
}
DISK_FIELDS: dict[str, st.SearchStrategy[object]] = {
    "directory": bad_path(),
    "capacity_bytes": st.one_of(not_int(), st.integers(max_value=0)),
    "backend": st.sampled_from(["auto", "threads", 0, None]),
    "direct_io": bad_bool(optional=True),
    "queue_depth": bad_int(1, 4096),
    "write_behind_depth": bad_int(1, 1 << 20),
    "write_behind_workers": bad_int(1, 1024),
    "threads": bad_int(1, 1024),
    "ring_entries": bad_int(1, 32768),
    "sync_writes": bad_bool(optional=False),
    "recycle_files": bad_bool(optional=False),
    "drain_on_close": bad_bool(optional=False),
    "min_free_bytes": st.one_of(not_int(), st.integers(max_value=-1)),
    "free_space_recheck_s": bad_seconds(finite=False),
    "enospc_retries": st.one_of(not_int(), st.integers(max_value=-1)),
    "follow_interval_s": st.one_of(bad_seconds(finite=True), st.floats(min_value=86400.5, max_value=1e300),
                                   st.floats(min_value=1e-300, max_value=0.00099)),
}
TP_INT_FIELDS = ("max_jobs", "worker_max_inflight", "max_frame_bytes", "register_chunk_bytes", "register_threads",
                 "pace_bytes", "stream_marks")
TP_FIELDS: dict[str, st.SearchStrategy[object]] = {
    **{name: bad_int(1) for name in TP_INT_FIELDS},
    "inline_copy_bytes": bad_int(0),
    **{name: bad_seconds(finite=True).filter(lambda v: v != 0) | st.just(0)
       for name in ("handshake_timeout_s", "close_timeout_s", "abandon_copies_s", "reconnect_initial_s")},
    "offload_runs": bad_bool(optional=False),
}
LAYOUT_FIELDS: dict[str, st.SearchStrategy[object]] = {
    # (no upper bound: a layout of huge pages is refused by the pool's start, "smaller than one page")
    **{name: st.one_of(not_int(), st.integers(max_value=0)) for name in ("num_layers", "num_kv_heads", "head_dim",
                                                                          "page_tokens")},
    "dtype": st.sampled_from([torch.float64, torch.int32, torch.bool, torch.complex64, torch.qint8, "float16",
                              np.float16, None]),
}
STORE_OPTIONS: dict[str, st.SearchStrategy[object]] = {
    "disk_dir": bad_path(),
    "disk_bytes": bad_int(1),
    "namespace": st.one_of(st.sampled_from([3, b"m", None]), st.just("m\ud800")),
    "disk_backend": st.sampled_from(["AUTO", "io_uring", 3, None, DiskBackend.AUTO]),
    "direct_io": bad_bool(optional=True),
    "queue_depth": bad_int(1, 4096),
    "staging_pages": bad_int(0),
    "poll_s": bad_seconds(finite=True) | st.just(0),
    "linger_s": bad_seconds(finite=True),
    "idle_poll_s": bad_seconds(finite=True),
    "zero_copy": bad_bool(optional=False),
    "writer_wait_s": bad_seconds(finite=True),
    "reader_refresh_s": bad_seconds(finite=True),
    "close_timeout": bad_seconds(finite=True),
}
HALF = KVLayout.mha(LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.dtype, LAYOUT.page_tokens)


def _good_kv() -> torch.Tensor:
    return torch.zeros(LAYOUT.num_layers, 32, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)


@st.composite
def bad_kv(draw: st.DrawFn) -> object:
    """A KV buffer ``KVBuffer.wrap`` must refuse for ``LAYOUT``."""
    kv = _good_kv()
    layers = list(kv.unbind(0))
    kind = draw(st.integers(0, 9))
    if kind == 0:  # not a tensor or a list of them
        return draw(st.sampled_from([None, 3, "kv", {}, kv.numpy(), set(), iter(layers)]))
    if kind == 1:  # a wrong dtype, of the whole or one layer
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.uint8, torch.float64]))
        if draw(st.booleans()):
            return kv.to(dtype)
        layers[draw(st.integers(0, len(layers) - 1))] = layers[0].to(dtype)
        return layers
    if kind == 2:  # a wrong number of dimensions, of the whole or of a layer (0-D, 1-D, 4-D)
        if draw(st.booleans()):
            return draw(st.sampled_from([kv[0], kv.unsqueeze(0), torch.tensor(1.0, dtype=LAYOUT.dtype)]))
        shape = draw(st.sampled_from([(), (3,), (1, 32, LAYOUT.rows, LAYOUT.head_dim)]))
        layers[draw(st.integers(0, len(layers) - 1))] = torch.zeros(shape, dtype=LAYOUT.dtype)
        return layers if draw(st.booleans()) else (layers, layers)
    if kind == 3:  # a wrong layer count, rows or head_dim
        return draw(st.sampled_from([layers[:1], layers * 2, kv[:, :, :1], kv[..., :4], kv[:1]]))
    if kind == 4:  # rows not contiguous, slots overlapping (expanded), layers sharing memory
        return draw(st.sampled_from([kv.transpose(2, 3).contiguous().transpose(2, 3), kv[:, :1].expand(-1, 32, -1, -1),
                                     kv[:1].expand(LAYOUT.num_layers, -1, -1, -1), [layers[0]] * LAYOUT.num_layers]))
    if kind == 5:  # nested, sparse, meta
        return draw(st.sampled_from([_nested(layers[0]), kv.to_sparse(), kv.to("meta"), [layers[0].to_sparse()] * 2,
                                     [_nested(layers[0][0])] * 2]))
    if kind == 6:  # no slots
        return kv[:, :0]
    if kind == 7:  # mismatched slot counts or devices between layers
        layers[1] = layers[1][:16]
        return layers
    if kind == 8:  # split K/V of the wrong shapes, or for a list that is not two lists
        k = [layer[:, : LAYOUT.num_kv_heads] for layer in layers]
        return draw(st.sampled_from([(k, k[:1]), (k, [layers[0]] * 2), (k, k), ([], [])]))
    return draw(st.sampled_from([[], (), [None, None], [layers[0], "x"]]))


# -- the checks -----------------------------------------------------------------------------------


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _refused(what: str, names: tuple[str, ...], call: Callable[[], object], root: Path) -> None:
    """``call()`` raises TypeError/ValueError naming one of ``names`` and creates nothing under ``root``.
    Any other exception, or none, fails the test with the call named."""
    before = _files(root)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (numpy scalars' truth, quantized dtypes)
            made = call()
    except (TypeError, ValueError) as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # what the contract forbids, reported as such
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), not TypeError/ValueError") from exc
    else:
        raise AssertionError(f"{what}: accepted ({made!r})")
    assert any(name.lower() in refusal.lower() for name in names), f"{what}: names none of {names}: {refusal}"
    assert _files(root) == before, f"{what}: refused, but it created {_files(root) - before}"


ENTRIES = ["cache", "shortcut", "disk", "tp", "layout", "mla", "kv", "tpcache", "worker", "store"]


def _bad_call(entry: str, data: st.DataObject, root: Path) -> None:
    """One drawn bad construction of ``entry``, checked by :func:`_refused`."""
    where = root / "d"
    if entry == "cache":
        name = data.draw(st.sampled_from(sorted(CACHE_FIELDS)), label="field")
        value = data.draw(CACHE_FIELDS[name], label=name)
        kw: dict[str, Any] = {name: value} if name == "disk" else {name: value, "disk": None}
        _refused(f"CacheConfig({name}={value!r})", (f"CacheConfig.{name}",), lambda: CacheConfig(**kw), root)
    elif entry == "shortcut":
        name = data.draw(st.sampled_from(sorted(SHORTCUTS)), label="shortcut")
        value = data.draw(SHORTCUTS[name], label=name)
        kw = {name: value} if name == "disk_dir" else {name: value, "disk_dir": where}
        _refused(f"CacheConfig({name}={value!r})", (f"CacheConfig.{name}",), lambda: CacheConfig(**kw), root)
    elif entry == "disk":
        name = data.draw(st.sampled_from(sorted(DISK_FIELDS)), label="disk field")
        value = data.draw(DISK_FIELDS[name], label=name)
        kw = {name: value} if name == "directory" else {name: value, "directory": where}
        _refused(f"DiskConfig({name}={value!r})", (f"DiskConfig.{name}",), lambda: DiskConfig(**kw), root)
    elif entry == "tp":
        name = data.draw(st.sampled_from(sorted(TP_FIELDS)), label="tp field")
        value = data.draw(TP_FIELDS[name], label=name)
        _refused(f"TPConfig({name}={value!r})", (f"TPConfig.{name}",), lambda: TPConfig(**{name: value}), root)
    elif entry in ("layout", "mla"):
        name = data.draw(st.sampled_from(sorted(LAYOUT_FIELDS)), label="layout field")
        value = data.draw(LAYOUT_FIELDS[name], label=name)
        if entry == "layout":
            kw = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": torch.float16, "page_tokens": 4,
                  name: value}
            _refused(f"KVLayout.mha({name}={value!r})", (name,), lambda: KVLayout.mha(**kw), root)
        else:
            arg = "latent_dim" if name in ("head_dim", "num_kv_heads") else name
            kw = {"num_layers": 2, "latent_dim": 8, "dtype": torch.float16, "page_tokens": 4, arg: value}
            _refused(f"KVLayout.mla({arg}={value!r})", (arg,), lambda: KVLayout.mla(**kw), root)
    elif entry == "kv":
        kv = data.draw(bad_kv(), label="kv")
        cfg = CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes, disk=None)
        _refused(f"KVCache(kv={kv!r:.120})", ("kv", "layer", "layout"), lambda: KVCache(cfg, LAYOUT, kv), root)
    elif entry == "tpcache":
        name = data.draw(st.sampled_from(["tp_size", "num_slots", "tp_config", "directory"]), label="tpcache arg")
        strategy = {"tp_size": bad_int(1) | st.just(3), "num_slots": bad_int(1),
                    "tp_config": st.sampled_from([{}, 3, "x", TPConfig]), "directory": bad_path()}[name]
        value = data.draw(strategy, label=name)
        kw = {"tp_size": 2, "num_slots": 64, name: value}
        cfg = CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes, disk=None)
        _refused(f"TPCache({name}={value!r})", (name, "num_kv_heads"), lambda: TPCache(cfg, LAYOUT, **kw), root)
    elif entry == "worker":
        cls = data.draw(st.sampled_from([RankWorker, RankWorkerThread]), label="worker")
        name = data.draw(st.sampled_from(["address", "rank", "tp_size", "layout", "config", "path"]), label="arg")
        strategy = {"address": bad_path(), "rank": bad_int(0, 1), "tp_size": bad_int(1) | st.just(3),
                    "layout": st.sampled_from([None, "mha", 3]), "config": st.sampled_from([{}, 3, TPConfig]),
                    "path": st.sampled_from(["staging", 0, True])}[name]
        value = data.draw(strategy, label=name)
        kv = torch.zeros(HALF.num_layers, 32, HALF.rows // 2, HALF.head_dim, dtype=HALF.dtype)
        kw = {"address": str(root / "sock"), "rank": 0, "tp_size": 2, "layout": HALF, "kv": kv, name: value}
        names = {"rank": ("tp_rank",), "tp_size": ("tp_size", "num_kv_heads")}.get(name, (name,))
        _refused(f"{cls.__name__}({name}={value!r})", names, lambda: cls(**kw), root)
    else:
        name = data.draw(st.sampled_from(sorted(STORE_OPTIONS)), label="option")
        value = data.draw(STORE_OPTIONS[name], label=name)
        options = {"disk_dir": str(where), name: value}
        _refused(f"StoreConfig.from_options({name}={value!r})", (name,), lambda: StoreConfig.from_options(options),
                 root)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_drawn_bad_settings_are_refused_by_name_and_create_nothing(
        data: st.DataObject, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))  # the default disk directory: never made
    for _ in range(CALLS_PER_EXAMPLE):
        _bad_call(data.draw(st.sampled_from(ENTRIES), label="entry"), data, tmp_path)
    assert not (tmp_path / "home").exists()


@pytest.mark.asyncio
async def test_a_valid_cache_after_the_refusals_serves_bit_exact_bytes(tmp_path: Path) -> None:
    """The refusals above leave no process-wide state behind (segment bookkeeping, seed caches)."""
    for bad in (10**400, 2**63):
        with pytest.raises(ValueError, match=r"CacheConfig\.cpu_bytes"):
            CacheConfig(cpu_bytes=bad, disk=None)
    with pytest.raises(ValueError, match=r"DiskConfig\.directory"):
        DiskConfig(directory=tmp_path / "\ud800")
    kv = make_kv(276)
    tokens = prompt(276, 8 * LAYOUT.page_tokens)
    async with KVCache(config(tmp_path / "disk"), LAYOUT, kv) as cache:
        assert (await cache.offload(tokens, torch.arange(len(tokens)))).stored == 8
        original = kv[:, : len(tokens)].clone()
        match = await cache.match(tokens)
        target = torch.arange(SLOTS - len(tokens), SLOTS)
        assert (await cache.load(match, target)).tokens == len(tokens)
        assert torch.equal(kv[:, target], original)
        await assert_quiescent(cache)


# -- the defects, one by one (each failed before the fix) -------------------------------------------


@pytest.mark.parametrize("value", [10**400, 2**63, 2**1100])
def test_a_pool_budget_beyond_64_bits_is_a_value_error_not_an_overflow_at_start(value: int) -> None:
    # Before: accepted; the start raised OverflowError formatting the pool's size in GiB (10**400).
    with pytest.raises(ValueError, match=r"CacheConfig\.cpu_bytes must be at most 2\*\*63 - 1"):
        CacheConfig(cpu_bytes=value, disk=None)
    for name in ("seen_window", "launch_bytes", "pool_chunk_bytes", "read_group_bytes"):
        with pytest.raises(ValueError, match=rf"CacheConfig\.{name} must be at most"):
            CacheConfig(disk=None, **{name: value})
    assert CacheConfig(cpu_bytes=MAX, disk=None).cpu_bytes == MAX


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TPConfig) if f.name != "offload_runs"])
def test_tp_settings_too_large_for_a_float_are_value_errors(name: str) -> None:
    # Before: OverflowError from math.isfinite ("int too large to convert to float").
    with pytest.raises(ValueError, match=f"TPConfig.{name}"):
        TPConfig(**{name: 10**400})


@pytest.mark.parametrize("form", ["0-d layers", "1-d layers", "0-d split", "nested stack", "nested layers"])
def test_a_kv_buffer_of_layers_without_slots_or_sizes_is_refused_by_name(form: str) -> None:
    # Before: IndexError (tuple index out of range) for 0-D layers, RuntimeError for nested tensors.
    scalar = torch.tensor(1.0, dtype=LAYOUT.dtype)
    kv = _good_kv()
    bad: Any = {
        "0-d layers": [scalar] * LAYOUT.num_layers,
        "1-d layers": [torch.zeros(3, dtype=LAYOUT.dtype)] * LAYOUT.num_layers,
        "0-d split": ([scalar] * LAYOUT.num_layers, [scalar] * LAYOUT.num_layers),
        "nested stack": _nested(kv[0]),
        "nested layers": [_nested(kv[0, 0])] * LAYOUT.num_layers,
    }[form]
    cfg = CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes, disk=None)
    with pytest.raises((TypeError, ValueError), match=r"(layer tensor 0|KV buffer) must be"):
        KVCache(cfg, LAYOUT, bad)


@pytest.mark.parametrize("path", ["\ud800", "x\udfff", "caf\ud83d"])
def test_a_directory_the_file_system_cannot_encode_is_refused_by_its_setting(tmp_path: Path, path: str) -> None:
    # Before: accepted; the start raised UnicodeEncodeError (a ValueError naming no setting).
    bad = str(tmp_path / path)
    with pytest.raises(ValueError, match=r"DiskConfig\.directory cannot be encoded"):
        DiskConfig(directory=bad)  # type: ignore[arg-type]  # a str: what users pass
    with pytest.raises(ValueError, match=r"DiskConfig\.directory cannot be encoded"):
        DiskConfig(directory=Path(bad))
    with pytest.raises(ValueError, match=r"CacheConfig\.disk_dir cannot be encoded"):
        CacheConfig(cpu_bytes=1 << 20, disk_dir=bad)
    with pytest.raises(ValueError, match="disk_dir cannot be encoded"):
        StoreConfig.from_options({"disk_dir": bad})
    with pytest.raises(ValueError, match="directory cannot be encoded"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk=None), LAYOUT, tp_size=2, num_slots=64, directory=bad)
    # An undecodable byte of a file name (os.fsdecode's surrogate escape) is a path like any other.
    assert DiskConfig(directory=tmp_path / "\udcff").directory == tmp_path / "\udcff"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [_PathLike(b"/tmp/x"), _PathLike(3), _PathLike(None)])
def test_a_path_like_not_giving_a_str_is_refused_by_its_setting(tmp_path: Path, value: object) -> None:
    # Before: pathlib's or os.fspath's TypeError, naming no setting.
    with pytest.raises(TypeError, match=r"CacheConfig\.disk_dir must be a"):
        CacheConfig(cpu_bytes=1 << 20, disk_dir=value)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match=r"DiskConfig\.directory must be a"):
        DiskConfig(directory=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="disk_dir must be a"):
        StoreConfig.from_options({"disk_dir": value})


@pytest.mark.parametrize("address", [None, 3, 1.5, b"/tmp/sock", [], "", "/tmp/\x00", _PathLike(b"/tmp/sock")])
@pytest.mark.parametrize("cls", [RankWorker, RankWorkerThread])
def test_a_rank_workers_address_of_a_wrong_kind_is_refused_by_name(address: object, cls: type) -> None:
    # Before: "expected str, bytes or os.PathLike object, not int" (pathlib), naming no argument;
    # "" was accepted (the working directory) and failed at connect.
    kv = torch.zeros(HALF.num_layers, 32, HALF.rows // 2, HALF.head_dim, dtype=HALF.dtype)
    with pytest.raises((TypeError, ValueError), match="address"):
        cls(address, 0, 2, HALF, kv)


@pytest.mark.parametrize("directory", ["", 3, b"/tmp", "/tmp/\x00", _PathLike(3)])
def test_a_tp_managers_directory_is_checked_when_the_cache_is_made(
        directory: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: accepted; the start failed naming nothing, and "" was the working directory (where the
    # manager made its socket when that directory was 0700).
    monkeypatch.chdir(tmp_path)
    with pytest.raises((TypeError, ValueError), match="directory"):
        TPCache(CacheConfig(cpu_bytes=1 << 20, disk=None), LAYOUT, tp_size=2, num_slots=64,
                directory=directory)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("options", "named"), [
    ({"disk_bytes": 0}, "disk_bytes must be at least 1"),
    ({"disk_bytes": -5}, "disk_bytes must be at least 1"),
    ({"disk_bytes": 10**400}, "disk_bytes must be at most"),
    ({"staging_pages": 10**400}, "staging_pages must be at most"),
    ({"staging_pages": 2**63}, "staging_pages must be at most"),
    ({"disk_dir": "/tmp/a\x00b"}, "disk_dir must not contain a NUL"),
])
def test_store_options_are_refused_by_the_option_name(tmp_path: Path, options: dict[str, object], named: str) -> None:
    # Before: "capacity_bytes must be positive" / "directory must be a non-empty path" (names the user
    # never wrote), and staging_pages=10**400 opened a store that raised OverflowError.
    with pytest.raises(ValueError, match=named.replace("*", r"\*")):
        StoreConfig.from_options({"disk_dir": str(tmp_path), **options})


def test_constructions_do_not_depend_on_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative directory is still a directory (only the empty one is refused)."""
    monkeypatch.chdir(tmp_path)
    assert DiskConfig(directory="rel").directory == Path("rel")  # type: ignore[arg-type]
    assert StoreConfig.from_options({"disk_dir": "rel"}).directory == Path("rel")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tp_size", [2**16, 2**20, 2**63, 10**400])
def test_a_tp_size_no_hello_can_carry_is_refused_when_made(tp_size: int) -> None:
    # Before: accepted; TPCache's start built a slice per rank (2**63: it never returned, 2**20: every
    # offload then stalled the loop over a million ranks), and a worker's hello raised struct.error.
    cfg = CacheConfig(cpu_bytes=1 << 20, disk=None)
    with pytest.raises(ValueError, match="tp_size must be at most 65535"):
        TPCache(cfg, LAYOUT, tp_size=tp_size, num_slots=64)
    kv = torch.zeros(HALF.num_layers, 32, HALF.rows // 2, HALF.head_dim, dtype=HALF.dtype)
    with pytest.raises(ValueError, match="tp_size must be at most 65535"):
        RankWorker("/tmp/aiokv-rev276.sock", 0, tp_size, HALF, kv)
    with pytest.raises(ValueError, match="num_slots must be a positive int of at most"):
        TPCache(cfg, LAYOUT, tp_size=2, num_slots=2**63)
    with pytest.raises(ValueError, match="tp_size must be at most 65535"):  # (2**63: it never returned)
        RankGroup(LAYOUT, tp_size, "/aiokv-rev276", 8)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"config": {}}, "config must be a TPConfig"), ({"config": "x"}, "config must be a TPConfig"),
    ({"directory": ""}, "directory is an empty path"), ({"directory": 3}, "directory must be a path"),
])
def test_a_rank_groups_config_and_directory_are_checked_when_it_is_made(kwargs: dict[str, Any], named: str) -> None:
    # Before: config={} was taken as the defaults, "x" kept (AttributeError at the first use), and the
    # directory failed at start naming nothing ("" the working directory).
    with pytest.raises((TypeError, ValueError), match=named):
        RankGroup(LAYOUT, 2, "/aiokv-rev276", 8, **kwargs)
