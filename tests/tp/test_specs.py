"""Transfer specs and wire frames: round trips, and malformed input is a clear ValueError, never a crash."""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.tp.specs import Direction, LayeredLoad, TransferSpec
from aiokv.tp.wire import (
    PROTOCOL_VERSION,
    Attached,
    Closed,
    Done,
    Hello,
    Layers,
    ProtocolError,
    RankStatus,
    Refuse,
    RefuseReason,
    Welcome,
)


@st.composite
def specs(draw: st.DrawFn) -> TransferSpec:
    direction = draw(st.sampled_from(list(Direction)))
    tokens = draw(st.integers(1, 16))
    pages = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6, unique=True))
    skip = draw(st.integers(0, tokens - 1)) if direction is Direction.LOAD else 0
    count = len(pages) * tokens - skip
    high = draw(st.sampled_from([2**31 - 1, 2**63 - 1]))
    slots = draw(st.lists(st.integers(0, high), min_size=count, max_size=count))
    dtype = np.int32 if high < 2**31 else np.int64
    return TransferSpec.build(
        draw(st.integers(0, 2**64 - 1)),
        direction,
        draw(st.integers(0, 2**64 - 1)),
        tokens,
        np.array(pages, dtype=np.uint64),
        np.array(slots, dtype=dtype),
        skip,
        direction is Direction.LOAD and draw(st.booleans()),
    )


@settings(max_examples=200, deadline=None)
@given(specs())
def test_round_trip_bytes_and_pickle(spec: TransferSpec) -> None:
    data = spec.to_bytes()
    back = TransferSpec.from_bytes(data)
    assert back == spec and back.slots.dtype == spec.slots.dtype
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert TransferSpec.from_bytes(bytearray(data)) == spec
    assert not back.slots.flags.writeable and not back.page_ids.flags.writeable


@settings(max_examples=200, deadline=None)
@given(specs(), st.data())
def test_truncated_or_extended_input_is_a_value_error(spec: TransferSpec, data: st.DataObject) -> None:
    raw = spec.to_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ValueError, match=r"truncated|header"):
        TransferSpec.from_bytes(raw[:cut])
    with pytest.raises(ValueError, match="trailing"):
        TransferSpec.from_bytes(raw + b"\0")


