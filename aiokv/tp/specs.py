"""Transfer specs: what the manager asks every rank to copy, as small frozen values.

A spec names pool pages and token slots only: every rank applies it to its own head slice (slot
numbering is the same on every rank, as engines' block tables are). It crosses from the scheduler
process to the ranks over aiokv's socket (:mod:`aiokv.tp.wire`) or the engine's own channel: it is
picklable and has a compact binary form, little-endian::

    header  magic b"AKVS" | version u8 | direction u8 | slot width u8 (4 or 8) | flags u8
            | job id u64 | pool epoch u64 | page_tokens u32 | skip_first u32 | pages u32 | slots u32
            [| stream u64, only with the STREAM flag]
    body    page ids uint32 x pages | slots int32/int64 x slots

``flags`` bit 0: LAYERED (a LOAD copied layer by layer, with readiness per layer); bit 2: STREAM (a
LOAD of a load stream: the stream's id follows the fixed header, and each rank orders the copy after
the mark it recorded when that stream began, ``wire.StreamBegins``); other bits are 0. Version 2
added the STREAM flag; a spec of another version is refused.

:meth:`TransferSpec.from_bytes` accepts any bytes and raises ``ValueError`` for anything that is not
one well-formed spec (never another exception).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

SPEC_MAGIC = b"AKVS"
SPEC_VERSION = 2
_HEADER = struct.Struct("<4sBBBBQQIIII")
_STREAM = struct.Struct("<Q")
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_SLOT_DTYPES: dict[int, np.dtype[Any]] = {4: np.dtype("<i4"), 8: np.dtype("<i8")}
_PAGE_DTYPE = np.dtype("<u4")
_FLAG_LAYERED = 1
_FLAG_STREAM = 4  # bit 1 is left unused
_FLAGS = _FLAG_LAYERED | _FLAG_STREAM

IntArrayLike = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
"""Integers as a sequence, a 1-D numpy array or a 1-D host tensor."""


class Direction(enum.Enum):
    """Which way a spec moves bytes."""

    OFFLOAD = 1
    """Engine KV buffer -> pool pages (only ranks that write pages take part)."""
    LOAD = 2
    """Pool pages -> engine KV buffer (every rank)."""


def _u(name: str, value: object, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise ValueError(f"{name} must be in [0, {limit}], got {value}")
    return value


def _as_numpy(name: str, values: IntArrayLike) -> npt.NDArray[np.integer[Any]]:
    if isinstance(values, torch.Tensor):
        if values.is_cuda:
            raise ValueError(f"{name} must be on the host (a spec is a host value), got a CUDA tensor")
        values = values.detach().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty")
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def _has_duplicates(values: npt.NDArray[np.uint32]) -> bool:
    # Sorted neighbours, not np.unique: numpy 2's unique imports numpy.ma on first use, 20-80 ms on
    # the loop that built or decoded the first multi-page spec (the manager's max loop lag in bench_tp).
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def _lowest(values: npt.NDArray[np.integer[Any]]) -> int:
    # A numpy reduction costs ~5 us even for a handful of values; a spec usually holds a few pages.
    return min(values.tolist()) if values.size <= 256 else int(values.min())


def _frozen(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class TransferSpec:
    """One transfer every participating rank runs on its own head slice.

    ``page_ids``: uint32 ``[P]``, distinct pool pages. ``slots``: int32 or int64 ``[S]``, the engine's
    token slots. OFFLOAD: ``S == P * page_tokens``, page i gets slots ``[i*T, (i+1)*T)``. LOAD:
    tokens ``[skip_first, P*T)`` of the concatenated pages go to the slots, ``S == P*T - skip_first``,
    ``0 <= skip_first < T`` (a partly needed first page). ``epoch`` names the pool the pages belong
    to: a worker attached to another pool refuses the spec. ``layered`` (LOAD only): the rank copies
    layer 0 of every page, then layer 1, ... and reports each layer as it lands (see
    :class:`LayeredLoad`). ``stream`` (LOAD only): the id of the load stream the spec belongs to
    (``RankGroup.begin_stream``); each rank orders the copy after the mark it recorded on its
    engine's stream when that stream began, instead of after the engine's stream at the copy's
    launch; 0: no stream. Arrays are read-only.

    Build with :meth:`build` (converts and validates); the constructor validates already typed values
    and raises ``ValueError`` naming the field.
    """

    job_id: int
    direction: Direction
    epoch: int
    page_tokens: int
    page_ids: npt.NDArray[np.uint32]
    slots: npt.NDArray[np.signedinteger[Any]]
    skip_first: int = 0
    layered: bool = False
    stream: int = 0

    def __post_init__(self) -> None:
        _u("job_id", self.job_id, _U64_MAX)
        _u("epoch", self.epoch, _U64_MAX)
        _u("page_tokens", self.page_tokens, _U32_MAX)
        _u("skip_first", self.skip_first, _U32_MAX)
        _u("stream", self.stream, _U64_MAX)
        if not isinstance(self.direction, Direction):
            raise ValueError(f"direction must be a Direction, got {self.direction!r}")
        if not isinstance(self.layered, bool):
            raise ValueError(f"layered must be a bool, got {self.layered!r}")
        pages, slots = self.page_ids, self.slots
        if not isinstance(pages, np.ndarray) or pages.dtype != _PAGE_DTYPE or pages.ndim != 1:
            raise ValueError("page_ids must be a 1-D uint32 array (use TransferSpec.build)")
        if not isinstance(slots, np.ndarray) or slots.dtype not in _SLOT_DTYPES.values() or slots.ndim != 1:
            raise ValueError("slots must be a 1-D int32 or int64 array (use TransferSpec.build)")
        if pages.flags.writeable or slots.flags.writeable:
            raise ValueError("page_ids and slots must be read-only arrays (use TransferSpec.build)")
        if pages.size > _U32_MAX or slots.size > _U32_MAX:
            raise ValueError("a spec holds at most 2**32 - 1 pages and slots")
        self._check_values()

    def _check_values(self) -> None:
        """The rules on values; the types are checked (or, decoding, implied by the binary form)."""
        pages, slots = self.page_ids, self.slots
        if self.page_tokens == 0:
            raise ValueError("page_tokens must be positive")
        if self.layered and self.direction is not Direction.LOAD:
            raise ValueError("only a LOAD spec is layered (an OFFLOAD gathers whole pages)")
        if self.stream and self.direction is not Direction.LOAD:
            raise ValueError("only a LOAD spec belongs to a load stream (an OFFLOAD is ordered at its launch)")
        if pages.size == 0 or slots.size == 0:
            raise ValueError("a spec moves at least one page and one slot")
        lowest = _lowest(slots)
        if lowest < 0:
            raise ValueError(f"slots holds a negative slot ({lowest})")
        if pages.size > 1 and _has_duplicates(pages):
            raise ValueError("page_ids holds duplicated pages")
        tokens = self.page_tokens
        if self.direction is Direction.OFFLOAD:
            if self.skip_first:
                raise ValueError("an OFFLOAD spec writes whole pages: skip_first must be 0")
        elif self.skip_first >= tokens:
            raise ValueError(f"skip_first must be in [0, {tokens}) (tokens of the first page), got {self.skip_first}")
        expect = pages.size * tokens - self.skip_first
        if slots.size != expect:
            raise ValueError(
                f"slots holds {slots.size} slots; {pages.size} pages of {tokens} tokens "
                f"less skip_first={self.skip_first} need {expect}"
            )

    @classmethod
    def build(
        cls,
        job_id: int,
        direction: Direction,
        epoch: int,
        page_tokens: int,
        page_ids: IntArrayLike,
        slots: IntArrayLike,
        skip_first: int = 0,
        layered: bool = False,
        stream: int = 0,
    ) -> TransferSpec:
        """A spec from any integer sequences, arrays or host tensors (copied; int32 slots stay int32)."""
        pages = _as_numpy("page_ids", page_ids)
        if int(pages.min()) < 0 or int(pages.max()) > _U32_MAX:
            raise ValueError(f"page_ids must be in [0, {_U32_MAX}]")
        raw_slots = _as_numpy("slots", slots)
        if raw_slots.dtype == np.int32:
            slot_array = raw_slots.astype("<i4", copy=True)
        else:
            if int(raw_slots.max()) > 2**63 - 1:
                raise ValueError("slots holds a slot beyond int64")
            slot_array = raw_slots.astype("<i8", copy=True)
        return cls(
            job_id,
            direction,
            epoch,
            page_tokens,
            _frozen(pages.astype(_PAGE_DTYPE, copy=True)),
            _frozen(slot_array),
            skip_first,
            layered,
            stream,
        )

    # -- derived --------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pool pages the spec touches."""
        return int(self.page_ids.size)

    @property
    def num_tokens(self) -> int:
        """Token slots the spec touches."""
        return int(self.slots.size)

    # -- binary form ----------------------------------------------------------------------------

    @property
    def encoded_bytes(self) -> int:
        """Length of :meth:`to_bytes`, without encoding."""
        extra = _STREAM.size if self.stream else 0
        return _HEADER.size + extra + self.page_ids.nbytes + self.slots.nbytes

    def to_bytes(self) -> bytes:
        """The compact binary form (see the module docstring)."""
        width = self.slots.dtype.itemsize
        flags = (_FLAG_LAYERED if self.layered else 0) | (_FLAG_STREAM if self.stream else 0)
        header = _HEADER.pack(
            SPEC_MAGIC,
            SPEC_VERSION,
            self.direction.value,
            width,
            flags,
            self.job_id,
            self.epoch,
            self.page_tokens,
            self.skip_first,
            self.page_ids.size,
            self.slots.size,
        )
        stream = _STREAM.pack(self.stream) if self.stream else b""
        return b"".join((header, stream, self.page_ids.tobytes(), self.slots.tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TransferSpec:
        """Decode :meth:`to_bytes` output; raises ``ValueError`` for truncated, trailing or bad input."""
        if not isinstance(data, bytes):
            data = bytes(data)  # the arrays below view it: never a buffer the caller may change
        if len(data) < _HEADER.size:
            raise ValueError(f"truncated spec: {len(data)} bytes, the header alone is {_HEADER.size}")
        (magic, version, direction, width, flags, job_id, epoch, page_tokens, skip_first, n_pages, n_slots) = (
            _HEADER.unpack_from(data)
        )
        if magic != SPEC_MAGIC:
            raise ValueError(f"not a transfer spec (magic {magic!r})")
        if version != SPEC_VERSION:
            raise ValueError(f"transfer spec version {version} is not supported (this side speaks {SPEC_VERSION})")
        if flags & ~_FLAGS:
            raise ValueError(f"transfer spec has unknown flags {flags:#x}")
        try:
            kind = Direction(direction)
        except ValueError:
            raise ValueError(f"transfer spec has an unknown direction {direction}") from None
        slot_dtype = _SLOT_DTYPES.get(width)
        if slot_dtype is None:
            raise ValueError(f"transfer spec has slot width {width}; 4 or 8 expected")
        body = _HEADER.size + (_STREAM.size if flags & _FLAG_STREAM else 0)
        expect = body + n_pages * _PAGE_DTYPE.itemsize + n_slots * width
        if len(data) != expect:
            what = "truncated" if len(data) < expect else "trailing bytes after"
            raise ValueError(f"{what} transfer spec: {len(data)} bytes, header says {expect}")
        stream = 0
        if flags & _FLAG_STREAM:
            (stream,) = _STREAM.unpack_from(data, _HEADER.size)
            if stream == 0:
                raise ValueError("transfer spec has the STREAM flag and stream id 0")
        pages = np.frombuffer(data, _PAGE_DTYPE, n_pages, body)
        slots = np.frombuffer(data, slot_dtype, n_slots, body + n_pages * _PAGE_DTYPE.itemsize)
        # The header's formats and the read-only views fix every type: only the values are checked
        # (on a rank the full constructor's checks were a third of a spec round trip's decode).
        spec = object.__new__(cls)
        for name, value in (
            ("job_id", job_id), ("direction", kind), ("epoch", epoch), ("page_tokens", page_tokens),
            ("page_ids", pages), ("slots", slots), ("skip_first", skip_first),
            ("layered", bool(flags & _FLAG_LAYERED)), ("stream", stream),
        ):
            object.__setattr__(spec, name, value)
        spec._check_values()
        return spec

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles through the compact form: an engine's own channel carries the same bytes.
        return (TransferSpec.from_bytes, (self.to_bytes(),))

    # -- value semantics ------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferSpec):
            return NotImplemented
        return (
            (self.job_id, self.direction, self.epoch, self.page_tokens, self.skip_first, self.layered, self.stream)
            == (other.job_id, other.direction, other.epoch, other.page_tokens, other.skip_first, other.layered,
                other.stream)
            and self.slots.dtype == other.slots.dtype
            and np.array_equal(self.page_ids, other.page_ids)
            and np.array_equal(self.slots, other.slots)
        )

    def __hash__(self) -> int:
        return hash((self.job_id, self.direction, self.epoch, self.num_pages, self.num_tokens))

    def __repr__(self) -> str:
        return (
            f"TransferSpec(job={self.job_id}, {self.direction.name}, epoch={self.epoch:#x}, "
            f"pages={self.num_pages}, tokens={self.num_tokens}, skip_first={self.skip_first}"
            f"{', layered' if self.layered else ''}{f', stream={self.stream}' if self.stream else ''})"
        )


@dataclass(frozen=True)
class LayeredLoad:
    """What a rank needs to wait on the layers of a layer-wise load: the pool epoch and the job ids
    of its specs (``TPLoadStream.layered_load()``). A small picklable value the scheduler puts in
    its step message to the ranks; each rank passes it to ``RankWorker.wait_layer``."""

    epoch: int
    jobs: tuple[int, ...]
    unsent: bool = False
    """Some copy of the stream failed before it was sent (a rank missing at admission, the group
    closing): its layers never land, so every rank's ``wait_layer`` answers False (after the sent
    copies' layer, as for a copy that failed on the rank)."""

    def __post_init__(self) -> None:
        _u("epoch", self.epoch, _U64_MAX)
        if not isinstance(self.unsent, bool):
            raise ValueError(f"unsent must be a bool, got {type(self.unsent).__name__}")
        if not isinstance(self.jobs, tuple):
            raise ValueError(f"jobs must be a tuple of job ids, got {type(self.jobs).__name__}")
        for job in self.jobs:
            _u("job id", job, _U64_MAX)
