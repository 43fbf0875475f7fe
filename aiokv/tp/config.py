"""Settings of the manager ↔ rank-worker link: queue bounds, timeouts, backoff, CUDA registration."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from aiokv.kernels.mover import PACE_BYTES
from aiokv.pool import DEFAULT_CHUNK_BYTES, DEFAULT_WORKERS

from .wire import CONTROL_FRAME_BYTES


@dataclass(frozen=True)
class TPConfig:
    """Bounds and timeouts of :class:`~aiokv.tp.RankGroup` and :class:`~aiokv.tp.RankWorker`.

    The link's own settings, used on both sides of it: rank processes build one without a
    :class:`~aiokv.CacheConfig`, so it is not nested in one; a :class:`~aiokv.tp.TPCache` takes it
    as ``tp_config``. Defaults shared with the pool come from :mod:`aiokv.pool`."""

    max_jobs: int = 1024
    """Jobs a group keeps in flight; ``submit`` waits and ``submit_nowait`` raises ``asyncio.QueueFull`` beyond."""
    worker_max_inflight: int = 256
    """Specs one worker runs at once; beyond it the worker stops reading its socket (backpressure)."""
    max_frame_bytes: int = 64 << 20
    """Largest frame either side accepts; a longer length prefix is a protocol error. At least
    :data:`~aiokv.tp.wire.CONTROL_FRAME_BYTES` (the hello exchange's and reports' frames)."""
    handshake_timeout_s: float = 10.0
    """Seconds a connection has to finish the hello exchange (the worker's pool attach included),
    and a worker's close waits at most for the manager to end the link after its CLOSED frame."""
    close_timeout_s: float = 30.0
    """Seconds ``RankGroup.aclose`` waits for jobs in flight before fencing the ranks still copying
    (it then waits for their reports, warning every ``close_timeout_s``)."""
    abandon_copies_s: float = 30.0
    """Seconds a worker's teardown still waits for its running copies once it is cancelled while
    waiting for them (an application's shutdown: a SIGTERM handler cancelling every task, or
    ``asyncio.run`` ending). Past it the copies are abandoned to the process's exit: no CLOSED, the
    pool stays mapped, the connection stays open until they end, and no worker of this process
    says hello for the rank again, so the manager holds the rank's jobs until the copies end or
    the process exits (then they fail: misses, never wrong KV)."""
    reconnect_initial_s: float = 0.01
    """First delay before a worker reconnects after a failed attempt; doubles on each failure."""
    reconnect_max_s: float = 1.0
    """Longest delay between a worker's reconnect attempts."""
    register_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes of the attached pool a CUDA worker registers per chunk (in the background)."""
    register_threads: int = DEFAULT_WORKERS
    """Threads a CUDA worker registers its pool mapping with."""
    pace_bytes: int = PACE_BYTES
    """How far a CUDA rank's layer-wise load runs ahead of the GPU (``PageMover.start_layers``): an
    engine stream sharing a hardware queue with the copy stream waits for at most this many bytes."""
    inline_copy_bytes: int = 256 << 10
    """A CPU rank's copy of at most this many bytes runs on the worker's loop when none is queued on
    the copy thread (the hop there and back, two thread wake-ups, costs more); 0: always hop."""
    stream_marks: int = 256
    """Load streams' marks a rank keeps (the newest; on CUDA one event each, recorded on the engine's
    stream when the stream began): a spec of a stream whose mark is gone is ordered after the
    engine's stream at its launch instead, as it was before marks (later, never unordered)."""
    offload_runs: bool = True
    """A CUDA rank offloads each page whose slots are one ascending run with one 2-D copy-engine
    memcpy straight from its KV buffer (``PageMover(slot_runs=True)``): no gather kernel, so rank
    processes sharing a GPU do not time-slice its SMs for their offloads. False: always gather."""

    def __post_init__(self) -> None:
        if not isinstance(self.offload_runs, bool):
            raise ValueError(f"TPConfig.offload_runs must be a bool, got {self.offload_runs!r}")
        for field in fields(self):
            if field.name == "offload_runs":
                continue
            value = getattr(self, field.name)
            low_ok = field.name == "inline_copy_bytes" and value == 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (not value > 0 and not low_ok):
                zero = " (or 0)" if field.name == "inline_copy_bytes" else ""
                raise ValueError(f"TPConfig.{field.name} must be a positive number{zero}, got {value!r}")
            if isinstance(value, int) and value > 2**63 - 1:
                # Before math.isfinite, which raised OverflowError on an int too large for a float.
                raise ValueError(f"TPConfig.{field.name} must be at most 2**63 - 1, got an int of "
                                 f"{value.bit_length()} bits")
            if not math.isfinite(value):  # an endless timeout or backoff would hang, not fail
                raise ValueError(f"TPConfig.{field.name} must be finite, got {value!r}")
            if field.type == "int" and not isinstance(value, int):
                raise ValueError(f"TPConfig.{field.name} must be an int, got {value!r}")
        if self.max_frame_bytes < CONTROL_FRAME_BYTES:
            # Every connection would end at its first frame and the workers reconnect forever.
            raise ValueError(f"TPConfig.max_frame_bytes must be at least {CONTROL_FRAME_BYTES} (the protocol's "
                             f"longest control frame: a WELCOME naming its pool), got {self.max_frame_bytes}")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("TPConfig.reconnect_max_s must be >= reconnect_initial_s")
