"""Adversarial (helper 281, leftovers of review 276): bad store settings and a bad SGLang config are
refused by the name the user wrote, before anything is made.

Before the fixes: ``close_timeout=0`` for a store (SGLang's backend, ``PageFileStore``) was accepted,
and every close of an idle store then logged disk I/O "still stuck in the kernel after close_timeout
(0.0 s)" and counted a ``close_timeouts`` (the vLLM tier refused 0 on its own, af863b0);
``disk_dir="."`` was refused naming ``directory``, a field the user never wrote; and
``AiokvHiCacheStorage(None)`` raised ``AttributeError`` ('NoneType' object has no attribute
'extra_config')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiokv.adapters.store import StoreConfig


@pytest.mark.parametrize("value", [0, 0.0, -0.0])
def test_a_store_close_timeout_of_zero_is_refused_by_name(tmp_path: Path, value: float) -> None:
    with pytest.raises(ValueError, match="close_timeout must be > 0"):
        StoreConfig.from_options({"disk_dir": str(tmp_path / "disk"), "close_timeout": value})
    with pytest.raises(ValueError, match="close_timeout must be > 0"):
        StoreConfig(tmp_path / "disk", close_timeout=value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("disk_dir", [".", "./", Path(".")])
def test_the_working_directory_as_disk_dir_is_refused_naming_disk_dir(disk_dir: object) -> None:
    with pytest.raises(ValueError, match=r"^disk_dir must not be the working directory"):
        StoreConfig.from_options({"disk_dir": disk_dir})


def _sglang() -> Any:
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory",
                        reason="SGLang is not installed (make test installs requirements-engines.txt)")
    from aiokv.adapters import sglang

    return sglang


@pytest.mark.parametrize("config", [None, {"extra_config": {}}, "config"])
def test_an_sglang_storage_config_of_another_type_is_a_type_error_naming_it(config: object) -> None:
    sglang = _sglang()
    with pytest.raises(TypeError, match="storage_config must be SGLang's HiCacheStorageConfig"):
        sglang.AiokvHiCacheStorage(config)


@pytest.mark.parametrize(("options", "named"), [
    ({"close_timeout": 0}, "close_timeout must be > 0"),
    ({"disk_dir": "."}, r"^disk_dir must not be the working directory"),
])
def test_sglang_refuses_these_options_by_their_extra_config_names(
        tmp_path: Path, options: dict[str, object], named: str) -> None:
    _sglang()
    from sglang_helpers import storage_config

    from aiokv.adapters.sglang import AiokvHiCacheStorage

    with pytest.raises(ValueError, match=named):
        AiokvHiCacheStorage(storage_config(tmp_path / "disk", interface_v1=True, options=options))
    assert list(tmp_path.iterdir()) == []
