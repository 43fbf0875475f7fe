"""The cost model: how fast each tier delivers and how fast the engine prefills, measured online.

Rates are moving averages (EWMA) of what whole calls achieved — bytes over the wall time of a
load's pool copies, of its disk reads — so concurrency inside a call counts as it should. The
engine's prefill time is given in the config (a rate), reported by the engine, or learned from the
claims of a :class:`aiokv.stream.LoadStream`. It is not linear in tokens: attention makes computing
``t`` tokens on top of a ``p``-token prefix cost about ``fixed + a·t + b·t·(p + t/2)``, and a rate
learned over short prefixes underprices a long prefix's recompute (1.2 s for 2.0 s at 32K on the
H200), so :class:`PrefillMeter` fits that curve from each call's tokens, time and prefix.
:meth:`CostModel.estimate` turns the meters into what a match would cost to load, to recompute,
and where a compute-or-load split would meet (:class:`PageCosts`: the claims' cost is a convex
quadratic in the pages computed, the load's a decreasing line).

The meters' state outlives the process in a rates file (:mod:`aiokv.rates_file`: its format,
checks, reading and writing); :class:`SavedRates` is what the cost model restores from it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

FIT_MIN_SAMPLES = 3
"""Observations a meter needs before it splits its time into a fixed part and a per-unit part."""
FIT_MIN_SPREAD = 0.1
"""Least spread of the observed amounts (standard deviation over mean) for that split: calls of one
size cannot tell a fixed cost from a slower rate."""
MIN_CALL_S = 1e-9
"""Shortest call time a meter takes (a nanosecond): below it, amount/seconds says nothing."""
MIN_CALL_AMOUNT = 1.0
"""Least amount a call a meter takes moves: a byte or a token. A saved line's mean amount below it
came from no calls; one of 1e-300 priced a page at inf and every estimate raised (review 114)."""
FIT_MIN_GROWTH = 0.01
"""Least part of the mean call's time that must scale with its amount for a line to be drawn."""
FIXED_MAX_S = 10.0
"""Largest fixed cost (and spread) a meter keeps or a rates file may hold, in seconds."""
MARGIN_FRACTION = 0.05
"""Stated part of the margin: a load or split expected to gain less than this fraction of the
recompute time (besides the measured spreads) is not worth its risk; recompute instead."""
TRIAL_AFTER_S = 60.0
"""A disk rate no read has refreshed for this long is stale: estimates with disk pages offer a trial
(:attr:`LoadEstimate.trial`) until a read comes back. Without it, a disk once measured slow (a cold
start, a busy device) had every later hit declined, so never measured again."""
TRIAL_SAMPLES = 8
"""Observations a disk meter needs, since it started (restored ones included) or since its last jump
(:data:`JUMP_RATIO`), before estimates with disk pages stop offering a trial. Fewer, its line can
rest on one call of another size: on the H200 a cold first 8K split, beside three plain loads of
one size, made a 0.18 s fixed part, and every later hit recomputed, never measured again. The
moving average (weight 0.3) leaves the first call 0.7^7 ≈ 0.08 of the moments by the 8th, a jump
0.3·0.7^7 ≈ 0.025. So at most 7 trial loads after a start, kept across restarts by the rates
file's count, and 7 after each jump."""
JUMP_RATIO = 2.0
"""A call slower than this times the meter's prediction for it is a jump (a busy device, a stall):
the count of :data:`TRIAL_SAMPLES` starts again from it. A disk that really became slower stops
jumping once its prediction catches up (each jump lifts the level by about a third or more), so
its trials end; a steady disk, fast or slow, has none after its first 7 calls."""

BOOT_CLOCK: int = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
"""The clock of :attr:`RateMeter.folded_ns`: one for every process of a boot, never set back."""


