"""The read path of the disk tier: a page job moved on by completion callbacks.

A read takes an I/O slot, loads header and page into a header slot and the caller's page, checks
the header (the slot goes back), then the payload's checksum (inline or on the checksum thread).
A file that fails verification is refused (:meth:`TierBase._reject`); every path ends the job
exactly once (:meth:`ReadPath._end_read`), and a cancelled caller waits for that end while the
kernel or a thread may still write into its page.

A KeyboardInterrupt (a signal) raised in a step of the job ends the job as a counted fault
(:meth:`ReadPath._read_settle`) unless the step had handed it on (the backend's load or the
checksum started: they deliver their completion, at least once), and the interrupt goes on.

A file gone at its open (ENOENT) is a miss either way; one whose page the tier itself took out of
its index under the read (evicted, deleted), or before it began, is counted ``_reads_evicted``
(review 222, helper 307), one still
indexed (unlinked behind the tier's back) ``_reads_unlinked``: the cache counts that read failed, and
any read whose window saw one (review 228: the counts are tier-wide).
"""

from __future__ import annotations

import asyncio
import functools

from aiokv.keys import PageKey

from .config import ReadOnly
from .jobs import Job, ReadBatch, ReadJob
from .memory import PageBuffer
from .pagefile import PageHeader, parse_header
from .safefiles import UnsafeFileError
from .tierbase import TierBase
from .uring import not_started


