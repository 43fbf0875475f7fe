"""`CacheConfig`: every knob of a `KVCache`, each with a default that works embedded."""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from aiokv.kernels import TransferPath
from aiokv.shm import shm_free_bytes
from aiokv.storage import DiskBackend

log = logging.getLogger(__name__)

GiB = 1 << 30


class Admission(enum.Enum):
    """Which pool pages the write-behind sends to disk."""

    ALL = "all"
    """Every page stored in the pool is also written to disk."""
    SEEN_TWICE = "seen_twice"
    """Only pages whose key was offloaded or looked up before (spares SSD wear on one-off prompts)."""


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * GiB


def default_cpu_bytes(fraction: float = 0.25, cap: int = 64 * GiB) -> int:
    """A quarter of RAM, at most 64 GiB, and at most 80% of the free shared memory."""
    budget = min(int(_ram_bytes() * fraction), cap)
    shm = shm_free_bytes()
    if shm is not None:
        # Segments of killed processes are reclaimed when a pool is created: count them as free.
        # (Imported here: a module-level import would make `python -m aiokv.segments` warn.)
        from aiokv.segments import reclaimable_bytes

        budget = min(budget, int((shm + reclaimable_bytes()) * 0.8))
    return max(budget, 0)


def default_disk_dir() -> Path | None:
    """``$XDG_CACHE_HOME/aiokv`` (or ``~/.cache/aiokv``) when writable, else None (no disk tier)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "aiokv"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


@dataclass(frozen=True)
class CacheConfig:
    """Configuration of a :class:`aiokv.KVCache`; every field has a working default."""

    cpu_bytes: int = field(default_factory=default_cpu_bytes)
    """Byte budget of the shared-memory page pool (pages = cpu_bytes // page bytes)."""

    disk_dir: Path | None = field(default_factory=default_disk_dir)
    """Directory of the disk tier; None disables it. Page files go under ``<dir>/<layout fingerprint>/``."""

    disk_bytes: int = 64 * GiB
    """Byte budget of the disk tier (LRU eviction beyond it)."""

    namespace: str = "default"
    """Model namespace mixed into every key: different models never share pages."""

    disk_backend: DiskBackend = DiskBackend.AUTO
    """Disk I/O backend; AUTO falls back from registered io_uring to plain io_uring to threads."""

    disk_direct_io: bool | None = None
    """O_DIRECT for page files; None uses it where the file system allows."""

    disk_queue_depth: int = 16
    """Page I/Os in flight on the disk tier."""

    write_behind_depth: int = 256
    """Pages that may wait for their disk write; beyond it new pages are not written (counted)."""

    admission: Admission = Admission.ALL
    """Which pages the write-behind persists."""

    seen_window: int = 1 << 16
    """Keys remembered for ``Admission.SEEN_TWICE``."""

    transfer_path: TransferPath | None = None
    """GPU <-> pool copy path; None picks STAGING for a CUDA KV buffer and REFERENCE on the CPU."""

    staging_pages: int = 4
    """Pages of GPU staging buffer per direction (staging path)."""

    launch_pages: int = 2
    """Pages whose copies are launched per event-loop turn; bounds the loop's stall on long transfers."""

    pool_chunk_bytes: int = 256 << 20
    """Pool memory is prepared (and CUDA-registered) in chunks of this many bytes."""

    pool_workers: int = 4
    """Threads that prepare pool chunks in the background."""

    tp_rank: int = 0
    """This process's tensor-parallel rank."""

    tp_size: int = 1
    """Tensor-parallel world size (each rank moves its own slice of every page's heads)."""

    prefill_tokens_per_s: float | None = None
    """The engine's prefill rate, if known (else learned from stream loads and ``note_prefill``)."""

    offload_wait: float = 5.0
    """Seconds an offload may wait, each time the pool is full, for write-behind to free pages
    before it drops the rest of its pages (counted as pool_exhausted)."""

    close_timeout: float = 30.0
    """Seconds ``aclose()`` waits for write-behind and background copies before giving up on them."""

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "disk_bytes", "disk_queue_depth", "write_behind_depth", "seen_window",
                     "staging_pages", "launch_pages", "pool_chunk_bytes", "pool_workers", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CacheConfig.{name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"CacheConfig.{name} must be positive, got {value}")
        if isinstance(self.tp_rank, bool) or not isinstance(self.tp_rank, int):
            raise TypeError("CacheConfig.tp_rank must be an int")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"CacheConfig.tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.disk_dir is not None and not isinstance(self.disk_dir, (str, Path)):
            raise TypeError(f"CacheConfig.disk_dir must be a Path or None, got {type(self.disk_dir).__name__}")
        if isinstance(self.disk_dir, str):
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))
        if not isinstance(self.namespace, str):
            raise TypeError("CacheConfig.namespace must be a str")
        if not isinstance(self.disk_backend, DiskBackend):
            raise TypeError(f"CacheConfig.disk_backend must be a DiskBackend, got {self.disk_backend!r}")
        if self.transfer_path is not None and not isinstance(self.transfer_path, TransferPath):
            raise TypeError(f"CacheConfig.transfer_path must be a TransferPath or None, got {self.transfer_path!r}")
        if not isinstance(self.admission, Admission):
            raise TypeError(f"CacheConfig.admission must be an Admission, got {self.admission!r}")
        if self.prefill_tokens_per_s is not None and (
            isinstance(self.prefill_tokens_per_s, bool) or not isinstance(self.prefill_tokens_per_s, (int, float))
            or not self.prefill_tokens_per_s > 0
        ):
            raise ValueError("CacheConfig.prefill_tokens_per_s must be None or a positive number")
        if isinstance(self.offload_wait, bool) or not isinstance(self.offload_wait, (int, float)) \
                or not self.offload_wait >= 0:
            raise ValueError("CacheConfig.offload_wait must be a non-negative number of seconds")
        if not isinstance(self.close_timeout, (int, float)) or self.close_timeout < 0:
            raise ValueError("CacheConfig.close_timeout must be a non-negative number of seconds")
