"""aiokv: an asyncio-native, tiered KV-cache manager for LLM inference engines.

The engine's attention KV cache spills from GPU memory to a pinned shared-memory CPU page pool and
behind it to page files on local disk written through io_uring; every call is a coroutine or a
plain function on one event loop::

    async with KVCache(CacheConfig(namespace="my-model"), layout, kv_buffer) as cache:
        hit = await cache.match(token_ids, salt=tenant)
        await cache.load(hit, slots[: hit.tokens])
        ...
        await cache.offload(token_ids, slots, salt=tenant)
"""

from importlib.metadata import PackageNotFoundError, version

from aiokv.cache import KVCache
from aiokv.config import Admission, CacheConfig
from aiokv.kernels import TransferPath
from aiokv.layout import KVLayout
from aiokv.pagetable import StaleHandleError
from aiokv.results import CacheStatistics, LoadResult, Match, OffloadResult, PrefetchResult, Tier
from aiokv.storage import DiskBackend

try:
    __version__ = version("aiokv")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "Admission",
    "CacheConfig",
    "CacheStatistics",
    "DiskBackend",
    "KVCache",
    "KVLayout",
    "LoadResult",
    "Match",
    "OffloadResult",
    "PrefetchResult",
    "StaleHandleError",
    "Tier",
    "TransferPath",
]