class ReadPath(TierBase):
    """Reads of the disk tier (see the module docstring); :class:`~.disk.DiskTier` calls them."""

    _reads_evicted = 0
    """Reads that found their file gone because the tier itself had taken the page out of its index
    under them (evicted, deleted, replaced), or found the key out of the index when they began:
    misses, not faults (:meth:`DiskTier.read_marks`). The latter too (helper 307): a caller that
    saw the page indexed starts its read as a task, whose first step runs after the callbacks
    already queued, an eviction by the write-behind among them; counted nowhere, that read was a
    fault for the cache (``disk_read_failed``) where only the budget had spoken."""

    _reads_unlinked = 0
    """Reads that found their file gone while their page was still indexed, or in a fan-out
    directory retired meanwhile: removed from outside (:meth:`DiskTier.read_marks`). A read that
    finds its key out of the index because such a read (of the same key, or of its directory)
    dropped it meanwhile counts ``_reads_evicted``; this count, taken over the same window, tells
    the cache that read apart (review 228)."""

    async def _read(self, key: PageKey, page: PageBuffer) -> bool:
        generation = self._index.generation(key)
        if generation is None or not self._accepting:
            self._misses += 1
            if generation is None and self._accepting:
                self._reads_evicted += 1  # out of the index before the read began (see _reads_evicted)
            return False
        job = ReadJob(key, page, generation, asyncio.get_running_loop().create_future())
        try:
            self._launch_read(job)
        except BaseException:
            # (a signal's KeyboardInterrupt: this caller is gone) a job still waiting for a slot
            # has touched nothing: it leaves (one already reading ends by itself).
            self._cancel_waiting(job)
            raise
        assert job.result is not None
        try:
            return await job.result
        except asyncio.CancelledError:
            if not self._cancel_waiting(job):
                await job.wait_ended()  # the kernel (or a thread) may still write into the page
            raise

    async def _read_batch(self, keys: list[PageKey], pages: list[PageBuffer]) -> list[bool]:
        """:meth:`_read` of each ``keys[i]`` into ``pages[i]`` (checked: distinct keys and pages),
        awaiting one future for the whole batch: its jobs are moved on by completion callbacks
        as single reads are, and the batch's future resolves when the last of them ended."""
        loop = asyncio.get_running_loop()
        batch = ReadBatch(len(keys), loop.create_future())
        jobs: list[ReadJob] = []
        accepting = self._accepting
        index = self._index
        try:
            for i, key in enumerate(keys):
                generation = index.generation(key) if accepting else None
                if generation is None:
                    self._misses += 1  # batch.oks[i] stays False
                    if accepting:
                        self._reads_evicted += 1  # out of the index before the read began
                    continue
                job = ReadJob(key, pages[i], generation, None, batch, i)
                batch.left += 1
                jobs.append(job)
                self._launch_read(job)  # may end the job at once (a fault): the guard keeps the batch open
        except BaseException:
            # (a signal's KeyboardInterrupt: this caller is gone) the jobs still waiting for a slot
            # have touched nothing: they leave (those already reading end by themselves).
            for job in jobs:
                self._cancel_waiting(job)
            raise
        batch.release()  # the guard: done now if every job ended already (or there was none)
        try:
            return await batch.done
        except asyncio.CancelledError:
            for job in jobs:  # those still waiting for a slot have touched nothing: they leave now
                self._cancel_waiting(job)
            for job in jobs:
                await job.wait_ended()  # the kernel (or a thread) may still write into its page
            raise

    def _launch_read(self, job: ReadJob) -> None:
        """Count ``job`` as a reader of its file and an active job, and queue it for an I/O slot."""
        key = job.key
        counted = False
        try:
            self._index.touch(key)
            # Counted from now, not from its slot: a write must not pick the file of a read still
            # waiting for a slot as its recycling victim (the overwrite could overlap the read).
            readers = self._index.readers
            readers[key] = readers.get(key, 0) + 1
            job.reading = True
            self._active += 1  # _job_started, inline
            counted = True  # (no call since the count: a signal's exception comes at calls)
            self._io_slots.take(job, self._read_slot)
        except BaseException as exc:
            if counted and not isinstance(exc, Exception) and not_started(self._io_slots.take, exc):
                self._read_settle(job)  # counted, never queued
            raise

    def _read_slot(self, job: Job, slot: int) -> None:
        step = -1  # the load's hand-off (none yet: ``start`` is set once it is)
        try:
            assert isinstance(job, ReadJob) and self._io is not None
            self._reads += 1
            try:
                dir_fd, name = self._where(job.key)
            except OSError as exc:  # its fan-out directory cannot be opened (safely): a counted miss
                self._read_unreader(job)
                self._io_slots.give_back(job)
                self._read_fault(job, exc)
                return
            start = self._io.start_load
            step = job.step = job.handoffs = job.handoffs + 1
            # A plain call (no *args): Python checks for signals as a call it does not inline returns,
            # and an interrupt after a load was handed over must not look like one before it.
            start(dir_fd, name, slot, job.page, functools.partial(self._read_loaded, job, step))
        except Exception:
            assert isinstance(job, ReadJob)
            job.step = 0
            self._read_unreader(job)
            self._io_slots.give_back(job)
            self._faults.unexpected("read")
            self._end_read(job, False)
        except BaseException as exc:
            # (a signal's KeyboardInterrupt) before the load was handed to the backend: ends here.
            # A load that started delivers its completion (at least once): nothing to do here.
            if isinstance(job, ReadJob) and (job.step != step or not_started(start, exc)):
                self._read_settle(job)
            raise

    def _read_unreader(self, job: ReadJob) -> None:
        """The read of ``job`` no longer needs its file (loaded, failed, or left the slot queue);
        once: the count changes and ``reading`` clears with no call between (an interrupt comes at
        the lookup before both)."""
        if not job.reading:
            return
        key = job.key
        readers = self._index.readers
        count = readers.get(key, 0) - 1
        if count:
            readers[key] = count
        else:
            del readers[key]
        job.reading = False

    def _read_settle(self, job: ReadJob) -> None:
        """End ``job`` after an interrupt left it between steps (no completion awaited): whatever it
        holds goes back (reader count, slot) and it ends as a counted fault; an end the interrupt
        cut short only wakes what is left. Idempotent."""
        job.step = 0
        self._read_unreader(job)
        self._io_slots.give_back(job)
        if not job.ended:
            self._count_interrupt("read")
        self._end_read(job, False)

    def _read_loaded(self, job: ReadJob, step: int, got: int | BaseException) -> None:
        if job.step != step:
            return  # delivered again after an interrupt (its deliverer could not tell): it ran
        job.step = 0
        hashed = -1  # the hash's hand-off (none yet)
        assert self._slots is not None and self._checksums is not None
        key, generation = job.key, job.generation
        try:
            if job.reading:  # _read_unreader, inline (once per page)
                readers = self._index.readers
                count = readers.get(key, 0) - 1
                if count:
                    readers[key] = count
                else:
                    del readers[key]
                job.reading = False
            if isinstance(got, BaseException):
                self._io_slots.give_back(job)
                self._read_fault(job, got)
                return
            if got != self._file_bytes:
                self._io_slots.give_back(job)
                self._reject(key, generation, f"truncated ({got} of {self._file_bytes} bytes)")
                self._end_read(job, False)
                return
            header = parse_header(self._slots.views[job.slot], self.layout, key)
            self._io_slots.give_back(job)  # the header is parsed: the slot may go on before the payload hash
            if not isinstance(header, PageHeader):
                self._reject(key, generation, header.value)
                self._end_read(job, False)
                return
            job.checksum = header.checksum
            payload = job.page.payload
            hashed = job.step = job.handoffs = job.handoffs + 1
            self._checksums.start(payload, functools.partial(self._read_hashed, job, hashed))
        except Exception:  # the slot back and the job ended on every path: later I/O must not hang
            job.step = 0
            self._io_slots.give_back(job)
            self._faults.unexpected("read")
            if not job.ended:
                self._end_read(job, False)
        except BaseException as exc:
            # (a signal's KeyboardInterrupt) before the hash started: ends here (a hash that started
            # delivers its result, at least once).
            if job.step != hashed or not_started(self._checksums.start, exc):
                self._read_settle(job)
            raise

    def _read_fault(self, job: ReadJob, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            prepared = self._dir
            if (self._index.generation(job.key) != job.generation and prepared is not None
                    and prepared.fanout[job.key[0]] >= 0):
                # The tier itself took the page out of its index under the read (evicted for room,
                # deleted, replaced): its file went with it. A miss, not a fault (review 214). (Not
                # when its fan-out directory was retired meanwhile: removed from outside.)
                self._reads_evicted += 1
                self._end_read(job, False)
                return
            # Still indexed: unlinked by someone else (another process, an operator, a bad clean-up):
            # never readable again. Not ``_reads_evicted``: the cache counts the read failed. But a
            # follower's files are removed by the writer it follows (its evictions, deletes), which
            # the next look would tell it: an eviction, no fault (docs/storage.md; review 228).
            if self._read_only is ReadOnly.LOCKED:
                self._reads_evicted += 1
            else:
                self._reads_unlinked += 1
            self._forget(job.key, job.generation)
            if self._read_only is not ReadOnly.LOCKED:  # (a follower's looks tell it)
                # With its directory (``rm -rf``)? Then its other keys leave the index at once, not
                # one miss each, and writes of them store again rather than find them present.
                self._fanout_gone(job.key[0])
        elif isinstance(exc, UnsafeFileError):  # planted: whatever a chain read into the page is never counted as read
            self._faults.count(exc, "read")
            if self._index.generation(job.key) == job.generation:
                self._drop(job.key)
        elif isinstance(exc, OSError):
            self._faults.count(exc, "read")
        else:
            self._faults.unexpected("read")
        self._end_read(job, False)

    def _read_hashed(self, job: ReadJob, step: int, checksum: int | BaseException) -> None:
        if job.step != step:
            return  # delivered again after an interrupt (its deliverer could not tell): it ran
        job.step = 0
        try:
            if isinstance(checksum, BaseException):
                if isinstance(checksum, OSError):  # the hash was interrupted before it started
                    self._faults.count(checksum, "read")
                else:
                    self._faults.unexpected("read")
                self._end_read(job, False)
            elif checksum != job.checksum:
                self._reject(job.key, job.generation, "payload checksum mismatch")
                self._end_read(job, False)
            else:
                self._bytes_read += self._file_bytes
                self._end_read(job, True)
        except Exception:  # never left unended: its caller and close() wait for the end
            self._faults.unexpected("read")
            if not job.ended:
                self._end_read(job, False)
        except BaseException:
            self._read_settle(job)  # (a signal's KeyboardInterrupt): ended, or its end's wake-ups done
            raise

    def _end_read(self, job: ReadJob, ok: bool) -> None:
        """``job`` ends with ``ok``: its caller told, counted and the tier's count of jobs down,
        once. The counts change in one block without a call (a signal's exception comes at calls)
        and the wake-ups after it are idempotent: a guard that ends the job again after an
        interrupt only wakes what is left (a caller told True before is not told again)."""
        result = job.result
        if result is not None and not result.done():
            result.set_result(ok)
        batch = job.batch
        if not job.ended:
            if ok:
                self._hits += 1
            else:
                self._misses += 1
            if batch is not None:
                batch.oks[job.index] = ok
                batch.left -= 1
            job.ended = True
            self._active -= 1
        if batch is not None and not batch.left and not batch.done.done():
            batch.done.set_result(batch.oks)
        self._job_ended(job)  # (ended: wakes those waiting for the end, and the close)

    def _cancel_waiting(self, job: ReadJob) -> bool:
        """A cancelled read still waiting for a slot ends at once (nothing was read); True then."""
        if job.ended:
            return True
        try:
            if not self._io_slots.leave(job):
                return False
            self._read_unreader(job)
            self._end_read(job, False)
            return True
        except BaseException as exc:
            # (a signal's KeyboardInterrupt) out of the queue but not ended: ended now.
            if (not isinstance(exc, Exception) and not job.ended and not job.step and not job.holds_slot
                    and not self._io_slots.waits(job)):
                job.then = None
                self._read_settle(job)
            raise
