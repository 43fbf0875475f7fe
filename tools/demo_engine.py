"""The demo's engine: workload, GPU slot blocks with prefix reuse, and the asyncio serving loop.

An engine owns a KV buffer ``[L, S, 2H, D]`` (or, under tensor parallelism, each rank process owns
its heads' part of it: ``demo_tp.py``) cut into blocks of ``page_tokens`` slots. Finished
requests leave their full prompt pages in the buffer as a GPU prefix cache (evicted LRU when blocks
run out); below it sits aiokv's pool and disk tier. Per request the loop: takes blocks (reusing a
GPU prefix), matches the part the GPU does not hold in aiokv and gets it into the buffer (``LoadPath``:
a plain ``load``, or a ``LoadStream`` that loads from the back while the engine prefills from the
front and/or lets the tail prefill wait layer by layer), prefills the rest in page-aligned chunks,
decodes greedily, awaits ``offload``, then frees its blocks.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextvars
import dataclasses
import enum
import hashlib
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch
from demo_model import LayerHook, LlamaModel

from aiokv import CacheStatistics, KVCache, LoadResult, Match, OffloadResult, PrefetchResult
from aiokv.costs import LoadEstimate
from aiokv.stream import LoadStream, StreamResult

if TYPE_CHECKING:
    from aiokv.tp import WorkerStatistics

_R = TypeVar("_R")

MODEL_THREAD_PREFIX = "demo-model"
"""Name of the threads the model runs on (``demo-model_0``, ...): ``--probe-gil`` reports CPU per
thread name, and the default executor's ``asyncio_#`` read as the event loop's thread (it is not:
the loop runs on the thread that called ``asyncio.run``)."""

_model_executor: concurrent.futures.ThreadPoolExecutor | None = None


def model_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of model threads (named :data:`MODEL_THREAD_PREFIX`), made on first use."""
    global _model_executor
    if _model_executor is None:
        _model_executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix=MODEL_THREAD_PREFIX)
    return _model_executor


async def on_model_thread(fn: Callable[..., _R], *args: object) -> _R:
    """``asyncio.to_thread`` on a model thread (:func:`model_executor`), the context copied alike."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(model_executor(), context.run, fn, *args)


LAYER_WAIT_S = 600.0
"""Bound of a CPU model thread's wait for one layer's copies (they finish in milliseconds)."""


def thread_counters() -> tuple[float, int, int]:
    """The calling thread's CPU seconds and voluntary / involuntary context switches (Linux; 0 elsewhere).

    A thread waiting for the GIL sleeps on a futex: a voluntary switch. One that loses its core to
    another runnable thread is preempted: an involuntary one. A CUDA sync spins without either.
    """
    waits = preemptions = 0
    try:
        with open("/proc/thread-self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    waits = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    preemptions = int(line.split()[1])
    except OSError:
        pass
    return time.thread_time(), waits, preemptions


class LoadPath(enum.Enum):
    """How the serving loop gets a cache hit's KV into its buffer."""

    PLAIN = "plain"
    """``await load(...)``, then prefill the rest."""
    SPLIT = "split"
    """``start_load``: the engine claims the matched prefix chunk by chunk from the front while the
    cache loads it from the back; where they meet the load stops (compute-or-load split)."""
    LAYERED = "layered"
    """``start_load(layered=True)`` without claims: the tail prefill waits on each layer's copies
    just before that layer's attention, so it overlaps the rest of the load."""
    SPLIT_LAYERED = "split-layered"
    """Both: claims from the front, then the tail prefill overlapping the last copies layer by layer."""
    AUTO = "auto"
    """Per hit: ``split-layered`` when the hit is all in the pool (one launch, layer-major: the tail
    overlaps the whole load), ``split`` when it reaches disk (its pages launch one by one as reads
    land, so per-layer readiness would cost a layer's launch and event per page and buy little)."""

    @property
    def claims(self) -> bool:
        """Whether the engine may compute part of the matched prefix itself."""
        return self in (LoadPath.SPLIT, LoadPath.SPLIT_LAYERED, LoadPath.AUTO)

    @property
    def layered(self) -> bool:
        """Whether some hits load layer by layer (the tail prefill then waits per layer)."""
        return self in (LoadPath.LAYERED, LoadPath.SPLIT_LAYERED, LoadPath.AUTO)

    def layered_for(self, reaches_disk: bool) -> bool:
        """Whether a hit (reaching disk or not) loads layer by layer on this path."""
        return self.layered and not (self is LoadPath.AUTO and reaches_disk)

    def without_layers(self) -> LoadPath:
        """The same path with whole-page copies (where per-layer readiness is not visible: TP)."""
        return LoadPath.SPLIT if self.claims else LoadPath.PLAIN


class ClaimPolicy(enum.Enum):
    """When a claiming ``LoadPath`` actually claims."""

    AUTO = "auto"
    """Only when the cost model expects it to pay (:func:`plan_hit`); while its rates are unknown,
    for hits that reach disk. A hit the model expects no gain from (fixed costs and margin
    included) is recomputed, its match released unloaded."""
    ALWAYS = "always"
    """Chunk after chunk until the fronts meet (Cake's dynamic split), whatever the rates; every
    hit is loaded or split, never declined."""


class HitPlan(enum.Enum):
    """What the serving loop does with a cache hit (:func:`plan_hit`)."""

    RECOMPUTE = "recompute"
    """Neither a load nor a split is expected to beat recomputing by the cost model's margin."""
    LOAD = "load"
    """Leave the whole match to the load."""
    SPLIT = "split"
    """Claim the front while the load brings the back."""


