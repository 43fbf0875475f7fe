"""aiokv: an asyncio-native, tiered KV-cache manager for LLM inference engines.

The engine's attention KV cache spills from GPU memory to a pinned shared-memory CPU page pool and
behind it to page files on local disk written through io_uring; every call is a coroutine or a
plain function on one event loop.
"""

from aiokv.layout import KVLayout

__all__ = ["KVLayout"]
