"""CPU offloads by :class:`HostGather`: a few torch calls a launch group, and the copy thread's jobs
as before (one job a group: withdrawn before it runs, it never runs).

Every torch call lets the GIL go (the op, and freeing each temporary): beside an engine thread that
runs Python, each can cost the copy thread a switch interval. ``reference_gather`` makes 2 copying
calls per layer (``index_select`` or a slice, ``index_copy_``) and views around them; these tests
pin one copying call per segment and run of pool pages from a run of slots, whatever the layers.
Bit-exactness: ``test_host_gather_props``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from kvcase import distinct_slots, full_kv, random_bits, rank_kv
from loop_probes import until_thread
from test_host_scatter import _Calls
from torch.utils._python_dispatch import TorchDispatchMode

from aiokv import CacheConfig, KVCache
from aiokv.cuda import CompletionBridge
from aiokv.kernels import PageMover, reference_gather
from aiokv.kernels.hostcopy import HostGather
from aiokv.layout import BufferForm, KVBuffer, KVLayout, TPSlice

COPYING = ("copy_", "index", "index_put_", "index_put", "index_select", "index_copy_", "_index_put_impl_", "clone")
"""aten ops that move bytes (views, slices and ``as_strided`` do not)."""


class _Ops(TorchDispatchMode):
    """The aten ops torch calls dispatch to (an indexed read is ``index``, an assignment ``index_put_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def copying(self) -> list[str]:
        return [n for n in self.names if n in COPYING]


def _case(num_layers: int, form: BufferForm = BufferForm.STACKED) -> tuple[KVBuffer, torch.Tensor]:
    layout = KVLayout.mha(num_layers, 2, 8, torch.float16, page_tokens=4)
    gen = torch.Generator().manual_seed(num_layers)
    kv = rank_kv(layout, full_kv(layout, 64, gen), form, TPSlice.of(layout), torch.device("cpu"))
    return kv, random_bits((11, *layout.page_shape), layout.dtype, gen)


def _expected(kv: KVBuffer, pages: torch.Tensor, slots: torch.Tensor, ids: list[int]) -> torch.Tensor:
    out = pages.clone()
    reference_gather(kv, slots, out, ids, True)
    return out


@pytest.mark.parametrize("num_layers", [2, 32])
@pytest.mark.parametrize(("ids", "slots", "copying"), [
    # A run of pool pages from a run of slots: one copy_ of every layer at once.
    ([3, 4, 5, 6, 7, 8], torch.arange(10, 10 + 24), ["copy_"]),
    # Pool pages in more runs than runs save: one indexed assignment (from the slots' view).
    ([9, 1, 5, 6, 0, 3], torch.arange(10, 10 + 24), ["index_put_"]),
    # Spread slots (a block table): one index_select into a temporary and one copy.
    ([3, 4, 5, 6, 7, 8], torch.arange(60).view(15, 4)[[5, 0, 9, 2, 14, 7]].flatten(), ["index_select", "copy_"]),
], ids=["runs", "spread-pages", "spread-slots"])
def test_a_launch_group_through_the_mover_is_one_copying_call_a_run_whatever_the_layers(
    num_layers: int, ids: list[int], slots: torch.Tensor, copying: list[str],
) -> None:
    # The old mover went by reference_gather: index_copy_ per layer (and index_select per layer
    # for spread slots), and ~14 torch calls a layer from Python: >= 32 copying ops at 32 layers.
    kv, pages = _case(num_layers)
    expected = _expected(kv, pages, slots, ids)
    mover = PageMover(kv, pages)
    with _Calls() as calls, _Ops() as ops:
        assert mover.offload(slots, ids, checked=True) is None
    assert ops.copying() == copying, ops.names
    assert len(calls.names) <= 12, calls.names  # tolist, a view, an index tensor, ...
    assert torch.equal(pages.view(torch.int16), expected.view(torch.int16))
    with _Calls() as ref_calls, _Ops() as ref:
        reference_gather(kv, slots, pages.clone(), ids, True)
    assert len(ref.copying()) >= num_layers and len(ref_calls.names) >= 4 * num_layers  # no longer done


def test_a_per_layer_buffer_is_one_call_a_layer() -> None:
    # Layers apart in memory (separate tensors): one copy_ a layer, no index ops.
    kv, pages = _case(4, BufferForm.SPLIT_KV)
    slots = torch.arange(8, 8 + 12)
    expected = _expected(kv, pages, slots, [2, 3, 4])
    host = HostGather(kv, pages)
    with _Ops() as ops:
        host.offload(slots, [2, 3, 4])
    assert ops.copying() == ["copy_"] * 2 * 4, ops.names  # K and V of each layer
    assert torch.equal(pages.view(torch.int16), expected.view(torch.int16))


def test_a_replica_that_does_not_write_writes_nothing() -> None:
    layout = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
    gen = torch.Generator().manual_seed(3)
    tp = TPSlice.of(layout, 3, 4)  # 4 ranks over 2 heads: rank 3 replicates rank 2's head
    assert not tp.writer
    kv = rank_kv(layout, full_kv(layout, 32, gen), BufferForm.STACKED, tp, torch.device("cpu"))
    pages = random_bits((4, *layout.page_shape), layout.dtype, gen)
    before = pages.clone()
    HostGather(kv, pages).offload(distinct_slots(8, 32, gen), [1, 2])
    assert torch.equal(pages.view(torch.int16), before.view(torch.int16))


@pytest.mark.asyncio
async def test_an_offload_cancelled_behind_its_running_group_runs_no_later_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One group a page: the first is held inside HostGather.offload on the copy thread, the others
    # queue behind it. Cancelled then, the call withdraws the queued groups (they never run), waits
    # for the running one, and stores nothing.
    layout = KVLayout.mha(2, 2, 8, torch.float32, page_tokens=4)
    kv = torch.randn(2, 64, 4, 8, generator=torch.Generator().manual_seed(9))
    gate, entered = threading.Event(), threading.Event()
    ran: list[list[int]] = []
    real = HostGather.offload

    def held(self: HostGather, slots: torch.Tensor, page_ids: list[int]) -> None:
        ran.append(list(page_ids))
        entered.set()
        assert gate.wait(60), "the test never let the copy run"
        real(self, slots, page_ids)

    monkeypatch.setattr(HostGather, "offload", held)
    withdrawn: list[bool] = []
    real_withdraw = CompletionBridge.withdraw

    def withdraw(self: CompletionBridge, future: asyncio.Future[Any]) -> bool:
        withdrawn.append(real_withdraw(self, future))
        return withdrawn[-1]

    monkeypatch.setattr(CompletionBridge, "withdraw", withdraw)
    config = CacheConfig(cpu_bytes=16 * layout.page_bytes, disk=None, namespace="gather-cancel",
                         pool_chunk_bytes=4 * layout.page_bytes, launch_pages=1, launch_turn_s=0)
    tokens = list(range(1000, 1000 + 4 * 4))
    async with KVCache(config, layout, kv) as cache:
        await cache.pool.wait_ready()
        task = asyncio.create_task(cache.offload(tokens, torch.arange(16)))
        try:
            await until_thread(entered.is_set, "the copy thread entered the first group")
            for _ in range(10):  # the launcher queues the other groups (launch_turn_s=0: one a turn)
                await asyncio.sleep(0)
            task.cancel()
            for _ in range(10):
                await asyncio.sleep(0)
            assert not task.done(), "the call returned while its group was still copying"
        finally:
            gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await cache.flush()
        assert withdrawn.count(True) >= 1, withdrawn  # groups were queued behind the held one
        assert len(ran) == 1, (ran, withdrawn)  # the withdrawn groups never ran
        assert (await cache.match(tokens)).tokens == 0  # nothing stored
        stats: Any = cache.stats()
        assert stats.pool_reserved == 0 and stats.pool_referenced == 0, stats
