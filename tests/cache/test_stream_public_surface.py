"""Load streams reach the manager only through its public members (docs/design.md, the manager).

The stream once called ``_promote``, ``_adopt``, ``_after``, ``_release_handles``, ``_measure`` and
``_running``: a rename inside the manager's paths broke it silently. Checked on the source (AST),
so any new private reach fails here, whichever path runs it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aiokv.manager import CacheManager

ROOT = Path(__file__).resolve().parents[2]
STREAMS = ["aiokv/stream.py", "aiokv/tp/stream.py"]


def private_manager_uses(source: str) -> list[str]:
    """``name._attr`` where ``name`` is the manager: a local ``manager`` or ``self._manager``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        owner = node.value
        is_local = isinstance(owner, ast.Name) and owner.id == "manager"
        is_field = (isinstance(owner, ast.Attribute) and owner.attr == "_manager"
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self")
        if is_local or is_field:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("path", STREAMS)
def test_streams_use_only_public_members_of_the_manager(path: str) -> None:
    assert private_manager_uses((ROOT / path).read_text()) == []


def test_the_check_sees_a_private_reach() -> None:
    # The forms the stream used before: a local and the stored field.
    source = "manager._release_handles(h)\nself._manager._promote(k)\nself._manager.promote(k)\n"
    assert private_manager_uses(source) == ["line 1: ._release_handles", "line 2: ._promote"]


@pytest.mark.parametrize("name", ["running_transfers", "release", "release_after", "promote",
                                  "adopt_promotion", "measure_pool_copies", "closing", "withdraw",
                                  "count_loaded"])
def test_the_stream_surface_is_documented(name: str) -> None:
    member = getattr(CacheManager, name)
    doc = (member.fget if isinstance(member, property) else member).__doc__
    assert doc and doc.strip()