def plan_hit(
    estimate: LoadEstimate, *, share: float, tail_tokens: int, match_tokens: int, page_tokens: int, layered: bool,
    disk: bool, claim_tokens: int = 0, claims: bool = True,
) -> HitPlan:
    """Recompute, load, or split a hit, by the cost model's prices (fixed costs included).

    ``estimate`` covers the whole match; ``share`` is the fraction still to bring in (the rest is in
    the GPU prefix); ``tail_tokens`` follow the match; ``disk``: some of it is read from disk. With
    the suffix's recompute time R, load time L (first-byte latency and set-up included), best split
    S (claims' per-call cost included; the model's meeting page) and tail prefill T: recomputing
    takes R + T, loading max(L, T) layer-wise or L + T, splitting S + T. Recompute unless a load gains
    more than the estimate's margin (:data:`aiokv.costs.MARGIN_FRACTION` of R plus the meters'
    spreads) or a split more than its own (that fraction plus the claims' spread: a load slower than
    its rates only moves the meeting point back); of two that pay, the faster: aiokv never picks a
    load it expects to lose. ``claim_tokens``: the
    most the engine claims per call (its chunk; 0: one claim), each paying the prefill's fixed cost.
    A disk hit whose estimate offers a trial (:attr:`aiokv.costs.LoadEstimate.trial`: disk meter unsettled or stale)
    splits instead of recomputing where the path ``claims`` (without claims a split is a whole
    load). While a rate is unknown, load, and claim for disk hits only: the pool is a memory copy,
    far faster than any prefill, and a claim made before the loader's first turn would keep a short
    pool hit from ever teaching the cost model the pool's rate.
    """
    prices = hit_prices(estimate, share=share, tail_tokens=tail_tokens, match_tokens=match_tokens,
                        page_tokens=page_tokens, layered=layered, claim_tokens=claim_tokens)
    if prices is None:
        load_s, compute_s = estimate.load_seconds, estimate.recompute_seconds
        if load_s is None or compute_s is None or load_s <= 0 or compute_s <= 0 or match_tokens <= 0:
            return HitPlan.SPLIT if disk else HitPlan.LOAD
        # An estimate without its per-page costs (built by hand): the rates alone, never declined.
        return HitPlan.SPLIT if _claim_pays_by_rates(
            load_s * share, compute_s * share, compute_s / match_tokens, tail_tokens, page_tokens, layered) \
            else HitPlan.LOAD
    load_pays = prices.recompute - prices.load > prices.margin
    split_pays = prices.recompute - prices.split > prices.split_margin
    if not (load_pays or split_pays):
        # An unsettled or stale disk meter (estimate.trial): split anyway, which re-measures the
        # disk at little risk; declined for good, a disk once slow would never be measured again.
        return HitPlan.SPLIT if disk and claims and estimate.trial else HitPlan.RECOMPUTE
    if load_pays and split_pays:
        return HitPlan.SPLIT if prices.split < prices.load else HitPlan.LOAD
    return HitPlan.SPLIT if split_pays else HitPlan.LOAD


@dataclass(frozen=True)
class HitPrices:
    """Expected seconds until the first token's prefill is done, per plan (:func:`hit_prices`)."""

    recompute: float
    load: float
    split: float
    margin: float
    """Gain a load must beat to be chosen."""
    split_margin: float
    """Gain the split must beat (:attr:`aiokv.costs.LoadEstimate.split_margin`: without the load's
    spreads where it claims, as a slower load only moves the meeting point)."""
    overhead: float
    """Fixed costs priced into the best split (first-byte latency, set-up, claims' per-call cost)."""


