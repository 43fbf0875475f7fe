"""A rates file of our own (0600, this user's, regular) whose content no parser check anticipated:
nesting deeper than the JSON parser recurses, an integer past a float's range. Each raised out of
``decode_rates`` (RecursionError, OverflowError) and failed every later ``KVCache.start()``; now
such a file is ignored and counted (``rates_ignored``) like any other unsound one.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from cache_helpers import DEVICE, LAYOUT, assert_quiescent, config, make_kv
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import KVCache
from aiokv.rates_file import (
    RATES_FILE,
    RATES_FORMAT,
    RATES_MAX_BYTES,
    RATES_VERSION,
    RatesFileError,
    decode_rates,
    read_rates_file,
)

FINGERPRINT = LAYOUT.fingerprint.hex()
KIND = DEVICE.type
PAGE = LAYOUT.page_bytes


def _doc(rate: str) -> bytes:
    """A rates file of this layout and device whose disk rate is the JSON text ``rate``."""
    head = json.dumps({"format": RATES_FORMAT, "version": RATES_VERSION, "layout": FINGERPRINT, "device": KIND})
    return (head[:-1] + ', "rates": {"disk": {"rate": ' + rate + ', "samples": 3}}}').encode()


HUGE_INT = _doc("1" + "0" * 400)  # json gives an int; float() and math.isfinite raise OverflowError
DEEP = b"[" * 2000 + b"]" * 2000  # 4000 bytes: within RATES_MAX_BYTES, deeper than the parser recurses
PLANTS = {"huge-int": HUGE_INT, "deep-nesting": DEEP}


def _plant(root: Path, data: bytes) -> Path:
    """``data`` as the rates file of ``root``'s layout directory: a regular file of ours, 0600."""
    layout_dir = root / FINGERPRINT
    layout_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = layout_dir / RATES_FILE
    path.write_bytes(data)
    os.chmod(path, 0o600)
    st_ = path.lstat()
    assert stat.S_ISREG(st_.st_mode) and st_.st_uid == os.geteuid() and stat.S_IMODE(st_.st_mode) == 0o600
    return path


def test_the_planted_files_fit_and_are_read_back_as_ours(tmp_path: Path) -> None:
    # Not refused for size or ownership: each reaches decode_rates, where it used to escape; the
    # same document with a sound rate is taken.
    assert decode_rates(_doc("1000000000.0"), FINGERPRINT, KIND).rates == {"disk": (1e9, 3)}
    for name, data in PLANTS.items():
        assert len(data) <= RATES_MAX_BYTES, name
        _plant(tmp_path / name, data)
        assert read_rates_file(tmp_path / name / FINGERPRINT) == data


@pytest.mark.parametrize("name", list(PLANTS))
def test_decode_refuses_them_as_corrupt(name: str) -> None:
    with pytest.raises(RatesFileError) as caught:
        decode_rates(PLANTS[name], FINGERPRINT, KIND)
    assert caught.value.reason == "corrupt"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["format", "version", "layout", "device", "rates", "rate", "samples", "entry"]),
       value=JSON_VALUES)
def test_any_value_in_any_field_is_accepted_or_refused_never_raised(field: str, value: object) -> None:
    doc: dict[str, object] = {"format": RATES_FORMAT, "version": RATES_VERSION, "layout": FINGERPRINT,
                              "device": KIND, "rates": {"disk": {"rate": 1e9, "samples": 3}}}
    entry = doc["rates"]
    assert isinstance(entry, dict)
    if field in ("rate", "samples"):
        entry["disk"][field] = value
    elif field == "entry":
        entry["disk"] = value
    else:
        doc[field] = value
    data = json.dumps(doc).encode()  # NaN/Infinity included: the parser refuses those constants
    try:
        saved = decode_rates(data, FINGERPRINT, KIND)
    except RatesFileError:
        return
    for rate, samples in saved.rates.values():
        assert isinstance(rate, float) and isinstance(samples, int)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=RATES_MAX_BYTES + 8))
def test_any_bytes_are_accepted_or_refused_never_raised(data: bytes) -> None:
    try:
        decode_rates(data, FINGERPRINT, KIND)
    except RatesFileError:
        pass


@pytest.mark.asyncio
@pytest.mark.parametrize("name", list(PLANTS))
async def test_a_start_over_an_unsound_file_of_ours_ignores_and_counts_it(tmp_path: Path, name: str) -> None:
    path = _plant(tmp_path, PLANTS[name])
    # Before the fix the start raised (RecursionError / OverflowError), and so did every later one.
    async with KVCache(config(tmp_path), LAYOUT, make_kv(11)) as cache:
        await cache.pool.wait_ready()
        assert all(m.rate is None for m in cache.manager.costs.meters().values())
        assert cache.stats().errors["rates_ignored"] == 1
        tokens = list(range(4 * LAYOUT.page_tokens))
        await cache.offload(tokens, torch.arange(len(tokens)))  # the cache works
        cache.manager.costs.disk.update(PAGE, 0.010)  # something learned: the close replaces the file
        await assert_quiescent(cache)
    assert decode_rates(path.read_bytes(), FINGERPRINT, KIND).rates["disk"][0] == pytest.approx(PAGE / 0.010)
    async with KVCache(config(tmp_path), LAYOUT, make_kv(12)) as again:
        assert again.manager.costs.disk.rate == pytest.approx(PAGE / 0.010)
        assert again.stats().errors.get("rates_ignored", 0) == 0
