"""How many pages one loop turn launches: a load's or an offload's launch group.

A long transfer is launched in groups, one per loop turn, so that the loop keeps serving other
requests between them. Counted in pages alone (``CacheConfig.launch_pages``, sized for an 8B
model's 32 MiB pages), a hit of small pages is many turns: a 16-token block of an 8B model is
2 MiB, so a 32K-token hit was 1,024 groups, and on the CPU each group is also a round trip to the
copy thread (a CPU pool hit of 39 pages of 64 KiB took 34.6-39.0 ms in groups of 2 and 5.7-7.6 ms
in one group; docs/measurements.md). :class:`LaunchSizer` grows a group beyond ``launch_pages``
while the loop time its pages add fits ``launch_turn_s`` and its bytes fit ``launch_bytes``; a
group is never smaller than ``launch_pages``.

A group's loop time is a fixed cost (the launch wrappers, an event, the bookkeeping) plus a cost
per page (validation, index building). On the H200 the fixed cost is most of it: ~200 us a load
group whatever its size, ~20 us more a page (``tools/bench_launch.py --group-costs``), so a
budget on the time per page (the first version) kept every GPU group at the floor. The sizer
learns the fixed cost from groups of different sizes (the intercept of a moving least-squares
line of loop time against pages) and bounds what grows with the group: the newest group's time
less the fixed cost, per page, times the pages, within ``launch_turn_s``. Until a fixed cost is
known, and whenever the bound allows more, a group grows by at most what one turn's budget gives
were all of the newest group's time per page (to the nearest page): a wrong estimate costs one
group about ``launch_turn_s`` more than the last, and a slower newest group shrinks the next at
once (a stall, or the budget's bound, once the fixed cost is known; before, a group past the floor
that would not grow goes back to it). Every :data:`PROBE_EVERY`-th group is of another size, so
that the line keeps seeing spread sizes: a line bent by a spike, or a fixed cost that moved under
groups of one size, is refitted from it.

Where the fixed cost is large and noisy (0.7-2 ms a group, 5-10% noise, on a busy GPU host) sizes
a page apart cannot show a cost of 5-20 us a page, and the line kept such groups at the floor. A
probe from the floor is therefore weighed against the floor groups' moving mean time: when all of
its pages fit the budget with the floor groups' noise (their mean deviation) added, the next
probe's span doubles and comes a few groups later, and the probe's size is held: no later group
is smaller but a stall, until groups at it cost past the budget on average (or one of them four
times past it, which also cuts the span to what four turns give at its cost). A dear probe shrinks
the span to what a turn's budget gives at its cost a page. The floor groups' mean is kept current
(:data:`REFRESH_EVERY`): a fixed cost that fell left it high, and held dear pages for good. Two
floor groups in a row past the line relearn the fixed cost; where the line's pages were dear, the
relearned line's second size is the periodic probe's, not a group of dear pages at once.
``tools/sim_launches.py`` simulates it.
"""

from __future__ import annotations

import math

DEFAULT_LAUNCH_BYTES = 64 << 20
"""``CacheConfig.launch_bytes``: an 8B model's two 32 MiB pages, what ``launch_pages`` gave it."""

DEFAULT_LAUNCH_TURN_S = 250e-6
"""``CacheConfig.launch_turn_s``: the loop time a group's pages may add to its fixed launch cost,
a fifth of the loop-lag budget (p99 1.2 ms). A CPU group hands its pages to the copy thread in
microseconds; an H200 load group of 2 MiB pages costs ~200 us plus ~20 us a page, so it grows to
about 12 pages a turn (~0.45 ms of the loop) instead of 2 (~0.24 ms a turn, six times the turns)."""

EWMA_WEIGHT = 0.5
"""Weight of the newest group in the moving sums the line is fitted to: a slow group (a first
launch that compiles, a GIL hand-over in the middle) shrinks the next groups at once and is
forgotten within a few groups."""

MIN_SPREAD = 0.1
"""The groups' sizes must spread by this share of their mean (standard deviation) for the fixed
cost to be read from them (the line's intercept); else the last one read is kept."""

LINE_OFF = 2.0
"""A stall (a group past the fixed cost plus a turn's budget a page) that took less than the line's
prediction for it divided by this is a sample of the line all the same: the line is off."""

PROBE_EVERY = 16
"""Every this many groups, one of another size: the floor for groups past the probes' span, else an
upward probe, the floor and the span (one page at first; within the byte cap). Groups of one size
say nothing new about the line: a spike that bent it (a fixed cost read as 0) kept every later
group at the floor, and a fixed cost that fell slowly under grown groups kept them growing to ~9
turns' budget (review 129). A probe's time refits the line only, and the group after it is sized
from the one before it, unless an upward probe showed its pages cheap (``LaunchSizer._weigh``).
It costs one group in this many a span past the budget, or one short group."""

