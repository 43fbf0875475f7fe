"""Adversarial (review 276): the SGLang backend's extra config, parsed at its constructor.

Before the fix: an extra config that is no mapping raised ``dict()``'s own errors ("dictionary update
sequence element #0 has length 1; 2 is required", "'int' object is not iterable"), and option names
of mixed types (an int beside the strs) ``TypeError`` from sorting the ignored ones, naming nothing.
Options the store takes are refused by the name the user wrote (``disk_bytes``, not
``capacity_bytes``). Nothing is created in the disk directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                    reason="SGLang is not installed (make test installs requirements-engines.txt)")

from sglang_helpers import storage_config

from aiokv.adapters.sglang import AiokvHiCacheStorage


@pytest.mark.parametrize("extra", ["disk_dir", [1], 5, [("disk_dir", "/tmp")], b"{}", 1.5])
def test_an_extra_config_that_is_no_mapping_is_a_type_error_naming_it(tmp_path: Path, extra: Any) -> None:
    config = storage_config(tmp_path / "disk", interface_v1=True)
    config.extra_config = extra
    with pytest.raises(TypeError, match="extra_config must be a mapping"):
        AiokvHiCacheStorage(config)
    assert list(tmp_path.iterdir()) == []


def test_option_names_of_mixed_types_are_ignored_with_a_warning(
        tmp_path: Path, backends: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    config = storage_config(tmp_path / "disk", interface_v1=True, options={1: 2, ("x",): 3})  # type: ignore[dict-item]
    with caplog.at_level(logging.WARNING, logger="aiokv.adapters.sglang"):
        backend = AiokvHiCacheStorage(config)
    backends.append(backend)
    assert "ignoring extra-config entries" in caplog.text and "('x',)" in caplog.text


@pytest.mark.parametrize(("options", "named"), [
    ({"disk_bytes": 0}, "disk_bytes must be at least 1"),
    ({"staging_pages": 10**400}, "staging_pages must be at most"),
    ({"disk_dir": "/tmp/aiokv-rev276-\ud800"}, "disk_dir cannot be encoded"),
])
def test_store_options_are_refused_by_the_name_in_the_extra_config(
        tmp_path: Path, options: dict[str, object], named: str) -> None:
    config = storage_config(tmp_path / "disk", interface_v1=False, options=options)
    with pytest.raises(ValueError, match=named):
        AiokvHiCacheStorage(config)
    assert list(tmp_path.iterdir()) == []
