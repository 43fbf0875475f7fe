"""One configuration tree: every disk setting reachable through ``CacheConfig.disk``, each default
defined once (in ``DiskConfig`` or in ``CacheConfig``'s own fields), shortcuts that fill the nested
config and never disagree with it silently, validation at the edge naming the field."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from aiokv import CacheConfig, DiskBackend, KVCache, KVLayout
from aiokv.config import DISK_SHORTCUTS, default_disk
from aiokv.storage import DiskConfig

LAYOUT = KVLayout.mha(2, 2, 8, torch.float16, page_tokens=4)
README = Path(__file__).resolve().parents[2] / "README.md"
DISK_FIELDS = {f.name: f for f in dataclasses.fields(DiskConfig)}


def _not_default(f: dataclasses.Field[Any], tmp: Path) -> object:
    """A valid value of DiskConfig field ``f`` that differs from its default."""
    if f.name == "directory":
        return tmp
    if f.name == "backend":
        return DiskBackend.THREADS  # works on every machine
    if f.name == "direct_io":
        return False
    default = f.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    assert isinstance(default, float), f"no non-default value for DiskConfig.{f.name}: extend this test"
    return default + 0.5


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private $XDG_CACHE_HOME: the default disk directory is ``home / "aiokv"``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# -- reachability -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_every_disk_setting_reaches_the_disk_tier(tmp_path: Path) -> None:
    # Before the nested config, nine DiskConfig settings (write_behind_workers, threads,
    # ring_entries, sync_writes, recycle_files, drain_on_close, min_free_bytes,
    # free_space_recheck_s, enospc_retries) could not be set through CacheConfig at all.
    values = {name: _not_default(f, tmp_path / "disk") for name, f in DISK_FIELDS.items()}
    disk = DiskConfig(**values)  # type: ignore[arg-type]
    config = CacheConfig(cpu_bytes=8 * LAYOUT.page_bytes, pool_chunk_bytes=4 * LAYOUT.page_bytes, disk=disk)
    kv = torch.zeros(LAYOUT.num_layers, 32, LAYOUT.rows, LAYOUT.head_dim, dtype=LAYOUT.dtype)
    async with KVCache(config, LAYOUT, kv) as cache:
        assert cache.disk is not None
        for name, value in values.items():
            assert getattr(cache.disk.config, name) == value, name
        assert cache.disk.statistics().backend is DiskBackend.THREADS


def test_shortcuts_fill_the_nested_config_from_its_defaults(tmp_path: Path) -> None:
    given: dict[str, object] = {"disk_dir": tmp_path, "disk_bytes": 1 << 30, "disk_backend": DiskBackend.URING,
                                "disk_direct_io": True, "disk_queue_depth": 5, "write_behind_depth": 7}
    assert set(given) == set(DISK_SHORTCUTS)
    config = CacheConfig(**given)  # type: ignore[arg-type]
    assert config.disk == DiskConfig(**{DISK_SHORTCUTS[s]: v for s, v in given.items()})  # type: ignore[arg-type]
    for short, value in given.items():
        assert getattr(config, short) == value  # the flat names read the nested values back
    # A str directory is accepted as before and stored as a Path.
    assert CacheConfig(disk_dir=str(tmp_path)).disk == DiskConfig(directory=tmp_path)


# -- one default per setting --------------------------------------------------------------------


def test_defaults_are_defined_once(home: Path) -> None:
    # The constructor carries no default of its own: every parameter's default is "not given",
    # resolved from the dataclass fields (CacheConfig's own) or DiskConfig's fields (the disk's).
    params = inspect.signature(CacheConfig).parameters
    names = {f.name for f in dataclasses.fields(CacheConfig)}
    assert set(params) == names | set(DISK_SHORTCUTS)
    assert {repr(p.default) for p in params.values()} == {"<default>"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    # No disk setting is a CacheConfig field: the shortcuts are views, not copies.
    assert not names & (set(DISK_SHORTCUTS) | set(DISK_FIELDS))
    # The disk tier of a default config is DiskConfig's defaults; the views read them.
    config = CacheConfig()
    assert config.disk == DiskConfig(directory=home / "aiokv")
    for short, name in DISK_SHORTCUTS.items():
        if name != "directory":
            assert getattr(config, short) == DISK_FIELDS[name].default, short
    # Queue depth used to default to 16 in CacheConfig and 32 in DiskConfig.
    assert config.disk_queue_depth == DiskConfig(directory=home).queue_depth
    # Without a disk tier the views still read DiskConfig's defaults (disk_dir reads None).
    off = CacheConfig(disk=None)
    assert off.disk is None and off.disk_dir is None
    assert off.disk_bytes == DISK_FIELDS["capacity_bytes"].default


def test_default_disk_directory_unwritable_means_no_disk_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "sub"))
    assert CacheConfig().disk is None
    # A disk setting that cannot be honoured (no directory for it) is refused, not dropped: it once
    # gave a config without a disk tier that read back disk_bytes as DiskConfig's 64 GiB default.
    with pytest.raises(ValueError, match=r"CacheConfig\.disk_bytes is given but there is no disk directory"):
        CacheConfig(disk_bytes=1 << 30)
    assert CacheConfig(disk_dir=tmp_path, disk_bytes=1 << 30).disk == DiskConfig(directory=tmp_path,
                                                                                capacity_bytes=1 << 30)
    assert CacheConfig(disk=None).disk is None and CacheConfig(disk_dir=None).disk is None
    with pytest.raises(ValueError, match=r"DiskConfig\.directory"):
        DiskConfig()


def test_an_empty_disk_dir_is_refused(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Path("") is the working directory: an unset environment variable (disk_dir=os.environ.get(...,
    # "")) put page files (and the layout's directory) wherever the process happened to run.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"CacheConfig\.disk_dir is an empty path"):
        CacheConfig(disk_dir="")
    with pytest.raises(ValueError, match=r"CacheConfig\.disk_dir is an empty path"):
        CacheConfig(disk=DiskConfig(directory=tmp_path), disk_dir="")
    assert not home.exists() and list(tmp_path.iterdir()) == []  # nothing created anywhere


# -- shortcuts against the nested config --------------------------------------------------------


@pytest.mark.parametrize("short", sorted(DISK_SHORTCUTS))
def test_a_shortcut_that_disagrees_with_disk_raises(tmp_path: Path, short: str) -> None:
    disk = DiskConfig(directory=tmp_path)
    name = DISK_SHORTCUTS[short]
    other = tmp_path / "other" if name == "directory" else _not_default(DISK_FIELDS[name], tmp_path)
    with pytest.raises(ValueError, match=f"CacheConfig.{short}=.* disagrees with disk.{name}"):
        CacheConfig(disk=disk, **{short: other})  # type: ignore[arg-type]
    # Agreeing is fine: the shortcut is redundant, not a second value.
    assert CacheConfig(disk=disk, **{short: getattr(disk, name)}).disk == disk  # type: ignore[arg-type]


def test_shortcuts_and_disk_none(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_bytes is given but disk=None"):
        CacheConfig(disk=None, disk_bytes=1 << 30)
    with pytest.raises(ValueError, match="disk_dir=None turns the disk tier off"):
        CacheConfig(disk=DiskConfig(directory=tmp_path), disk_dir=None)
    assert CacheConfig(disk=None, disk_dir=None).disk is None
    assert CacheConfig(disk_dir=None).disk is None  # alone, disk_dir=None is the other way to say "no tier"
    with pytest.raises(ValueError, match=r"CacheConfig\.disk_bytes"):
        CacheConfig(disk_dir=None, disk_bytes=0)


def test_a_directory_beside_disk_none_is_refused(home: Path, tmp_path: Path) -> None:
    # Regression: disk=None beside disk_dir=<a directory> silently gave no tier (the directory
    # was dropped); any disk setting beside disk=None is refused, a directory included.
    for directory in (tmp_path / "pages", str(tmp_path / "pages")):
        with pytest.raises(ValueError, match=r"CacheConfig\.disk_dir is given but disk=None turns the disk tier off"):
            CacheConfig(disk=None, disk_dir=directory)
    assert not (tmp_path / "pages").exists() and not home.exists()  # nothing created
    assert CacheConfig(disk=None).disk is None and CacheConfig(disk=None, disk_dir=None).disk is None
    assert CacheConfig().disk == default_disk()  # the default is unchanged


@pytest.mark.parametrize("short", sorted(set(DISK_SHORTCUTS) - {"disk_dir"}))
def test_a_disk_setting_beside_disk_dir_none_is_refused(home: Path, tmp_path: Path, short: str) -> None:
    # It once meant "no tier" silently: a directory left None by a variable (disk_dir=args.disk_dir)
    # beside a size gave a cache without disk that read disk_bytes back as DiskConfig's 64 GiB default.
    name = DISK_SHORTCUTS[short]
    value = _not_default(DISK_FIELDS[name], tmp_path)
    with pytest.raises(ValueError, match=f"CacheConfig.{short} is given but disk_dir=None turns the disk tier off"):
        CacheConfig(disk_dir=None, **{short: value})  # type: ignore[arg-type]
    assert not home.exists()  # nothing created
    # With a directory the same setting is honoured.
    config = CacheConfig(disk_dir=tmp_path, **{short: value})  # type: ignore[arg-type]
    assert config.disk is not None and getattr(config.disk, name) == value


def test_replace_changes_the_nested_config(tmp_path: Path) -> None:
    config = CacheConfig(cpu_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert dataclasses.replace(config, namespace="m").disk == config.disk
    assert config.disk is not None
    bigger = dataclasses.replace(config, disk=dataclasses.replace(config.disk, capacity_bytes=2 << 30))
    assert bigger.disk_bytes == 2 << 30 and bigger.disk_dir == tmp_path
    assert dataclasses.replace(config, disk=None).disk is None
    # replace() passes ``disk`` along: a shortcut beside it must agree, so this names the way.
    with pytest.raises(ValueError, match=r"dataclasses.replace\(config.disk, capacity_bytes="):
        dataclasses.replace(config, disk_bytes=3 << 30)  # type: ignore[call-arg]
    assert pickle.loads(pickle.dumps(config)) == config


# -- validation at the edge ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DISK_FIELDS))
def test_every_disk_setting_is_validated(tmp_path: Path, name: str) -> None:
    good = {"directory": tmp_path}
    with pytest.raises(TypeError, match=f"DiskConfig.{name} must be"):
        DiskConfig(**{**good, name: 1.5 if name == "directory" else "x"})  # type: ignore[arg-type]
    default = DISK_FIELDS[name].default
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        with pytest.raises(ValueError, match=f"DiskConfig.{name} must be"):
            DiskConfig(**{**good, name: -1})  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "most"), [("queue_depth", 4096), ("ring_entries", 32768), ("threads", 1024),
                                          ("write_behind_workers", 1024), ("write_behind_depth", 1 << 20)])
def test_sizes_beyond_what_the_tier_can_build_are_refused(tmp_path: Path, name: str, most: int) -> None:
    # Regression (adversarial run): queue_depth=2**20 was accepted and the tier's start built a
    # header slot, iovecs and SQEs per entry on the loop (7 s; 2**31: a minute and 13 GB).
    assert getattr(DiskConfig(directory=tmp_path, **{name: most}), name) == most
    with pytest.raises(ValueError, match=f"DiskConfig.{name} must be at most {most}"):
        DiskConfig(directory=tmp_path, **{name: most + 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"DiskConfig.{name} must be at most"):
        DiskConfig(directory=tmp_path, **{name: 2**31})  # type: ignore[arg-type]


@pytest.mark.parametrize("short", sorted(DISK_SHORTCUTS))
def test_a_bad_shortcut_names_itself(tmp_path: Path, short: str) -> None:
    extra = {} if short == "disk_dir" else {"disk_dir": tmp_path}
    with pytest.raises(TypeError, match=f"CacheConfig.{short} must be"):
        CacheConfig(**extra, **{short: 1.5 if short == "disk_direct_io" else object()})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"cpu_bytes": 0}, ValueError, "cpu_bytes"),
        ({"cpu_bytes": 1.0}, TypeError, "cpu_bytes"),
        ({"seen_window": True}, TypeError, "seen_window"),
        ({"pool_workers": 0}, ValueError, "pool_workers"),
        ({"read_group_bytes": 0}, ValueError, "read_group_bytes"),
        ({"read_group_bytes": 1.5}, TypeError, "read_group_bytes"),
        ({"stream_readahead_bytes": True}, TypeError, "stream_readahead_bytes"),
        ({"stream_readahead_bytes": -1}, ValueError, "stream_readahead_bytes"),
        ({"tp_rank": 1}, ValueError, "tp_rank"),
        ({"namespace": b"m"}, TypeError, "namespace"),
        ({"admission": "all"}, TypeError, "admission"),
        ({"transfer_path": "staging"}, TypeError, "transfer_path"),
        ({"prefill_tokens_per_s": "fast"}, TypeError, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": 0.0}, ValueError, "prefill_tokens_per_s"),
        ({"offload_wait": float("nan")}, ValueError, "offload_wait"),
        ({"commit_wait": -0.5}, ValueError, "commit_wait"),
        ({"commit_wait": "1"}, TypeError, "commit_wait"),
        ({"close_timeout": True}, TypeError, "close_timeout"),
        ({"close_timeout": -1}, ValueError, "close_timeout"),
        ({"disk": "/tmp"}, TypeError, "disk"),
    ],
)
def test_bad_values_raise_naming_the_field_and_change_nothing(
    home: Path, kwargs: dict[str, object], error: type[Exception], field: str
) -> None:
    with pytest.raises(error, match=f"CacheConfig.{field}"):
        CacheConfig(**kwargs)  # type: ignore[arg-type]
    # The default disk directory is created only for a config that is valid otherwise.
    assert not home.exists()


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        CacheConfig(1 << 20)  # type: ignore[misc]


def test_readme_documents_every_disk_setting_and_shortcut() -> None:
    text = README.read_text()
    for name in (*DISK_FIELDS, *DISK_SHORTCUTS):
        assert f"`{name}`" in text, f"README's configuration text misses {name}"


def test_disk_config_takes_a_str_or_path_like_directory_as_a_path(tmp_path: Path) -> None:
    # Regression: DiskConfig(directory=str) was refused (TypeError) although CacheConfig took one.
    class Where:
        def __fspath__(self) -> str:
            return str(tmp_path / "pl")

    assert DiskConfig(directory=str(tmp_path)).directory == tmp_path
    assert DiskConfig(directory=Where()).directory == tmp_path / "pl"  # type: ignore[arg-type]
    for empty in ("", Path(""), Path(".")):
        with pytest.raises(ValueError, match="non-empty path"):
            DiskConfig(directory=empty)  # type: ignore[arg-type]