@settings(max_examples=300, deadline=None)
@given(specs(), st.data())
def test_corrupted_input_decodes_or_raises_value_error(spec: TransferSpec, data: st.DataObject) -> None:
    raw = bytearray(spec.to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        TransferSpec.from_bytes(bytes(raw))
    except ValueError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(raw: bytes) -> None:
    try:
        TransferSpec.from_bytes(raw)
    except ValueError:
        pass


def test_header_lies_are_clear_errors() -> None:
    spec = TransferSpec.build(1, Direction.LOAD, 7, 4, [3, 5], torch.arange(6), 2)
    raw = bytearray(spec.to_bytes())
    with pytest.raises(ValueError, match="magic"):
        TransferSpec.from_bytes(b"XXXX" + bytes(raw[4:]))
    bad = bytearray(raw)
    bad[4] = 99
    with pytest.raises(ValueError, match="version 99"):
        TransferSpec.from_bytes(bytes(bad))
    bad = bytearray(raw)
    bad[5] = 7
    with pytest.raises(ValueError, match="direction 7"):
        TransferSpec.from_bytes(bytes(bad))
    bad = bytearray(raw)
    bad[6] = 2
    with pytest.raises(ValueError, match="slot width 2"):
        TransferSpec.from_bytes(bytes(bad))
    bad = bytearray(raw)
    bad[7] = 2  # flags: bit 0 is LAYERED, the rest are unknown
    with pytest.raises(ValueError, match="unknown flags 0x2"):
        TransferSpec.from_bytes(bytes(bad))
    # Decoding checks every value rule the constructor does (only the types come from the format).
    header = 40  # the header's size: page ids follow it, then the slots
    for offset, fmt, value, message in [
        (24, "<I", 0, "page_tokens must be positive"),
        (28, "<I", 4, r"skip_first must be in \[0, 4\)"),
        (header + 4, "<I", 3, "duplicated pages"),
        (header + 8, "<q", -1, "negative slot"),
    ]:
        bad = bytearray(raw)
        struct.pack_into(fmt, bad, offset, value)
        with pytest.raises(ValueError, match=message):
            TransferSpec.from_bytes(bytes(bad))
    offload = bytearray(TransferSpec.build(1, Direction.OFFLOAD, 7, 4, [3], range(4)).to_bytes())
    offload[7] = 1
    with pytest.raises(ValueError, match="only a LOAD spec is layered"):
        TransferSpec.from_bytes(bytes(offload))
    # A header claiming 2**32-1 slots on a short body: a length error, no huge allocation.
    huge = bytearray(raw)
    struct.pack_into("<I", huge, 36, 2**32 - 1)
    with pytest.raises(ValueError, match="truncated"):
        TransferSpec.from_bytes(bytes(huge))


def test_build_validates_counts_and_values() -> None:
    with pytest.raises(ValueError, match="need 8"):
        TransferSpec.build(1, Direction.OFFLOAD, 1, 4, [0, 1], range(7))
    with pytest.raises(ValueError, match="skip_first must be 0"):
        TransferSpec.build(1, Direction.OFFLOAD, 1, 4, [0], [0, 1, 2], 1)
    with pytest.raises(ValueError, match="skip_first must be in"):
        TransferSpec.build(1, Direction.LOAD, 1, 4, [0, 1], [0, 1, 2, 3], 4)
    with pytest.raises(ValueError, match="negative"):
        TransferSpec.build(1, Direction.OFFLOAD, 1, 2, [0], [-1, 0])
    with pytest.raises(ValueError, match="duplicated pages"):
        TransferSpec.build(1, Direction.OFFLOAD, 1, 1, [2, 2], [0, 1])
    with pytest.raises(ValueError, match="integers"):
        TransferSpec.build(1, Direction.OFFLOAD, 1, 1, [0], np.array([0.5]))
    with pytest.raises(ValueError, match="job_id"):
        TransferSpec.build(-1, Direction.OFFLOAD, 1, 1, [0], [0])
    with pytest.raises(ValueError, match="only a LOAD spec is layered"):
        TransferSpec.build(1, Direction.OFFLOAD, 1, 1, [0], [0], layered=True)
    with pytest.raises(ValueError, match="layered must be a bool"):
        TransferSpec.build(1, Direction.LOAD, 1, 1, [0], [0], layered=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read-only"):
        TransferSpec(1, Direction.OFFLOAD, 1, 1, np.zeros(1, np.uint32), np.zeros(1, np.int64))
    spec = TransferSpec.build(9, Direction.LOAD, 1, 4, torch.tensor([4, 2]), torch.arange(5, dtype=torch.int32), 3)
    assert (spec.num_pages, spec.num_tokens, spec.slots.dtype) == (2, 5, np.int32)
    assert "job=9" in repr(spec)
    layered = TransferSpec.build(9, Direction.LOAD, 1, 4, [4, 2], range(5), 3, layered=True)
    assert layered != TransferSpec.build(9, Direction.LOAD, 1, 4, [4, 2], range(5), 3)
    assert TransferSpec.from_bytes(layered.to_bytes()).layered and "layered" in repr(layered)
    with pytest.raises(ValueError, match="job id"):
        LayeredLoad(1, (-1,))
    with pytest.raises(ValueError, match="tuple"):
        LayeredLoad(1, [1])  # type: ignore[arg-type]


def test_wire_messages_round_trip_and_refuse_garbage() -> None:
    hello = Hello(PROTOCOL_VERSION, 3, 4, b"f" * 16, "cuda")
    assert Hello.decode(hello.encode()) == hello
    other = PROTOCOL_VERSION + 1
    assert Hello.decode(Hello(other, 0, 0, b"", "").encode()[:6]).version == other  # parsed for the refusal
    for device in ["", "CUDA", "cu da", "cuda:0", "x" * 33, "é"]:  # a hello names a device kind, nothing else
        with pytest.raises(ProtocolError, match="device kind"):
            Hello.decode(Hello(PROTOCOL_VERSION, 3, 4, b"f" * 16, device).encode())
    welcome = Welcome(1, 4, b"f" * 16, 2**63, 10, 4096, "/aiokv-1-abc")
    assert Welcome.decode(welcome.encode()) == welcome
    later = Welcome(PROTOCOL_VERSION, 4, b"f" * 16, 5, 10, 4096, "/aiokv-1-abc", 64, 2**64 - 1)
    assert Welcome.decode(later.encode()) == later  # a session's first job id travels whole
    refusal = Refuse(RefuseReason.LAYOUT, "x" * 2000)
    back = Refuse.decode(refusal.encode())
    assert back.reason is RefuseReason.LAYOUT and len(back.text) == 512
    assert Attached.decode(Attached(5, True).encode()) == Attached(5, True)
    assert Done.decode(Done(7, RankStatus.COPY_FAILED, "é").encode()) == Done(7, RankStatus.COPY_FAILED, "é")
    assert Layers.decode(Layers(7, 3).encode()) == Layers(7, 3)
    for last, taken in ((0, 0), (7, 3), (2**64 - 1, 2**64 - 1)):  # 0: the worker took no spec
        assert Closed.decode(Closed(last, taken).encode()) == Closed(last, taken)
    with pytest.raises(ProtocolError):
        Closed.decode(struct.pack("<Q", 7))  # protocol 9's frame: no count of the specs taken
    for decode, raw in [
        (Hello.decode, b"nope"),
        (Welcome.decode, b"\0" * 5),
        (Refuse.decode, b"\x63"),
        (Attached.decode, struct.pack("<QB", 1, 2)),
        (Done.decode, struct.pack("<QB", 1, 99)),
        (Done.decode, struct.pack("<QB", 1, RankStatus.RANK_LOST.value)),
        (Done.decode, struct.pack("<QB", 1, 0) + b"\xff"),
        (Layers.decode, struct.pack("<QI", 1, 0)),
        (Layers.decode, struct.pack("<QI", 1, 2) + b"\0"),
        (Closed.decode, struct.pack("<I", 1)),
        (Closed.decode, struct.pack("<Q", 1) + b"\0"),
    ]:
        with pytest.raises(ProtocolError):
            decode(raw)


def test_the_first_multi_page_spec_loads_no_module_on_the_loop() -> None:
    # numpy 2's np.unique imports numpy.ma on first use: the first multi-page spec built (manager)
    # or decoded (worker) stalled that loop 20-80 ms (bench_tp's one unexplained max loop lag).
    code = (
        "import sys\n"
        "from aiokv.tp.specs import Direction, TransferSpec\n"
        "before = set(sys.modules)\n"
        "spec = TransferSpec.build(1, Direction.LOAD, 1, 4, [3, 1, 2], range(1, 12), skip_first=1)\n"
        "TransferSpec.from_bytes(spec.to_bytes())\n"
        "for dup in ([3, 1, 3], [0, 0]):\n"
        "    try:\n"
        "        TransferSpec.build(2, Direction.OFFLOAD, 1, 4, dup, range(4 * len(dup)))\n"
        "    except ValueError as exc:\n"
        "        assert 'duplicated' in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(dup)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"imported while building and decoding specs: {out.stdout}"