class RateMeter:
    """An exponentially weighted moving average of a rate (amount per second), and of the line
    ``seconds = fixed + amount / marginal`` through the same observations.

    ``rate`` is the moving average of amount/seconds per call (what is saved as the rate). Calls of
    different sizes (a claim of a page and one of a chunk; a load of 5 pages and one of 31) also
    tell a fixed cost per call (time to the first delivered byte, a launch's set-up) from the
    marginal rate: a weighted least-squares line over the moving moments of (amount, seconds),
    used by :meth:`seconds` once :data:`FIT_MIN_SAMPLES` calls of spread sizes were seen (or a
    saved line was restored). ``spread`` is the moving average of how far each call's time lay from
    what the meter predicted for it before it was folded: the margin of an estimate.

    ``samples`` counts the observations folded in (a restored meter keeps its count); ``listener``
    is called after each fold (the cache schedules saving the rates).
    """

    def __init__(self, weight: float = 0.3, initial: float | None = None) -> None:
        self._weight = weight
        self._initial = initial
        self._rate = initial
        self.samples = 0
        """Observations folded in so far (restored ones included)."""
        self.listener: Callable[[], None] | None = None
        self._moments: tuple[float, float, float, float] | None = None  # means of x, y, x², xy
        self._fitted = 0  # observations in the moments (not restored ones)
        self._spread: float | None = None
        self._line: tuple[float, float] | None = None  # line() as of the last change (when _line_ok)
        self._line_ok = False
        self._jumped_at = 0  # samples before the last jump was folded (0: none since the start)
        self.folded_ns: int | None = None
        """``CLOCK_BOOTTIME`` (ns, system-wide) of the last observation folded in; None when none was
        since the start or a reset (restored rates keep it): how new a save of the meter is."""

    def update(self, amount: float, seconds: float) -> None:
        """Fold in one observation; ignored when it carries no information."""
        if _informative(amount, seconds):
            self._fold(amount, seconds, self.seconds(amount))

    def _fold(self, amount: float, seconds: float, predicted: float | None) -> None:
        """Fold in a checked observation whose time was ``predicted`` before it (None: no rate yet)."""
        if predicted is not None:
            error = min(abs(seconds - predicted), FIXED_MAX_S)
            self._spread = error if self._spread is None else self._ewma(self._spread, error)
            if seconds > JUMP_RATIO * predicted:
                self._jumped_at = self.samples
        rate = amount / seconds
        self._rate = rate if self._rate is None else self._ewma(self._rate, rate)
        self._moments = self._ewma_all(self._moments, (amount, seconds, amount * amount, amount * seconds))
        self._fitted += 1
        self._line_ok = False
        self.samples += 1
        self.folded_ns = time.clock_gettime_ns(BOOT_CLOCK)
        if self.listener is not None:
            self.listener()

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self._weight) * old + self._weight * new

    def _ewma_all(self, old: tuple[float, float, float, float] | None,
                  new: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
        if old is None:
            return new
        return (self._ewma(old[0], new[0]), self._ewma(old[1], new[1]), self._ewma(old[2], new[2]),
                self._ewma(old[3], new[3]))

    def restore(self, rate: float, samples: int, saved: SavedFit | None = None) -> None:
        """Take a saved state (already checked and clamped): the moving averages go on from it.
        ``saved``: the line's moments and the spread saved with the rate (version 3 files), so a
        line forms across restarts from calls that each process saw few of."""
        self._rate = rate
        self.samples = samples
        self._jumped_at = 0  # not saved: a restored meter is judged by its count alone
        if saved is not None:
            self._spread = saved.spread
            if saved.moments is not None:
                self._moments, self._fitted = saved.moments, saved.fitted
        self._line_ok = False

    def reset(self) -> None:
        """Back to the state it was built with: what it measured belongs to another device."""
        self._rate = self._initial
        self.samples = 0
        self._moments = None
        self._fitted = 0
        self._line_ok = False
        self._spread = None
        self._jumped_at = 0
        self.folded_ns = None

    @property
    def settled(self) -> int:
        """Observations folded since the meter started (restored ones included) or since its last
        jump, that one included: a call slower than :data:`JUMP_RATIO` times its prediction."""
        return self.samples - self._jumped_at

    @property
    def rate(self) -> float | None:
        """The current estimate, or None before the first observation."""
        return self._rate

    def line(self) -> tuple[float, float] | None:
        """``(fixed seconds, marginal rate)`` of the calls seen, or None while it cannot be told.

        The least-squares line through the moving moments, its fixed part clipped to
        ``[0, FIXED_MAX_S]`` and the line kept through the mean call (a negative fixed part is
        noise: the calls then scale with their size). None before :data:`FIT_MIN_SAMPLES` calls
        of spread sizes (restored ones included), or when the time does not grow with the amount.
        """
        if not self._line_ok:
            self._line, self._line_ok = self._fit(), True
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        m = self._moments
        if m is not None and self._fitted >= FIT_MIN_SAMPLES:
            mx, my, mxx, mxy = m
            var = mxx - mx * mx
            if var > (FIT_MIN_SPREAD * mx) ** 2:
                slope = (mxy - mx * my) / var
                # The time must grow with the amount by more than rounding noise: calls of spread
                # sizes that took equal times (times rounded to the ms) left a slope of ~1e-19,
                # a fixed part equal to the mean time, and a division by zero on every later use.
                if slope * mx > FIT_MIN_GROWTH * my:
                    # Below my by at least that growth; clipped, the line still passes the mean call.
                    fixed = min(max(my - slope * mx, 0.0), FIXED_MAX_S)
                    return fixed, mx / (my - fixed)
        return None

    @property
    def fixed(self) -> float:
        """Seconds every call pays whatever its size (0 while :meth:`line` cannot tell)."""
        line = self.line()
        return 0.0 if line is None else line[0]

    @property
    def marginal(self) -> float | None:
        """Amount per second beyond the fixed part (:attr:`rate` while :meth:`line` cannot tell)."""
        line = self.line()
        return self._rate if line is None else line[1]

    @property
    def spread(self) -> float:
        """Moving average of the gap between each call's time and its prediction, in seconds (0: none yet)."""
        return 0.0 if self._spread is None else self._spread

    def seconds(self, amount: float) -> float | None:
        """Predicted seconds of a call moving ``amount`` (0 for nothing); None before any rate."""
        marginal = self.marginal
        if marginal is None:
            return None
        return 0.0 if amount <= 0 else self.fixed + amount / marginal

    def saved_fit(self) -> SavedFit | None:
        """What :func:`aiokv.rates_file.encode_rates` keeps besides the rate (None: nothing yet)."""
        if self._moments is None and self._spread is None:
            return None
        return SavedFit(self._moments, self._fitted, self._spread)


MOMENT_BOUNDS = (1e15, 3600.0)
"""Largest mean amount (bytes or tokens) and mean call time (seconds) a meter folds in, and a
saved line may hold."""


def _informative(amount: float, seconds: float) -> bool:
    """Whether a call of ``amount`` in ``seconds`` tells a meter something (NaN does not)."""
    # Beyond MOMENT_BOUNDS (a PB, an hour) the moments' squares and products could overflow
    # and every later estimate with them: such a call tells nothing real either.
    max_amount, max_seconds = MOMENT_BOUNDS
    return MIN_CALL_AMOUNT <= amount <= max_amount and MIN_CALL_S <= seconds <= max_seconds


@dataclass(frozen=True)
class SavedFit:
    """A meter's line state as saved: the moving means of amount, seconds, amount² and
    amount·seconds over ``fitted`` calls (None: no call yet), and the spread (None: none yet);
    for the prefill meter also the moving means of q, q², amount·q and q·seconds, with
    q = tokens·(prefix + tokens/2) (``curve``; None: none)."""

    moments: tuple[float, float, float, float] | None
    fitted: int
    spread: float | None
    curve: tuple[float, float, float, float] | None = None


@dataclass(frozen=True)
class SavedRates:
    """What :func:`aiokv.rates_file.decode_rates` accepted: ``(rate, samples)`` by meter name,
    clamped, and each meter's line moments and spread where the file has them (and the prefill
    curve's). Defined here, with :class:`SavedFit`, as :meth:`CostModel.restore` takes it (the
    file module imports this one, never the reverse)."""

    rates: dict[str, tuple[float, int]]
    clamped: tuple[str, ...]
    """Names of the rates that lay outside :data:`aiokv.rates_file.RATE_BOUNDS` (a spread outside
    ``[0, FIXED_MAX_S]`` counts as its meter's)."""
    fits: dict[str, SavedFit] = dataclasses.field(default_factory=dict)


FIT_MIN_INDEPENDENCE = 1e-3
"""Least part of the attention term's variance (over the calls' moving window) that the calls'
sizes must leave unexplained (1 - correlation², after the fixed part is taken out where it can be)
for the prefill meter to tell attention's quadratic cost from a per-token one."""


FIT_MIN_ATTENTION = 1e-6
"""Least part of the mean call's time the prefill meter's attention term must take to be told from
rounding noise (calls that scale linearly leave a ``b`` of ~1e-24 s/token²)."""


PREFILL_WEIGHT = 0.1
"""The prefill meter's moving-average weight: a longer memory than the tiers' (0.3), as a curve of
three terms extrapolated to long prefixes needs more calls than a line (with 2% noise on the calls,
a 32K recompute priced from calls over prefixes under 4K erred up to 13% at 0.3, 3% at 0.1), and an
engine's prefill speed does not drift as a shared disk's does."""


class PrefillMeter(RateMeter):
    """The engine's prefill time, attention included: ``seconds = fixed + a·t + b·t·(p + t/2)``
    for a call computing ``t`` tokens on top of a ``p``-token prefix already in the KV cache.

    Attention makes each token's cost grow with its position: token i costs about ``a + b·i``,
    so a call over positions ``[p, p + t)`` pays ``a·t + b·((p+t)² - p²)/2``, which is the
    formula above; chunks of one prompt add up to ``a·n + b·n²/2`` whatever the chunking (plus
    their per-call fixed costs). A rate of tokens per second cannot price a long prefix's
    recompute from calls over short ones: on the H200 (8B shape) such a rate priced a 32K
    recompute at 1.2 s while it took 2.0 s.

    ``(fixed, a, b)`` is the weighted least-squares fit over moving moments of ``(t, q, seconds)``
    with ``q = t·(p + t/2)`` (the same weights as :class:`RateMeter`'s line), constrained to
    ``0 <= fixed <= FIXED_MAX_S``, ``a >= 0``, ``b >= 0``. Calls of one size cannot tell the fixed
    part from ``a`` (it is then 0, as a rate is); calls whose ``q`` their size explains (one prefix,
    or :data:`FIT_MIN_INDEPENDENCE`) cannot tell ``b``, nor can a fit whose best ``b`` is 0: then
    the meter prices as :class:`RateMeter` does (its line, else its average rate), with ``b = 0``.
    :meth:`line`, :attr:`fixed` and :attr:`marginal` keep describing that linear line;
    :meth:`coefficients`, :meth:`seconds` and :meth:`compute_seconds` use the curve.
    """

    def __init__(self, weight: float = PREFILL_WEIGHT, initial: float | None = None) -> None:
        super().__init__(weight, initial)
        self._curve_moments: tuple[float, float, float, float] | None = None  # means of q, q², tq, qy
        self._curve: tuple[float, float, float] | None = None  # curve() as of the last change
        self._curve_ok = False

    def update(self, amount: float, seconds: float, prefix: float = 0.0) -> None:
        """Fold in a call of ``amount`` tokens on top of ``prefix`` tokens that took ``seconds``;
        ignored when it carries no information (or a prefix outside ``[0, MOMENT_BOUNDS[0]]``)."""
        if not (_informative(amount, seconds) and 0 <= prefix <= MOMENT_BOUNDS[0]):
            return
        predicted = self.seconds(amount, prefix)
        q = amount * (prefix + amount / 2)
        self._curve_moments = self._ewma_all(self._curve_moments, (q, q * q, amount * q, q * seconds))
        self._curve_ok = False
        self._fold(amount, seconds, predicted)  # (calls the listener last)

    def restore(self, rate: float, samples: int, saved: SavedFit | None = None) -> None:
        """As :meth:`RateMeter.restore`; moments saved without the curve's (a linear meter's) are
        not taken: the two sets must describe the same calls."""
        if saved is not None and saved.moments is not None and saved.curve is None:
            saved = dataclasses.replace(saved, moments=None, fitted=0)
        super().restore(rate, samples, saved)
        if saved is not None and saved.curve is not None and saved.moments is not None:
            self._curve_moments = saved.curve
        self._curve_ok = False

    def reset(self) -> None:
        super().reset()
        self._curve_moments = None
        self._curve_ok = False

    def saved_fit(self) -> SavedFit | None:
        fit = super().saved_fit()
        return None if fit is None else dataclasses.replace(fit, curve=self._curve_moments)

    def curve(self) -> tuple[float, float, float] | None:
        """``(fixed s, a s/token, b s/token²)`` with ``b > 0``, or None while the calls cannot
        tell attention's quadratic term (:meth:`coefficients` then falls back to the line)."""
        if not self._curve_ok:
            self._curve, self._curve_ok = self._fit_curve(), True
        return self._curve

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(fixed, a, b)`` the meter prices with: the curve, else the line (``b = 0``), else the
        average rate (``fixed = b = 0``); None before any rate."""
        curve = self.curve()
        if curve is not None:
            return curve
        line = self.line()
        if line is not None:
            return line[0], 1 / line[1], 0.0
        return None if self._rate is None else (0.0, 1 / self._rate, 0.0)

    def seconds(self, amount: float, prefix: float = 0.0) -> float | None:
        """Predicted seconds of one call computing ``amount`` tokens on top of ``prefix`` tokens
        (0 for nothing); None before any rate."""
        return self.compute_seconds(prefix, prefix + amount) if amount > 0 else (
            None if self.coefficients() is None else 0.0)

    def compute_seconds(self, start: float, end: float, calls: float = 1.0) -> float | None:
        """Seconds to compute tokens ``[start, end)`` of a prompt (the earlier ones in the KV cache)
        in ``calls`` calls, each paying the fixed part: ``calls·fixed + a·n + b·n·(start + end)/2``
        with ``n = end - start``, whatever the chunking; 0 for nothing, None before any rate."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        n = end - start
        if n <= 0:
            return 0.0
        fixed, a, b = coefficients
        return calls * fixed + n * (a + b * (start + end) / 2)

    def _fit_curve(self) -> tuple[float, float, float] | None:
        m, c = self._moments, self._curve_moments
        if m is None or c is None or self._fitted < FIT_MIN_SAMPLES:
            return None
        mt, my, mtt, mty = m
        mq, mqq, mtq, mqy = c
        # Features scaled by their means (u = t/E[t], v = q/E[q]): the normal equations' entries
        # are then of order 1 whatever the units, so the thresholds below are relative.
        uu, vv, uv = mtt / (mt * mt), mqq / (mq * mq), mtq / (mt * mq)
        uy, vy = mty / mt, mqy / mq
        var_u, var_v, cov = uu - 1, vv - 1, uv - 1
        sized = var_u > FIT_MIN_SPREAD**2  # calls of spread sizes: a fixed part can be told
        if sized:
            told = var_u * var_v - cov * cov > FIT_MIN_INDEPENDENCE * var_u * var_v
        else:
            told = uu * vv - uv * uv > FIT_MIN_INDEPENDENCE * uu * vv
        if not told:
            return None
        # Weighted least squares over (1, u, v) with bounds: the best of the solutions on each face
        # of the box (fixed free, at 0 or at FIXED_MAX_S; a and b free or at 0). The objective
        # drops the constant E[y²] (the moments do not keep it): it compares candidates only.
        gram = ((1.0, 1.0, 1.0), (1.0, uu, uv), (1.0, uv, vv))
        rhs = (my, uy, vy)
        best: tuple[float, tuple[float, float, float]] | None = None
        for fixed_at in ((None, 0.0, FIXED_MAX_S) if sized else (0.0,)):
            for a_free, b_free in ((True, True), (True, False), (False, True), (False, False)):
                theta = _bounded_solve(gram, rhs, (fixed_at, None if a_free else 0.0, None if b_free else 0.0))
                if theta is None or not (0 <= theta[0] <= FIXED_MAX_S and theta[1] >= 0 and theta[2] >= 0):
                    continue
                cost = sum(theta[i] * gram[i][j] * theta[j] for i in range(3) for j in range(3)) - 2 * sum(
                    theta[i] * rhs[i] for i in range(3))
                if best is None or cost < best[0]:
                    best = cost, theta
                if a_free and b_free and (fixed_at is None or not sized):
                    break  # the least over the whole box is feasible: every face's costs at least as much
            else:
                continue
            break
        if best is None:
            return None
        fixed, alpha, beta = best[1]
        # b clipped at 0 is the line's case. The curve must grow with the calls by more than rounding
        # noise, and pass near the mean call (the fit's constraints may pull it off; a planted file's
        # moments no calls produced may too): else the line prices.
        if (beta <= FIT_MIN_ATTENTION * my or alpha + beta <= FIT_MIN_GROWTH * my
                or not 0.5 * my <= fixed + alpha + beta <= 2 * my):
            return None
        return fixed, alpha / mt, beta / mq


def _bounded_solve(gram: tuple[tuple[float, float, float], ...], rhs: tuple[float, float, float],
                   held: tuple[float | None, float | None, float | None]) -> tuple[float, float, float] | None:
    """The least-squares solution of ``gram·θ = rhs`` with the components ``held`` at their
    values (None: free); None when the free part is singular (a relative pivot below 1e-12)."""
    free = [i for i in range(3) if held[i] is None]
    theta = [0.0 if h is None else h for h in held]
    # The free rows of the normal equations, the held components moved to the right-hand side.
    rows = [[gram[i][j] for j in free] + [rhs[i] - sum(gram[i][j] * theta[j] for j in range(3) if j not in free)]
            for i in free]
    n = len(free)
    for col in range(n):  # Gaussian elimination with partial pivoting (at most 3x3)
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * max(1.0, abs(gram[free[col]][free[col]])):
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col], strict=True)]
    for col in reversed(range(n)):
        value = rows[col][n] - sum(rows[col][j] * theta[free[j]] for j in range(col + 1, n))
        theta[free[col]] = value / rows[col][col]
    return theta[0], theta[1], theta[2]


