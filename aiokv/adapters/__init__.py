"""Engine adapters: aiokv's disk tier inside inference engines that load a storage tier by module path.

- :mod:`aiokv.adapters.vllm`: ``AiokvTier``, a vLLM ``SecondaryTierManager`` (tiering offload).
- :mod:`aiokv.adapters.sglang`: ``AiokvHiCacheStorage``, an SGLang ``HiCacheStorage`` backend.

Each engine module imports its engine; this package and :mod:`aiokv` import neither, so aiokv works
without the engines installed. Both adapters share :class:`~aiokv.adapters.store.PageFileStore`:
checksummed page files of aiokv's disk tier, driven from an event loop on a thread of its own.
"""
