"""``LaunchSizer`` on simulated clocks: how large its launch groups get, and how far past the turn's
budget, where a group's loop time is a fixed cost plus a cost per page under noise.

Two parts, each seeded (no wall clock; the same run prints the same figures):

- **Regimes**: ``--seeds`` sequences of ``--groups`` groups, each a run of regimes of 20-300 groups
  with a fixed cost of 0-2 ms, 1-400 us a page, lognormal noise (sigma 0-0.6) and, in 30% of
  them, a 0.5-5 ms spike in 5% of the groups. Counted from a regime's 60th group on (settled):
  ``cheap_stuck``, the share of groups at <= 3 pages where pages are cheap (>= 20 fit the turn's
  budget, ``launch_turn_s``, the loop time the pages may add to the fixed cost, whatever the fixed
  cost is); ``over_4_turns``, the share of groups above the floor whose pages took more than four
  turns' budget; probes count as groups.
- **Busy host**: dear pages (400 us each, past a turn's budget: every group belongs at the floor)
  under preemption spikes of 3-10 ms in 10% / 25% / 45% of the groups (two spinning threads beside
  the test suite on two cores gave 45%): ``past_floor``, the share of groups above the floor (the
  probes alone are one in ``PROBE_EVERY``); and a host that turns busy for good (the H200's fixed
  cost 0.2 -> 1.5 ms at group 300, 20 us a page): ``mean_pages`` from group 400 on (the fixed cost
  relearned, groups grow back).
- **Models**: the H200 load groups (200 us + 20 us a page, ``tools/bench_launch.py
  --group-costs``; 12 pages fit) and the CPU's (20 us + 5 us a page; 50 fit), lognormal noise
  0.1 / 0.25 / 0.5: mean group size and the share of groups whose pages took more than two turns.

``--against REV`` runs the sizer of a git revision beside the working tree's on the same clocks and
prints both with ratios (the working tree's ÷ the revision's).

    python tools/sim_launches.py
    python tools/sim_launches.py --against HEAD --seeds 300 --json /tmp/sim.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aiokv import launches

ROOT = Path(__file__).resolve().parents[1]

TURN_S = launches.DEFAULT_LAUNCH_TURN_S
FLOOR = 2
PAGE_BYTES = 4096
MAX_BYTES = 1 << 40  # no byte cap: what the time allows shows
FIXED_S = (0.0, 5e-6, 50e-6, 200e-6, 700e-6, 2e-3)
PAGE_S = (1e-6, 5e-6, 20e-6, 60e-6, 120e-6, 220e-6, 400e-6)
SIGMAS = (0.0, 0.1, 0.3, 0.6)
SETTLE = 60
"""Groups of a regime before it is counted (the sizer's time to adapt)."""
CHEAP_PAGES = 20
STUCK_PAGES = 3
MODELS = {"h200_load": (200e-6, 20e-6), "cpu": (20e-6, 5e-6)}
MODEL_SIGMAS = (0.1, 0.25, 0.5)


class Sizer(Protocol):
    def pages(self) -> int: ...

    def record(self, pages: int, seconds: float) -> None: ...


SizerClass = Callable[[int, int, float, int], Sizer]


def regimes(seeds: int, groups: int, sizer_class: SizerClass) -> dict[str, float]:
    """The regime sequences' counts for ``sizer_class`` (see the module's docstring)."""
    cheap = stuck = settled = over = 0
    worst = 0.0  # the most turns' budget a group's pages above the floor took
    for seed in range(seeds):
        plan = random.Random(seed)
        spans = []
        start = 0
        while start < groups:
            end = start + plan.randint(20, 300)
            spans.append((start, end, plan.choice(FIXED_S), plan.choice(PAGE_S), plan.choice(SIGMAS),
                          plan.random() < 0.3))
            start = end
        rng = random.Random(seed * 7 + 1)
        sizer = sizer_class(FLOOR, MAX_BYTES, TURN_S, PAGE_BYTES)
        span = 0
        for k in range(groups):
            while spans[span][1] <= k:
                span += 1
            begin, _, fixed, per_page, sigma, spiky = spans[span]
            pages = sizer.pages()
            seconds = (fixed + per_page * pages) * rng.lognormvariate(0, sigma)
            if spiky and rng.random() < 0.05:
                seconds += rng.uniform(0.5e-3, 5e-3)
            sizer.record(pages, seconds)
            if k - begin < SETTLE:
                continue
            settled += 1
            if pages > FLOOR:
                worst = max(worst, per_page * pages / TURN_S)
                over += per_page * pages > 4 * TURN_S
            if TURN_S / per_page >= CHEAP_PAGES:
                cheap += 1
                stuck += pages <= STUCK_PAGES
    return {"cheap_stuck": stuck / max(cheap, 1), "over_4_turns": over / max(settled, 1), "worst_turns": worst}


def model(fixed: float, per_page: float, sigma: float, seeds: int, groups: int,
          sizer_class: SizerClass) -> dict[str, float]:
    """Mean group size (from the 100th group) and the share of groups past two turns' budget."""
    sizes: list[int] = []
    over = 0
    for seed in range(seeds):
        rng = random.Random(seed)
        sizer = sizer_class(FLOOR, MAX_BYTES, TURN_S, PAGE_BYTES)
        for k in range(groups):
            pages = sizer.pages()
            sizer.record(pages, (fixed + per_page * pages) * rng.lognormvariate(0, sigma))
            if k >= 100:
                sizes.append(pages)
                over += pages > FLOOR and per_page * pages > 2 * TURN_S
    return {"mean_pages": statistics.mean(sizes), "over_2_turns": over / len(sizes)}


BUSY_SPIKES = (0.1, 0.25, 0.45)


def busy(seeds: int, groups: int, sizer_class: SizerClass) -> dict[str, float]:
    """The busy-host counts (see the module's docstring)."""
    out: dict[str, float] = {}
    for rate in BUSY_SPIKES:
        past = total = 0
        for seed in range(seeds):
            rng = random.Random(seed * 13 + 5)
            sizer = sizer_class(FLOOR, MAX_BYTES, TURN_S, PAGE_BYTES)
            for k in range(groups):
                pages = sizer.pages()
                seconds = (20e-6 + 400e-6 * pages) * rng.lognormvariate(0, 0.05)
                if rng.random() < rate:
                    seconds += rng.uniform(3e-3, 10e-3)
                sizer.record(pages, seconds)
                if k >= SETTLE:
                    total += 1
                    past += pages > FLOOR
        out[f"spikes {rate} past_floor"] = past / max(total, 1)
    sizes: list[int] = []
    for seed in range(seeds):
        rng = random.Random(seed * 17 + 3)
        sizer = sizer_class(FLOOR, MAX_BYTES, TURN_S, PAGE_BYTES)
        for k in range(max(groups, 800)):
            fixed = 200e-6 if k < 300 else 1.5e-3
            pages = sizer.pages()
            sizer.record(pages, (fixed + 20e-6 * pages) * rng.lognormvariate(0, 0.1))
            if k >= 400:
                sizes.append(pages)
    out["rise mean_pages"] = statistics.mean(sizes)
    return out


def run(seeds: int, groups: int, sizer_class: SizerClass) -> dict[str, Any]:
    out: dict[str, Any] = {"regimes": regimes(seeds, groups, sizer_class),
                           "busy": busy(max(1, seeds // 10), groups, sizer_class)}
    for name, (fixed, per_page) in MODELS.items():
        out[name] = {str(sigma): model(fixed, per_page, sigma, max(1, seeds // 15), groups, sizer_class)
                     for sigma in MODEL_SIGMAS}
    return out


def sizer_at(rev: str) -> SizerClass:
    """``LaunchSizer`` as ``aiokv/launches.py`` was at git revision ``rev``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:aiokv/launches.py"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(f"launches_at_{rev}", file.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    Path(file.name).unlink()
    sizer: SizerClass = module.LaunchSizer
    return sizer


def _rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, float]]]:
    """(label, {variant: value}) for every figure."""
    first = next(iter(results.values()))
    rows = [(f"regimes {key}", {v: r["regimes"][key] for v, r in results.items()}) for key in first["regimes"]]
    rows += [(f"busy {key}", {v: r["busy"][key] for v, r in results.items()}) for key in first["busy"]]
    for name in MODELS:
        for sigma in first[name]:
            for key in first[name][sigma]:
                rows.append((f"{name} sigma {sigma} {key}", {v: r[name][sigma][key] for v, r in results.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--groups", type=int, default=3000)
    parser.add_argument("--against", default=None, help="a git revision whose sizer runs beside this one")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.seeds <= 0 or args.groups <= 0:
        parser.error("--seeds and --groups must be positive")
    variants: dict[str, SizerClass] = {}
    if args.against is not None:
        variants[args.against] = sizer_at(args.against)
    variants["tree"] = launches.LaunchSizer
    results = {name: run(args.seeds, args.groups, cls) for name, cls in variants.items()}
    names = list(results)
    print(f"{'figure':44}" + "".join(f"{name:>12}" for name in names) + ("       ratio" if len(names) > 1 else ""))
    for label, values in _rows(results):
        line = f"{label:44}" + "".join(f"{values[name]:12.4f}" for name in names)
        if len(names) > 1:
            line += f"{values[names[1]] / values[names[0]]:12.2f}" if values[names[0]] else f"{'-':>12}"
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