def hit_prices(
    estimate: LoadEstimate, *, share: float, tail_tokens: int, match_tokens: int, page_tokens: int, layered: bool,
    claim_tokens: int = 0,
) -> HitPrices | None:
    """The prices :func:`plan_hit` compares; None while a rate is unknown (no per-page costs)."""
    costs = estimate.costs
    if costs is None or match_tokens <= 0:
        return None
    pages = match_tokens // page_tokens
    # Claims are whole pages: a chunk smaller than a page still claims one (0 prices one claim in all).
    claim_pages = max(1, claim_tokens // page_tokens) if claim_tokens > 0 else 0
    suffix = dataclasses.replace(costs.suffix(pages - round(share * pages)), claim_pages=claim_pages)
    part = suffix.estimate()
    if part.recompute_seconds is None or part.split_seconds is None:
        return None
    # The tail attends over the whole match: priced after its pages.
    tail = costs.compute_seconds(pages, pages + tail_tokens / page_tokens)
    whole = suffix.load(0)  # the stream's walk from the back, no claims (a split meeting at page 0)
    load = max(whole, tail) if layered else whole + tail
    return HitPrices(part.recompute_seconds + tail, load, part.split_seconds + tail, part.margin_seconds,
                     part.split_margin, part.overhead_seconds)


def claim_pays(
    estimate: LoadEstimate, *, share: float, tail_tokens: int, match_tokens: int, page_tokens: int, layered: bool,
    disk: bool, claim_tokens: int = 0,
) -> bool:
    """Whether computing part of the matched prefix should beat leaving all of it to the load
    (:func:`plan_hit` says split)."""
    return plan_hit(estimate, share=share, tail_tokens=tail_tokens, match_tokens=match_tokens,
                    page_tokens=page_tokens, layered=layered, disk=disk, claim_tokens=claim_tokens) is HitPlan.SPLIT


def _claim_pays_by_rates(
    load: float, recompute: float, per_token: float, tail_tokens: int, page_tokens: int, layered: bool
) -> bool:
    """Claims by the rates alone: the fronts meet near L·R/(L+R), later by half a page's compute on
    average (claims are whole pages) and never before one page is computed; the tail follows.
    Without claims the tail overlaps the load layer by layer (max(L, T)) or follows it (L + T)."""
    tail = tail_tokens * per_token
    page = page_tokens * per_token
    meet = max(page, load * recompute / (load + recompute) + page / 2)
    return meet + tail < (max(load, tail) if layered else load + tail)


class SessionKind(enum.Enum):
    """What a session is: a multi-turn chat, or users asking about a shared document."""

    CHAT = "chat"
    DOC = "doc"


def claim_size(
    *, gap: int, loaded: int, load_s: float, computed: int, compute_s: float, page: int, chunk: int
) -> int:
    """Tokens the engine should claim next in a compute-or-load split: a page, at most a chunk.

    ``gap``: tokens between the engine's position and the load's front; ``loaded`` tokens were
    launched by the load in ``load_s`` seconds, ``computed`` by the engine in ``compute_s``. At
    these paces the fronts meet after the engine's share gap·c/(c+l) of the gap; claiming more would
    compute what the load would have delivered sooner. One page while either pace is unknown.
    """
    if gap <= 0 or loaded <= 0 or computed <= 0 or load_s <= 0 or compute_s <= 0:
        return page
    load_rate, compute_rate = loaded / load_s, computed / compute_s
    share = gap * compute_rate / (load_rate + compute_rate)
    return max(page, min(chunk, int(share) // page * page))


@dataclass(frozen=True)
class Session:
    """One user's conversation: turn k's prompt is turn k-1's prompt + its answer + ``texts[k]``."""

    name: str
    tenant: str
    kind: SessionKind
    texts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class WorkloadConfig:
    """Size of the generated workload (all lengths in tokens)."""

    tenants: int = 4
    chats_per_tenant: int = 5
    chat_turns: int = 4
    system_tokens: int = 96
    chat_text: tuple[int, int] = (100, 200)
    docs_per_tenant: int = 2
    doc_tokens: tuple[int, int] = (800, 1100)
    users_per_doc: int = 3
    doc_turns: int = 2
    question_tokens: tuple[int, int] = (24, 64)
    seed: int = 0


def make_workload(cfg: WorkloadConfig, vocab: int) -> list[Session]:
    """Sessions in arrival order, deterministic from ``cfg.seed``.

    Each tenant has a system prompt shared by its chats; each document is read by several users of
    its tenant whose sessions are spread over the run, so late readers find it in a lower tier.
    """
    rng = random.Random(cfg.seed)

    def text(bounds: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(rng.randint(*bounds)))

    chats: list[Session] = []
    readers: list[list[Session]] = []
    for t in range(cfg.tenants):
        tenant = f"tenant{t}"
        system = tuple(rng.randrange(vocab) for _ in range(cfg.system_tokens))
        for c in range(cfg.chats_per_tenant):
            turns = [system + text(cfg.chat_text)] + [text(cfg.chat_text) for _ in range(cfg.chat_turns - 1)]
            chats.append(Session(f"{tenant}/chat{c}", tenant, SessionKind.CHAT, tuple(turns)))
        for d in range(cfg.docs_per_tenant):
            doc = text(cfg.doc_tokens)
            group = []
            for u in range(cfg.users_per_doc):
                turns = [doc + text(cfg.question_tokens)]
                turns += [text(cfg.question_tokens) for _ in range(cfg.doc_turns - 1)]
                group.append(Session(f"{tenant}/doc{d}/user{u}", tenant, SessionKind.DOC, tuple(turns)))
            readers.append(group)
    rng.shuffle(chats)
    rng.shuffle(readers)
    # Reader u of every document arrives in wave u. The chats between waves grow 4x per wave, so
    # a document comes back after a short gap (found in the pool) and after a long one (on disk).
    waves = [[group[u] for group in readers] for u in range(cfg.users_per_doc)]
    weights = [4**u for u in range(len(waves))]
    bounds = [round(len(chats) * sum(weights[: u + 1]) / sum(weights)) for u in range(len(waves))]
    order: list[Session] = []
    for u, wave in enumerate(waves):
        order += wave + chats[(bounds[u - 1] if u else 0) : bounds[u]]
    return order


def page_digests(tokens: Sequence[int], salt: str, page_tokens: int) -> list[bytes]:
    """Cumulative digest of every full page: page i's digest covers the salt and tokens of pages 0..i."""
    out: list[bytes] = []
    h = hashlib.blake2b(salt.encode(), digest_size=16)
    for i in range(len(tokens) // page_tokens):
        h.update(torch.tensor(tokens[i * page_tokens : (i + 1) * page_tokens], dtype=torch.int64).numpy().tobytes())
        out.append(h.copy().digest())
    return out


class BlockTable:
    """Blocks of ``block_tokens`` slots with reference counts and an LRU prefix cache of full pages.

    All methods are synchronous: the loop's single thread makes each call atomic.
    """

    def __init__(self, num_blocks: int, block_tokens: int, prefix_reuse: bool) -> None:
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.prefix_reuse = prefix_reuse
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references
        self.evictions = 0

    def try_acquire(self, keys: Sequence[bytes], total: int) -> tuple[list[int], list[int]] | None:
        """Reference the cached blocks of the longest prefix of ``keys`` and take new blocks up to ``total``.

        Returns ``(hit_blocks, new_blocks)``, or None (nothing taken) when too few blocks are free.
        """
        hits: list[int] = []
        if self.prefix_reuse:
            for key in keys:
                block = self._by_key.get(key)
                if block is None:
                    break
                hits.append(block)
        need = total - len(hits)
        idle_hits = sum(1 for b in hits if b in self._lru)
        if need > len(self._free) + len(self._lru) - idle_hits:
            return None
        for b in hits:
            self._lru.pop(b, None)
            self._refs[b] += 1
        new: list[int] = []
        while len(new) < need:
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._by_key[self._key_of.pop(b)]
                self.evictions += 1
            self._refs[b] = 1
            new.append(b)
        return hits, new

    def publish(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Make full prompt pages findable by later requests (first writer of a key wins)."""
        if not self.prefix_reuse:
            return
        for b, key in zip(blocks, keys, strict=False):
            if key not in self._by_key and b not in self._key_of:
                self._by_key[key] = b
                self._key_of[b] = key

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; cached blocks stay in the LRU, others become free."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def slots(self, blocks: Sequence[int], count: int, device: torch.device) -> torch.Tensor:
        """The first ``count`` slot indices of ``blocks`` in order, int64 ``[count]``."""
        t = self.block_tokens
        base = torch.tensor(blocks, dtype=torch.int64)[:, None] * t + torch.arange(t)[None, :]
        return base.reshape(-1)[:count].to(device)

    def in_use(self) -> int:
        """Blocks referenced by a running request."""
        return self.num_blocks - len(self._free) - len(self._lru)


@dataclass
class RequestResult:
    """What one request did and produced; times in seconds."""

    name: str
    tenant: str
    kind: str
    index: int
    prompt_tokens: int
    gpu_tokens: int = 0
    pool_tokens: int = 0
    disk_tokens: int = 0
    computed_tokens: int = 0
    claimed_tokens: int = 0  # matched, but computed by the engine itself (compute-or-load split)
    declined_tokens: int = 0  # matched, but recomputed: the cost model expected no gain from the cache
    plan: str = ""  # HitPlan of a streamed hit ("": none, or the claim policy forced the split)
    plan_prices: dict[str, float] = field(default_factory=dict)  # its HitPrices (seconds), when priced
    lost_tokens: int = 0  # matched but not loaded (a lower tier failed)
    prefetched_pages: int = 0  # promoted disk -> pool by prefetch while the request waited
    match_s: float = 0.0
    load_s: float = 0.0  # waited for the load: plain, the whole call; a stream, launched()/finish() only
    prefill_s: float = 0.0
    launch_s: float = 0.0  # of prefill_s, until the first token's last chunk was queued (host side)
    prefill_at: float = 0.0  # perf_counter seconds when its prefill began
    model_cpu_s: float = 0.0  # CPU time of the model's thread(s) in its prefill and decode calls
    model_waits: int = 0  # their voluntary context switches: waits (for the GIL, a lock, a blocking sync)
    model_preemptions: int = 0  # their involuntary ones: another thread took the core
    gil_lag_s: float | None = None  # the demo's GIL probe over its prefill (--probe-gil), mean wake-up lag
    threads_s: dict[str, float] = field(default_factory=dict)  # CPU s per thread name over its prefill (--probe-gil)
    decode_s: float = 0.0
    offload_s: float = 0.0
    ttft_s: float = 0.0
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # float32 [gen_tokens, V] on CPU
    prompt_digest: bytes = b""


class ServingCache(Protocol):
    """What the serving loop calls on aiokv: ``KVCache`` (one process) and ``TPCache`` (TP ranks)."""

    async def match(self, tokens: Sequence[int], salt: str | None = None) -> Match: ...

    async def load(self, match: Match, slots: torch.Tensor, *, from_token: int = 0) -> LoadResult: ...

    async def offload(
        self, tokens: Sequence[int], slots: torch.Tensor, *, salt: str | None = None
    ) -> OffloadResult: ...

    async def prefetch(self, tokens: Sequence[int], *, salt: str | None = None) -> PrefetchResult: ...

    async def flush(self) -> None: ...

    def estimate(self, match: Match) -> LoadEstimate: ...


@dataclass(eq=False)
class _Stream:
    """A cache hit being streamed into the buffer while the request computes."""

    stream: LoadStream
    tokens: int  # match.tokens: the tail prefill starts here
    claim: bool  # the engine computes the front of the match itself
    layered: bool  # the tail prefill waits on each layer
    started: float  # perf_counter seconds at start_load (the load's pace is measured from here)
    result: StreamResult | None = None
    waited: float = 0.0  # seconds the request waited in launched()/finish() (the rest overlapped)


@dataclass(frozen=True)
class Computed:
    """One request's model work: logits and tokens of every decode step, and when they happened."""

    logits: list[torch.Tensor]  # float32 [V] per generated token
    generated: list[int]
    prefill_start: float  # perf_counter seconds
    first_token: float
    end: float
    queued: float  # when the first token's last prefill chunk was queued (before waiting for its logits)


@dataclass(frozen=True)
class First:
    """The logits of the prompt's last position (float32 ``[V]``) and the greedy token they give."""

    logits: torch.Tensor
    token: int
    queued: float = 0.0
    """perf_counter seconds when its chunk was queued, before the wait for the logits (0: not timed)."""


def prefill_chunks(start: int, n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of each prefill chunk of positions ``[start, n)``.

    Chunks end on absolute multiples of ``chunk_tokens``, so they are the same with or without hits.
    """
    out: list[tuple[int, int]] = []
    pos = start
    while pos < n:
        end = min(n, (pos // chunk_tokens + 1) * chunk_tokens)
        out.append((pos, end))
        pos = end
    return out


class ServingLoop(abc.ABC):
    """The per-request steps over slot blocks and an optional aiokv cache; subclasses run the model.

    Slot indices stay on the host here: aiokv validates device indices by a read-back ordered after
    the engine's stream, and a blocking ``.to(device)`` on the loop would wait for another
    request's prefill; the model's side moves them to its device itself (TP ranks get host indices).
    ``load_path`` and ``claim`` choose how a hit is loaded (:class:`LoadPath`, :class:`ClaimPolicy`).
    """

    def __init__(
        self,
        blocks: BlockTable,
        cache: ServingCache | None,
        chunk_tokens: int,
        gen_tokens: int,
        keep_logits: bool = True,
        prefetch: bool = False,
        settle: bool = False,
        load_path: LoadPath = LoadPath.PLAIN,
        claim: ClaimPolicy = ClaimPolicy.AUTO,
    ) -> None:
        if chunk_tokens % blocks.block_tokens:
            raise ValueError("chunk_tokens must be a multiple of page_tokens")
        if gen_tokens < 1:
            raise ValueError("gen_tokens must be at least 1")
        self.blocks = blocks
        self.cache = cache
        self.chunk_tokens = chunk_tokens
        self.gen_tokens = gen_tokens
        self.keep_logits = keep_logits
        self.prefetch = prefetch
        self.settle = settle  # wait for write-behind after each offload: reproducible tier counts
        self.load_path = load_path
        self.claim = claim
        self.page = blocks.block_tokens
        self._freed = asyncio.Condition()
        self._accelerator = asyncio.Lock()  # one accelerator: prefill/decode of one request at a time

    async def _take_blocks(self, keys: Sequence[bytes], total: int) -> tuple[list[int], list[int]]:
        if total > self.blocks.num_blocks:
            raise ValueError(f"a request needs {total} blocks; the KV buffer has {self.blocks.num_blocks}")
        async with self._freed:
            while (got := self.blocks.try_acquire(keys, total)) is None:
                await self._freed.wait()
        return got

    async def _give_blocks(self, blocks: Sequence[int]) -> None:
        self.blocks.release(blocks)
        async with self._freed:
            self._freed.notify_all()

    async def serve(self, name: str, tenant: str, kind: str, index: int, prompt: list[int]) -> RequestResult:
        """Serve one request: reuse, load, prefill the rest, decode, offload; return its record."""
        n, page = len(prompt), self.page
        res = RequestResult(name, tenant, kind, index, n)
        raw = torch.tensor(prompt, dtype=torch.int64).numpy().tobytes()
        res.prompt_digest = hashlib.blake2b(raw, digest_size=16).digest()
        # At least one prompt token is computed, to produce the first token's logits.
        usable = (n - 1) // page * page
        keys = page_digests(prompt, tenant, page)
        total_slots = n + self.gen_tokens - 1  # the last generated token is never fed back
        t0 = time.perf_counter()
        hit_blocks, new_blocks = await self._take_blocks(keys[: usable // page], -(-total_slots // page))
        blocks = hit_blocks + new_blocks
        streaming: _Stream | None = None
        try:
            slots = self.blocks.slots(blocks, total_slots, torch.device("cpu"))
            start = res.gpu_tokens = len(hit_blocks) * page
            # Like an engine's input preparation: the request's token ids and slots reach the
            # device before a load is launched (a copy queued behind a load's copies would wait for
            # all of them: CUDA runs host-to-device copies of all streams on one engine, in order).
            self._stage_inputs(prompt, slots)
            if self.cache is not None and usable > start:
                if self.load_path is LoadPath.PLAIN:
                    start = await self._load(res, prompt[:usable], slots, start)
                else:
                    # Started before waiting for the accelerator: the load runs while it is busy.
                    streaming = await self._open_stream(res, prompt, usable, slots, start)
            async with self._accelerator:
                done = await self._compute(prompt, start, slots, streaming)
            res.generated = done.generated
            res.prefill_s, res.ttft_s = done.first_token - done.prefill_start, done.first_token - t0
            res.launch_s = done.queued - done.prefill_start
            res.prefill_at = done.prefill_start
            res.model_cpu_s, res.model_waits, res.model_preemptions = self._take_model_work(slots)
            res.decode_s = done.end - done.first_token
            if streaming is not None:
                self._record_stream(res, streaming, start)
            elif self.cache is not None:
                self._note_prefill(n - start, res.prefill_s, start)
            res.computed_tokens = n - res.gpu_tokens - res.pool_tokens - res.disk_tokens
            if self.keep_logits:
                res.logits = torch.stack(done.logits).cpu()
            full = n // page
            self.blocks.publish(blocks[:full], keys[:full])
            if self.cache is not None:
                # Only the prompt's pages: answers' K/V come from one-token decode steps, whose
                # arithmetic differs from a prefill chunk, so a later from-scratch run would differ.
                t3 = time.perf_counter()
                await self.cache.offload(prompt[: full * page], slots[: full * page], salt=tenant)
                res.offload_s = time.perf_counter() - t3
                if self.settle:
                    await self.cache.flush()
        finally:
            if streaming is not None:
                await streaming.stream.aclose()  # a no-op after finish(); else no copy touches the slots after it
            self._unstage_inputs(slots)
            await asyncio.shield(self._give_blocks(blocks))
        return res

    def _stage_inputs(self, prompt: list[int], slots: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Copy a request's token ids and slots to the accelerator ahead of its loads (if it has one)."""

    def _take_model_work(self, slots: torch.Tensor) -> tuple[float, int, int]:
        """What the model's threads spent on the request with ``slots``: CPU seconds, voluntary and
        involuntary context switches (zeros where the model runs elsewhere: TP ranks)."""
        del slots
        return 0.0, 0, 0

    def _unstage_inputs(self, slots: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Forget what :meth:`_stage_inputs` copied for the request with ``slots``."""

    async def _load(self, res: RequestResult, prefix: list[int], slots: torch.Tensor, start: int) -> int:
        """Match ``prefix`` in aiokv and load what the GPU prefix lacks; return where prefill starts."""
        assert self.cache is not None
        t = time.perf_counter()
        m = await self.cache.match(prefix, salt=res.tenant)
        res.match_s = time.perf_counter() - t
        async with m:  # releases the match when it is not loaded (load consumes it)
            if m.tokens <= start:
                return start
            if self.claim is ClaimPolicy.AUTO and not self._worth_loading(m, start):
                res.declined_tokens = m.tokens - start  # the match is released unloaded
                return start
            t = time.perf_counter()
            # Returns once the copies are complete (and our stream is ordered after them); a sync
            # here would block the loop on another request's prefill running on the same stream.
            loaded = await self.cache.load(m, slots[start : m.tokens], from_token=start)
        res.load_s = time.perf_counter() - t
        end = max(start, int(loaded.tokens))
        res.pool_tokens = loaded.pool_pages * self.page
        res.disk_tokens = loaded.disk_pages * self.page
        res.lost_tokens = m.tokens - end
        return end

    def _worth_loading(self, m: Match, start: int) -> bool:
        """Whether loading ``m`` from ``start`` is expected to beat recomputing it by the cost
        model's margin (True while a rate is unknown: loading is how it is learned)."""
        assert self.cache is not None
        estimate = self.cache.estimate(m)
        costs = estimate.costs
        verdict = estimate.worth_loading if costs is None else costs.suffix(start // self.page).estimate().worth_loading
        return verdict is not False

    async def _open_stream(
        self, res: RequestResult, prompt: list[int], usable: int, slots: torch.Tensor, start: int
    ) -> _Stream | None:
        """Match the prompt's first ``usable`` tokens and start streaming what the GPU prefix lacks."""
        assert self.cache is not None
        t = time.perf_counter()
        m = await self.cache.match(prompt[:usable], salt=res.tenant)
        res.match_s = time.perf_counter() - t
        async with m:  # releases the match when no stream takes it
            if m.tokens <= start:
                return None
            layered = self.load_path.layered_for(m.disk_pages > 0)
            estimate = self.cache.estimate(m)
            share, tail = (m.tokens - start) / m.tokens, len(prompt) - m.tokens
            # Claims are at most a chunk (claim_size), each a prefill call with its fixed cost.
            prices = hit_prices(estimate, share=share, tail_tokens=tail, match_tokens=m.tokens,
                                page_tokens=self.page, layered=layered, claim_tokens=self.chunk_tokens)
            if prices is not None:
                res.plan_prices = dataclasses.asdict(prices)
            plan = HitPlan.SPLIT if self.claim is ClaimPolicy.ALWAYS else plan_hit(
                estimate, share=share, tail_tokens=tail, match_tokens=m.tokens, page_tokens=self.page,
                layered=layered, disk=m.disk_pages > 0, claim_tokens=self.chunk_tokens,
                claims=self.load_path.claims)
            res.plan = plan.value
            if plan is HitPlan.RECOMPUTE:
                res.declined_tokens = m.tokens - start  # the match is released unloaded
                return None
            claim = self.load_path.claims and plan is HitPlan.SPLIT
            started = time.perf_counter()
            stream = await self._start_stream(m, slots[start : m.tokens], start, layered)
        return _Stream(stream, m.tokens, claim, layered, started)

    def _record_stream(self, res: RequestResult, s: _Stream, start: int) -> None:
        assert s.result is not None
        r = s.result
        res.pool_tokens = r.pool_pages * self.page
        res.disk_tokens = r.disk_pages * self.page
        res.claimed_tokens = r.claimed - start
        res.lost_tokens = r.loaded_from - r.claimed  # what a fault left to the engine
        res.load_s = s.waited

    async def _compute(self, prompt: list[int], start: int, slots: torch.Tensor, s: _Stream | None) -> Computed:
        """Prefill ``prompt[start:]`` into ``slots`` (earlier positions hold their K/V), then decode.

        With a stream, the match's prefix is claimed from the front and loaded from the back
        (``LoadStream``) before the tail. Returns when the K/V of every prompt position are in the
        KV buffer(s), so they may be offloaded.
        """
        n = len(prompt)
        t_start = time.perf_counter()
        first: First | None
        if s is None:
            first = await self._prefill(prompt, start, n, slots, first=True)
        else:
            pos = await self._claim_front(prompt, start, slots, s) if s.claim else start
            if s.layered:
                # Every copy is launched (or the loader met our claims): a disk fault below the
                # front left [pos, front) to us; then the tail waits on each layer of the rest.
                t = time.perf_counter()
                front = await s.stream.launched()
                s.waited += time.perf_counter() - t
                await self._prefill(prompt, pos, front, slots)
                first = await self._prefill(prompt, s.tokens, n, slots, first=True, layers=s.stream)
                t = time.perf_counter()
                s.result = await s.stream.finish()
                s.waited += time.perf_counter() - t
                if s.result.loaded_from > front:  # a copy failed after its launch: the tail read bad KV
                    await self._prefill(prompt, front, s.result.loaded_from, slots)
                    first = await self._prefill(prompt, s.tokens, n, slots, first=True)
            else:
                t = time.perf_counter()
                s.result = await s.stream.finish()
                s.waited += time.perf_counter() - t
                await self._prefill(prompt, pos, s.result.loaded_from, slots)
                first = await self._prefill(prompt, s.tokens, n, slots, first=True)
        assert first is not None
        t_first = time.perf_counter()
        logits, generated = await self._decode(n, first, slots)
        return Computed(logits, generated, t_start, t_first, time.perf_counter(), first.queued or t_first)

    async def _claim_front(self, prompt: list[int], pos: int, slots: torch.Tensor, s: _Stream) -> int:
        """Claim and compute the match from ``pos`` until it meets the load's front; return where we stopped.

        Each claim is sized to where the fronts should meet at their current paces (:func:`claim_size`):
        a long chunk claimed up front would be computed even where the load would have been there
        sooner. Claims stay on the grid of :func:`prefill_chunks`, so with one page per chunk they
        have the shapes of a from-scratch run.
        """
        first = previous = pos
        started = time.perf_counter()
        while True:
            now = time.perf_counter()
            front = s.stream.front
            size = claim_size(
                gap=front - pos, loaded=s.tokens - front, load_s=now - s.started,
                computed=previous - first, compute_s=now - started, page=self.page, chunk=self.chunk_tokens,
            )
            planned = s.stream.planned
            if planned is not None and planned > pos:
                # The cost model's split (known from the first hit after a restart: its rates
                # are kept in the disk tier's directory): claim up to it in whole chunks.
                size = max(size, planned - pos)
            want = min(s.tokens, pos + size, (pos // self.chunk_tokens + 1) * self.chunk_tokens)
            end = s.stream.claim(want)
            if end <= pos:
                return pos
            await self._prefill(prompt, pos, end, slots, paced=True)
            # Only chunks before the last are surely computed (CUDA: the last may still be queued).
            previous, pos = pos, end

    @abc.abstractmethod
    def _note_prefill(self, tokens: int, seconds: float, prefix: int) -> None:
        """Tell the cache's cost model how long this engine took to prefill ``tokens`` tokens on
        top of ``prefix`` tokens in its KV buffer (where the cache takes it)."""

    @abc.abstractmethod
    async def _start_stream(self, match: Match, slots: torch.Tensor, start: int, layered: bool) -> LoadStream:
        """``start_load`` on this loop's cache (host ``slots`` of tokens ``[start, match.tokens)``)."""

    @abc.abstractmethod
    async def _prefill(
        self,
        prompt: list[int],
        begin: int,
        end: int,
        slots: torch.Tensor,
        *,
        first: bool = False,
        layers: LoadStream | None = None,
        paced: bool = False,
    ) -> First | None:
        """Prefill positions ``[begin, end)`` (nothing when empty) in chunks of :func:`prefill_chunks`.

        ``first``: return the last position's logits and greedy token (computed by then).
        ``layers``: a layer-wise stream whose copies each layer's attention must wait for.
        ``paced``: return only once the accelerator finished everything but this call's last chunk,
        so that claims track what was computed, not what was queued.
        """

    @abc.abstractmethod
    async def _decode(self, n: int, first: First, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        """Greedy decode after a prompt of ``n`` tokens: logits and token of every generated token."""


class _OrderedLayers:
    """CUDA layer hook: the model thread's current stream waits (on the GPU, no host wait) for layer
    l's copies, placed between layer l's projections and its attention. Once per layer: later
    chunks on the same stream are ordered after the wait already."""

    def __init__(self, stream: LoadStream) -> None:
        self._stream = stream
        self._ordered: set[int] = set()

    def __call__(self, layer: int) -> None:
        if layer not in self._ordered:
            self._stream.order_layer(layer)
            self._ordered.add(layer)


class _LayerGate:
    """CPU layer hook: the model thread blocks until layer l of every copy landed.

    A task on the loop follows the stream's layers in order (``wait_layer``) and opens one
    ``threading.Event`` per layer, so the model thread waits only for layers not yet in and makes
    no loop round trip for those that are (each round trip could wait out the GIL's switch
    interval). A copy that failed opens its layer too: ``finish()`` reports it and the engine redoes
    the tail.
    """

    def __init__(self, stream: LoadStream, layers: int) -> None:
        self._ready = [threading.Event() for _ in range(layers)]
        self._task = asyncio.get_running_loop().create_task(self._follow(stream))

    async def _follow(self, stream: LoadStream) -> None:
        for layer, ready in enumerate(self._ready):
            await stream.wait_layer(layer)
            ready.set()

    def __call__(self, layer: int) -> None:
        if not self._ready[layer].wait(LAYER_WAIT_S):
            raise TimeoutError(f"layer {layer} of the load did not land in {LAYER_WAIT_S} s")

    async def aclose(self) -> None:
        """Stop following (the prefill ended, maybe early) and wait until the task is done."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class Engine(ServingLoop):
    """One process: one model, one KV buffer, one optional aiokv cache; serves requests from many tasks."""

    def __init__(
        self,
        model: LlamaModel,
        kv: torch.Tensor,
        blocks: BlockTable,
        cache: KVCache | None,
        chunk_tokens: int,
        gen_tokens: int,
        keep_logits: bool = True,
        prefetch: bool = False,
        settle: bool = False,
        load_path: LoadPath = LoadPath.PLAIN,
        claim: ClaimPolicy = ClaimPolicy.AUTO,
    ) -> None:
        super().__init__(blocks, cache, chunk_tokens, gen_tokens, keep_logits, prefetch, settle, load_path, claim)
        self.kv_cache = cache
        self.model = model
        self.kv = kv
        self._paced: torch.cuda.Event | None = None  # the last paced chunk's completion (CUDA)
        # Per request (keyed by its host slots' id): (prompt, host slots, device tokens, device slots).
        self._staged: dict[int, tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Per request (keyed by its host slots' id): its model calls' CPU seconds, waits, preemptions.
        self._work: dict[int, tuple[float, int, int]] = {}

    async def _start_stream(self, match: Match, slots: torch.Tensor, start: int, layered: bool) -> LoadStream:
        assert self.kv_cache is not None
        return await self.kv_cache.start_load(match, slots, from_token=start, layered=layered)

    def _note_prefill(self, tokens: int, seconds: float, prefix: int) -> None:
        if self.kv_cache is not None and tokens > 0 and seconds > 0:
            self.kv_cache.note_prefill(tokens, seconds, prefix=prefix)

    async def _prefill(
        self,
        prompt: list[int],
        begin: int,
        end: int,
        slots: torch.Tensor,
        *,
        first: bool = False,
        layers: LoadStream | None = None,
        paced: bool = False,
    ) -> First | None:
        if end <= begin:
            return None
        hook: LayerHook | None = None
        gate: _LayerGate | None = None
        if layers is not None and self.kv.is_cuda:
            hook = _OrderedLayers(layers)
        elif layers is not None:
            hook = gate = _LayerGate(layers, self.model.cfg.num_layers)
        # The model runs in a worker thread (torch releases the GIL), so the loop keeps serving
        # the cache's disk and copy completions, and the stream's loader, while a chunk computes.
        try:
            return await on_model_thread(self._counted, slots, self._on_device, self._prefill_sync, prompt, begin,
                                           end, slots, first, hook, paced)
        finally:
            if gate is not None:
                await gate.aclose()

    def _on_device(self, fn: Callable[..., _R], *args: object) -> _R:
        if self.kv.is_cuda:
            # A worker thread starts on device 0 and the default stream: follow the KV buffer's device.
            with torch.cuda.device(self.kv.device):
                return fn(*args)
        return fn(*args)

    def _stage_inputs(self, prompt: list[int], slots: torch.Tensor) -> None:
        if self.kv.is_cuda:
            with torch.cuda.device(self.kv.device):
                tokens = self._to_device(torch.tensor(prompt, dtype=torch.int64))
                self._staged[id(slots)] = (prompt, slots, tokens, self._to_device(slots))

    def _unstage_inputs(self, slots: torch.Tensor) -> None:
        self._staged.pop(id(slots), None)
        self._work.pop(id(slots), None)

    def _take_model_work(self, slots: torch.Tensor) -> tuple[float, int, int]:
        return self._work.pop(id(slots), (0.0, 0, 0))

    def _counted(self, host_slots: torch.Tensor, fn: Callable[..., _R], *args: object) -> _R:
        """``fn(*args)`` on this (model) thread, its CPU time and context switches added to the request's."""
        cpu, waits, preempted = thread_counters()
        try:
            return fn(*args)
        finally:
            c, w, p = thread_counters()
            before = self._work.get(id(host_slots), (0.0, 0, 0))
            self._work[id(host_slots)] = (before[0] + c - cpu, before[1] + w - waits, before[2] + p - preempted)

    def _inputs(
        self, prompt: list[int], begin: int, end: int, host_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Device token ids of ``[begin, end)`` and slots of ``[0, end)``: slices of the staged copies
        when this request's inputs were staged (the same objects), else copied now."""
        staged = self._staged.get(id(host_slots))
        if staged is not None and staged[0] is prompt and staged[1] is host_slots:
            return staged[2][begin:end], staged[3][:end]
        tokens = self._to_device(torch.tensor(prompt[begin:end], dtype=torch.int64))
        return tokens, self._to_device(host_slots[:end])

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the KV buffer's device; a pageable copy would wait for the queued chunks."""
        if not self.kv.is_cuda:
            return host
        # Not host.pin_memory(): its is_pinned() check asks the driver about the pointer (2.7 ms of
        # a traced 8K pool hit on the H100 host, for two calls); a pinned block of the caching
        # host allocator takes no query.
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned.to(self.kv.device, non_blocking=True)

    def _prefill_sync(
        self, prompt: list[int], begin: int, end: int, host_slots: torch.Tensor, first: bool,
        hook: LayerHook | None, paced: bool,
    ) -> First | None:
        tokens, slots = self._inputs(prompt, begin, end, host_slots)
        for b, e in prefill_chunks(begin, end, self.chunk_tokens):
            logits = self.model.forward(tokens[b - begin : e - begin], b, slots[:e], self.kv, hook)
        if paced and self.kv.is_cuda:
            # Keep one chunk queued behind the running one: no bubble, and the next claim comes
            # only once the GPU reached this chunk.
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            previous, self._paced = self._paced, done
            if previous is not None:
                previous.synchronize()
        else:
            self._paced = None
        if not first:
            return None
        # Host-side end of the prefill: on CUDA the kernels are queued, not run. A prefill_s far
        # above launch_s waited for the GPU; launch_s itself grows when the launching thread is
        # starved (the GIL, the CPU).
        queued = time.perf_counter()
        # .item() waits for this stream's prefill; a device-wide sync would also wait for the
        # cache's copies of other requests on its side stream.
        return First(logits, int(logits.argmax().item()), queued)

    async def _decode(self, n: int, first: First, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        return await on_model_thread(self._counted, slots, self._on_device, self._decode_sync, n, first, slots)

    def _decode_sync(self, n: int, first: First, host_slots: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
        slots = self._to_device(host_slots)
        logits_list, generated = [first.logits], [first.token]
        token = first.token
        for i in range(self.gen_tokens - 1):
            step = torch.tensor([token], dtype=torch.int64, device=self.kv.device)
            logits = self.model.forward(step, n + i, slots[: n + i + 1], self.kv)
            token = int(logits.argmax().item())
            logits_list.append(logits)
            generated.append(token)
        return logits_list, generated


@dataclass(eq=False)
class _Turn:
    """A turn waiting for an engine slot, and the prefetch started for it."""

    name: str
    prompt: list[int]
    tenant: str
    prefetch: asyncio.Task[PrefetchResult] | None = None


def request_names(sessions: Sequence[Session]) -> list[str]:
    """The name of every request (turn) of ``sessions``: ``<session>/turn<k>``."""
    return [f"{s.name}/turn{k}" for s in sessions for k in range(len(s.texts))]


def admission_order(results: Sequence[RequestResult]) -> list[str]:
    """Request names in the order a run admitted them to the engine (by ``index``)."""
    return [r.name for r in sorted(results, key=lambda r: r.index)]


async def run_sessions(
    engine: ServingLoop,
    sessions: Sequence[Session],
    concurrency: int,
    window: int,
    on_done: Callable[[RequestResult], None],
    order: Sequence[str] | None = None,
) -> list[RequestResult]:
    """Serve ``sessions`` in arrival order with ``window`` open at once and ``concurrency`` requests in flight.

    A session's next turn waits for its previous answer and then queues behind the other open
    sessions' turns (FIFO), so a user comes back after about ``window - 1`` other requests.

    ``order`` (request names, from :func:`admission_order` of a run of the same sessions, window
    and concurrency) admits the requests in exactly that order instead: a turn that is ready waits
    until every request before it was admitted. Each request then has the same index, and the
    same requests in flight before it, as in that run, so per-request times compare like for
    like. Raises ``ValueError`` unless ``order`` names every request once.
    """
    if order is not None and sorted(order) != sorted(request_names(sessions)):
        raise ValueError("order must name every request of the sessions exactly once")
    results: list[RequestResult] = []
    counter = iter(range(1 << 30))
    open_gate = asyncio.Semaphore(window)
    in_flight = asyncio.Semaphore(concurrency)  # FIFO: waiters enter in the order of ``queue``
    queue: list[_Turn] = []
    admitted = 0  # requests admitted so far (``order``: the position of the next one)
    turn_changed = asyncio.Condition()

    async def wait_turn(name: str) -> None:
        if order is not None:
            async with turn_changed:
                await turn_changed.wait_for(lambda: order[admitted] == name)

    def next_in_line() -> _Turn | None:
        if order is None:
            return queue[0] if queue else None
        following = order[admitted] if admitted < len(order) else None
        return next((t for t in queue if t.name == following), None)

    async def session(s: Session) -> None:
        nonlocal admitted
        async with open_gate:
            prompt: list[int] = []
            for k, text in enumerate(s.texts):
                prompt = prompt + list(text)
                name = f"{s.name}/turn{k}"
                turn = _Turn(name, prompt, s.tenant)
                queue.append(turn)
                await wait_turn(name)
                async with in_flight:
                    queue.remove(turn)
                    admitted += 1
                    if order is not None:
                        async with turn_changed:
                            turn_changed.notify_all()
                    nxt = next_in_line()
                    if engine.cache is not None and engine.prefetch and nxt is not None and nxt.prefetch is None:
                        # The next turn in line will start within one request: promote its disk pages
                        # into the pool now, while this one computes (earlier, the pool may evict them).
                        nxt.prefetch = asyncio.create_task(engine.cache.prefetch(nxt.prompt, salt=nxt.tenant))
                    promoted = (await turn.prefetch).promoted if turn.prefetch is not None else 0
                    r = await engine.serve(name, s.tenant, s.kind.value, next(counter), prompt)
                r.prefetched_pages = promoted
                results.append(r)
                on_done(r)
                prompt = prompt + r.generated

    async with asyncio.TaskGroup() as tg:
        for s in sessions:
            tg.create_task(session(s))
    results.sort(key=lambda r: r.name)
    return results


async def timed_run(
    engine: ServingLoop,
    sessions: Sequence[Session],
    concurrency: int,
    window: int,
    on_done: Callable[[RequestResult], None],
    order: Sequence[str] | None = None,
) -> tuple[list[RequestResult], float]:
    """:func:`run_sessions` (``order``: admit in this order) and its wall time in seconds."""
    t = time.perf_counter()
    results = await run_sessions(engine, sessions, concurrency, window, on_done, order)
    return results, time.perf_counter() - t


@dataclass
class Runs:
    """Both runs of the demo's workload: records, wall times (s), the cache's counters, TP ranks."""

    cached: list[RequestResult]
    scratch: list[RequestResult]
    wall: float
    wall_scratch: float
    stats: CacheStatistics | None
    rank_pids: tuple[int, ...] = ()
    rank_workers: tuple[WorkerStatistics, ...] = ()  # each TP rank's aiokv worker, once stopped
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # run -> perf_counter begin, end


def total_requests(sessions: Sequence[Session]) -> int:
    """Number of requests (turns) in ``sessions``."""
    return sum(len(s.texts) for s in sessions)

