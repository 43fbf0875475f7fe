"""A seeded random drive of the SGLang backend's calls as HiCache's controller issues them, from
its two threads at once, against an oracle, with page files damaged underneath (review 167).

SGLang's prefetch thread asks ``batch_exists`` for a prefix and reads it with ``batch_get_v1`` into
host-pool pages it owns; its backup thread writes host pages with ``batch_set_v1`` (the same key
again too); now and then ``clear()`` runs; the page files are flipped, cut and unlinked behind the
backend. Every page's bytes are a function of its key. The oracle, per call: a page a get reports
True holds exactly the bytes set under its key; a page it reports False, and every page the call
did not name, is not written after the call returned (a sentinel is written into it and checked
later); pages a set reads are unchanged; ``batch_exists`` counts only keys some set named; no call
raises and every call returns within a bound. ``AIOKV_REV167_SEEDS=N`` drives N seeds.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

import torch
from sglang_helpers import PAGE, attach, fill, host_pool, indices, page

PAGES = 24
OWN = PAGES // 2  # pages 0..11: the prefetch thread's; 12..23: the backup thread's
KEYS = 20
ROUNDS = int(os.environ.get("AIOKV_REV167_ROUNDS", "600")) // 6
EXTRA = int(os.environ.get("AIOKV_REV167_SEEDS", "0"))
CALL_BOUND_S = 20.0


def key_seed(key: str) -> int:
    return int(key.rsplit("-", 1)[1]) + 7919


class Oracle:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.expected: list[torch.Tensor | None] = [None] * PAGES
        self.content: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()  # the two threads' own bookkeeping (never held across a backend call)
        self.set_keys: set[str] = set()
        self.serial = 0
        self.arrived = 0

    def sentinel(self, index: int) -> None:
        with self.lock:
            self.serial += 1
            value = float(self.serial % 1000 + 1)
        data = torch.full_like(page(self.pool, index), value)
        self.pool.set_from_flat_data_page(index * PAGE, data)
        self.expected[index] = page(self.pool, index)

    def put(self, index: int, key: str) -> None:
        fill(self.pool, index, key_seed(key))
        data = page(self.pool, index)
        with self.lock:
            self.content.setdefault(key, data)
        assert torch.equal(self.content[key], data)
        self.expected[index] = data

    def check(self, pages: range) -> None:
        for index in pages:
            want = self.expected[index]
            if want is not None:
                assert torch.equal(page(self.pool, index), want), f"host page {index} changed behind its owner"


def bounded(what: str, call: Any) -> Any:
    """``call()`` on a helper thread, within ``CALL_BOUND_S``."""
    out: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name=f"rev167-{what}").start()
    assert done.wait(CALL_BOUND_S), f"{what} did not return within {CALL_BOUND_S} s"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def prefetch(backend: Any, oracle: Oracle, rng: random.Random, keys: list[str], errors: list[BaseException],
             damage: Any) -> None:
    try:
        own = range(OWN)
        for i in range(OWN):
            oracle.sentinel(i)
        for _ in range(ROUNDS):
            ask = rng.sample(keys, rng.randint(1, 6))
            found = bounded("batch_exists", lambda a=ask: backend.batch_exists(a))
            assert 0 <= found <= len(ask)
            with oracle.lock:
                assert set(ask[:found]) <= oracle.set_keys, "exists counted a key no set named"
            if rng.random() < 0.1:
                damage(rng)
            if not found:
                continue
            # As the controller: read the prefix it found (pages may be gone or damaged since).
            targets = rng.sample(list(own), found)
            got = bounded("batch_get_v1", lambda a=ask[:found], t=targets: backend.batch_get_v1(a, indices(t)))
            assert len(got) == found and all(isinstance(g, bool) for g in got)
            for key, index, ok in zip(ask[:found], targets, got, strict=True):
                if ok:
                    oracle.arrived += 1
                    assert torch.equal(page(oracle.pool, index), oracle.content[key]), f"{key}: wrong bytes"
                oracle.sentinel(index)  # reused at once; nothing may write it from now on
            oracle.check(own)
    except BaseException as exc:
        errors.append(exc)


def backup(backend: Any, oracle: Oracle, rng: random.Random, keys: list[str], errors: list[BaseException]) -> None:
    try:
        own = range(OWN, PAGES)
        for _ in range(ROUNDS):
            chosen = rng.sample(keys, rng.randint(1, 6))
            targets = rng.sample(list(own), len(chosen))
            for key, index in zip(chosen, targets, strict=True):
                oracle.put(index, key)
            with oracle.lock:
                oracle.set_keys.update(chosen)
            done = bounded("batch_set_v1", lambda c=chosen, t=targets: backend.batch_set_v1(c, indices(t)))
            assert len(done) == len(chosen) and all(isinstance(d, bool) for d in done)
            oracle.check(own)  # a set only reads its pages
            if rng.random() < 0.02:
                assert isinstance(bounded("clear", backend.clear), bool)
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "staged"])
@pytest.mark.parametrize("seed", [1] if not EXTRA else list(range(1000, 1000 + EXTRA)))
def test_controller_threads_at_random_over_damaged_page_files(
        tmp_path: Path, backends: list[Any], seed: int, zero_copy: bool) -> None:
    pool = host_pool(PAGES)
    backend = attach(backends, tmp_path, pool, interface_v1=True,
                     options={"zero_copy": zero_copy, "disk_bytes": 10 * (1 << 20) // 64})
    oracle = Oracle(pool)
    keys = [f"page-{seed}-{i}" for i in range(KEYS)]

    def damage(r: random.Random) -> None:
        # os.walk skips a directory removed meanwhile (clear() runs on the other thread)
        files = [Path(top, name) for top, _, names in os.walk(tmp_path) for name in names if len(name) == 32]
        if not files:
            return
        path = r.choice(files)
        try:
            how = r.choice(("flip", "truncate", "unlink"))
            if how == "flip":
                raw = bytearray(path.read_bytes())
                if len(raw) > 4096:
                    raw[r.randrange(4096, len(raw))] ^= 0x20
                    path.write_bytes(bytes(raw))
            elif how == "truncate":
                os.truncate(path, r.choice((0, 4096)))
            else:
                path.unlink()
        except FileNotFoundError:
            pass  # evicted or cleared meanwhile

    errors: list[BaseException] = []
    threads = [threading.Thread(target=prefetch, args=(backend, oracle, random.Random(seed * 2), keys, errors, damage),
                                name="rev167-prefetch"),
               threading.Thread(target=backup, args=(backend, oracle, random.Random(seed * 2 + 1), keys, errors),
                                name="rev167-backup")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * ROUNDS * CALL_BOUND_S)
        assert not thread.is_alive()
    if errors:
        raise errors[0]
    oracle.check(range(PAGES))
    assert oracle.arrived > 0  # the drive read pages back, not only misses
