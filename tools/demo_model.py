"""A small Llama-architecture decoder in plain torch that reads and writes a token-slot KV buffer.

The KV buffer is one tensor ``[L, S, 2 * H_kv, D]`` (K heads, then V heads), the layout aiokv pages.
Each forward call processes one chunk of a request: it writes the chunk's K/V into the request's
slots and attends over all slots of the request up to the chunk's end.

Bit-exactness with and without the cache comes from doing the same arithmetic in both cases: the
engine always prefills in chunks aligned to absolute multiples of ``chunk_tokens`` (a multiple of
the page size), so a chunk computed after a cache hit has the same shapes and inputs as the chunk
computed from scratch, and the K/V it reads back are byte copies of what a from-scratch run wrote.

Tensor parallelism (``Shard``): a rank holds its query heads, KV heads and MLP columns; the two
partial sums per layer are combined by an all-reduce the caller supplies. Bit-exactness then holds
between two runs under the same split (the all-reduce's summation order is fixed), not against the
one-process model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder; weights are random from ``seed`` (no download)."""

    num_layers: int = 4
    hidden: int = 512
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate: int = 1408
    vocab: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.num_heads

    @property
    def params(self) -> int:
        """Number of weights (embedding and LM head untied)."""
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.hidden * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.num_layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


PRESETS: dict[str, ModelConfig] = {
    # Runs in the test suite in seconds.
    "tiny": ModelConfig(num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, intermediate=128, vocab=256),
    # The CPU default of `make demo`.
    "small": ModelConfig(),
    # Llama-3.1-8B's shape (random weights), for an H200.
    "8b": ModelConfig(
        num_layers=32,
        hidden=4096,
        num_heads=32,
        num_kv_heads=8,
        intermediate=14336,
        vocab=128256,
        rope_theta=500000.0,
        dtype=torch.bfloat16,
    ),
}


def preset(name: str, dtype: torch.dtype | None = None, seed: int = 0) -> ModelConfig:
    """A preset shape, optionally with another dtype or seed; raises ``KeyError`` for unknown names."""
    cfg = PRESETS[name]
    return replace(cfg, dtype=dtype or cfg.dtype, seed=seed)


@dataclass(frozen=True)
class Shard:
    """The part of every layer one of ``size`` tensor-parallel ranks holds (Megatron's split).

    Query heads and the MLP's intermediate columns are cut into ``size`` contiguous ranges; KV heads
    too when ``size`` divides them, else (``size`` a multiple of the KV heads) each KV head is
    replicated on ``size // num_kv_heads`` ranks, as ``aiokv.layout.TPSlice`` assumes. Embedding,
    norms and LM head are replicated. ``Shard()`` is the whole model.
    """

    rank: int = 0
    size: int = 1

    def check(self, cfg: ModelConfig) -> None:
        """Raise ``ValueError`` when ``cfg`` cannot be split this way."""
        n, hk = self.size, cfg.num_kv_heads
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} out of range for tp size {n}")
        if cfg.num_heads % n or cfg.intermediate % n:
            raise ValueError(f"tp size {n} must divide num_heads {cfg.num_heads} and intermediate {cfg.intermediate}")
        if hk % n and n % hk:
            raise ValueError(f"tp size {n} must divide num_kv_heads {hk} or be a multiple of it")

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """First query head and count."""
        count = cfg.num_heads // self.size
        return self.rank * count, count

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """First KV head and count (one replicated head when the KV heads are fewer than the ranks)."""
        hk = cfg.num_kv_heads
        if self.size <= hk:
            count = hk // self.size
            return self.rank * count, count
        return self.rank // (self.size // hk), 1

    def columns(self, cfg: ModelConfig) -> tuple[int, int]:
        """First intermediate column of the MLP and count."""
        count = cfg.intermediate // self.size
        return self.rank * count, count


def _rows(w: torch.Tensor, *ranges: tuple[int, int]) -> torch.Tensor:
    """Rows ``[start, start + count)`` of each range, stacked; ``w`` itself when they cover it in order."""
    if [s for s, _ in ranges] == [sum(c for _, c in ranges[:i]) for i in range(len(ranges))] and \
            sum(c for _, c in ranges) == w.shape[0]:
        return w
    return torch.cat([w[s : s + c] for s, c in ranges]).contiguous()


