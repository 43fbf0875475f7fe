"""`KVCache`: the object an inference engine embeds.

A thin facade over two halves that also run apart: the :class:`aiokv.manager.CacheManager`
(keys, page table, tiers, counters; no engine tensors) and an in-process worker
(:class:`aiokv.transfers.LocalTransfers`: the kernels moving bytes between the engine's KV buffer
and the pool). It validates every argument at this edge, the slot indices against the engine's
buffer included, before anything changes.

Four coroutines on one event loop: ``match`` (longest cached prefix), ``load`` (prefix into the
engine's KV slots), ``offload`` (the engine's KV into the pool, then write-behind to disk) and
``prefetch`` (disk -> pool). A cancelled caller never leaks a reference and never leaves a copy
touching its slots (see ``docs/design.md``, cancellation contract).
"""

from __future__ import annotations

import asyncio
import importlib
import sys

import torch

from aiokv.config import CacheConfig
from aiokv.cuda import CompletionBridge
from aiokv.facade import CacheFacade
from aiokv.kernels import TransferPath
from aiokv.kernels.mover import PageMover
from aiokv.keys import Salt, Tokens, token_array, tp_part
from aiokv.layout import KVBuffer, KVBufferLike, KVLayout, TPSlice
from aiokv.manager import CacheManager
from aiokv.pool import run_in_new_thread
from aiokv.results import LoadResult, Match, OffloadResult
from aiokv.slots import SlotValidator
from aiokv.stream import LoadStream
from aiokv.transfers import LocalTransfers


def _nothing(_: object) -> None:
    """A closed bridge leaves nothing to dispose of."""


class KVCache(CacheFacade):
    """Tiered KV cache for one model layout and one engine KV buffer.

    ``kv_buffer`` is the engine's KV cache: a tensor ``[L, S, rows, D]``, a list of L tensors
    ``[S, rows, D]`` or ``(k_list, v_list)`` of ``[S, H, D]`` (see :class:`aiokv.layout.KVBuffer`),
    on a CUDA device or the CPU. Use as ``async with KVCache(config, layout, kv) as cache``.
    """

    def __init__(self, config: CacheConfig | None, layout: KVLayout, kv_buffer: KVBufferLike) -> None:
        if config is None:
            config = CacheConfig()
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.config = config
        self.layout = layout
        self.tp = TPSlice.of(layout, config.tp_rank, config.tp_size)
        self.kv = KVBuffer.wrap(layout, kv_buffer, self.tp)
        self._cuda = self.kv.device.type == "cuda"
        # Pages of a rank that holds part of the heads carry only its rows: key them apart.
        self._manager = CacheManager(
            config, layout, part=tp_part(self.tp, layout), writer=self.tp.writer, register_cuda=self._cuda
        )
        self._bridge = CompletionBridge()
        self._slots = SlotValidator(self.kv, self._bridge, self._manager.track)
        self._transfers: LocalTransfers | None = None

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the pool, the copy engine and (when configured) the disk tier.

        Raises ``RuntimeError`` after :meth:`aclose`.
        """
        if self._transfers is not None:
            self._manager.check_running()
            return
        # Threads before the pool's preparation holds the mmap lock (see CompletionBridge.prestart).
        self._bridge.prestart(self._cuda)
        pool = await self._manager.start()
        cfg = self.config
        path = cfg.transfer_path or (TransferPath.STAGING if self._cuda else TransferPath.REFERENCE)
        if path is not TransferPath.REFERENCE and "aiokv.kernels.launch" not in sys.modules:
            # Triton takes a few hundred ms to import: in a thread, never on the loop (the mover's
            # own modules come with the package: an import holds the GIL while the loop waits).
            await asyncio.to_thread(importlib.import_module, "aiokv.kernels.launch")
        mover = PageMover(self.kv, pool.pages, path, cfg.staging_pages, run_pages=pool.chunk_pages)
        self._transfers = LocalTransfers(mover, self._bridge, self.kv.device)
        self._manager.attach(self._transfers)

    async def aclose(self) -> None:
        """Wait (up to ``close_timeout``) for background copies and write-behind, then free everything.

        Idempotent.
        """
        await self._manager.aclose()
        # Joins the bridge's threads: off the loop, on a thread the loop does not wait to start
        # (to_thread's first call would start the default executor's thread here).
        await run_in_new_thread(self._bridge.close, "aiokv-bridge-close", _nothing)
        await self._manager.close_pool()

    # -- the engine's calls ---------------------------------------------------------------------

    async def load(self, match: Match, slots: torch.Tensor, *, from_token: int = 0) -> LoadResult:
        """Copy tokens ``[from_token, match.tokens)`` of ``match`` into the KV ``slots``.

        ``slots``: 1-D integer tensor, one slot per token, ``len == match.tokens - from_token``.
        Pool pages start copying at once; disk pages are read into the pool and copied as each
        arrives. Returns when the data is in the KV buffer and the current CUDA stream is ordered
        after the copies. A fault below shortens the result to the valid contiguous prefix.
        Consumes ``match``. Raises ``TypeError``/``ValueError`` for bad arguments (nothing changes).
        """
        count = self._manager.check_load(match, from_token)
        host = await self._slots.check(slots, count)
        return await self._manager.load(match, host, from_token)

    async def start_load(
        self, match: Match, slots: torch.Tensor, *, from_token: int = 0, layered: bool = False
    ) -> LoadStream:
        """Start loading ``match`` from its last page backwards while the engine computes it from the
        front: a compute-or-load split (see :class:`aiokv.stream.LoadStream`). Returns at once.

        Arguments as for :meth:`load`; consumes ``match``. ``layered``: copy layer by layer, so the
        engine can prefill the uncached tail while later layers still arrive (``stream.launched()``,
        then ``wait_layer``/``order_layer`` before each layer). Raises ``TypeError``/``ValueError``
        for bad arguments (nothing changes).
        """
        if not isinstance(layered, bool):
            raise TypeError(f"layered must be a bool, got {type(layered).__name__}")
        count = self._manager.check_load(match, from_token)
        host = await self._slots.check(slots, count)
        return self._manager.start_load(match, host, from_token, layered)

    async def offload(self, tokens: Tokens, slots: torch.Tensor, *, salt: Salt = None) -> OffloadResult:
        """Copy the KV of the full pages of ``tokens`` (held in ``slots``) into the pool.

        ``slots``: 1-D integer tensor, one KV slot per token (``len(slots) == len(tokens)``).
        Pages already cached or being written are skipped; the rest are gathered on a side stream
        ordered after the current CUDA stream, committed, then queued for disk. Returns when the
        engine may reuse the slots. Pool exhaustion and copy faults are counted, never raised;
        bad arguments raise ``TypeError``/``ValueError`` before anything changes.
        """
        self._manager.check_running()
        ids = token_array(tokens)
        host = await self._slots.check(slots, int(ids.size))
        return await self._manager.offload(ids, host, salt)