@dataclass(frozen=True)
class PageCosts:
    """Per-page and per-call costs of one match (seconds), from which every plan is priced.

    Pages ``[0, pool_pages)`` are in the pool, ``[pool_pages, pool_pages + disk_pages)`` on disk.
    A load from the back of pages ``[k, P)`` takes :attr:`load_fixed` plus ``copy`` per page plus
    ``read`` per disk page; computing ``[0, k)`` in claims takes ``claim_fixed`` per claim plus
    ``compute·k + attend·k²/2`` (attention: page i costs ``compute + attend·(i + 1/2)``, whatever
    the chunking); recomputing all of it in the engine's own prefill pass
    ``compute·P + attend·P²/2`` (that pass's fixed cost is paid with or without the cache).
    """

    copy: float
    read: float
    compute: float
    copy_fixed: float
    """A load's copies: set-up before the first page lands (pool meter's fixed part)."""
    read_fixed: float
    """A load's disk reads: latency of the first read beyond its bytes (disk meter's fixed part)."""
    claim_fixed: float
    """A claim of a split: the engine's per-call prefill cost (prefill meter's fixed part)."""
    pool_pages: int
    disk_pages: int
    page_tokens: int
    copy_spread: float = 0.0
    read_spread: float = 0.0
    claim_spread: float = 0.0
    claim_pages: int = 0
    """Pages the engine claims per call at most (its prefill chunk); 0: all in one claim. Computing
    k pages then takes ``(k + n - 1) / n`` claims, a line at or above ``ceil(k / n)``."""
    attend: float = 0.0
    """Attention's growth of a page's compute cost per page of prefix before it (the prefill
    meter's ``b`` times page_tokens²); ``compute`` already includes the pages before page 0."""

    @property
    def pages(self) -> int:
        return self.pool_pages + self.disk_pages

    @property
    def load_fixed(self) -> float:
        """Fixed cost of a load of any pages from the back (the last page is a disk page if any is)."""
        return self.copy_fixed + (self.read_fixed if self.disk_pages else 0.0)

    def load(self, k: int) -> float:
        """Loading pages ``[k, P)`` from the back (0 for none)."""
        n = self.pages - k
        if n <= 0:
            return 0.0
        disk = min(n, self.disk_pages)
        return self.load_fixed + n * self.copy + disk * self.read

    def _claims_line(self) -> tuple[float, float]:
        """Computing k > 0 pages in claims: ``base + k * slope`` seconds."""
        n = self.claim_pages
        if n <= 0:
            return self.claim_fixed, self.compute
        return self.claim_fixed * (1 - 1 / n), self.compute + self.claim_fixed / n

    def compute_seconds(self, first: float, end: float) -> float:
        """Computing pages ``[first, end)`` (fractions of a page allowed), per-call costs aside."""
        n = end - first
        return 0.0 if n <= 0 else n * (self.compute + self.attend * (first + end) / 2)

    def ready(self, k: int) -> float:
        """When the prefix is in with the fronts meeting at page ``k``: compute ``[0, k)``, load the rest."""
        if k >= self.pages:
            return self.compute_seconds(0, self.pages)  # no load: the engine's own pass, no claims
        base, slope = self._claims_line()
        compute = 0.0 if k <= 0 else base + k * (slope + self.attend * k / 2)
        return max(compute, self.load(k))

    def best_split(self) -> int:
        """The page where the fronts should meet (the least k of the least :meth:`ready`), in O(1).

        On ``[1, P-1]`` ``ready`` is the max of an increasing convex quadratic (the claims) and a
        decreasing two-piece line (the load: disk pages, then pool pages), so its least value over
        integers lies next to where they cross: on each piece one root of a quadratic. The ends
        (load all, recompute all) are priced apart.
        """
        p = self.pages
        best_k, best = p, self.ready(p)
        candidates = [0]
        if p >= 2:
            claims_base, c = self._claims_line()
            a, b, h = self.copy, self.read, self.attend / 2
            pool, disk = self.pool_pages, self.disk_pages
            # On the disk piece (k >= pool): claims_base + k c + h k² = load_fixed + (P - k)(a + b).
            x = _crossing(h, c + a + b, claims_base - self.load_fixed - p * (a + b)) if disk else -math.inf
            if x < pool:  # on the pool piece: ... = load_fixed + disk (a + b) + (pool - k) a
                x = _crossing(h, c + a, claims_base - self.load_fixed - disk * (a + b) - pool * a)
            x = min(max(x, 1.0), p - 1.0)
            candidates += [math.ceil(x), math.floor(x)]
        for k in candidates:  # ties: the least k (the most loaded)
            ready = self.ready(k)
            if ready < best or (ready == best and k < best_k):
                best_k, best = k, ready
        return best_k

    def suffix(self, first: int) -> PageCosts:
        """The costs of pages ``[first, P)`` alone (the engine holds the others, which each of
        these pages attends over)."""
        first = min(max(first, 0), self.pages)
        pool = max(self.pool_pages - first, 0)
        return dataclasses.replace(self, pool_pages=pool, disk_pages=self.pages - first - pool,
                                   compute=self.compute + self.attend * first)

    def estimate(self, pool_seconds: float | None = 0.0) -> LoadEstimate:
        """The :class:`LoadEstimate` of these pages (``pool_seconds``: None when the copy rate is
        unknown and counted free, else priced here)."""
        p, disk = self.pages, self.disk_pages
        k = self.best_split()
        ready = self.ready(k)
        claims = 0 < k < p
        recompute = self.compute_seconds(0, p)
        margin = (MARGIN_FRACTION * recompute + self.copy_spread + (self.read_spread if disk else 0.0)
                  + (self.claim_spread if claims else 0.0))
        # A split proper is not exposed to the load's rates: a slower read or copy only moves the
        # meeting point back (the engine computes more), towards recomputing plus the claims' cost.
        # Its margin is the stated fraction and the claims' own spread; a plain load keeps the whole.
        split_margin = MARGIN_FRACTION * recompute + self.claim_spread if claims else margin
        claims_base, slope = self._claims_line()
        overhead = (self.load_fixed if k < p else 0.0) + (claims_base + k * (slope - self.compute) if claims else 0.0)
        return LoadEstimate(
            None if pool_seconds is None else 0.0 if p == 0 else self.copy_fixed + p * self.copy,
            0.0 if disk == 0 else self.read_fixed + disk * self.read,
            recompute, k * self.page_tokens, ready, overhead, margin, self, split_margin_seconds=split_margin)


