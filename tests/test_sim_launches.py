"""tools/sim_launches.py measures what it says: seeded figures (the same twice), within their
ranges, a git revision's sizer run beside the working tree's, bad arguments refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))
import sim_launches

from aiokv.launches import LaunchSizer

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_the_figures_are_seeded_and_in_range() -> None:
    first = sim_launches.run(4, 400, LaunchSizer)
    assert sim_launches.run(4, 400, LaunchSizer) == first  # no wall clock
    regimes = first["regimes"]
    assert 0 <= regimes["cheap_stuck"] <= 1 and 0 <= regimes["over_4_turns"] <= 1 and regimes["worst_turns"] >= 0
    busy = first["busy"]
    assert all(0 <= busy[f"spikes {rate} past_floor"] <= 1 for rate in sim_launches.BUSY_SPIKES)
    assert busy["rise mean_pages"] >= sim_launches.FLOOR
    for name in sim_launches.MODELS:
        assert sorted(first[name]) == sorted(str(sigma) for sigma in sim_launches.MODEL_SIGMAS)
        for figures in first[name].values():
            assert figures["mean_pages"] >= sim_launches.FLOOR and 0 <= figures["over_2_turns"] <= 1


def test_a_model_without_noise_settles_where_the_pages_fit() -> None:
    # The H200 load groups: 200 us + 20 us a page, 12 pages fit the 250 us budget.
    figures = sim_launches.model(200e-6, 20e-6, 0.0, 1, 300, LaunchSizer)
    assert 10 <= figures["mean_pages"] <= 13 and figures["over_2_turns"] == 0


def test_a_revision_s_sizer_runs_beside_the_tree_s() -> None:
    head = sim_launches.sizer_at("HEAD")
    assert head is not LaunchSizer
    sizer = head(2, 1 << 30, 250e-6, 4096)
    assert sizer.pages() == 2


def test_bad_arguments_are_refused() -> None:
    done = subprocess.run([sys.executable, str(TOOLS / "sim_launches.py"), "--seeds", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "must be positive" in done.stderr, done.stderr
