"""`OffloadPath`: how the manager stores the engine's pages: offload rounds, then write-behind.

An offload keys the full pages, reserves them, gathers the new ones from the engine's slots,
commits them once copied and queues the admitted ones for the disk tier; when the pool is full of
pages the write-behind still holds it waits for room and goes on in rounds. Mixed into
:class:`aiokv.manager.CacheManager`; the state is :class:`aiokv.managerbase.ManagerBase`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from aiokv.config import Admission
from aiokv.keys import PageKey, Salt, Tokens
from aiokv.managerbase import ManagerBase
from aiokv.pagetable import PageHandle, PageState, Reservation, ReserveOutcome
from aiokv.results import OffloadResult
from aiokv.transfers import Copy, CopyWithdrawn


class OffloadPath(ManagerBase):
    """Offload rounds and write-behind of the manager (see the module docstring)."""

    # -- offload --------------------------------------------------------------------------------

    async def offload(self, tokens: Tokens, slots: torch.Tensor, salt: Salt = None) -> OffloadResult:
        """Store the full pages of ``tokens`` not already cached (see ``KVCache.offload``).

        ``slots``: host int64, one per token, checked against the engine's buffer by the caller.
        """
        self._running()
        keys = self.keys(tokens, salt)
        if not keys:
            return OffloadResult(0, 0, 0)
        if not self._writer:
            # Replicated heads / MLA on rank > 0: the writer rank stores the page.
            return OffloadResult(0, len(keys), 0)
        admitted_before = None
        if self.config.admission is Admission.SEEN_TWICE:
            admitted_before = {k for k in keys if k in self._seen}
        self._note_seen(keys)
        stored = skipped = dropped = withdrawn = 0
        # Pages still to reserve, in order: the whole call at first (a range: its slots a slice).
        todo: Sequence[int] = range(len(keys))
        # Pages another call was writing when this one reserved them (PENDING, counted skipped):
        # waited for once this call copied its own, and written by it if that call gives them up.
        others: list[int] = []
        deadline: float | None = None
        expired: list[bool] = []  # the call's waits stop together: one commit_wait_expired
        room = True  # False once a wait for room came to nothing: what still finds none is dropped
        try:
            # Rounds: store what the pool can take; when it is full of pages the write-behind still
            # holds, wait (bounded) for them to reach disk and go on, instead of dropping the rest.
            while todo or others:
                if not todo:
                    # Review 202: the second of two offloads of one prefix reported the first's
                    # pages skipped at once; the first then cancelled (or its copy failed), neither
                    # stored them, and the prefix was lost although this call returned success.
                    deadline = self._commit_deadline() if deadline is None else deadline
                    todo = await self._given_up(keys, others, deadline, expired)
                    others = []
                    skipped -= len(todo)  # counted again by the round that reserves them now
                    continue
                if self._closed:
                    # The close began between rounds: what still needed a copy is withdrawn (dropped,
                    # not a fault); pages in the pool or being written meanwhile would have been skipped.
                    state_of = self.pool.table.state_of
                    held = sum(1 for i in todo if state_of(keys[i]) is not PageState.FREE)
                    skipped += held
                    withdrawn += len(todo) - held
                    dropped += len(todo) - held
                    break
                wanted = [keys[i] for i in todo]
                reservations = self.pool.reserve(wanted)
                fit = next((i for i, r in enumerate(reservations) if r.outcome is ReserveOutcome.EXHAUSTED),
                           len(reservations))
                others += [todo[i] for i, r in enumerate(reservations[:fit]) if r.outcome is ReserveOutcome.PENDING]
                counts = await self._store(wanted[:fit], reservations[:fit], self._slots_of(slots, todo[:fit]),
                                           admitted_before)
                stored, skipped, dropped = stored + counts[0], skipped + counts[1], dropped + counts[2]
                withdrawn += counts[3]
                todo = todo[fit:]
                if todo and not (room and await self._wait_for_room()):
                    room = False
                    dropped += len(todo)
                    self.faults.record("pool_exhausted", f"{len(todo)} pages not offloaded: the pool is full "
                                       "of referenced pages")
                    todo = ()
        finally:
            # Also when cancelled (or failing) after a round: the pages earlier rounds stored are
            # in the pool and served, and must be counted (they went uncounted: review 195).
            self._stored += stored
            self._skipped += skipped
            self._dropped += dropped
            self.withdraw(withdrawn)
        return OffloadResult(stored, skipped, dropped)

    def _slots_of(self, slots: torch.Tensor, pages: Sequence[int]) -> torch.Tensor:
        """The host slots of ``pages`` (indices into the call's pages), in order: a slice for a run
        of pages (every first round), else gathered."""
        t = self.layout.page_tokens
        if isinstance(pages, range) and pages.step == 1:
            return slots[pages.start * t : pages.stop * t]
        index = torch.tensor(list(pages), dtype=torch.long)
        return slots[: slots.numel() // t * t].reshape(-1, t).index_select(0, index).reshape(-1)

    async def _given_up(self, keys: Sequence[PageKey], others: list[int], deadline: float,
                        expired: list[bool]) -> list[int]:
        """Wait (until ``deadline``, loop time) for the pages ``others`` (indices into ``keys``)
        that other calls were writing; returns those given up (an offload cancelled or whose copy
        failed, a read that failed; a third writer that took one over is waited for in turn),
        which this call reserves again. A page committed is stored; one whose writer is still at
        it past the deadline (a stopped TP rank, a stuck driver call) stays skipped, counted
        ``commit_wait_expired`` once a call. A cancel leaves the pages and their writers alone
        (this call has nothing in flight here)."""
        state_of = self.pool.table.state_of
        again: list[int] = []
        for i in others:
            # Not committed and FREE: given up; still RESERVED: written past the deadline, skipped.
            if not await self._wait_written(keys[i], deadline, "an offload", expired) and state_of(
                    keys[i]) is PageState.FREE:
                again.append(i)
        return again

    async def _store(
        self, keys: Sequence[PageKey], reservations: Sequence[Reservation], slots: torch.Tensor,
        admitted_before: set[PageKey] | None,
    ) -> tuple[int, int, int, int]:
        """Copy the RESERVED pages of one round, commit them and queue them for disk.

        ``slots`` holds ``len(keys) * page_tokens`` host slots. Returns (stored, skipped, dropped,
        withdrawn): withdrawn pages (also dropped) were never copied because the cache began
        closing first, a paced copy still waiting (:class:`CopyWithdrawn`) or a group not launched.
        """
        pool, transfers = self._running()
        new = [(i, r.handle) for i, r in enumerate(reservations) if r.handle is not None]
        skipped = len(reservations) - len(new)  # PRESENT or PENDING: a round holds no EXHAUSTED key
        if not new:
            return 0, skipped, 0, 0
        t = self.layout.page_tokens
        handles = [h for _, h in new]
        index = torch.tensor([i for i, _ in new], dtype=torch.long)
        chosen = slots.view(len(keys), t).index_select(0, index).reshape(-1)
        sizer = self.offload_launches
        copies: list[tuple[Copy, list[PageHandle]]] = []
        unlaunched: list[PageHandle] = []
        try:
            begin = 0
            while begin < len(handles):
                # Bounded host work per loop turn: validation above, then each group's launches.
                await asyncio.sleep(0)
                if self._closed:
                    # The close began: nothing more goes to the copy engine (as the pacer's close
                    # withdraws what waits); the close frees the pool once launched copies ended.
                    unlaunched = handles[begin:]
                    break
                turn = time.perf_counter()
                part = handles[begin : begin + sizer.pages()]
                copy = transfers.offload(chosen[begin * t : (begin + len(part)) * t], [h.page for h in part])
                copies.append((copy, part))
                begin += len(part)
                if copy.launch is None or copy.launch.launched:
                    # (A paced CUDA copy that was only queued took tens of µs: its launch, the
                    # same host work, comes later from a completion callback. Learned from, such
                    # samples grew groups whose deferred launches then held the loop.)
                    sizer.record(len(part), time.perf_counter() - turn)
            outcomes = await asyncio.shield(asyncio.gather(*(c.future for c, _ in copies), return_exceptions=True))
        except BaseException:
            # Cancelled (or a launch refused its arguments): the slots may be reused as soon as we
            # return, so no copy may still read them, and launched pages are aborted (their bytes
            # cannot be trusted), the rest at once.
            await transfers.quiesce([c for c, _ in copies], offload=True)
            launched = {id(h) for _, part in copies for h in part}
            for copy, part in copies:
                self._after(copy.future, part, commit=False)
            for handle in handles:
                if id(handle) not in launched:
                    pool.table.abort(handle)
            raise
        # Withdrawn by the close (never ran) is not a failure: aborted alike, counted apart.
        withdrawn = unlaunched + [h for (_, part), out in zip(copies, outcomes, strict=True)
                                  if isinstance(out, CopyWithdrawn) for h in part]
        errors = [out for out in outcomes if out is not None and not isinstance(out, CopyWithdrawn)]
        failed = [h for (_, part), out in zip(copies, outcomes, strict=True)
                  if out is not None and not isinstance(out, CopyWithdrawn) for h in part]
        if errors:
            self.faults.record("copy_failed", f"offload copy failed: {errors[0]!r}")
        if failed or withdrawn:
            bad = {id(h) for h in failed} | {id(h) for h in withdrawn}
            for handle in failed + withdrawn:
                pool.table.abort(handle)
            new = [(i, h) for i, h in new if id(h) not in bad]
        self._bytes["gpu_to_pool"] += len(new) * self.layout.payload_bytes
        commit, to_disk = pool.table.commit, self._disk is not None  # once per page: locals
        for i, handle in new:
            key = keys[i]
            admit = to_disk and (admitted_before is None or key in admitted_before)
            kept = commit(handle, keep=admit)
            if kept is not None:
                self._write_behind(key, kept)
        return len(new), skipped, len(failed) + len(withdrawn), len(withdrawn)

    def _write_behind(self, key: PageKey, handle: PageHandle) -> None:
        disk = self._disk
        if disk is None or disk.contains(key) or disk.read_only is not None:
            # A read-only tier (another cache writes this directory, or the file system is
            # read-only) refuses writes by design: not a full queue, nothing to count here.
            self._release_handles([handle])
            return
        if disk.write_behind_nowait(key, handle):
            self._bytes["pool_to_disk"] += self.layout.page_bytes
        else:
            self._release_handles([handle])
            if not self._closed:  # a closing tier accepts no more writes by design: not a full queue
                self.faults.record("write_behind_full", "write-behind queue full: page kept in the pool only")