def _crossing(h: float, slope: float, offset: float) -> float:
    """The greater root of ``h x² + slope x + offset`` (``h, slope >= 0``): where an increasing
    convex quadratic (the claims) meets a decreasing line (the load), their difference being that
    polynomial. -inf when the claims lie above the line everywhere, inf when below everywhere."""
    disc = slope * slope - 4 * h * offset
    if disc < 0:
        return -math.inf  # (h > 0 and offset > 0: above everywhere)
    den = slope + math.sqrt(disc)
    if den <= 0:  # slope = 0 and h·offset = 0: flat, or a double root at 0
        return 0.0 if offset == 0 else -math.inf if offset > 0 else math.inf
    # -2·offset / (slope + √disc): no cancellation, and -offset/slope as h -> 0 (the line's case).
    return -2 * offset / den


@dataclass(frozen=True)
class LoadEstimate:
    """What loading a match would cost, by the rates measured so far (None: not known yet)."""

    pool_seconds: float | None
    """Copying its pool pages into the KV buffer (the copies' fixed cost included)."""
    disk_seconds: float | None
    """Reading its disk pages into the pool (before they are copied; the first read's latency included)."""
    recompute_seconds: float | None
    """Prefilling its tokens instead."""
    split_token: int | None
    """Where a compute-or-load split is expected to meet: compute ``[0, split)``, load the rest."""
    split_seconds: float | None = None
    """When the prefix is expected in with that split (fixed costs included)."""
    overhead_seconds: float = 0.0
    """Fixed costs in that split (the load's first-byte latency and set-up, the claims' per-call cost)."""
    margin_seconds: float = 0.0
    """Gain a load or split must beat: :data:`MARGIN_FRACTION` of recomputing plus the meters' spreads."""
    costs: PageCosts | None = None
    """The per-page costs behind it (None while a rate is unknown), to price part of the match."""
    trial: bool = False
    """The disk meter is no basis yet for declining a split: fewer than :data:`TRIAL_SAMPLES`
    observations since its start or a jump (:attr:`RateMeter.settled`), or stale
    (:data:`TRIAL_AFTER_S` without a read). A split re-measures it at little risk (the engine
    computes from the front meanwhile, and the fronts meet wherever the disk really is: at worst
    recomputing plus the split's fixed costs).
    :attr:`split_pays` then says None (not known); :attr:`worth_loading` keeps its verdict, as a
    plain load could lose the whole difference."""
    split_margin_seconds: float | None = None
    """Gain a split proper (the engine claims a front, the load brings the back) must beat: the
    stated fraction of recomputing and the claims' spread, without the load's spreads (a slower
    load moves the meeting point, it cannot make the split lose more than the claims cost). None:
    :attr:`margin_seconds`, as for a plain load."""

    @property
    def load_seconds(self) -> float | None:
        """Loading the whole match (disk reads and copies overlap: the slower of the two bounds it)."""
        if self.pool_seconds is None or self.disk_seconds is None:
            return None
        return max(self.pool_seconds, self.disk_seconds)

    @property
    def worth_loading(self) -> bool | None:
        """Whether a plain load is expected to beat recomputing by more than the margin (None: not known yet).

        False as soon as one known part alone (the disk reads, say) takes as long as recomputing
        less the margin, even while the other's rate is unknown: aiokv never picks a load it expects
        to lose.
        """
        compute = self.recompute_seconds
        if compute is None:
            return None
        bar = compute - self.margin_seconds
        known = [part for part in (self.pool_seconds, self.disk_seconds) if part is not None]
        if any(part >= bar for part in known):
            return False
        load = self.load_seconds
        return None if load is None else load < bar

    @property
    def split_margin(self) -> float:
        """The margin :attr:`split_pays` applies (:attr:`split_margin_seconds`, else the whole one)."""
        return self.margin_seconds if self.split_margin_seconds is None else self.split_margin_seconds

    @property
    def split_pays(self) -> bool | None:
        """Whether the best split (a plain load included: split 0) beats recomputing by more than
        the margin (None: not known yet, or a :attr:`trial` is due). False: recompute instead."""
        if self.split_seconds is None or self.recompute_seconds is None or self.trial:
            return None
        return self.split_seconds < self.recompute_seconds - self.split_margin