BASE_WEIGHT = 0.25
"""Weight of the newest floor group in the moving mean of floor groups' time (and of their
deviation from it) that upward probes are weighed against, and of the newest group at or past the
held size in its moving cost per page: averaged over a few groups, as one group's noise is not."""

REFRESH_EVERY = 2 * PROBE_EVERY
"""After this many groups past the floor recorded since the last floor group, the next group is
at the floor (a probe; asked again until one is recorded): the held size and upward probes are
weighed against the floor groups' mean time, which floor groups alone move. With every probe
upward (a span past the held size) none came, a fixed cost that fell left the mean high, the held
groups' pages looked free, and 10 pages of 120 us (4.8 turns' budget) stayed for good (simulated);
under a paced offload, floor probes it queued and never recorded left it so for 50 groups."""

HOLD_PROBE_EVERY = PROBE_EVERY // 4
"""After an upward probe that showed its pages cheap, the next probe comes this many groups later:
each such probe doubles the span (1, 2, 4, ... pages past the floor), so a regime where 50 pages
fit is reached in a few dozen groups instead of a few hundred."""


class LaunchSizer:
    """Pages per launch group for one kind of transfer (loads or offloads) of one manager.

    ``min_pages`` is the floor (``launch_pages``); ``max_bytes // page_bytes`` the ceiling (at least
    the floor); ``turn_s`` the loop time a group's pages may add to its fixed cost (0: groups stay
    at the floor). Used from the loop thread only: :meth:`pages` before a group's launch,
    :meth:`record` after it with the loop time the group took (validation, the launch call, the
    bookkeeping).
    """

    __slots__ = ("_base", "_ceiling", "_dev", "_extra_probe", "_fixed", "_floor", "_groups", "_held", "_held_cost",
                 "_last", "_probe_out", "_relearn", "_rises", "_slope", "_span", "_sums", "_turn_s", "_unfloored")

    def __init__(self, min_pages: int, max_bytes: int, turn_s: float, page_bytes: int) -> None:
        if min_pages <= 0 or max_bytes <= 0 or page_bytes <= 0 or not turn_s >= 0:
            raise ValueError(f"bad launch sizes: {min_pages} pages, {max_bytes} bytes, {turn_s} s, page {page_bytes}")
        self._floor = min_pages
        self._ceiling = max(min_pages, max_bytes // page_bytes)
        self._turn_s = turn_s
        self._last: tuple[int, float, bool] | None = None  # the newest group: pages, seconds (capped), stalled
        self._fixed: float | None = None  # a group's fixed loop time, once groups of several sizes gave it
        # Moving means of pages, seconds, pages², pages × seconds (the line's least squares).
        self._sums: list[float] | None = None
        self._slope = 0.0  # the line's seconds per page, with the fixed cost
        self._rises = 0  # floor groups in a row past the line itself (see record)
        self._relearn = False  # the line was dropped on a rise: its second size waits for a probe
        self._groups = 0  # groups sized by pages() (every PROBE_EVERY-th is a probe)
        self._probe_out = False  # the last pages() gave a probe: the next record() is its time
        self._extra_probe = 0  # the number of a group to probe besides every PROBE_EVERY-th (0: none)
        self._unfloored = 0  # groups past the floor recorded since the last floor group
        self._span = 1  # pages an upward probe (one from the floor) adds to the floor
        self._base: float | None = None  # moving mean of floor groups' seconds
        self._dev = 0.0  # moving mean of their absolute deviation from it (the groups' noise)
        self._held = min_pages  # a size an upward probe showed cheap: no group below it but a stall
        self._held_cost = 0.0  # moving mean of groups at the held size or past it: seconds past the
        # floor's mean per page past the floor

    def pages(self) -> int:
        """How many pages the next group launches."""
        # Counted here, not in record: a paced CUDA offload queues groups it never records (it
        # times only launched ones), and a count moved by record alone kept every queued group of
        # such an offload the probe's size (review 130).
        self._groups += 1
        last = self._last
        if last is None or self._turn_s <= 0:
            self._probe_out = False
            return self._floor
        if self._unfloored >= REFRESH_EVERY:
            # A floor group is owed (REFRESH_EVERY): a probe, until one is recorded.
            self._probe_out = True
            return self._floor
        size = self._size(last)
        self._probe_out = self._groups % PROBE_EVERY == 0 or self._groups == self._extra_probe
        if self._probe_out:
            # (Relearning, a page past the floor: the span was learned under the old fixed cost, and
            # a probe of it took 116 pages of 400 us once pages had turned dear.)
            up = min(self._floor + (1 if self._relearn else self._span), self._ceiling)
            return up if size < up else self._floor
        return size

    def _size(self, last: tuple[int, float, bool]) -> int:
        """The group size the newest group and the line give (no probe)."""
        pages, seconds, stalled = last
        if stalled:
            return self._floor
        if seconds <= 0:  # a clock too coarse to see the group: the byte ceiling bounds it
            return self._ceiling
        # Growth of at most one turn's budget over the newest group, were all of its time per page
        # (infinite for an infinite budget); and, once the fixed cost is known, the budget's bound.
        best = pages + self._turn_s * pages / seconds
        if math.isfinite(best):
            if self._relearn:  # (set only with the fixed cost dropped, cleared once one is read)
                # Relearning dear pages after a rise: the periodic probe gives the line its second
                # size. A group a page past the floor right away cost one extra group of dear pages
                # per relearn, and on a host whose preemptions put two floor groups in a row past
                # the line (45% of them 3-10 ms late: two spinners beside the suite on two cores)
                # that was one group in nine past the floor, not one in PROBE_EVERY (a launch-group
                # test failed on the H200 under 14 test processes; tools/sim_launches.py, busy).
                return self._floor
            if self._fixed is not None or pages <= self._floor:
                best = math.floor(best + 0.5)  # to the nearest page: 2.96 pages is a step of one
                # At least a page: a fixed cost past two turns' budget is no reason to stay put (the
                # bound below keeps a costly page out; at the floor, one larger group measures it).
                best = max(best, pages + 1)
            else:
                # Past the floor with no fixed cost known (none read yet: the probes' line was noise,
                # or sizes a page apart did not spread enough to read one): grow only by whole pages
                # that fit were all of the time per page, else back to the floor, which is safe and
                # spreads the sizes for the line. Rounded up and kept, noise crept groups a page at a
                # time past the budget for good (to 2,175 pages of 400 us each, simulated).
                best = math.floor(best)
                if best <= pages:
                    return self._floor
        if self._fixed is not None:
            per_page = self.per_page_s
            assert per_page is not None
            if per_page > 0:
                best = min(best, self._turn_s / per_page)
        return self._ceiling if best >= self._ceiling else max(self._held, int(best))

    def record(self, pages: int, seconds: float) -> None:
        """Fold a group of ``pages`` that held the loop ``seconds`` into the estimate."""
        if pages <= 0:
            return
        # A probe (the last pages() gave one) refits the line; the next group is sized from the
        # group before it.
        probe, self._probe_out = self._probe_out, False
        # Once the fixed cost is known, a group past it plus a turn's budget a page is a stall (a
        # compile, a page fault storm, a GIL hand-over): it sends the next groups to the floor, a few
        # fast ones bring them back, and it says nothing of the line. Before, a slow group only
        # keeps the next from growing (its step is small): a GPU's first groups, ~0.4 ms of fixed
        # cost on a busy host, are no stall.
        if not math.isfinite(seconds):  # no measurement (NaN) or no end (inf): a stall, not a sample
            if not probe:
                self._last = (pages, (self._fixed or 0.0) + self._turn_s * pages, True)
            return
        seconds = max(seconds, 0.0)
        # (A relearning probe refits the line only: weighed as an upward probe, noise past a turn's
        # budget showed its dear page cheap and doubled the span, and the next probe took 6 pages
        # of 400 us.)
        cheap = self._weigh(pages, seconds, probe and not self._relearn)
        stalled = False
        sample_s = seconds  # what the line learns from this group (a learned stall uncapped)
        if self._fixed is not None:
            limit = self._fixed + self._turn_s * pages
            line = self._fixed + self._slope * pages
            stalled = seconds >= limit
            if stalled and pages <= self._floor and seconds >= limit + self._slope * pages:
                # Past the line itself at the floor, where no group can shrink, twice in a row: the
                # fixed cost rose (a busy host) and every group would be a stall; relearn it. (Once
                # is a spike: relearning on it made a group past the budget, a probe, for nothing.)
                self._rises += 1
                if self._rises >= 2:
                    # Where the line's pages were dear (past a turn's budget each), a group a page
                    # past the floor could not have grown groups under the old fixed cost and will
                    # not under a higher one: the line's second size waits for the periodic probe.
                    self._relearn = self._slope > self._turn_s
                    self._fixed = self._sums = None
                    self._rises = 0
            else:
                self._rises = 0
            # A stall sends the next group to the floor and is no sample, unless it took less than
            # half what the line predicts: then the line is off, not the group. (Where pages cost
            # more than the budget every floor group is a stall; learning from none, a line a spike
            # had bent, a fixed cost read as 0 and pages dear, never came straight, review 129.)
            learned = not stalled or seconds * LINE_OFF < line or cheap  # (a line a spike bent)
            seconds = min(seconds, limit)
            if not learned:
                if not probe:
                    self._last = (pages, seconds, stalled)
                return
        if not probe:
            self._last = (pages, seconds, stalled)
        elif cheap:  # the probe's size was shown to fit: the next group grows from it
            self._last = (pages, sample_s, False)
        seconds = sample_s
        sample = (float(pages), seconds, float(pages * pages), pages * seconds)
        sums = self._sums
        if sums is None:
            self._sums = sums = list(sample)
        else:
            for i, value in enumerate(sample):
                sums[i] += EWMA_WEIGHT * (value - sums[i])
        mean_pages, mean_seconds, mean_squares, mean_products = sums
        spread = mean_squares - mean_pages * mean_pages
        if spread > (MIN_SPREAD * mean_pages) ** 2:
            slope = (mean_products - mean_pages * mean_seconds) / spread
            fixed = max(0.0, mean_seconds - slope * mean_pages)
            if fixed > seconds:
                # A fixed cost above the newest group's whole time: an old outlier (a first launch
                # that compiled) bent the line. Taken, pages looked free and groups stayed far past
                # the budget for good; the line starts over from the newest group.
                self._sums = list(sample)
            else:
                self._fixed, self._slope = fixed, max(0.0, slope)
                self._relearn = False

    def _weigh(self, pages: int, seconds: float, probe: bool) -> bool:
        """Weigh a group against the floor groups' mean time; True for an upward probe whose pages
        fit the turn's budget beyond the floor groups' noise (the held size grows to it)."""
        floor = self._floor
        base = self._base
        if pages == floor:
            self._unfloored = 0
            if base is None or seconds < base - self._turn_s - 2 * self._dev:
                # (Faster than the mean by more than a turn's budget beyond the noise: the fixed
                # cost fell, and weighed against the old mean the held groups' pages look free.)
                self._base = seconds
            else:
                self._base = base + BASE_WEIGHT * (seconds - base)
                self._dev += BASE_WEIGHT * (abs(seconds - base) - self._dev)
            return False
        if pages < floor:  # a transfer's last pages: no size to weigh
            return False
        self._unfloored += 1
        if base is None:
            return False
        if seconds < base - self._turn_s - 2 * self._dev:
            # More pages than the floor, faster than the floor groups by more than a turn's budget
            # beyond their noise: their mean is old (the fixed cost fell). No evidence either way;
            # the next group measures the floor.
            self._unfloored = REFRESH_EVERY
            return False
        # Seconds each page past the floor added to the floor groups' mean.
        cost = max(0.0, seconds - base) / (pages - floor)
        if not probe:
            if pages >= self._held > floor:
                # The held size stays while the groups at it fit the budget on average; one group
                # far past it (pages dearer now, a new regime) takes it down at once.
                self._held_cost += BASE_WEIGHT * (cost - self._held_cost)
                if cost * self._held > 4 * self._turn_s:
                    self._held = max(floor, min(self._held, int(self._turn_s / cost)))
                    # The span within what four turns' budget gives at this cost: left as it was,
                    # the next upward probe (a few groups later) took up to twice the old held
                    # size of the dearer pages (116 pages of 400 us, 185 turns' budget, simulated).
                    self._span = max(1, min(self._span, int(4 * self._turn_s / cost)))
                elif self._held_cost * self._held > self._turn_s:
                    self._held = max(floor, min(self._held, int(self._turn_s / self._held_cost)))
                    self._span = max(1, min(self._span, self._held - floor))
            return False
        # An upward probe. Its pages are cheap if, with the floor groups' noise added to what they
        # added, all of them fit the budget; believed only where that noise is within a turn's
        # budget (under more, one probe's luck held sizes of dear pages: 1.7% of groups past 4
        # turns' budget against 1.5%, simulated, tools/sim_launches.py).
        excess = seconds - base
        if self._dev <= self._turn_s and (excess + self._dev) * pages <= self._turn_s * (pages - floor):
            self._extra_probe = self._groups + HOLD_PROBE_EVERY
            self._span = max(1, min(2 * self._span, self._ceiling - floor))
            if pages > self._held:  # (within the ceiling: a group recorded larger than asked)
                self._held, self._held_cost = min(pages, self._ceiling), cost
            return True
        if excess > self._turn_s:
            # Dear: the next upward probe adds what a turn's budget gives at this cost a page.
            self._span = max(1, min(self._span, int(self._span * self._turn_s / excess)))
        return False

    @property
    def per_page_s(self) -> float | None:
        """The loop seconds each page of the newest group added to its fixed cost (all of its time
        per page while no fixed cost is known; None before the first group)."""
        last = self._last
        if last is None:
            return None
        pages, seconds, _ = last
        return max(0.0, seconds - (self._fixed or 0.0)) / pages
