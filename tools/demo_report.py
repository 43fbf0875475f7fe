"""Progress bar, oracle comparison, summary table, JSON and PNG output of the demo."""

from __future__ import annotations

import dataclasses
import enum
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from demo_engine import RequestResult, Session, total_requests

if TYPE_CHECKING:
    from aiokv.tp import WorkerStatistics


class Progress:
    """A one-line text progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.tokens = {"gpu": 0, "pool": 0, "disk": 0, "computed": 0}
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_decile = -1

    def __call__(self, r: RequestResult) -> None:
        self.done += 1
        self.tokens["gpu"] += r.gpu_tokens
        self.tokens["pool"] += r.pool_tokens
        self.tokens["disk"] += r.disk_tokens
        self.tokens["computed"] += r.computed_tokens
        width = 30
        filled = width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        tok = " ".join(f"{k}={v}" for k, v in self.tokens.items())
        line = f"{self.label:>10} [{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:6.1f}s {tok}"
        decile = 10 * self.done // max(1, self.total)
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if self.done == self.total else ""))
        elif decile != self._last_decile:
            sys.stderr.write(line + "\n")
        self._last_decile = decile
        sys.stderr.flush()


def progress_bar(label: str, sessions: Sequence[Session], show: bool) -> Callable[[RequestResult], None]:
    """A :class:`Progress` over every turn of ``sessions``, or a no-op when ``show`` is False."""
    if show:
        return Progress(label, total_requests(sessions))

    def quiet(_: RequestResult) -> None:
        pass

    return quiet


@dataclass(frozen=True)
class OracleReport:
    """Outcome of comparing the cached run against the from-scratch run, request by request."""

    compared: int
    mismatches: tuple[str, ...]
    max_abs_logit_diff: float
    logits_bit_exact: bool


def compare(cached: Sequence[RequestResult], scratch: Sequence[RequestResult], exact: bool) -> OracleReport:
    """Generated tokens must be identical; logits bit-exact when ``exact`` (CPU), else the diff is reported."""
    base = {r.name: r for r in scratch}
    bad: list[str] = []
    worst = 0.0
    all_equal = True
    for r in cached:
        b = base.get(r.name)
        if b is None:
            bad.append(f"{r.name}: missing from the from-scratch run")
            continue
        if r.prompt_digest != b.prompt_digest:
            bad.append(f"{r.name}: prompt differs (an earlier turn's answer differed)")
            continue
        if r.generated != b.generated:
            bad.append(f"{r.name}: generated {r.generated} with cache, {b.generated} from scratch")
        if r.logits is not None and b.logits is not None:
            diff = float((r.logits - b.logits).abs().max())
            worst = max(worst, diff)
            equal = torch.equal(r.logits, b.logits)
            all_equal = all_equal and equal
            if exact and not equal:
                bad.append(f"{r.name}: final logits differ (max abs diff {diff:.3g})")
    if len(cached) != len(scratch):
        bad.append(f"request counts differ: {len(cached)} with cache, {len(scratch)} from scratch")
    return OracleReport(len(cached), tuple(bad), worst, all_equal)


def plain(value: Any) -> Any:
    """Stats and results as JSON-ready values (enums by value, dataclasses as dicts)."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, torch.Tensor)):
        return None
    return value


NOISE = 1.1
"""A request counts as slower beyond noise when its TTFT with the cache exceeds this times from scratch."""


@dataclass(frozen=True)
class TTFTRatio:
    """One request's time to first token with the cache against the same request from scratch."""

    name: str
    cached_s: float
    scratch_s: float  # NaN when the request is missing from the scratch run

    @property
    def ratio(self) -> float:
        """cache / scratch: above 1 the cache made this request slower."""
        return self.cached_s / self.scratch_s if self.scratch_s > 0 else float("nan")


def ttft_ratios(cached: Sequence[RequestResult], scratch: Sequence[RequestResult]) -> list[TTFTRatio]:
    """Per request of ``cached`` (same order), its TTFT ratio against the request of the same name."""
    base = {r.name: r.ttft_s for r in scratch}
    return [TTFTRatio(r.name, r.ttft_s, base.get(r.name, float("nan"))) for r in cached]


