"""Review 218 (a pin; no defect found): the close retries the unlinks that failed (review 204)
and waits for those unlink tasks; a retry that succeeds takes its key out of the pending-delete
record (:mod:`storage.deletelog`) and starts a save of it on a thread of its own, outside that
list. Suspected: the close went on and closed the layout directory's descriptor under that thread.
It does not: ``_close_spares`` waits for every job of the tier (the save is one, as is a save the
last one starts) before the backend and the directory are closed. Pinned here.

Real: an ext4 on a loop device over a FUSE file whose writes can be held (``gate_helpers``); the
page file made immutable (``chattr +i``: the delete's unlink answers EPERM for real, the record
saved), then mutable again and the device's writes held, so the close's save waits in its fsync
for real; the close is given ``SHOW_S`` to end (it must not) before the writes are let go. Root
only."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from disk_helpers import assert_clean, config, key_of
from follow_helpers import started
from gate_helpers import gated_ext4
from take_over_helpers import chattr, exists
from test_adv_rev175_fanouts import _bytes_of
from test_adv_rev181_put_back import _settled

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend, DiskTier
from aiokv.storage.deletelog import DELETES_NAME

TAG = 0x5C
SHOW_S = 2.0
"""How long the close is given to end while the save is held: before the fix it ended at once."""


def _saving() -> bool:
    return any(t.name == "aiokv-disk-deletes" and t.is_alive() for t in threading.enumerate())


@pytest.mark.root
@pytest.mark.asyncio
async def test_the_close_waits_for_the_record_save_its_retried_unlink_started(
        tmp_path: Path, backend: DiskBackend, layout: KVLayout, pool: PagePool) -> None:
    size = layout.page_bytes
    victim = key_of(0, TAG)
    with gated_ext4(tmp_path, 32) as (mount, gate):
        cfg = config(mount / "disk", backend, follow_interval_s=3600.0, min_free_bytes=0)
        tier = DiskTier(cfg, layout, pool)
        closing: asyncio.Future[None] | None = None
        faults = 0
        saving_at_close: list[bool] = []
        try:
            async with started(tier) as a:
                assert await a.write_from(victim, memoryview(_bytes_of(victim, size)))
                await _settled(a)
                page = Path(a.files.path(victim))
                record = a.files.layout_dir / DELETES_NAME
                chattr("+i", page)
                try:
                    await a.delete(victim)  # EPERM: the file stays, named in the record
                    assert exists(page) and exists(record), "the unlink did not fail: nothing to test"
                finally:
                    chattr("-i", page)
                faults = sum(a.statistics().errors.values())
                gate.hold()
                closing = asyncio.ensure_future(a.aclose())
                closing.add_done_callback(lambda _: saving_at_close.append(_saving()))
                await asyncio.to_thread(gate.wait_held)  # the save's fsync waits at the gate
                await asyncio.wait({closing}, timeout=SHOW_S)
                gate.release()
                await asyncio.wait_for(asyncio.shield(closing), 60.0)
                closing.result()
            assert saving_at_close == [False], \
                "the close ended while the pending-delete record's save still ran on its thread"
            assert not exists(page), "the retried unlink at the close did not remove the page"
            assert not exists(record), "the record still names a delete carried out at the close"
            assert sum(tier.statistics().errors.values()) == faults, "the close's save met a fault"
        finally:
            gate.release()
            if closing is not None and not closing.done():
                await asyncio.wait({closing}, timeout=60.0)
    assert_clean(pool)