class CostModel:
    """Per-tier delivered throughput and the engine's prefill rate, with estimates built on them."""

    def __init__(self, prefill_tokens_per_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = RateMeter()
        """Bytes per second copied from the pool into the KV buffer."""
        self.disk = RateMeter()
        """Bytes per second read from disk into the pool."""
        self.prefill = PrefillMeter(initial=prefill_tokens_per_s)
        """The engine's prefill time by tokens and prefix (a configured rate is its prior)."""
        self._clock = clock
        self._disk_seen = (self.disk.samples, clock())
        """The disk meter's sample count as last seen, and when it last changed or a trial was offered."""

    def meters(self) -> dict[str, RateMeter]:
        """The meters by the names they are saved under (the keys of
        :data:`aiokv.rates_file.RATE_BOUNDS`)."""
        return {"pool": self.pool, "disk": self.disk, "prefill": self.prefill}

    def folded_ns(self) -> int | None:
        """``CLOCK_BOOTTIME`` (ns) of the last observation any meter folded in (None: none since the
        start or a reset). A cache saves its rates only after a fold, so a later cache's saved
        rates always hold a later one: how a late save is told from a newer file."""
        folded = [m.folded_ns for m in self.meters().values() if m.folded_ns is not None]
        return max(folded, default=None)

    def reset(self) -> None:
        """Forget every measurement (the configured prefill rate stays)."""
        for meter in self.meters().values():
            meter.reset()

    def restore(self, saved: SavedRates, keep: Callable[[str], bool] = lambda name: False) -> None:
        """Take what :func:`aiokv.rates_file.decode_rates` accepted, except the meters ``keep`` names."""
        meters = self.meters()
        for name, (rate, samples) in saved.rates.items():
            if not keep(name):
                meters[name].restore(rate, samples, saved.fits.get(name))

    def estimate(self, pool_pages: int, disk_pages: int, page_tokens: int, page_bytes: int,
                 prefix_tokens: int = 0) -> LoadEstimate:
        """Costs of a prefix of ``pool_pages`` pool pages followed by ``disk_pages`` disk pages,
        after ``prefix_tokens`` tokens the engine holds (which computing these pages attends over).

        Each tier's time is its fixed cost per call plus its bytes at the marginal rate
        (:meth:`RateMeter.line`; the average rate while the meter cannot tell them apart); the
        prefill's is :meth:`PrefillMeter.coefficients`' curve.
        """
        pool, disk, prefill = self.pool, self.disk, self.prefill
        pages = pool_pages + disk_pages
        copy = pool.seconds(pages * page_bytes)
        read = 0.0 if disk_pages == 0 else disk.seconds(disk_pages * page_bytes)
        coefficients = prefill.coefficients()
        recompute = prefill.compute_seconds(prefix_tokens, prefix_tokens + pages * page_tokens, calls=0)
        pool_rate, disk_rate = pool.marginal, disk.marginal
        # Pages reaching disk: their reads bound the load whatever the copies cost, so an unknown
        # copy rate counts as free there (the split is then the latest the load can meet).
        if not pages or coefficients is None or read is None or (pool_rate is None and not disk_pages):
            return LoadEstimate(copy, read, recompute, None)
        fixed, a, b = coefficients
        costs = PageCosts(
            copy=0.0 if pool_rate is None else page_bytes / pool_rate,
            read=0.0 if disk_rate is None else page_bytes / disk_rate,
            # A page at page index i of these costs (a + b·(prefix + (i + 1/2)·T))·T.
            compute=(a + b * prefix_tokens) * page_tokens,
            copy_fixed=0.0 if pool_rate is None else pool.fixed,
            read_fixed=disk.fixed if disk_pages else 0.0,
            claim_fixed=fixed,
            pool_pages=pool_pages, disk_pages=disk_pages, page_tokens=page_tokens,
            copy_spread=pool.spread, read_spread=disk.spread, claim_spread=prefill.spread,
            attend=b * page_tokens * page_tokens,
        )
        estimate = costs.estimate(None if copy is None else 0.0)
        return dataclasses.replace(estimate, trial=True) if disk_pages and self._trial_due() else estimate

    def _trial_due(self) -> bool:
        """Whether the disk meter is no basis yet for declining a split: unsettled (fewer than
        :data:`TRIAL_SAMPLES` observations since its start or its last jump) or stale
        (:data:`TRIAL_AFTER_S` without a read). Asking takes nothing: every estimate
        says so until reads change it (an engine's own ``estimate`` call to decide, or a stream's,
        must not use up the trial the engine would act on)."""
        now = self._clock()
        disk = self.disk
        samples, since = self._disk_seen
        if disk.samples != samples:
            self._disk_seen = (disk.samples, now)
            stale = False
        else:
            stale = now - since >= TRIAL_AFTER_S
        return stale or disk.settled < TRIAL_SAMPLES
