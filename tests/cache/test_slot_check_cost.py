"""The slot check at the public edge (``aiokv.slots``): right answers on every path, and a cost that
follows the call's slots, not the engine's buffer (issue #10: it was a fresh ``zeros(num_slots)``
and torch index ops per call, 0.2-0.6 ms of a streaming hit's loop step)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aiokv.cuda import CompletionBridge
from aiokv.layout import KVBuffer, KVLayout
from aiokv.slots import SlotValidator, check_values

LAYOUT = KVLayout.mha(1, 1, 8, torch.float16, page_tokens=4)


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor a torch op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.largest = max(self.largest, item.numel())
        self.ops.append(str(func))
        return out


def _validator(num_slots: int) -> SlotValidator:
    kv = KVBuffer.wrap(LAYOUT, torch.zeros(LAYOUT.num_layers, num_slots, LAYOUT.rows, LAYOUT.head_dim,
                                           dtype=LAYOUT.dtype))
    return SlotValidator(kv, CompletionBridge(), lambda future, finish: None)


@pytest.mark.asyncio
async def test_a_check_builds_nothing_the_size_of_the_buffer() -> None:
    # 256 slots of a 2048-slot buffer (8x: the old check's bitmap case): before, every call made a
    # zeros(2048) and scattered into it; now nothing torch makes is larger than the call's slots.
    validator = _validator(2048)
    slots = torch.randperm(2048)[:256]
    for _ in range(3):
        with _Sizes() as sizes:
            host = await validator.check(slots, 256)
        assert sizes.largest <= 256, (sizes.largest, sizes.ops)
        assert torch.equal(host, slots)


@pytest.mark.asyncio
@pytest.mark.parametrize("num_slots", [64, 4096], ids=["bitmap", "sort"])
async def test_every_bad_value_is_refused_and_the_scratch_stays_clean(num_slots: int) -> None:
    validator = _validator(num_slots)
    distinct = torch.arange(0, 64, 2) if num_slots == 64 else torch.arange(0, 4096, 128)
    bad: list[tuple[torch.Tensor, str]] = [
        (torch.cat([distinct[:-1], distinct[3:4]]), "duplicated"),  # one repeat, far from its twin
        (torch.full((32,), 5), "duplicated"),
        (torch.cat([distinct[:-1], torch.tensor([num_slots])]), "out of range"),
        (torch.cat([torch.tensor([-1]), distinct[1:]]), "negative"),
    ]
    for _ in range(2):  # a refused call must leave the reused bitmap clean for the next one
        for slots, what in bad:
            with pytest.raises(ValueError, match=what):
                await validator.check(slots.to(torch.int32), 32)
        assert torch.equal(await validator.check(distinct, 32), distinct)
        # The same slots again, and their neighbours: none was left marked by an earlier call.
        assert torch.equal(await validator.check(distinct + 1, 32), distinct + 1)


def test_check_values_without_a_scratch_and_with_one_agree() -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        num_slots = int(torch.randint(n, 4 * n + 2, (1,), generator=gen))
        values = torch.randint(0, num_slots, (n,), generator=gen)
        expect_ok = int(torch.unique(values).numel()) == n
        seen = np.zeros(num_slots, np.bool_)
        for scratch in (None, seen):
            try:
                check_values(values, num_slots, scratch)
                ok = True
            except ValueError:
                ok = False
            assert ok == expect_ok, (trial, values.tolist())
        assert not seen.any()


def test_checks_from_two_threads_never_share_the_bitmap() -> None:
    # Outside the one-loop contract, but a verdict must never be wrong: a validator checked from two
    # threads (each with its own loop) let duplicated slots pass and refused distinct ones while
    # both marked the one bitmap (numpy releases the GIL there).
    import asyncio
    import threading
    import time

    from aiokv.cuda import CompletionBridge
    from aiokv.layout import KVBuffer
    from aiokv.slots import SlotValidator

    slots, n = 1 << 18, 50_000
    kv = KVBuffer.wrap(LAYOUT, torch.zeros(LAYOUT.num_layers, slots, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype))
    bridge = CompletionBridge()
    validator = SlotValidator(kv, bridge, lambda f, c: None)
    good = torch.arange(n, dtype=torch.int64)
    dup = torch.arange(n, dtype=torch.int64)
    dup[1] = 0
    wrong = {"good": 0, "dup": 0}
    checks = {"good": 0, "dup": 0}
    stop = time.monotonic() + 3

    def run(name: str, tensor: torch.Tensor, should_pass: bool) -> None:
        async def go() -> None:
            while time.monotonic() < stop:
                try:
                    await validator.check(tensor, n)
                    passed = True
                except ValueError:
                    passed = False
                checks[name] += 1
                wrong[name] += passed != should_pass

        asyncio.run(go())

    threads = [threading.Thread(target=run, args=("good", good, True)),
               threading.Thread(target=run, args=("dup", dup, False))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        bridge.close()
    assert checks["good"] > 0 and checks["dup"] > 0
    assert wrong == {"good": 0, "dup": 0}, (wrong, checks)
