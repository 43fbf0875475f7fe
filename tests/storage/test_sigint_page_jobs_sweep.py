"""A seeded sweep of real SIGINTs over the disk tier's page-job code: round after round of read and
write batches on one tier, each with a KeyboardInterrupt raised at a point drawn at random from
those the round reaches (a function's entry or a C call's return in the page-job code:
:class:`~interrupt_helpers.SignalPoints`), the loop then run again as an application's cleanup
would. Every round must end every caller, give every slot, count, room and reference back, leave
no descriptor open and serve no wrong byte (a per-page oracle); every page is read back at the end.

Before the fix a round hung once its point was in a job's step (most of them); a timer-driven
SIGINT landing anywhere hung 1 in 15-45 rounds (the ring's own code too, then)."""

from __future__ import annotations

from pathlib import Path

import pytest
from interrupt_helpers import PAGE_JOB_FILES, Variant, random_sigint_sweep

from aiokv.layout import KVLayout
from aiokv.pool import PagePool
from aiokv.storage import DiskBackend

ROUNDS = 12
"""Rounds per backend and variant: 132 in all."""


@pytest.mark.parametrize("variant", ["plain", "spares", "thread-hashes", "ring-opens"])
def test_random_sigints_in_read_and_write_batches_lose_nothing(tmp_path: Path, backend: DiskBackend,
                                                               layout: KVLayout, pool: PagePool,
                                                               variant: Variant) -> None:
    random_sigint_sweep(tmp_path, backend, layout, pool, variant, PAGE_JOB_FILES, f"{backend.value}-{variant}",
                        ROUNDS)