@dataclass(frozen=True)
class MissComparison:
    """Requests that computed their whole prompt in both runs: the engine did the same work, so
    their own prefill (not the queue ahead of them) shows whether serving with the cache slowed
    the engine's compute: ratios cache / scratch of ``prefill_s`` and of its host part ``launch_s``."""

    requests: int
    prefill_median: float | None
    prefill_worst: float | None
    worst_request: str | None
    launch_median: float | None
    # Medians over these requests' prefill + decode, (with cache, from scratch): the model thread's
    # voluntary switches per second (waits: the GIL, a lock), involuntary ones (preempted), CPU share.
    waits_per_s: tuple[float, float] | None = None
    preemptions_per_s: tuple[float, float] | None = None
    cpu_share: tuple[float, float] | None = None


def _per_compute_s(r: RequestResult, value: float) -> float:
    return value / max(1e-9, r.prefill_s + r.decode_s)


def compare_misses(cached: Sequence[RequestResult], scratch: Sequence[RequestResult]) -> MissComparison:
    """:class:`MissComparison` of the requests of ``cached`` that hit nothing (by name in ``scratch``)."""
    base = {r.name: r for r in scratch}
    pairs = [(r, base[r.name]) for r in cached
             if r.name in base and r.computed_tokens == r.prompt_tokens == base[r.name].computed_tokens
             and r.prefill_s > 0 and base[r.name].prefill_s > 0]
    if not pairs:
        return MissComparison(0, None, None, None, None)
    prefill = [(c.prefill_s / s.prefill_s, c.name) for c, s in pairs]
    launch = [c.launch_s / s.launch_s for c, s in pairs if c.launch_s > 0 and s.launch_s > 0]
    worst = max(prefill)

    def both(get: Callable[[RequestResult], float]) -> tuple[float, float]:
        return (statistics.median(_per_compute_s(c, get(c)) for c, _ in pairs),
                statistics.median(_per_compute_s(s, get(s)) for _, s in pairs))

    return MissComparison(len(pairs), statistics.median(v for v, _ in prefill), worst[0], worst[1],
                          statistics.median(launch) if launch else None, both(lambda r: r.model_waits),
                          both(lambda r: r.model_preemptions), both(lambda r: r.model_cpu_s))


def summarize(
    cached: Sequence[RequestResult], scratch: Sequence[RequestResult], wall: float, wall_scratch: float
) -> dict[str, Any]:
    """Totals of both runs (tokens, seconds), and how many requests the cache made slower."""
    def total(rs: Sequence[RequestResult], attr: str) -> Any:
        return sum(getattr(r, attr) for r in rs)

    ratios = [x for x in ttft_ratios(cached, scratch) if x.ratio == x.ratio]  # NaN: nothing to compare
    worst = max(ratios, key=lambda x: x.ratio, default=None)
    slower = [x for x in ratios if x.ratio > 1.0]
    position = {r.name: r.index for r in scratch}
    misses = compare_misses(cached, scratch)
    return {
        "requests": len(cached),
        "prompt_tokens": total(cached, "prompt_tokens"),
        "gpu_prefix_tokens": total(cached, "gpu_tokens"),
        "pool_tokens": total(cached, "pool_tokens"),
        "disk_tokens": total(cached, "disk_tokens"),
        "claimed_tokens": total(cached, "claimed_tokens"),
        "declined_tokens": total(cached, "declined_tokens"),
        "lost_tokens": total(cached, "lost_tokens"),
        "prefetched_pages": total(cached, "prefetched_pages"),
        "computed_tokens": total(cached, "computed_tokens"),
        "computed_tokens_scratch": total(scratch, "computed_tokens"),
        "prefill_s": total(cached, "prefill_s"),
        "prefill_s_scratch": total(scratch, "prefill_s"),
        "load_s": total(cached, "load_s"),
        "ttft_s_mean": total(cached, "ttft_s") / max(1, len(cached)),
        "ttft_s_mean_scratch": total(scratch, "ttft_s") / max(1, len(scratch)),
        "wall_s": wall,
        "wall_s_scratch": wall_scratch,
        "compared_ttft": len(ratios),
        "slower_requests": len(slower),
        "slower_fraction": len(slower) / max(1, len(ratios)),
        "slower_beyond_noise": sum(1 for x in ratios if x.ratio > NOISE),
        "slower_names": [x.name for x in slower],
        "worst_ttft_ratio": worst.ratio if worst else None,
        "worst_request": worst.name if worst else None,
        # Requests admitted at another position than from scratch (0: like-for-like queues).
        "admitted_elsewhere": sum(1 for r in cached if position.get(r.name, r.index) != r.index),
        "miss_requests": misses.requests,
        "miss_prefill_ratio_median": misses.prefill_median,
        "miss_prefill_ratio_worst": misses.prefill_worst,
        "miss_prefill_worst_request": misses.worst_request,
        "miss_launch_ratio_median": misses.launch_median,
        "miss_model_waits_per_s": misses.waits_per_s,
        "miss_model_preemptions_per_s": misses.preemptions_per_s,
        "miss_model_cpu_share": misses.cpu_share,
    }


