"""Rank processes whose copies the test holds: the real worker in a real process, each CPU copy
(HostGather.offload or HostScatter.load inside the rank's mover) waiting for the test before it moves a byte.

Importable by spawned children (tests/tp is on their ``sys.path``).
"""

from __future__ import annotations

import multiprocessing.connection
from dataclasses import dataclass
from typing import Any

from tp_helpers import CONFIG, SLOTS, RankProcesses, rank_main

from aiokv.layout import KVLayout
from aiokv.tp import TPConfig


@dataclass(frozen=True)
class Held:
    """Process-shared handles of one held rank (pickled into the child at spawn)."""

    entered: Any
    """Semaphore: released once per copy that began (before it waits on ``gate``)."""
    gate: Any
    """Semaphore: each copy acquires it before it moves its bytes (the test releases it)."""
    finished: Any
    """Shared int: copies whose bytes are fully written."""

    def release(self, copies: int = 1) -> None:
        for _ in range(copies):
            self.gate.release()

    def finished_copies(self) -> int:
        with self.finished.get_lock():
            return int(self.finished.value)


def _hold(held: Held) -> None:
    from aiokv.kernels import mover

    def wrap(copy: Any) -> Any:
        def held_copy(*args: Any) -> None:
            held.entered.release()
            assert held.gate.acquire(timeout=120), "the test never let this copy run"
            copy(*args)
            with held.finished.get_lock():
                held.finished.value += 1

        return held_copy

    mover.HostGather.offload = wrap(mover.HostGather.offload)  # type: ignore[method-assign]
    mover.HostScatter.load = wrap(mover.HostScatter.load)  # type: ignore[method-assign]


def held_rank_main(
    ctrl: multiprocessing.connection.Connection, address: str, rank: int, tp_size: int, layout: KVLayout,
    seed: int, slots: int, fill: bool, threaded: bool, config: TPConfig, held: Held | None,
) -> None:
    if held is not None:
        _hold(held)
    rank_main(ctrl, address, rank, tp_size, layout, seed, slots, fill, threaded, "cpu", config)


class HeldRanks(RankProcesses):
    """CPU rank processes (even ranks: thread runner, odd: async runner); ranks in ``held`` have
    their copies held (see :class:`Held`)."""

    def __init__(
        self, address: Any, layout: KVLayout, tp_size: int, seed: int, held: frozenset[int],
        config: TPConfig = CONFIG, slots: int = SLOTS,
    ) -> None:
        super().__init__(address, layout, tp_size, seed, fill=True, slots=slots, config=config)
        self.held = {r: Held(self._ctx.Semaphore(0), self._ctx.Semaphore(0), self._ctx.Value("q", 0)) for r in held}

    def start(self, rank: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=held_rank_main,
            args=(child, self.address, rank, self.tp_size, self.layout, self.seed, self.slots, True,
                  rank % 2 == 0, self.config, self.held.get(rank)),
            daemon=True,
        )
        proc.start()
        child.close()
        self.procs[rank], self.ctrl[rank] = proc, parent
