"""Review 194: a follower whose look retires a fan-out directory replaced under it (moved away
and another put in its place, or removed and made again by the writer) opens and lists the one
there now at a later look, however long after the change its looks come.

The look that retires the descriptor leaves the name to "a later look", but a look opens a
fan-out directory without a descriptor only when the layout directory changed since the last
look (or an open failed). When the retiring look came at least ``SETTLE_NS`` (1 s) after the
change — likely with the default ``follow_interval_s`` of 2 s — it recorded the layout
directory's stamp as it was, no later look saw a change, and the directory was never opened
again: every page there invisible to the follower (misses, not served nor followed) until a
restart. Real renames and a real copy of the directory; a real wait for the change to settle."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import Looks, started
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev188_deletes_away import _served

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier, ReadOnly
from aiokv.storage.layoutdir import SETTLE_NS

TAG = 0x3B


def _until_settled_s(directory: Path) -> float:
    """Seconds until ``directory``'s last change is SETTLE_NS old (a look then records its stamp
    rather than listing it again at the next look): what the test waits is the clock itself."""
    st = os.stat(directory)
    return max(0.0, (max(st.st_mtime_ns, st.st_ctime_ns) + SETTLE_NS - time.time_ns()) / 1e9) + 0.01


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["replaced", "removed"])
async def test_a_fan_out_directory_replaced_long_before_the_look_is_followed_again(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool, how: str) -> None:
    size = layout.page_bytes
    keys = [key_of(i, TAG) for i in range(3)]
    cfg = config(tmp_path / "disk", backend, follow_interval_s=3600.0)
    async with started(DiskTier(cfg, layout, pool)) as b:
        for key in keys[:2]:
            assert await b.write_from(key, memoryview(_bytes_of(key, size)))
        async with started(DiskTier(cfg, layout, pool)) as a:
            looks = Looks(a)
            assert a.read_only is ReadOnly.LOCKED
            await looks.until(lambda: all(a.contains(key) for key in keys[:2]))
            layout_dir = a.files.layout_dir
            fan = layout_dir / f"{TAG:02x}"
            if how == "replaced":
                os.rename(fan, tmp_path / "old")
                shutil.copytree(tmp_path / "old", fan, copy_function=shutil.copy2)  # another directory
            else:
                shutil.rmtree(fan)  # an operator's clean-up; the writer makes it again at its next write
                assert await b.write_from(keys[2], memoryview(_bytes_of(keys[2], size)))
                assert await b.write_from(keys[0], memoryview(_bytes_of(keys[0], size)))
            await asyncio.sleep(_until_settled_s(layout_dir))
            await looks.next()  # retires the descriptor: its name leads elsewhere (or nowhere)
            await looks.next()
            await looks.next()
            want = keys[:2] if how == "replaced" else [keys[0], keys[2]]
            assert a._dir is not None and a._dir.fanout[TAG] >= 0, "the directory there now was never opened"
            for key in want:
                assert a.contains(key), "a page of the directory put in place is not followed"
                assert await _served(a, key, size)
    assert_clean(pool)
