"""A rank process whose KV buffer is too small for the cache (importable by spawned children)."""

from __future__ import annotations

import asyncio
import multiprocessing.connection

import torch
from tp_helpers import full_kv, rank_kv

from aiokv.layout import KVLayout
from aiokv.tp import RankWorker, TPConfig, WorkerRefusedError


def refused_rank_main(
    ctrl: multiprocessing.connection.Connection, address: str, rank: int, tp_size: int, layout: KVLayout,
    slots: int, config: TPConfig,
) -> None:
    """Run a worker over a buffer of ``slots`` slots until it ends; send ``("refused", error)`` when
    it was refused for good, ``("ended", None)`` otherwise."""
    torch.set_num_threads(1)
    kv = rank_kv(full_kv(layout, 1, slots), layout, rank, tp_size)

    async def main() -> None:
        worker = RankWorker(address, rank, tp_size, layout, kv, config)
        try:
            async with asyncio.timeout(120):
                await worker.run()
        except WorkerRefusedError as exc:
            ctrl.send(("refused", exc))
            return
        except TimeoutError:
            ctrl.send(("ended", "neither attached nor refused within 120 s"))
            return
        ctrl.send(("ended", None))

    asyncio.run(main())
