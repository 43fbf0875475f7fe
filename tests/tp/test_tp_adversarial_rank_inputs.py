"""Rank-side public API: malformed arguments are a TypeError/ValueError at the constructor.

Found by the adversarial run (s24): ``RankWorker(..., layout="mha")`` raised AttributeError
('str' object has no attribute 'kind'); ``RankWorker(..., config={})`` was accepted (a dict, not a
TPConfig: it fails later, inside ``run()``, with an AttributeError); ``RankWorkerThread`` the same.
``TPCache`` checks its ``tp_config`` type already.
"""

from __future__ import annotations

import pytest
import torch
from tp_helpers import CONFIG, full_kv, rank_kv

from aiokv import KVLayout
from aiokv.tp import RankWorker, RankWorkerThread

LAYOUT = KVLayout.mha(2, 4, 8, torch.float16, page_tokens=4)


@pytest.mark.parametrize("runner", [RankWorker, RankWorkerThread])
def test_a_rank_worker_refuses_arguments_of_the_wrong_type(runner: type) -> None:
    kv = rank_kv(full_kv(LAYOUT, 1), LAYOUT, 0, 2)
    with pytest.raises(TypeError, match="layout"):
        runner("/nonexistent/manager.sock", 0, 2, "mha", kv, CONFIG)
    with pytest.raises(TypeError, match="config"):
        runner("/nonexistent/manager.sock", 0, 2, LAYOUT, kv, {})
    with pytest.raises(TypeError, match="engine_stream"):
        runner("/nonexistent/manager.sock", 0, 2, LAYOUT, kv, CONFIG, engine_stream="stream")
    with pytest.raises(TypeError, match="path"):
        runner("/nonexistent/manager.sock", 0, 2, LAYOUT, kv, CONFIG, path="staging")