def format_table(summary: Mapping[str, Any], stats: Any, oracle: OracleReport) -> str:
    """The summary table printed at the end of a run."""
    s = summary
    p = max(1, s["prompt_tokens"])

    def row(name: str, with_cache: object, without: object = "") -> str:
        return f"  {name:<34}{with_cache!s:>16}{without!s:>16}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = [
        row("", "with cache", "from scratch"),
        row("requests", s["requests"], s["requests"]),
        row("prompt tokens", s["prompt_tokens"], s["prompt_tokens"]),
        row("  served from GPU prefix", f"{s['gpu_prefix_tokens']} ({100 * s['gpu_prefix_tokens'] / p:.0f}%)"),
        row("  served from CPU pool", f"{s['pool_tokens']} ({100 * s['pool_tokens'] / p:.0f}%)"),
        row("  served from disk", f"{s['disk_tokens']} ({100 * s['disk_tokens'] / p:.0f}%)"),
        row("  matched, computed by the split", s["claimed_tokens"]),
        row("  matched, recomputed (no gain expected)", s["declined_tokens"]),
        row("  matched, load failed", s["lost_tokens"]),
        row("pages prefetched disk->pool", s["prefetched_pages"]),
        row("prefill tokens computed", s["computed_tokens"], s["computed_tokens_scratch"]),
        row("prefill compute (s)", f"{s['prefill_s']:.2f}", f"{s['prefill_s_scratch']:.2f}"),
        row("waiting for loads (s)", f"{s['load_s']:.2f}", "0"),
        row("mean time to first token (s)", f"{s['ttft_s_mean']:.3f}", f"{s['ttft_s_mean_scratch']:.3f}"),
        row("requests slower with cache (TTFT)",
            f"{s['slower_requests']}/{s['compared_ttft']} ({100 * s['slower_fraction']:.0f}%)"),
        row(f"  of them beyond {NOISE:.1f}x", s["slower_beyond_noise"]),
        row("worst TTFT ratio cache/scratch", "-" if s["worst_ttft_ratio"] is None else
            f"{s['worst_ttft_ratio']:.2f}x"),
        row("  worst request", s["worst_request"] or "-"),
        row("  admitted at another position", s["admitted_elsewhere"]),
        row("misses (no hit): requests", s["miss_requests"]),
        row("  own prefill cache/scratch, median", ratio(s["miss_prefill_ratio_median"])),
        row("  worst", ratio(s["miss_prefill_ratio_worst"])),
        row("  host launch part, median", ratio(s["miss_launch_ratio_median"])),
        *([] if s["miss_model_waits_per_s"] is None else [
            row("  model thread: waits per s", *(f"{x:.0f}" for x in s["miss_model_waits_per_s"])),
            row("  model thread: preemptions per s", *(f"{x:.0f}" for x in s["miss_model_preemptions_per_s"])),
            row("  model thread: CPU share", *(f"{100 * x:.0f}%" for x in s["miss_model_cpu_share"])),
        ]),
        row("wall time (s)", f"{s['wall_s']:.1f}", f"{s['wall_s_scratch']:.1f}"),
        row("speedup: prefill / TTFT / wall", "/".join(
            f"{s[k + '_scratch'] / s[k]:.2f}x" if s[k] else "-" for k in ("prefill_s", "ttft_s_mean", "wall_s"))),
    ]
    if stats is not None:
        lines.append("  bytes moved by aiokv:")
        for direction, n in sorted(plain(getattr(stats, "bytes_moved", {})).items()):
            lines.append(row(f"    {direction}", f"{n / 2**20:.1f} MiB"))
        hit = plain(getattr(stats, "hit_tokens", {}))
        if hit:
            lines.append(row("  match hit tokens by tier", " ".join(f"{k}={v}" for k, v in sorted(hit.items()))))
        lines.append(row("  pages stored/skipped/dropped", "/".join(
            str(getattr(stats, a, "?")) for a in ("pages_stored", "pages_skipped", "pages_dropped"))))
        lines.append(row("  pages promoted disk->pool", getattr(stats, "pages_promoted", "?")))
        errors = {k: v for k, v in plain(getattr(stats, "errors", {})).items() if v}
        lines.append(row("  faults by kind", ", ".join(f"{k}={v}" for k, v in sorted(errors.items())) or "none"))
    verdict = "OK" if not oracle.mismatches else f"{len(oracle.mismatches)} MISMATCHES"
    exact = "bit-exact" if oracle.logits_bit_exact else f"max abs diff {oracle.max_abs_logit_diff:.3g}"
    lines.append(row("oracle (tokens, logits)", f"{verdict}, {exact}"))
    return "\n".join(lines)


