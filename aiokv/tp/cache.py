"""`TPCache`: the scheduler side of a tensor-parallel group — one pool, one page table, one disk tier.

The engine's scheduler process owns it; each rank process runs a :class:`aiokv.tp.RankWorker` with
its own slice of the KV buffer, connected to :attr:`TPCache.address`::

    async with TPCache(config, layout, tp_size=2, num_slots=S) as cache:   # scheduler
        await cache.wait_ranks()
        hit = await cache.match(tokens)
        await cache.load(hit, slots)             # every rank scatters its heads into `slots`
        await cache.offload(tokens, slots)       # every writer rank gathers its heads; the page is
                                                 # committed only when all of them succeeded
    async with RankWorker(address, rank, 2, layout, kv_slice): ...         # rank process r

Pages hold every head (each rank writes its slice of the same pool page), so keys are the same for
every rank and one ``match`` serves all of them. Pages are rank-major (:meth:`KVLayout.for_tp`):
each rank's heads are one contiguous block of every page, which it copies whole (on a GPU, at the
copy engines' rate); the page format is in the fingerprint that keys and page files carry. Slots
are the scheduler's host indices, the same on every rank. A rank that fails, dies or is not attached
fails the transfer: an offload then stores nothing of it and a load is shortened (to a miss);
nothing partial is ever served. Each call is admitted for the rank processes attached when it
begins: a rank restarted during the call (a spec held for room, a later offload round, a stream's
later launch) fails the call's remaining transfers instead of reading or writing the new process's
buffer, which holds its new engine's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import torch

from aiokv.config import CacheConfig
from aiokv.facade import CacheFacade
from aiokv.kernels.paths import DEFAULT_STAGING_PAGES
from aiokv.keys import Salt, Tokens, token_array
from aiokv.layout import KVLayout, TPSlice
from aiokv.manager import CacheManager
from aiokv.paths import path_setting
from aiokv.results import LoadResult, Match, OffloadResult
from aiokv.slots import check_host_slots

from .config import TPConfig
from .group import GroupStatistics, RankGroup
from .stream import TPLoadStream
from .transfers import GroupTransfers
from .wire import MAX_TP_SIZE


class TPCache(CacheFacade):
    """Tiered KV cache shared by the ``tp_size`` ranks of one engine (see the module docstring).

    ``num_slots``: token slots of each rank's KV buffer (the same on every rank; a rank whose buffer
    has fewer is refused at attach: :class:`~aiokv.tp.WorkerRefusedError` there). ``directory``:
    where the workers' socket lives (a private 0700 directory; a fresh temporary one when None).
    Raises ``ValueError`` when ``tp_size`` and the layout's heads do not divide or ``config`` sets
    what only the ranks use (``transfer_path``, ``staging_pages``), ``TypeError`` for arguments of
    the wrong type.
    """

    def __init__(
        self,
        config: CacheConfig | None,
        layout: KVLayout,
        *,
        tp_size: int,
        num_slots: int,
        tp_config: TPConfig | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        if config is None:
            config = CacheConfig()
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if config.tp_size != 1 or config.tp_rank != 0:
            raise ValueError("CacheConfig.tp_rank/tp_size are for one-process caches; pass tp_size to TPCache")
        # The ranks move the bytes: their copy settings are theirs (RankWorker(path=...)). Given to the
        # manager they were silently ignored.
        if config.transfer_path is not None:
            raise ValueError("CacheConfig.transfer_path is not used by a TPCache: each rank picks its path "
                             "(RankWorker(..., path=...))")
        if config.staging_pages != DEFAULT_STAGING_PAGES:
            raise ValueError("CacheConfig.staging_pages is not used by a TPCache: the ranks' movers keep "
                             "their own staging")
        TPSlice.of(layout, 0, tp_size)  # tp_size and the heads divide (ValueError/TypeError)
        if tp_size > MAX_TP_SIZE:
            # The start built a slice per rank (2**63 ranks: it never returned), and no worker could say hello.
            raise ValueError(f"tp_size must be at most {MAX_TP_SIZE} (a rank's hello carries it in 16 bits), "
                             f"got {tp_size}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 0 < num_slots <= 2**63 - 1:
            raise ValueError(f"num_slots must be a positive int of at most 2**63 - 1 (slots are int64), "
                             f"got {num_slots!r}")
        if tp_config is not None and not isinstance(tp_config, TPConfig):
            raise TypeError(f"tp_config must be a TPConfig, got {type(tp_config).__name__}")
        if directory is not None:
            # Here, not at start: there an int raised naming nothing, and "" was the working directory.
            directory = path_setting(directory, "directory")
        self.config = config
        self.layout = layout
        self.tp_size = tp_size
        self.num_slots = num_slots
        self._tp_config = tp_config
        self._directory = directory
        self.page_layout = layout.for_tp(tp_size)
        """The pool's and page files' format: rank-major, one part per head slice (its fingerprint keys
        every page, so caches of another TP split over the same ``disk_dir`` never serve these bytes)."""
        # The ranks move the bytes: the rates are labelled by their device, known once they attach.
        self._manager = CacheManager(config, self.page_layout, device_later=True)
        self._group: RankGroup | None = None
        self._transfers: GroupTransfers | None = None
        self._close_task: asyncio.Future[None] | None = None
        self._starting: asyncio.Future[None] | None = None  # resolved when a start() in flight has settled

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the pool and the disk tier, and listen for rank workers.

        Raises ``RuntimeError`` after :meth:`aclose`, and when ``aclose`` is called while it runs:
        the close waits for it, and it stops listening (closes the rank group it opened) before
        it raises, so nothing it made outlives the cache.
        """
        if self._close_task is not None:
            raise RuntimeError("the TPCache is closed: a closed cache cannot be started again")
        if self._group is not None:
            self._manager.check_running()
            return
        if self._starting is not None and not self._starting.done():
            raise RuntimeError("TPCache.start() is already running")
        starting = self._starting = asyncio.get_running_loop().create_future()
        try:
            pool = await self._manager.start()
            self._check_not_closing()
            group = RankGroup(
                self.layout, self.tp_size, pool.name, pool.num_pages, config=self._tp_config,
                directory=self._directory, on_all_attached=self._manager.set_device, num_slots=self.num_slots,
            )
            await group.start()
            if self._close_task is not None:
                # The close began while the group started listening: its _close never saw it.
                await group.aclose()
                self._check_not_closing()
            self._group = group
            self._transfers = GroupTransfers(group)
            self._manager.attach(self._transfers)
        finally:
            starting.set_result(None)

    def _check_not_closing(self) -> None:
        if self._close_task is not None:
            raise RuntimeError("the TPCache was closed while it was starting")

    async def aclose(self) -> None:
        """Wait (bounded) for write-behind and transfers in flight, fence the ranks still copying and
        wait for them, stop serving workers, free the pool (see :meth:`RankGroup.aclose`).

        When it returns, no rank copies into or out of its KV buffer for this cache (and every
        ``load``/``offload`` that ended reported what landed). Idempotent. Workers notice and wait to
        re-attach to a new manager. The close runs once, in a task every call waits for: a cancelled
        ``aclose`` raises but the close goes on to the end (the pool is freed once the ranks are done).
        """
        if self._close_task is None or self._close_task.cancelled():
            # Run anew when a loop-wide cancel (an application's SIGTERM handler cancelling every
            # task) ended the close's own task while it waited for the ranks: every later call
            # raised that cancel at once and the pool was never freed (review 204). Each step of
            # _close may run again (each close it awaits is idempotent).
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        if self._starting is not None:
            # A start in flight may still be opening the rank group: it closes it and raises.
            await self._starting
        await self._manager.aclose()
        if self._group is not None:
            await self._group.aclose()
        await self._manager.close_pool()

    @property
    def group(self) -> RankGroup:
        """The rank group (after start)."""
        if self._group is None:
            raise RuntimeError("TPCache is not started: use `async with TPCache(...)` or await start()")
        return self._group

    @property
    def address(self) -> str:
        """The socket path rank workers connect to."""
        return os.fspath(self.group.address)

    async def wait_ranks(self) -> None:
        """Wait until every rank's worker is attached to this cache's pool."""
        await self.group.wait_attached()

    # -- the scheduler's calls ------------------------------------------------------------------

    async def load(self, match: Match, slots: torch.Tensor, *, from_token: int = 0) -> LoadResult:
        """Every rank copies tokens ``[from_token, match.tokens)`` into its ``slots`` (host indices).

        Returns when every rank reported; a rank that failed or is gone shortens the result (to
        the pages before that transfer). Raises ``TypeError``/``ValueError`` for bad arguments.
        """
        count = self._manager.check_load(match, from_token)
        host = check_host_slots(slots, count, self.num_slots)
        with self._admitted():  # its copies go only to the rank processes attached now
            return await self._manager.load(match, host, from_token)

    def start_load(
        self, match: Match, slots: torch.Tensor, *, from_token: int = 0, layered: bool = False
    ) -> TPLoadStream:
        """A compute-or-load split over ``match`` for every rank (see :class:`aiokv.stream.LoadStream`).

        ``layered``: every rank copies layer by layer; ``stream.wait_layer(l)`` resolves once all
        ranks have layer ``l``, and each rank's engine waits on its own copies through
        ``RankWorker.wait_layer(stream.layered_load(), l)`` (see :mod:`aiokv.tp.stream`). Returns at
        once (unlike ``KVCache.start_load``, not a coroutine: host slots need no device round trip).
        Consumes ``match``; raises ``TypeError``/``ValueError`` for bad arguments (nothing changes).
        """
        if not isinstance(layered, bool):
            raise TypeError(f"layered must be a bool, got {type(layered).__name__}")
        count = self._manager.check_load(match, from_token)
        host = check_host_slots(slots, count, self.num_slots)
        self._manager.check_running()
        assert self._transfers is not None  # running implies started
        with self._transfers.admitted():  # its loader task, created here, keeps the ranks' sessions
            return TPLoadStream(self._manager, self._transfers, match, host, from_token, layered)

    async def offload(self, tokens: Tokens, slots: torch.Tensor, *, salt: Salt = None) -> OffloadResult:
        """Every writer rank copies its heads of ``tokens``' full pages from ``slots`` into the pool.

        A page is committed only when all of them succeeded; returns when the ranks may reuse the
        slots. Raises ``TypeError``/``ValueError`` for bad arguments (nothing changes).
        """
        self._manager.check_running()
        ids = token_array(tokens)
        host = check_host_slots(slots, int(ids.size), self.num_slots)
        with self._admitted():  # every round's copies read only the rank processes attached now
            return await self._manager.offload(ids, host, salt)

    def _admitted(self) -> contextlib.AbstractContextManager[tuple[int, ...]]:
        """The call's admission (:meth:`GroupTransfers.admitted`): the ranks' sessions now."""
        assert self._transfers is not None  # checked running by the caller
        return self._transfers.admitted()

    def group_statistics(self) -> GroupStatistics:
        """Ranks attached, connections and jobs of the rank group."""
        return self.group.statistics()
