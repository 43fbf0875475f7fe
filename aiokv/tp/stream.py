"""`TPLoadStream`: a :class:`~aiokv.stream.LoadStream` whose copies run on the ranks of a TP group.

Ordering on a CUDA rank: as the stream begins, every attached rank is told (a STREAM_BEGINS frame,
sent by ``start_load`` itself) and records a *mark* on its engine's stream when it reads it; the
stream's copies on that rank are ordered after the mark, not after the engine's stream at each
copy's launch. So they wait for everything the rank's engine had queued when it read the frame
(all it queued before ``start_load``, and whatever it queued in the short time until the read), and
not for the chunks it queues later (a split's claimed chunks, which must not touch the loaded
slots, as in one process). The engine's stream still waits on each copy (at its launch; layered:
per layer, ``wait_layer``) before its later kernels can read the slots.

An engine can make the mark exact: it puts ``stream.stream_id`` and ``stream.epoch`` in its next
step message, and each rank calls ``RankWorker.begin_stream(stream_id, epoch)`` (or
``RankWorkerThread.begin_stream``) at the start of that step, before queuing its kernels. The mark
is recorded then, on the engine's thread; the earlier of it and the frame's is kept::

    stream = cache.start_load(match, slots)                        # scheduler
    send_step(chunk, stream=(stream.stream_id, stream.epoch))      # the engine's own channel
    ...                                                            # rank r, as the step begins:
    worker.begin_stream(*step.stream)                              #   then queue its kernels

Layer by layer (``TPCache.start_load(..., layered=True)``) each rank copies layer 0 of every page,
then layer 1, ... Readiness lives on both sides:

- the scheduler: ``stream.wait_layer(l)`` resolves once every rank reported layer ``l`` landed
  (ranks send a LAYERS frame per layer: CPU once its bytes are in, CUDA once its event completed);
- each rank: the engine's rank process waits on its own copies before layer ``l``'s attention,
  ``RankWorker.wait_layer(load, l)`` with ``load = stream.layered_load()`` carried in the scheduler's
  step message (CPU: a host wait for the layer's bytes; CUDA: its stream waits on the layer's
  event, no host wait)::

    stream = cache.start_load(match, slots, layered=True)          # scheduler
    await stream.launched()
    send_step(tail_tokens, load=stream.layered_load())             # the engine's own channel
    ...                                                            # rank r, before layer l:
    worker.wait_layer(step.load, l)                                #   RankWorkerThread: blocking
    result = await stream.finish()                                 # scheduler, after the step
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aiokv.results import Match
from aiokv.stream import LoadStream

from .specs import LayeredLoad
from .transfers import _STREAM

if TYPE_CHECKING:
    from aiokv.manager import CacheManager

    from .transfers import GroupTransfers


class TPLoadStream(LoadStream):
    """A load stream over rank workers (created by ``TPCache.start_load``)."""

    def __init__(
        self,
        manager: CacheManager,
        transfers: GroupTransfers,
        match: Match,
        slots: torch.Tensor,
        from_token: int,
        layered: bool,
    ) -> None:
        self._group_transfers = transfers
        self.layered = layered
        """Whether the ranks copy layer by layer."""
        # The base class's mark() begins the stream on the ranks (each records its own mark then),
        # and the loader task it creates carries the stream's id into every LOAD spec it launches.
        with transfers.streaming():
            super().__init__(manager, match, slots, from_token, layered)
            scope = _STREAM.get()
            assert scope is not None  # set by streaming() for this construction
            self._stream_id = scope.stream  # numbered by the base class's mark()
        self._epoch = transfers.group.epoch

    @property
    def stream_id(self) -> int:
        """This stream's id in its rank group (> 0), for the engine's step message: each rank's
        ``RankWorker.begin_stream(stream_id, epoch)`` records its mark at the start of that step.

        0 when the stream has no id: it began while the group was closing, or after the group ran
        out of ids (``2**64 - 1`` streams); its copies are then ordered at their launch on every
        rank, and announcing it does nothing. Ids are unique within a group only: announce them
        with :attr:`epoch`.
        """
        return self._stream_id

    @property
    def epoch(self) -> int:
        """The pool epoch of the rank group this stream runs on (what ranks check an announced
        :attr:`stream_id` against: another manager numbers its streams from 1 again)."""
        return self._epoch

    def layered_load(self) -> LayeredLoad:
        """The pool epoch and the job ids of this stream's copies, for the ranks' ``wait_layer``.

        Call after :meth:`launched` (the set of copies is fixed then). Copies that failed before
        they were sent are left out (their layers never land; ``finish`` counts them) and mark the
        value ``unsent``: the ranks' ``wait_layer`` then answers False (it answered True for every
        layer of a stream none of whose copies was sent, a rank missing at its start). Raises
        ``RuntimeError`` before ``launched()`` or for a stream that is not layered.
        """
        if not self.layered:
            raise RuntimeError("layered_load() of a stream started without layered=True")
        if not self._loader.done():
            raise RuntimeError("layered_load() before launched(): the set of copies is not fixed yet")
        ids = [self._group_transfers.job_id(copy) for _, copy, _, _ in self._unique_copies()]
        jobs = tuple(sorted(j for j in ids if j is not None))
        return LayeredLoad(self._group_transfers.group.epoch, jobs, unsent=len(jobs) < len(ids))
