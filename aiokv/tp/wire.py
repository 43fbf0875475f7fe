"""Frames between a :class:`~aiokv.tp.RankGroup` and its workers, over one Unix-domain stream socket.

Every frame is ``length u32 | kind u8 | payload`` (little-endian; ``length`` counts kind + payload).
A session::

    worker  --HELLO(version, rank, tp_size, layout fingerprint, device kind)--> manager
    worker  <--WELCOME(version, tp_size, fingerprint, pool epoch, pages, slots, name)-- or REFUSE(reason, text)
    worker  --ATTACHED(epoch, ok, text)-->          (after mapping the pool by name; not ok: refused or failed)
    worker  <--SPEC(TransferSpec bytes)--  ...  --DONE(job id, status, text)-->
            (a layered LOAD: --LAYERS(job id, layers landed)--> as layers land, before its DONE)
    worker  <--STREAM_BEGINS(stream id)--   (a load stream began: the rank records its mark now;
                                             that stream's LOAD specs name the id and follow it)
    worker  --CLOSED(last job id taken, specs taken)-->  (its engine closed it, or the manager fenced
                                             it: it took the first ``specs taken`` SPEC frames of
                                             the session and none after, reported every one before
                                             this frame, and none of its copies runs)

Decoders raise :class:`ProtocolError` (a ``ValueError``) for anything malformed.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 10
"""2: layered LOAD specs and LAYERS frames. 3: HELLO carries the rank's device kind. 4: a worker
keeps its end open after the manager's EOF (a fence) until its copies are over and reported, and
closes it only then: the manager reads a connection's end as "none of that rank's copies runs".
5: WITHDRAWN frames: a layered job held for room and withdrawn unsent (its id was already in a
``layered_load()``) ends the ranks' waits for it. 6: WELCOME carries the token slots the manager
addresses; a worker whose KV buffer has fewer refuses to attach. 7: STREAM_BEGINS frames, and specs
of version 2 (a LOAD of a load stream names the stream: the rank orders its copy after the mark it
recorded when it read that stream's STREAM_BEGINS). 8: WELCOME carries the first job id of the
session: a rank that attaches again to the same pool learns which job ids were issued before (their
specs never reach the new session), so its engine's layer waits for them end at once. 9: CLOSED frames:
a worker that ends its session itself (its engine closed it) or at a fence says, after the last
report of the copies it ran, the last job it took; the manager fails what it sent after that
(WORKER_CLOSING) at once rather than hold the rank until its process exits, as it must for a
connection that just ends (a third party may have cut it under running copies). 10: CLOSED also
carries how many SPEC frames the session took: the manager tells what was never run by the order it
wrote specs in, not by job id (ids follow the order specs were built, not sent: review 191)."""
HELLO_MAGIC = b"AKVH"
_FRAME = struct.Struct("<IB")
_HELLO = struct.Struct("<4sHHH16s")
MAX_TP_SIZE = 0xFFFF
"""Most ranks a group can have: a hello carries the rank and ``tp_size`` in 16 bits each."""
_WELCOME = struct.Struct("<HH16sQIQQQ")
_REFUSE = struct.Struct("<B")
_ATTACHED = struct.Struct("<QB")
_DONE = struct.Struct("<QB")
_LAYERS = struct.Struct("<QI")
_WITHDRAWN = struct.Struct("<Q")
_STREAM_BEGINS = struct.Struct("<Q")
_CLOSED = struct.Struct("<QQ")
MAX_TEXT_BYTES = 512
"""Longest error text a frame carries (longer texts are cut)."""
MAX_DEVICE_BYTES = 32
"""Longest device kind a HELLO carries (``torch.device.type``: ``cpu``, ``cuda``, ...)."""
CONTROL_FRAME_BYTES = 1 + max(s.size for s in (_HELLO, _WELCOME, _REFUSE, _ATTACHED, _DONE, _LAYERS, _WITHDRAWN,
                                             _STREAM_BEGINS, _CLOSED)) \
    + MAX_TEXT_BYTES
"""The longest length prefix of any frame but SPEC (kind, fixed fields and the longest text: a
WELCOME naming its pool). ``TPConfig.max_frame_bytes`` may not be below it: a link whose hello or
welcome cannot pass would end in a protocol error at every reconnect, forever."""


class ProtocolError(ValueError):
    """A peer sent something that is not a valid frame of this protocol."""


class FrameKind(enum.Enum):
    """What a frame carries."""

    HELLO = 1
    WELCOME = 2
    REFUSE = 3
    ATTACHED = 4
    SPEC = 5
    DONE = 6
    LAYERS = 7
    WITHDRAWN = 8
    STREAM_BEGINS = 9
    CLOSED = 10


_KINDS = {kind.value: kind for kind in FrameKind}  # a dict lookup per frame, not an Enum call


class RankStatus(enum.Enum):
    """How one rank's part of a job ended. Values up to 15 travel in DONE frames."""

    OK = 0
    COPY_FAILED = 1
    """The copy raised (a CUDA error, a failed CPU copy)."""
    BAD_SPEC = 2
    """The spec does not fit this rank's layout or KV buffer (slots out of range, wrong page size)."""
    STALE_EPOCH = 3
    """The spec names another pool than the one this worker attached."""
    NOT_REGISTERED = 4
    """A page lies in a pool chunk this worker could not register with CUDA."""
    WORKER_CLOSING = 5
    """The worker is shutting down and ran nothing more."""
    RANK_LOST = 16
    """(manager side) The rank disconnected or died with the job in flight."""
    NOT_ATTACHED = 17
    """(manager side) The rank was not attached when the job was submitted."""
    GROUP_CLOSED = 18
    """(manager side) The group closed before the rank reported."""


_STATUS = {status.value: status for status in RankStatus}
_WORKER_STATUS = {value: status for value, status in _STATUS.items() if value < 16}


class RefuseReason(enum.Enum):
    """Why a manager refused a worker's hello."""

    VERSION = 1
    TP_SIZE = 2
    LAYOUT = 3
    RANK_RANGE = 4
    RANK_TAKEN = 5
    """Another live connection holds this rank (retried: the old one may not be noticed dead yet)."""
    CLOSING = 6
    """The group is closing (retried: a new manager may come)."""
    PEER = 7
    """The connecting process belongs to another user."""
    SLOTS = 8
    """(worker side) Its KV buffer has fewer token slots than the manager addresses."""

    @property
    def retry(self) -> bool:
        """Whether a worker should try again later rather than give up."""
        return self in (RefuseReason.RANK_TAKEN, RefuseReason.CLOSING)


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "replace")[:MAX_TEXT_BYTES]
    return raw.decode("utf-8", "ignore").encode("utf-8")


