"""The read path of the disk tier: a page job moved on by completion callbacks.

A read takes an I/O slot, loads header and page into a header slot and the caller's page, checks
the header (the slot goes back), then the payload's checksum (inline or on the checksum thread).
A file that fails verification is refused (:meth:`TierBase._reject`); every path ends the job
exactly once (:meth:`ReadPath._end_read`), and a cancelled caller waits for that end while the
kernel or a thread may still write into its page.
"""

from __future__ import annotations

import asyncio
import functools

from aiokv.keys import PageKey

from .jobs import Job, ReadBatch, ReadJob
from .memory import PageBuffer
from .pagefile import PageHeader, parse_header
from .safefiles import UnsafeFileError
from .tierbase import TierBase


class ReadPath(TierBase):
    """Reads of the disk tier (see the module docstring); :class:`~.disk.DiskTier` calls them."""

    async def _read(self, key: PageKey, page: PageBuffer) -> bool:
        generation = self._index.generation(key)
        if generation is None or not self._accepting:
            self._misses += 1
            return False
        job = ReadJob(key, page, generation, asyncio.get_running_loop().create_future())
        self._launch_read(job)
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
        for i, key in enumerate(keys):
            generation = index.generation(key) if accepting else None
            if generation is None:
                self._misses += 1  # batch.oks[i] stays False
                continue
            job = ReadJob(key, pages[i], generation, None, batch, i)
            batch.left += 1
            jobs.append(job)
            self._launch_read(job)  # may end the job at once (a fault): the guard keeps the batch open
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
        self._index.touch(key)
        # Counted from now, not from its slot: a write must not pick the file of a read still
        # waiting for a slot as its recycling victim (the overwrite could overlap the read).
        readers = self._index.readers
        readers[key] = readers.get(key, 0) + 1
        self._active += 1  # _job_started, inline
        self._io_slots.take(job, self._read_slot)

    def _read_slot(self, job: Job, slot: int) -> None:
        assert isinstance(job, ReadJob) and self._io is not None
        self._reads += 1
        try:
            where = self._where(job.key)
        except OSError as exc:  # its fan-out directory cannot be opened (safely): a counted miss
            self._read_unreader(job.key)
            self._io_slots.give_back(job)
            self._read_fault(job, exc)
            return
        try:
            self._io.start_load(*where, slot, job.page, functools.partial(self._read_loaded, job))
        except Exception:
            self._read_unreader(job.key)
            self._io_slots.give_back(job)
            self._faults.unexpected("read")
            self._end_read(job, False)

    def _read_unreader(self, key: PageKey) -> None:
        """The read of ``key`` no longer needs its file (loaded, failed, or left the slot queue)."""
        readers = self._index.readers
        count = readers.get(key, 0) - 1
        if count:
            readers[key] = count
        else:
            del readers[key]

    def _read_loaded(self, job: ReadJob, got: int | BaseException) -> None:
        assert self._slots is not None and self._checksums is not None
        key, generation = job.key, job.generation
        readers = self._index.readers  # _read_unreader, inline (once per page)
        count = readers.get(key, 0) - 1
        if count:
            readers[key] = count
        else:
            del readers[key]
        try:
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
            self._checksums.start(job.page.payload, functools.partial(self._read_hashed, job))
        except Exception:  # the slot back and the job ended on every path: later I/O must not hang
            self._io_slots.give_back(job)
            self._faults.unexpected("read")
            if not job.ended:
                self._end_read(job, False)

    def _read_fault(self, job: ReadJob, exc: BaseException) -> None:
        if isinstance(exc, FileNotFoundError):
            self._forget(job.key, job.generation)  # removed behind our back
        elif isinstance(exc, UnsafeFileError):  # planted: whatever a chain read into the page is never counted as read
            self._faults.count(exc, "read")
            if self._index.generation(job.key) == job.generation:
                self._drop(job.key)
        elif isinstance(exc, OSError):
            self._faults.count(exc, "read")
        else:
            self._faults.unexpected("read")
        self._end_read(job, False)

    def _read_hashed(self, job: ReadJob, checksum: int | BaseException) -> None:
        try:
            if isinstance(checksum, BaseException):
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

    def _end_read(self, job: ReadJob, ok: bool) -> None:
        if ok:
            self._hits += 1
        else:
            self._misses += 1
        batch = job.batch
        if batch is not None:
            batch.ended(job.index, ok)
        elif job.result is not None and not job.result.done():
            job.result.set_result(ok)
        self._job_ended(job)

    def _cancel_waiting(self, job: ReadJob) -> bool:
        """A cancelled read still waiting for a slot ends at once (nothing was read); True then."""
        if job.ended or not self._io_slots.leave(job):
            return job.ended
        self._read_unreader(job.key)
        self._misses += 1
        self._job_ended(job)
        return True
