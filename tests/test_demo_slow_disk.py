"""The demo over a really slow disk tier (#10): a disk hit the cost model expects to lose is never
loaded (recomputed by a path without claims, split as a trial by one with them while the disk meter
is unsettled: the engine computes it from the front and waits for no read; only the pages that arrive
from the back before it meets them are loaded), and the oracle stays bit-exact.

The disk tier lives on an ext4 loop device whose reads this process may issue only at a fixed rate
(a cgroup v1 ``blkio.throttle.read_bps_device`` limit: the kernel delays the bios; O_DIRECT reads
meet it). Needs root and cgroup v1 blkio; skipped elsewhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "storage"))  # the storage suite's file-system helpers
sys.path.insert(0, str(Path(__file__).resolve().parent / "cache"))  # the blkio throttle of the split's test
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import demo
from fs_helpers import loop_ext4
from test_cache_split_slow import throttled_reads

READ_BPS = 128 << 10  # a tiny page (4 KiB) takes ~30 ms to read, the engine computes one in ~1 ms (above
# the disk rate's lower bound, 100 kB/s: a slower one is clamped when restored)
PROMPT = 128
PAGE = 8
PAGE_BYTES = 4096  # the tiny preset's page: 8 tokens x 2 layers x K,V x 2 heads x 16 x float32


@pytest.mark.slow
@pytest.mark.root
def test_a_disk_hit_slower_than_recomputing_is_recomputed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ttft.json"
    with loop_ext4(tmp_path, 1024) as mount, throttled_reads(mount, READ_BPS):
        argv = ["--preset", "tiny", "--disk-dir", str(mount / "disk"), "--ttft", "--ttft-lengths", str(PROMPT),
                "--chunk-tokens", str(PAGE), "--repeats", "1", "--load-path", "plain", "auto", "--json", str(out)]
        assert demo.main(argv) == 0
    print(capsys.readouterr().out)
    rows = json.loads(out.read_text())["ttft"]
    usable = (PROMPT - 1) // PAGE * PAGE
    for row in rows:
        throttled = usable // PAGE * PAGE_BYTES / READ_BPS
        if row["disk_only_s"] < throttled / 2:
            pytest.skip(f"the blkio throttle did not hold: disk-only {row['disk_only_s']:.3f} s "
                        f"(throttled: {throttled:.3f} s)")
        assert row["disk_direct_io"] is True  # the reads reached the throttled device
        assert row["max_abs_logit_diff"] == 0.0
        assert row["disk_s"] < row["disk_only_s"] / 2  # nowhere near the throttled load's time
        # The pool still pays (a memory copy): loaded, not declined.
        assert row["pool_hit_tokens"] == usable and row["pool_declined_tokens"] == 0
    plain = next(row for row in rows if row["load_path"] == "plain")
    # A plain load is never taken when expected to lose: nothing loaded, every token recomputed.
    assert plain["disk_declined_tokens"] == usable, plain
    assert plain["disk_hit_tokens"] == plain["disk_pool_tokens"] == plain["disk_claimed_tokens"] == 0
    auto = next(row for row in rows if row["load_path"] == "auto")
    # A path that claims splits instead, as a trial: each repeat is a restarted cache whose disk
    # meter has fewer than aiokv.costs.TRIAL_SAMPLES reads (a split re-measures at little risk). The
    # engine computes from the front while the throttled reads arrive from the back: only pages that
    # arrived before the claims met them are loaded (none when the engine computes a page in ~1 ms,
    # one to three on a slower CI machine where it takes ~6 ms), never more than the throttle let
    # through in the hit's time, and every matched token is either claimed or loaded.
    assert auto["disk_plan"] == "split", auto
    assert auto["disk_declined_tokens"] == 0, auto
    assert auto["disk_claimed_tokens"] + auto["disk_hit_tokens"] == usable, auto
    through = int(auto["disk_s"] * READ_BPS // PAGE_BYTES) + 1  # + 1: a read already under way
    assert auto["disk_hit_tokens"] <= through * PAGE, auto
    assert auto["disk_claimed_tokens"] >= usable // 2, auto  # the engine computed most of it
    prices = auto["disk_plan_prices"]
    # Neither pays: the load against its margin, the split against its own (the claims' spread only).
    assert prices["recompute"] - prices["load"] <= prices["margin"]
    assert prices["recompute"] - prices["split"] <= prices["split_margin"]