def _cols(w: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Columns ``[start, start + count)`` of ``w`` (contiguous); ``w`` itself when that is all of it."""
    return w if (start, count) == (0, w.shape[1]) else w[:, start : start + count].contiguous()


class Layer:
    """Weights of one decoder layer (fused QKV and fused gate/up projections), or a shard of them."""

    def __init__(self, cfg: ModelConfig, gen: torch.Generator, device: torch.device, shard: Shard = Shard()) -> None:
        h, d = cfg.hidden, cfg.head_dim
        hq, hk, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate
        qkv_out = (hq + 2 * hk) * d

        def linear(out_f: int, in_f: int) -> torch.Tensor:
            # Scaled so activations keep unit size through many layers of random weights.
            w = torch.randn(out_f, in_f, generator=gen, device=device, dtype=torch.float32)
            return (w / math.sqrt(in_f)).to(cfg.dtype)

        # Every rank draws the whole layer (the same generator sequence as one process, so the TP
        # model has the same weights) and keeps its slice; the rest is freed before the next layer.
        (qs, qc), (ks, kc), (cs, cc) = shard.q_heads(cfg), shard.kv_heads(cfg), shard.columns(cfg)
        self.attn_norm = torch.ones(h, device=device, dtype=cfg.dtype)
        self.wqkv = _rows(linear(qkv_out, h), (qs * d, qc * d), ((hq + ks) * d, kc * d), ((hq + hk + ks) * d, kc * d))
        self.wo = _cols(linear(h, hq * d), qs * d, qc * d)
        self.mlp_norm = torch.ones(h, device=device, dtype=cfg.dtype)
        self.w_gate_up = _rows(linear(2 * inter, h), (cs, cc), (inter + cs, cc))
        self.w_down = _cols(linear(h, inter), cs, cc)


AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the tensor-parallel ranks (identical result on every rank); returns the sum."""

LayerHook = Callable[[int], None]
"""Called with a layer index right before that layer's attention reads the KV buffer: a layer-wise
load makes the engine wait there for that layer's copies (on the GPU stream, or the host on CPU)."""


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class LlamaModel:
    """Decoder with RMSNorm, rotary embeddings, GQA attention over a slot KV buffer, SwiGLU MLP.

    With a ``shard`` of more than one rank it holds that rank's heads and MLP columns, its KV
    buffer holds only its KV heads (K then V), and ``all_reduce`` combines the ranks' partial
    outputs of the attention output projection and the MLP down projection (Megatron-style).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        max_positions: int,
        shard: Shard = Shard(),
        all_reduce: AllReduce = _no_reduce,
    ) -> None:
        shard.check(cfg)
        self.cfg = cfg
        self.device = device
        self.shard = shard
        self.all_reduce = all_reduce
        self.q_heads = shard.q_heads(cfg)[1]
        self.kv_heads = shard.kv_heads(cfg)[1]
        # Weights are drawn on the device itself: 8B parameters drawn on a CPU would take minutes.
        gen = torch.Generator(device=device)
        gen.manual_seed(cfg.seed)
        self.embed = torch.randn(cfg.vocab, cfg.hidden, generator=gen, device=device).to(cfg.dtype)
        self.layers = [Layer(cfg, gen, device, shard) for _ in range(cfg.num_layers)]
        self.final_norm = torch.ones(cfg.hidden, device=device, dtype=cfg.dtype)
        head = torch.randn(cfg.vocab, cfg.hidden, generator=gen, device=device, dtype=torch.float32)
        self.lm_head = (head / math.sqrt(cfg.hidden)).to(cfg.dtype)
        half = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        self.cos = angles.cos()
        self.sin = angles.sin()
        self.max_positions = max_positions

    def new_kv_buffer(self, slots: int) -> torch.Tensor:
        """A zeroed KV buffer ``[L, slots, 2 * H_kv, D]`` (this shard's KV heads) in the model dtype and device."""
        c = self.cfg
        return torch.zeros(
            c.num_layers, slots, 2 * self.kv_heads, c.head_dim, device=self.device, dtype=c.dtype
        )

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return xf.to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, pos: slice) -> torch.Tensor:
        """Rotate ``x`` ``[M, heads, D]`` by the angles of positions ``pos`` (half-split convention)."""
        cos = self.cos[pos][:, None, :]
        sin = self.sin[pos][:, None, :]
        xf = x.float()
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        slots: torch.Tensor,
        kv: torch.Tensor,
        before_attention: LayerHook | None = None,
    ) -> torch.Tensor:
        """Run tokens at positions ``[start, start + M)``; return the float32 logits ``[V]`` of the last one.

        ``tokens``: ``[M]`` int64. ``slots``: ``[start + M]`` int64, the request's slot of every
        position so far; the chunk's K/V are written to ``slots[start:]`` and attention reads all of
        ``slots`` (earlier positions must already hold their K/V, computed or loaded, or arrive by the
        time ``before_attention(layer)`` returns).
        """
        return self.logits(self.hidden(tokens, start, slots, kv, before_attention))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The float32 logits ``[V]`` of the last row of ``hidden`` ``[M, hidden]``."""
        last = self._norm(hidden[-1:], self.final_norm)
        return (last @ self.lm_head.T).float()[0]

    @torch.inference_mode()
    def hidden(
        self,
        tokens: torch.Tensor,
        start: int,
        slots: torch.Tensor,
        kv: torch.Tensor,
        before_attention: LayerHook | None = None,
    ) -> torch.Tensor:
        """The decoder layers of :meth:`forward`: the final hidden states ``[M, hidden]`` (every rank's)."""
        c = self.cfg
        m = tokens.shape[0]
        end = start + m
        if slots.shape[0] != end:
            raise ValueError(f"need {end} slots, got {slots.shape[0]}")
        if end > self.max_positions:
            raise ValueError(f"position {end} beyond max_positions {self.max_positions}")
        hq, hk, d = self.q_heads, self.kv_heads, c.head_dim
        pos = slice(start, end)
        new_slots = slots[start:]
        # Query i sits at position start + i: causal aligned to the lower right of [M, end]. As a
        # CausalBias it runs in the flash/memory-efficient kernels on CUDA without a materialised mask.
        mask = causal_lower_right(m, end)
        x = self.embed[tokens]
        for li, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm)
            qkv = h @ layer.wqkv.T
            q = qkv[:, : hq * d].view(m, hq, d)
            k = qkv[:, hq * d : (hq + hk) * d].view(m, hk, d)
            v = qkv[:, (hq + hk) * d :].view(m, hk, d)
            kv_layer = kv[li]
            kv_layer[new_slots, :hk] = self._rope(k, pos)
            kv_layer[new_slots, hk:] = v
            if before_attention is not None:
                # As late as possible: this layer's projections above overlapped its load.
                before_attention(li)
            # Read every position back from the buffer, the chunk's own included, so the same bytes
            # feed attention whether earlier positions were computed now or loaded from the cache.
            ctx = kv_layer[slots]
            rep = hq // hk
            keys = ctx[:, :hk].transpose(0, 1).repeat_interleave(rep, dim=0)
            vals = ctx[:, hk:].transpose(0, 1).repeat_interleave(rep, dim=0)
            qh = self._rope(q, pos).transpose(0, 1)
            # 4-D (batch of one): the flash and memory-efficient CUDA kernels accept only 4-D inputs.
            att = F.scaled_dot_product_attention(qh[None], keys[None], vals[None], attn_mask=mask)[0]
            # Under TP each rank holds some heads: its output projection is a partial sum of x's update.
            x = x + self.all_reduce(att.transpose(0, 1).reshape(m, hq * d) @ layer.wo.T)
            h = self._norm(x, layer.mlp_norm)
            gate, up = (h @ layer.w_gate_up.T).chunk(2, dim=-1)
            x = x + self.all_reduce((F.silu(gate) * up) @ layer.w_down.T)
        return x
