"""Validation of the engine's slot indices before any state changes.

Slot indices are checked on the CPU: type, shape, count, range and duplicates. Indices that live
on a CUDA device are first read back by a copy ordered after the engine's current stream and
awaited through the completion bridge, so validation never blocks the event loop on the GPU.

The values are checked once per call, here (the launches below trust them), with numpy and a
bitmap of the buffer's slots kept from call to call: its cost follows the call's slots and their
span, not the buffer (a fresh ``zeros(num_slots)`` and torch's index ops per call, or a sort for a
large buffer, were 0.2-0.6 ms of a 16K-token streaming hit's loop step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from aiokv.cuda import CompletionBridge, Lane
from aiokv.layout import KVBuffer


def check_form(slots: object, count: int, name: str = "slots") -> torch.Tensor:
    """Type, dtype, shape and count of a slot tensor (values are checked separately)."""
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch tensor, got {type(slots).__name__}")
    if slots.is_nested or slots.layout is not torch.strided:
        # (a sparse tensor's numpy() raised torch's TypeError, a nested one's shape a RuntimeError)
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {slots.layout}"
                        f"{' (nested)' if slots.is_nested else ''}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(slots.shape)}")
    if slots.numel() != count:
        raise ValueError(f"{name} has {slots.numel()} entries, expected {count}")
    return slots


def warm_read_back(device: torch.device) -> None:
    """Load the device kernels that :meth:`SlotValidator.check` launches for strided CUDA slots.

    A strided slot tensor (a block table's column) is gathered on the device before its read-back,
    by torch's copy kernel for its dtype. Under CUDA lazy loading a kernel's first launch in a
    process loads it, which waits until the device is idle: the first load given such slots stalled
    the loop for as long as the engine's queued work (508 ms behind a 0.5 s kernel on an H100).
    Blocks the calling thread until its own stream is done: run it off the loop (the warm-up thread).
    """
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        for dtype in (torch.int32, torch.int64):
            torch.zeros(4, dtype=dtype, device=device)[::2].contiguous()
    stream.synchronize()


def check_host_slots(slots: object, count: int, num_slots: int, name: str = "slots") -> torch.Tensor:
    """Validate host slot indices of a KV buffer of ``num_slots`` slots; returns them as int64.

    For a scheduler that holds no KV buffer (the slots are the same on every rank). Raises
    ``TypeError``/``ValueError``; a CUDA tensor is refused (pass the scheduler's host copy).
    """
    tensor = check_form(slots, count, name)
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a host (CPU) tensor here, got one on {tensor.device}")
    # Always a copy of our own: the caller may reuse its index buffer as soon as the call returns
    # (a streaming load launches later, from these validated values, without checking again).
    tensor = tensor.to(torch.int64, copy=True)
    if count:
        check_values(tensor, num_slots, None, name)
    return tensor


def check_values(slots: torch.Tensor, num_slots: int, seen: np.ndarray[Any, np.dtype[np.bool_]] | None,
                 name: str = "slots") -> None:
    """``slots`` (a non-empty 1-D int64 CPU tensor) must be distinct slots in ``[0, num_slots)``.

    Distinct: marked in ``seen``, an all-False bool array of at least ``num_slots`` entries left
    all-False again (a caller's scratch, reused from call to call; None: one is made for the
    values' span), only the values' span counted and cleared; values spread over more than 32
    slots each are sorted instead. Either way the cost follows the call, not the buffer. Raises
    ``ValueError`` naming ``name``.
    """
    values = slots.numpy()
    low, high = int(values.min()), int(values.max())
    if low < 0:
        raise ValueError(f"{name} holds a negative slot ({low})")
    if high >= num_slots:
        raise ValueError(f"{name} holds slot {high}, out of range for a KV buffer of {num_slots} slots")
    span = high - low + 1
    if values.size > span:
        raise ValueError(f"{name} holds duplicated slots")
    if span > 32 * values.size:
        # Few slots spread wide: a sort of the call's values. Not np.unique: its first call imports
        # numpy.ma (85-104 ms holding the GIL on an H100 host, a loop stall of the first such load).
        ordered = np.sort(values)
        distinct = 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1]))
    elif seen is None:
        marks = np.zeros(span, np.bool_)
        marks[values - low] = True
        distinct = int(np.count_nonzero(marks))
    else:
        try:
            seen[values] = True
            distinct = int(np.count_nonzero(seen[low : high + 1]))
        finally:
            seen[low : high + 1] = False  # the span only: a memset, whatever the buffer's size
    if distinct != values.size:
        raise ValueError(f"{name} holds duplicated slots")


class SlotValidator:
    """Checks slot tensors against one KV buffer.

    ``track`` keeps an abandoned read-back's pinned buffer alive until its copy completes (the
    cache's background-job tracker).
    """

    def __init__(
        self,
        kv: KVBuffer,
        bridge: CompletionBridge,
        track: Callable[[asyncio.Future[Any], Callable[[], None]], None],
    ) -> None:
        self.kv = kv
        self._bridge = bridge
        self._track = track
        self._control_stream: torch.cuda.Stream | None = None
        # The bitmap check_values marks a call's slots in (all False between calls: a check never
        # awaits). Made at the first check: a byte per slot of the engine's buffer.
        self._seen: np.ndarray[Any, np.dtype[np.bool_]] | None = None

    async def check(self, slots: object, count: int, name: str = "slots") -> torch.Tensor:
        """Validate ``slots`` and return them as a CPU int64 tensor.

        Slots on a CUDA device are read back asynchronously (a copy ordered after the engine's
        current stream, awaited through the bridge), so validation never blocks the loop on the GPU.
        """
        slots = check_form(slots, count, name)
        if slots.device != self.kv.device and slots.device.type != "cpu":
            raise ValueError(f"{name} is on {slots.device}, the KV buffer is on {self.kv.device}")
        host = await self._to_host(slots) if slots.device.type == "cuda" else slots
        # A copy of our own unless the read-back made one: launches after this call returned (a
        # streaming load's) use these validated values unchecked, whatever the caller does to its buffer.
        host = host.to(torch.int64, copy=host is slots)
        if count:
            # Taken for the check and put back after: a check from another thread meanwhile (outside
            # the one-loop contract, but then never a wrong verdict) gets None and makes its own marks.
            seen, self._seen = self._seen, None
            if seen is None:
                seen = np.zeros(self.kv.num_slots, np.bool_)
            try:
                check_values(host, self.kv.num_slots, seen, name)  # range and duplicates, once per call
            finally:
                self._seen = seen
        return host

    async def _to_host(self, slots: torch.Tensor) -> torch.Tensor:
        host = torch.empty(slots.shape, dtype=slots.dtype, pin_memory=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(slots.device))
        if self._control_stream is None:
            self._control_stream = torch.cuda.Stream(slots.device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self._control_stream):
            self._control_stream.wait_event(ready)
            # Contiguous on the device first: torch's copy of a strided CUDA tensor into pinned
            # memory blocked the host (here: the loop) until the engine's queued work ended (~0.5 s
            # behind a 0.5 s kernel on the H200, eager module loading or lazy alike). The gather
            # runs on the control stream, after ``ready``; its memory belongs to that stream.
            host.copy_(slots if slots.is_contiguous() else slots.contiguous(), non_blocking=True)
            # Blocking: the control lane's waiter sleeps on it (the read-back may wait behind the
            # engine's whole stream) instead of spinning a core that the loop thread needs.
            done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            done.record(self._control_stream)
        slots.record_stream(self._control_stream)
        future = self._bridge.wait(done, Lane.CONTROL)
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            keep = [host]  # the pinned buffer must outlive the DMA into it
            self._track(future, keep.clear)
            raise
        return host
