"""The disk tier: page files below the CPU page pool, written through io_uring on the event loop.

See ``docs/storage.md`` for the format, backends, crash safety and fault handling.
"""

from .config import DiskBackend, DiskConfig, DiskStatistics, ErrorKind, ReadOnly
from .disk import DiskTier

__all__ = ["DiskBackend", "DiskConfig", "DiskStatistics", "DiskTier", "ErrorKind", "ReadOnly"]
