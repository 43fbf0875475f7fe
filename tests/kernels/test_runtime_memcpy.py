"""``aiokv.cuda.memcpy_async``: raw cudaMemcpyAsync through the runtime torch loaded."""

from __future__ import annotations

import pytest
import torch

from aiokv import cuda


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_without_cuda_the_raw_copy_is_unavailable_and_refuses() -> None:
    assert not cuda.raw_memcpy_available()
    with pytest.raises(RuntimeError, match="no CUDA runtime"):
        cuda.memcpy_async(0, 0, 1, None)  # type: ignore[arg-type]


class _RefusingRuntime:
    """The runtime's answer to a refused copy (what a copy crossing two registrations gets)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int]] = []
        self.cleared = 0

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> int:
        self.calls.append((dst, src, nbytes, kind, stream))
        return 1

    def cudaMemcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int,
                          stream: int) -> int:
        self.calls.append((dst, src, width * height, kind, stream))
        return 1

    def cudaGetErrorString(self, err: int) -> bytes:
        return b"invalid argument"

    def cudaGetLastError(self) -> int:
        """Reads and clears the thread's last error (the refused call's)."""
        self.cleared += 1
        return 1


def test_a_refused_copy_raises_with_cudas_message(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = _RefusingRuntime()
    monkeypatch.setattr(cuda, "_runtime_library", lambda: runtime)

    class _Stream:
        cuda_stream = 1234

    with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync\(4096 bytes\) failed: CUDA error 1 \(invalid argument\)"):
        cuda.memcpy_async(8192, 16384, 4096, _Stream())  # type: ignore[arg-type]
    assert runtime.calls == [(8192, 16384, 4096, 4, 1234)]  # cudaMemcpyDefault, the caller's stream
    with pytest.raises(RuntimeError, match=r"cudaMemcpy2DAsync\(3 x 4096 bytes\) failed: CUDA error 1 \(invalid"):
        cuda.memcpy2d_async(8192, 4096, 16384, 1 << 20, 4096, 3, _Stream())  # type: ignore[arg-type]
    assert runtime.calls[1] == (8192, 16384, 3 * 4096, 4, 1234)
    assert runtime.cleared == 2  # each refusal's error cleared: torch's next launch must not see it


def test_prestart_starts_the_copy_thread_once_and_a_closed_bridge_starts_nothing() -> None:
    import threading

    def copy_threads() -> int:
        return sum(t.name.startswith("aiokv-copy") for t in threading.enumerate())

    before = copy_threads()
    bridge = cuda.CompletionBridge()
    bridge.prestart(False)
    bridge.prestart(False)
    assert copy_threads() == before + 1
    bridge.close()
    assert copy_threads() == before
    bridge.prestart(False)
    assert copy_threads() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_raw_copy_moves_host_and_device_bytes_on_the_stream() -> None:
    assert cuda.raw_memcpy_available()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    back = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        cuda.memcpy_async(dev.data_ptr() + 1, src.data_ptr() + 1, (3 << 20) - 2, stream)  # odd offsets
        cuda.memcpy_async(back.data_ptr(), dev.data_ptr(), 3 << 20, stream)  # device to device too
    stream.synchronize()
    assert torch.equal(back[1:-1].cpu(), src[1:-1])