def _decode_text(payload: bytes, offset: int) -> str:
    if len(payload) - offset > MAX_TEXT_BYTES:
        raise ProtocolError(f"text of {len(payload) - offset} bytes exceeds {MAX_TEXT_BYTES}")
    try:
        return payload[offset:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"text is not UTF-8: {exc}") from None


def _fixed(layout: struct.Struct, payload: bytes, what: str, exact: bool) -> tuple[Any, ...]:
    if len(payload) < layout.size or (exact and len(payload) != layout.size):
        raise ProtocolError(f"{what} of {len(payload)} bytes; {layout.size} expected")
    return layout.unpack_from(payload)


def frame(kind: FrameKind, payload: bytes) -> bytes:
    """One frame ready to write."""
    return _FRAME.pack(len(payload) + 1, kind.value) + payload


class FrameParser:
    """Complete frames out of the bytes of one connection, fed as they arrive (synchronous)."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buffer = bytearray()

    @property
    def pending(self) -> bytes:
        """Bytes of a frame not complete yet."""
        return bytes(self._buffer)

    def feed(self, data: bytes) -> list[tuple[FrameKind, bytes]]:
        """Append ``data``; return the frames it completed. Raises :class:`ProtocolError` when malformed."""
        self._buffer += data
        buffer, start, frames = self._buffer, 0, []
        while len(buffer) - start >= _FRAME.size:
            length, kind = _FRAME.unpack_from(buffer, start)
            if length < 1 or length > self._max:
                raise ProtocolError(f"frame of {length} bytes (limit {self._max})")
            end = start + _FRAME.size + length - 1
            if end > len(buffer):
                break
            what = _KINDS.get(kind)
            if what is None:
                raise ProtocolError(f"unknown frame kind {kind}")
            frames.append((what, bytes(buffer[start + _FRAME.size : end])))
            start = end
        del buffer[:start]
        return frames


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[FrameKind, bytes]:
    """The next frame. Raises ``asyncio.IncompleteReadError`` at EOF, :class:`ProtocolError` when malformed."""
    length, kind = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if length < 1 or length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes (limit {max_bytes})")
    try:
        what = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    payload = await reader.readexactly(length - 1) if length > 1 else b""
    return what, payload


@dataclass(frozen=True)
class Hello:
    """Worker -> manager: who the worker is. ``device``: the kind of device its KV buffer is on
    (``torch.device.type``); the manager labels the rates it learns through the ranks by it."""

    version: int
    rank: int
    tp_size: int
    fingerprint: bytes
    device: str

    def encode(self) -> bytes:
        return _HELLO.pack(HELLO_MAGIC, self.version, self.rank, self.tp_size, self.fingerprint) + _text(self.device)

    @classmethod
    def decode(cls, payload: bytes) -> Hello:
        # Magic and version first: a peer of another version gets a clear refusal, not a parse error.
        if len(payload) < 6 or payload[:4] != HELLO_MAGIC:
            raise ProtocolError("not an aiokv worker hello")
        (version,) = struct.unpack_from("<H", payload, 4)
        if version != PROTOCOL_VERSION:
            return cls(version, 0, 0, b"", "")
        _, version, rank, tp_size, fingerprint = _fixed(_HELLO, payload, "hello", exact=False)
        device = _decode_text(payload, _HELLO.size)
        if not 0 < len(device) <= MAX_DEVICE_BYTES or not device.isascii() or not device.isidentifier() \
                or not device.islower():
            raise ProtocolError(f"hello names no device kind: {device[:MAX_DEVICE_BYTES]!r}")
        return cls(int(version), int(rank), int(tp_size), bytes(fingerprint), device)


@dataclass(frozen=True)
class Welcome:
    """Manager -> worker: the pool to attach and the group's geometry. ``num_slots``: the token slots
    its specs address (every rank's KV buffer must have at least as many); 0: not stated."""

    version: int
    tp_size: int
    fingerprint: bytes
    epoch: int
    num_pages: int
    page_bytes: int
    pool_name: str
    num_slots: int = 0
    first_job: int = 0
    """Job ids below this were issued before this session (0: none stated): their specs never reach
    it, so the rank's waits for them end at once rather than for a later spec that may never come."""

    def encode(self) -> bytes:
        head = _WELCOME.pack(self.version, self.tp_size, self.fingerprint, self.epoch, self.num_pages, self.page_bytes,
                             self.num_slots, self.first_job)
        return head + _text(self.pool_name)

    @classmethod
    def decode(cls, payload: bytes) -> Welcome:
        version, tp_size, fingerprint, epoch, pages, page_bytes, slots, first_job = _fixed(
            _WELCOME, payload, "welcome", exact=False)
        name = _decode_text(payload, _WELCOME.size)
        return cls(version, tp_size, fingerprint, epoch, pages, page_bytes, name, slots, first_job)


@dataclass(frozen=True)
class Refuse:
    """Manager -> worker: the hello was refused."""

    reason: RefuseReason
    text: str

    def encode(self) -> bytes:
        return _REFUSE.pack(self.reason.value) + _text(self.text)

    @classmethod
    def decode(cls, payload: bytes) -> Refuse:
        (reason,) = _fixed(_REFUSE, payload, "refusal", exact=False)
        try:
            kind = RefuseReason(reason)
        except ValueError:
            raise ProtocolError(f"unknown refusal reason {reason}") from None
        return cls(kind, _decode_text(payload, _REFUSE.size))


@dataclass(frozen=True)
class Attached:
    """Worker -> manager: the pool of ``epoch`` is mapped (``ok``), or why not."""

    epoch: int
    ok: bool
    text: str = ""

    def encode(self) -> bytes:
        return _ATTACHED.pack(self.epoch, self.ok) + _text(self.text)

    @classmethod
    def decode(cls, payload: bytes) -> Attached:
        epoch, ok = _fixed(_ATTACHED, payload, "attach report", exact=False)
        if ok not in (0, 1):
            raise ProtocolError(f"attach report has ok={ok}")
        return cls(epoch, bool(ok), _decode_text(payload, _ATTACHED.size))


@dataclass(frozen=True)
class Done:
    """Worker -> manager: how this rank's part of job ``job_id`` ended."""

    job_id: int
    status: RankStatus
    text: str = ""

    def encode(self) -> bytes:
        return _DONE.pack(self.job_id, self.status.value) + _text(self.text)

    @classmethod
    def decode(cls, payload: bytes) -> Done:
        job_id, status = _fixed(_DONE, payload, "completion", exact=False)
        kind = _WORKER_STATUS.get(status)
        if kind is None:
            if status in _STATUS:
                raise ProtocolError(f"completion status {_STATUS[status].name} is manager-side only")
            raise ProtocolError(f"unknown completion status {status}")
        # Most completions carry no text: no slice and decode for them (eight per round trip).
        return cls(job_id, kind, _decode_text(payload, _DONE.size) if len(payload) > _DONE.size else "")


@dataclass(frozen=True)
class Layers:
    """Worker -> manager: layers ``0 .. landed-1`` of layered job ``job_id`` are in this rank's buffer."""

    job_id: int
    landed: int

    def encode(self) -> bytes:
        return _LAYERS.pack(self.job_id, self.landed)

    @classmethod
    def decode(cls, payload: bytes) -> Layers:
        job_id, landed = _fixed(_LAYERS, payload, "layer report", exact=True)
        if landed == 0:
            raise ProtocolError("layer report of 0 layers")
        return cls(job_id, landed)


@dataclass(frozen=True)
class Withdrawn:
    """Manager -> worker: layered job ``job_id`` was withdrawn before it was sent (it waited for
    room); it never arrives, so waits for its layers end (False)."""

    job_id: int

    def encode(self) -> bytes:
        return _WITHDRAWN.pack(self.job_id)

    @classmethod
    def decode(cls, payload: bytes) -> Withdrawn:
        (job_id,) = _fixed(_WITHDRAWN, payload, "withdrawal", exact=True)
        return cls(job_id)


@dataclass(frozen=True)
class StreamBegins:
    """Manager -> worker: load stream ``stream`` began (``TPCache.start_load``). The rank records a
    mark on its engine's stream when it reads this; the stream's LOAD specs (``TransferSpec.stream``)
    are ordered after that mark. Ids start at 1 and are never reused by one manager."""

    stream: int

    def encode(self) -> bytes:
        return _STREAM_BEGINS.pack(self.stream)

    @classmethod
    def decode(cls, payload: bytes) -> StreamBegins:
        (stream,) = _fixed(_STREAM_BEGINS, payload, "stream start", exact=True)
        if stream == 0:
            raise ProtocolError("stream start of stream 0 (ids start at 1)")
        return cls(stream)


@dataclass(frozen=True)
class Closed:
    """Worker -> manager, its session's last frame: the worker took the first ``taken`` SPEC frames
    of the session (the last of them job ``last_job``; 0: none) and none after, every one it took
    reported (DONE) before this frame, and none of its copies still runs. The manager fails at once
    what the rank owes if that is exactly the specs it wrote after the first ``taken`` (a link
    delivers them in the order written; job ids need not follow it)."""

    last_job: int
    taken: int

    def encode(self) -> bytes:
        return _CLOSED.pack(self.last_job, self.taken)

    @classmethod
    def decode(cls, payload: bytes) -> Closed:
        last_job, taken = _fixed(_CLOSED, payload, "close report", exact=True)
        return cls(last_job, taken)
