"""`PageIndex`: which page files the tier has, in LRU order, their bytes and the budget in force.

Plain synchronous bookkeeping for :class:`~aiokv.storage.DiskTier`: evictions return keys and the
tier removes their files. ``used`` counts indexed files, the room claimed by writes in flight and
the room held by spare files (:mod:`.spares`, ``spares`` of them).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator

from aiokv.keys import PageKey

from .layoutdir import FreeSpace

RECYCLE_WINDOW = 8
"""How many of the least recently used files may be looked at for one that no read has open."""


class PageIndex:
    """Keys of page files (oldest first) with a generation each, so that a late job can tell
    whether the file it looked at is still the indexed one."""

    def __init__(self, file_bytes: int, capacity_bytes: int, min_free_bytes: int) -> None:
        self.file_bytes = file_bytes
        self.budget = capacity_bytes
        """The configured budget."""
        self.min_free_bytes = min_free_bytes
        self.capacity = capacity_bytes
        """The budget in force: ``budget`` or less when the file system has less room."""
        self.used = 0
        self.spares = 0
        """Files of room in ``used`` held by spare files (in stock or being made)."""
        self.evictions = 0
        self._free_then = 0
        self._used_then = 0
        self.readers: dict[PageKey, int] = {}
        """Reads in progress per key (absent: none): their files are not recycled. A plain dict: a
        Counter's missing-key and delete paths are Python calls, on every read and recycle."""
        self._entries: OrderedDict[PageKey, int] = OrderedDict()
        self._generation = 0

    def __contains__(self, key: PageKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PageKey]:
        return iter(self._entries)

    def generation(self, key: PageKey) -> int | None:
        return self._entries.get(key)

    def touch(self, key: PageKey) -> None:
        """Mark ``key`` most recently used."""
        self._entries.move_to_end(key)

    def add(self, key: PageKey) -> None:
        """Index ``key``'s file (its room is already counted in ``used``), most recently used."""
        self._generation += 1
        self._entries[key] = self._generation

    def add_found(self, key: PageKey) -> None:
        """Index a file found at start (oldest first): count its room too."""
        self.used += self.file_bytes
        self.add(key)

    def add_least_recent(self, keys: list[PageKey]) -> None:
        """Index files found after start (oldest first) as the least recently used, before every
        indexed file, and count their room (the caller trims the index to the budget)."""
        entries = self._entries
        for key in reversed(keys):
            self._generation += 1
            entries[key] = self._generation
            entries.move_to_end(key, last=False)
            self.used += self.file_bytes

    def remove(self, key: PageKey) -> None:
        """Out of the index, its room given back."""
        del self._entries[key]
        self.used -= self.file_bytes

    def forget(self, key: PageKey, generation: int) -> bool:
        """:meth:`remove` ``key`` if it is still the file of ``generation``."""
        if self._entries.get(key) != generation:
            return False
        self.remove(key)
        return True

    @property
    def stored_bytes(self) -> int:
        """``used`` less the spare files' room: indexed files and writes in flight."""
        return self.used - self.spares * self.file_bytes

    def reserve_spares(self, count: int) -> int:
        """Room for up to ``count`` spare files, only where it is free (nothing is evicted for a
        spare); returns how many it reserved."""
        count = max(0, min(count, (self.capacity - self.used) // self.file_bytes))
        self.used += count * self.file_bytes
        self.spares += count
        return count

    def spare_taken(self) -> None:
        """A write took a spare: its room passes to the write (still in ``used``)."""
        self.spares -= 1

    def release_spares(self, count: int) -> None:
        """``count`` spares gone (not made, or removed): their room is free again."""
        self.spares -= count
        self.used -= count * self.file_bytes

    def give_back(self) -> None:
        """A claimed room that was not used (the write failed)."""
        self.used -= self.file_bytes

    def claim(self, recycle: bool) -> tuple[PageKey | None, list[PageKey]] | None:
        """Room for one more file, counted in ``used``: ``(victim, evicted)``, or None when there is
        none. With ``recycle``, a full index hands over its least recently used file that no read
        has open (``victim``, out of the index) to be overwritten — creating a file costs far more
        kernel CPU than overwriting one — and its room passes to the new file. ``evicted``: keys
        whose files the caller must remove."""
        size = self.file_bytes
        if recycle and self.used + size > self.capacity:
            victim = self._recyclable()
            if victim is not None:
                evicted = self.evict_to(self.capacity, keep=victim)
                # The victim leaves the index last, with no call before the return (a signal's
                # KeyboardInterrupt comes at calls): its file and room pass to the caller, or it
                # stays indexed (before, an interrupt at the eviction's entry lost its room).
                del self._entries[victim]
                self.evictions += 1
                return victim, evicted
        evicted = self.evict_to(self.capacity - size)
        if self.used + size > self.capacity:
            return None
        self.used += size
        return None, evicted

    def _recyclable(self) -> PageKey | None:
        # The least recently used file that no read has open (an overwrite would tear that read).
        readers = self.readers
        for index, key in enumerate(self._entries):
            if index >= RECYCLE_WINDOW:
                break
            if not readers.get(key):
                return key
        return None

    def evict_to(self, limit: int, keep: PageKey | None = None) -> list[PageKey]:
        """Remove least recently used keys (never ``keep``) until ``used <= limit``; the caller
        removes their files."""
        evicted = []
        while self.used > limit and self._entries:
            key = next(iter(self._entries))
            if key == keep:
                key = next(itertools.islice(self._entries, 1, None), keep)
                if key == keep:
                    break
            self.evictions += 1
            self.remove(key)
            evicted.append(key)
        return evicted

    def set_capacity(self, space: FreeSpace, after_enospc: bool, pending: int = 0) -> None:
        """The budget in force: what is stored plus what the file system still offers (bytes less
        ``min_free_bytes``, and inodes), never above ``budget``; after ENOSPC never above what is
        stored (the file system just said so, whatever statvfs counts). ``pending``: the tier's new
        files whose room was in ``used`` at the look but whose blocks it may not have seen taken
        (writes in flight, spares being made): off the free room :meth:`free_bytes` starts from (not off the budget in
        force: docs/storage.md, the file system's room)."""
        room = space.bytes - self.min_free_bytes
        if space.files is not None:
            room = min(room, space.files * self.file_bytes)
        capacity = min(self.budget, self.used + max(0, room))
        self.capacity = min(capacity, self.used) if after_enospc else capacity
        free = space.bytes if space.files is None else min(space.bytes, space.files * self.file_bytes)
        self._free_then = 0 if after_enospc else free - pending * self.file_bytes
        self._used_then = self.used

    def free_bytes(self) -> int:
        """Room the file system has free for page files, as far as the tier knows, in bytes (free
        inodes count as a file's bytes each, as in :meth:`set_capacity`): what the last look found
        (none after ENOSPC) less what ``used`` grew by since. Files it evicted count as freed here
        once out of the index; the tier subtracts those whose unlink has not landed. The tier's
        writes in flight and spares being made at the look count as taken (``pending``). Others'
        files since the look are not seen (corrected at the next look, or the next ENOSPC)."""
        return self._free_then + self._used_then - self.used