def tp_line(tp: int, pids: Sequence[int], workers: Sequence[WorkerStatistics]) -> str:
    """One line on the TP ranks: processes, how they combine, what each rank's aiokv worker ran."""
    per_rank = "; ".join(
        f"rank {w.rank}: {w.specs} transfer specs ({', '.join(f'{k.name}={v}' for k, v in w.reports.items())})"
        for w in workers
    )
    return (f"tensor parallel: {tp} rank processes (pids {', '.join(map(str, pids))}), partial sums combined by a "
            f"gloo all-reduce; {per_rank or 'no worker statistics (a rank did not stop cleanly)'}")


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as indented JSON."""
    import json

    path.write_text(json.dumps(plain(payload), indent=2, sort_keys=True, default=str) + "\n")


def plot(path: Path, cached: Sequence[RequestResult], scratch: Sequence[RequestResult], title: str) -> None:
    """Per-request time to first token with and without the cache (requests the cache made slower
    in red), the load's wall time, and where each prompt's tokens came from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(cached, key=lambda r: r.index)
    ratios = {x.name: x for x in ttft_ratios(cached, scratch)}
    x = list(range(len(order)))
    fig, (ax_t, ax_k) = plt.subplots(2, 1, figsize=(max(8.0, 0.12 * len(order) + 4), 7.5), sharex=True)
    ms = 1000.0
    ax_t.bar(x, [ratios[r.name].scratch_s * ms for r in order], width=0.9, color="#d0d0d0",
             label="from scratch")
    ax_t.bar(x, [r.ttft_s * ms for r in order], width=0.5, color="#1f77b4", label="with cache")
    worst = max(ratios.values(), key=lambda q: q.ratio if q.ratio == q.ratio else 0.0, default=None)
    marked = [i for i, r in enumerate(order) if ratios[r.name].ratio > 1.0]
    if marked:
        ax_t.bar(marked, [order[i].ttft_s * ms for i in marked], width=0.5, color="#d62728",
                 label=f"with cache, slower than from scratch: {len(marked)}/{len(order)}"
                 + (f", worst {worst.ratio:.2f}x" if worst else ""))
    ax_t.scatter(x, [r.load_s * ms for r in order], s=9, color="#ff7f0e", zorder=3,
                 label="with cache: waiting for the load")
    ax_t.set_ylabel("time to first token (ms)")
    ax_t.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax_t.set_title(title, fontsize=10)
    parts: list[tuple[str, Callable[[RequestResult], int], str]] = [
        ("GPU prefix", lambda r: r.gpu_tokens, "#2ca02c"),
        ("CPU pool", lambda r: r.pool_tokens, "#9467bd"),
        ("disk", lambda r: r.disk_tokens, "#8c564b"),
        ("cached, computed by the split", lambda r: r.claimed_tokens, "#17becf"),
        ("cached, recomputed (no gain expected)", lambda r: r.declined_tokens, "#bcbd22"),
        ("computed", lambda r: r.computed_tokens - r.claimed_tokens - r.declined_tokens, "#1f77b4"),
    ]
    bottom = [0.0] * len(order)
    for label, get, color in parts:
        vals = [float(get(r)) for r in order]
        ax_k.bar(x, vals, width=0.9, bottom=bottom, color=color, label=label)
        bottom = [a + b for a, b in zip(bottom, vals, strict=True)]
    ax_k.set_ylabel("prompt tokens by source")
    ax_k.set_xlabel("request (arrival order)")
    ax_k.legend(loc="upper right", fontsize=8, ncols=3, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_ttft(rows: Sequence[Mapping[str, Any]]) -> str:
    """The --ttft tables: pool hits against their floor, disk hits against the harmonic bound."""
    if not rows:
        return "  (no rows)"
    r0 = rows[0]
    lines = [
        f"  disk tier: {r0['disk_backend']}, O_DIRECT={r0['disk_direct_io']}",
        "  pool hits; floor = max(memcpy of the loaded bytes, tail prefill alone) + one layer's share of the tail",
        f"  {'prompt':>7} {'path':>13} {'recompute':>10} {'loaded':>9} {'memcpy':>8} {'tail':>8} {'floor':>8}"
        f" {'pool hit':>9} {'/floor':>7} {'speedup':>8} {'claimed':>8} {'declined':>8} {'hit tok':>8}",
    ]
    for r in rows:
        lines.append(
            f"  {r['prompt_tokens']:>7} {r['load_path']:>13} {r['recompute_s'] * 1e3:>8.1f}ms"
            f" {r['loaded_bytes'] / 2**20:>6.1f}MiB {r['memcpy_s'] * 1e3:>6.1f}ms {r['tail_s'] * 1e3:>6.1f}ms"
            f" {r['pool_floor_s'] * 1e3:>6.1f}ms {r['pool_s'] * 1e3:>7.1f}ms {r['pool_vs_floor']:>6.2f}x"
            f" {r['pool_speedup']:>7.1f}x {r['pool_claimed_tokens']:>8} {r.get('pool_declined_tokens', 0):>8}"
            f" {r['pool_hit_tokens']:>8}"
        )
    lines += [
        "  disk hits (restarted cache, empty pool); bound = 1 / (1/recompute + 1/disk-only load)",
        f"  {'prompt':>7} {'path':>13} {'recompute':>10} {'disk-only':>10} {'bound':>9} {'disk hit':>9}"
        f" {'/bound':>7} {'speedup':>8} {'claimed':>8} {'declined':>8} {'hit tok':>8} {'max|dlogit|':>12}",
    ]
    for r in rows:
        lines.append(
            f"  {r['prompt_tokens']:>7} {r['load_path']:>13} {r['recompute_s'] * 1e3:>8.1f}ms"
            f" {r['disk_only_s'] * 1e3:>8.1f}ms {r['disk_bound_s'] * 1e3:>7.1f}ms {r['disk_s'] * 1e3:>7.1f}ms"
            f" {r['disk_vs_bound']:>6.2f}x {r['disk_speedup']:>7.2f}x {r['disk_claimed_tokens']:>8}"
            f" {r.get('disk_declined_tokens', 0):>8}"
            f" {r['disk_hit_tokens'] + r['disk_pool_tokens']:>8} {r['max_abs_logit_diff']:>12.3g}"
        )
    lines.append("  claimed: prefix tokens the engine computed itself (compute-or-load split); declined: "
                 "matched tokens recomputed because the cost model expected no gain; speedup: recompute / hit")
    return "\n".join(lines)
