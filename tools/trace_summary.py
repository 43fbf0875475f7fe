"""Summarize a ``torch.profiler`` Chrome trace of one request (``tools/demo.py --ttft --trace DIR``).

Where a pool hit's time goes on the device: per CUDA stream its first start and last end relative
to the trace's first device event, busy time, the largest kernels and copies, and the idle gaps on
each stream longer than ``--gap-ms`` (a copy stream idle while the load is not over, or the
compute stream idle waiting for a layer, show as gaps). Host side: the busiest ops per thread.

    python tools/trace_summary.py trace/pool16384-auto.json [--gap-ms 0.3] [--top 6]
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclass
class Stream:
    """Device events of one stream, in microseconds."""

    spans: list[tuple[float, float, str]] = field(default_factory=list)

    def busy_us(self) -> float:
        total, end = 0.0, float("-inf")
        for b, e, _ in sorted(self.spans):
            if e > end:
                total += e - max(b, end)
                end = e
        return total

    def gaps(self, min_us: float) -> list[tuple[float, float]]:
        out, end = [], None
        for b, e, _ in sorted(self.spans):
            if end is not None and b - end >= min_us:
                out.append((end, b))
            end = e if end is None else max(end, e)
        return out


def summarize(events: list[dict[str, Any]], gap_ms: float, top: int) -> list[str]:
    """The summary's lines."""
    streams: dict[str, Stream] = collections.defaultdict(Stream)
    host: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") in DEVICE_CATS:
            stream = str(e.get("args", {}).get("stream", e.get("tid")))
            streams[stream].spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e["name"])))
        elif e.get("cat") == "cpu_op":
            host[str(e.get("tid"))][str(e["name"])] += float(e["dur"])
    if not streams:
        return ["no device events in the trace (a CPU run, or CUPTI unavailable)"]
    t0 = min(b for s in streams.values() for b, _, _ in s.spans)
    t1 = max(e for s in streams.values() for _, e, _ in s.spans)
    lines = [f"device span {1e-3 * (t1 - t0):.2f} ms over {len(streams)} streams"]
    for name, s in sorted(streams.items(), key=lambda kv: min(b for b, _, _ in kv[1].spans)):
        first = min(b for b, _, _ in s.spans) - t0
        last = max(e for _, e, _ in s.spans) - t0
        lines.append(f"stream {name}: {len(s.spans)} events, {1e-3 * first:.2f} -> {1e-3 * last:.2f} ms, "
                     f"busy {1e-3 * s.busy_us():.2f} ms")
        by_name: collections.Counter[str] = collections.Counter()
        for b, e, n in s.spans:
            by_name[n[:70]] += e - b
        for n, us in by_name.most_common(top):
            lines.append(f"    {1e-3 * us:8.2f} ms  {n}")
        gaps = s.gaps(gap_ms * 1e3)
        if gaps:
            shown = ", ".join(f"{1e-3 * (b - t0):.2f}+{1e-3 * (e - b):.2f}" for b, e in gaps[:12])
            more = f" (+{len(gaps) - 12} more)" if len(gaps) > 12 else ""
            lines.append(f"    gaps >= {gap_ms} ms (at+length, ms): {shown}{more}; "
                         f"total {1e-3 * sum(e - b for b, e in gaps):.2f} ms")
    for tid, ops in host.items():
        lines.append(f"host thread {tid}: " + ", ".join(f"{n} {1e-3 * us:.2f} ms" for n, us in ops.most_common(top)))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, nargs="+")
    p.add_argument("--gap-ms", type=float, default=0.3)
    p.add_argument("--top", type=int, default=6)
    a = p.parse_args()
    for path in a.trace:
        events = json.loads(path.read_text())["traceEvents"]
        print(f"== {path}")
        print("\n".join(summarize(events, a.gap_ms, a.top)))


if __name__ == "__main__":
    main()
