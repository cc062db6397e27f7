"""Online step-cost model: seconds per engine step as a line in the tokens fed to it.

    time(tokens) = c0 + c1 * tokens

c0 is the fixed cost of a step (reading all weights once, launch and Python overhead);
c1 the marginal cost of one more token in the batch (compute). At a small batch c1 * tokens
is small next to c0 and extra verify tokens are nearly free; at a large batch the step is
compute bound and they are not. SmartSpec (arXiv 2406.14066) models the batch latency the
same way, as a linear function of the batched tokens.

The fit is exponentially weighted least squares over ``(tokens, seconds)`` samples, so the
model follows drift (other tenants, thermal state, a different prompt mix): sample i of n
has weight ``decay ** (n - 1 - i)``. Until ``min_samples`` samples have been seen the
priors are used. The slope is shrunk towards the prior slope with weight ``SLOPE_PRIOR``
(in tokens^2): when every sample has the same token count the slope is unidentifiable and
the prior slope is used, while a spread of a few tokens already lets the data dominate.

The line alone is not enough on real hardware: on a CPU a step of 2 tokens costs much more than
the slope fitted over prefill chunks says (small-M GEMMs run single-threaded), so a linear model
calls a low-acceptance draft a win when it loses. So each
measured token count also keeps its own EMA (exact counts up to ``EXACT_TOKENS``, then
quarter-octave buckets), and ``predict`` uses that measured cost once a bucket has
``bucket_min_samples`` samples, and the line elsewhere. The policy explores a K whose cost is
still unmeasured by choosing it (the line predicts it cheap), so the table fills exactly where
decisions are made.

The table is also keyed by the step's batch size when the caller knows it (``requests``: the
decoding requests of a step that carried no prefill chunk). Equal token counts are not equal
steps: 7 requests verifying 4 drafts each (35 tokens) and 2 requests plus a 25-token prefill
chunk differ in attention over each request's context and in per-request work, and a table keyed
by tokens alone misprices one K against another. The policy compares K at a
fixed batch size, so it asks for ``(requests, tokens)``: measured there, or the line, never
another composition's cost. Calls without ``requests`` keep the token-keyed table.

At a fixed batch size the prediction is also *monotone in tokens*: a step never costs less than
a measured step of the same batch with fewer tokens.
Why: the line is fitted over every step, prefill chunks included, so at a given batch it can sit
far below that batch's measured costs, and an unmeasured verify then looks cheaper than the
plain step it replaces.

Beyond a batch's last measured count the curve rises by the *draft-token slope*: an EMA of
(verify step - plain step of the same batch) / drafted tokens over every verify step whose batch
has a measured plain step. The line's own slope is no guide there: prefill chunks are cheap per
token, so the line fitted over them comes out nearly flat while drafted tokens on a decode batch
cost an order of magnitude more each. With that slope a batch
size seen only in plain steps is priced sensibly at once, instead of every drafted token count
being explored as if free.

A batch's verify entries are kept *relative to its plain step* (``_ratio``: each verify step's
seconds over the batch's plain entry at that moment), and priced as that ratio times the plain
entry now. Why: the machine's speed drifts, and the policy compares entries measured at different
times: raw verify entries kept from a fast spell make verifies look free once a slow spell has
raised the plain entry. A ratio carries no speed, so the fresh plain entry scales the old verify
entries with it. (One machine-wide speed factor over fixed per-entry shapes did worse: shapes
learned on one workload misled on another. A ratio is re-learned from each verify step, at the
same rate as a raw entry.)

Prefill is priced on top of the decode part of a step: ``predict_step(decode_tokens, decoding,
prefill_tokens)`` is the decode step's prediction plus ``prefill_token_s`` per prompt token, an EMA
of (step seconds - the decode part's prediction) / prompt tokens over every step that fed a prompt
chunk. Why additive: a prompt chunk's rows go through the same GEMMs as the decode rows, and its
attention is over its own short context, so its cost hardly depends on the batch beside it. The
scheduler (workers/scheduler.py) sizes prompt chunks from this, and the
goodput policy sizes K from the decode part: one model of the step both spend.
"""

from __future__ import annotations

import bisect
import math
from typing import Any, TypeGuard

SLOPE_PRIOR = 1.0  # ridge weight pulling c1 towards prior_per_token_s; tiny next to any real spread
MIN_STEP_S = 1e-6  # predictions never reach 0: goodput divides by them
EXACT_TOKENS = 32  # token counts up to this each have their own table entry; above, quarter-octave buckets
BUCKET_ALPHA = 0.2  # EMA weight of a new sample in its bucket
SLOPE_ALPHA = 0.1  # EMA weight of one verify step in the draft-token slope
PREFILL_ALPHA = 0.1  # EMA weight of one 16+-token prompt chunk in the per-prompt-token cost
PREFILL_FULL_WEIGHT_TOKENS = 16  # smaller chunks update the per-token cost with proportionally less weight
CURVE_SPAN = 5  # a batch's cost curve is built up to requests * CURVE_SPAN tokens at once (K = 4 verifies)


def bucket(tokens: int) -> int:
    """Table key of a step of ``tokens`` tokens: the count itself up to ``EXACT_TOKENS``, then
    quarter-octave buckets (33-38 -> one key, ...), so a long prefill shares a key with its neighbours."""
    if tokens <= EXACT_TOKENS:
        return tokens
    return EXACT_TOKENS + 1 + int(4 * math.log2(tokens / EXACT_TOKENS))


class StepCostModel:
    def __init__(
        self,
        prior_base_s: float = 0.05,
        prior_per_token_s: float = 0.003,
        min_samples: int = 8,
        decay: float = 0.98,
        bucket_min_samples: int = 2,
    ) -> None:
        if prior_base_s <= 0 or prior_per_token_s < 0:
            raise ValueError("prior_base_s must be > 0 and prior_per_token_s >= 0")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.prior_base_s = prior_base_s
        self.prior_per_token_s = prior_per_token_s
        self.min_samples = min_samples
        self.decay = decay
        self.num_samples = 0
        self.bucket_min_samples = bucket_min_samples  # 0 disables the table (the line alone)
        self._table: dict[int, list[float]] = {}  # bucket -> [EMA seconds, samples], every step
        self._by_batch: dict[tuple[int, int], list[float]] = {}  # (requests, bucket) -> the same, decode-only steps
        self._ratio: dict[tuple[int, int], list[float]] = {}  # (requests, bucket) -> [EMA of seconds / plain, samples]
        self._curves: dict[int, list[float]] = {}  # requests -> monotone predictions by tokens (see _curve)
        self._curves_key: tuple = ()  # num_samples and the settings the cached curves were built with
        self.draft_token_s: float | None = None  # EMA: seconds per drafted token over the batch's plain step
        self.prefill_token_s: float | None = None  # EMA: seconds a prompt token adds to a step
        # exponentially weighted sums: weight, x, y, x^2, x*y (x = tokens, y = seconds)
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, tokens: int, seconds: float, requests: int | None = None, prefill_tokens: int = 0) -> None:
        """Add one step's measurement. Non-positive or non-finite samples are ignored.

        ``requests``: the step's decoding requests (None: unknown). ``prefill_tokens``: prompt tokens
        among ``tokens``. Only steps without prompt tokens enter the per-batch tables; steps with them
        teach the per-prompt-token cost."""
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        if prefill_tokens > 0:
            self._observe_prefill(tokens - prefill_tokens, seconds, requests or 0, prefill_tokens)
            requests = None
        d, x, y = self.decay, float(tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        self.num_samples += 1
        tables: list[tuple[dict[Any, list[float]], Any, float]] = [
            (self._table, bucket(tokens), y)
        ]  # (table, key, value)
        if requests is not None and requests > 0:
            tables.append((self._by_batch, (requests, bucket(tokens)), y))
        if requests is not None and tokens > requests:
            plain = self.measured(requests, requests)
            if plain is not None:
                slope = max((y - plain) / (tokens - requests), 0.0)
                prev = self.draft_token_s
                self.draft_token_s = slope if prev is None else prev + SLOPE_ALPHA * (slope - prev)
                if bucket(tokens) != bucket(requests):
                    tables.append((self._ratio, (requests, bucket(tokens)), y / plain))
        for table, key, value in tables:
            entry = table.setdefault(key, [value, 0.0])
            entry[0] += BUCKET_ALPHA * (value - entry[0]) if entry[1] else 0.0
            entry[1] += 1

    def _observe_prefill(self, decode_tokens: int, seconds: float, decoding: int, prefill_tokens: int) -> None:
        """Update ``prefill_token_s`` from a step that fed ``prefill_tokens`` prompt tokens besides
        ``decode_tokens`` tokens of ``decoding`` requests. A step with decoding requests teaches it
        only once that batch's plain step is measured (else the decode part is a guess)."""
        if decoding > 0:
            if self.measured(decoding, decoding) is None:
                return
            base = self.predict(decode_tokens, requests=decoding)
        else:
            base = self._fixed_step_s()
        per = max((seconds - base) / prefill_tokens, 0.0)
        alpha = PREFILL_ALPHA * min(1.0, prefill_tokens / PREFILL_FULL_WEIGHT_TOKENS)
        p = self.prefill_token_s
        self.prefill_token_s = per if p is None else p + alpha * (per - p)

    def _fixed_step_s(self) -> float:
        """What a step costs before any token: a measured 1-request plain step, else the line's intercept."""
        one = self.measured(1, 1)
        return one if one is not None else self.coefficients()[0]

    def prefill_per_token_s(self) -> float:
        """Seconds one more prompt token adds to a step: measured, else the line's slope (or its prior)."""
        if self.prefill_token_s is not None:
            return max(self.prefill_token_s, MIN_STEP_S)
        return max(self.coefficients()[1], MIN_STEP_S)

    def predict_step(self, decode_tokens: int, decoding: int, prefill_tokens: int = 0) -> float:
        """Seconds of a step feeding ``decode_tokens`` tokens of ``decoding`` decoding requests (their
        pending tokens and drafts) and ``prefill_tokens`` prompt tokens."""
        base = self.predict(decode_tokens, requests=decoding) if decoding > 0 else self._fixed_step_s()
        return max(base + self.prefill_per_token_s() * prefill_tokens, MIN_STEP_S)

    @property
    def fitted(self) -> bool:
        """True once the line is fitted from measurements rather than the priors."""
        return self.num_samples >= self.min_samples

    def coefficients(self) -> tuple[float, float]:
        """``(c0, c1)``: seconds per step and seconds per token, both >= 0."""
        if self.num_samples < self.min_samples:
            return self.prior_base_s, self.prior_per_token_s
        w = self._w
        mx, my = self._sx / w, self._sy / w
        vxx = max(self._sxx - w * mx * mx, 0.0)  # weighted sum of squared deviations of x
        cxy = self._sxy - w * mx * my
        c1 = max((cxy + SLOPE_PRIOR * self.prior_per_token_s) / (vxx + SLOPE_PRIOR), 0.0)
        c0 = my - c1 * mx
        if c0 < 0.0:  # noise made the line cross zero: keep it through the mean, from the origin
            c0, c1 = 0.0, my / mx
        return c0, c1

    def measured(self, tokens: int | float, requests: int | None = None) -> float | None:
        """The table's EMA for steps of ``tokens`` tokens (of ``requests`` decoding requests and no
        prefill, when given), or None while it has too few samples."""
        if self.bucket_min_samples <= 0:
            return None
        b = bucket(max(1, round(tokens)))
        if requests is not None and b != bucket(requests):  # a verify step: relative to the plain step now
            rel, plain = self._ratio.get((requests, b)), self._by_batch.get((requests, bucket(requests)))
            if self._ready(rel) and self._ready(plain):
                return rel[0] * plain[0]
        entry = self._table.get(b) if requests is None else self._by_batch.get((requests, b))
        return entry[0] if self._ready(entry) else None

    def _ready(self, entry: list[float] | None) -> TypeGuard[list[float]]:
        """Whether a table entry has enough samples to price steps by."""
        return entry is not None and entry[1] >= self.bucket_min_samples

    def predict(self, tokens: int | float, requests: int | None = None) -> float:
        """Expected seconds for a step that feeds ``tokens`` tokens: measured when known, else the line.

        With ``requests`` (a decode step of that many requests and no prefill), the batch's monotone
        curve: see :meth:`_curve`."""
        if requests is not None and requests > 0 and tokens >= requests:
            return self._curve(requests, round(tokens))
        m = self.measured(tokens, requests)
        if m is not None:
            return max(m, MIN_STEP_S)
        c0, c1 = self.coefficients()
        return max(c0 + c1 * tokens, MIN_STEP_S)

    def _curve(self, requests: int, tokens: int) -> float:
        """Predicted seconds of a decode step of ``requests`` requests feeding ``tokens`` >= requests tokens.

        Over the token counts of this batch size: measured entries as measured, gaps between them
        interpolated, counts below the first measured one the line, and a running maximum over all of
        it, so that a token more never costs less; counts beyond the last measured one are extrapolated
        from it with the draft-token slope (or are the line, where that is higher). Cached per batch
        size until the next observation (which changes ``num_samples``) or a change of settings.
        """
        key = (
            self.num_samples,
            self.prior_base_s,
            self.prior_per_token_s,
            self.min_samples,
            self.decay,
            self.bucket_min_samples,
        )
        if key != self._curves_key:
            self._curves.clear()
            self._curves_key = key
        curve = self._curves.get(requests)  # [i] = prediction for requests + i tokens
        if curve is None or len(curve) <= tokens - requests:
            hi = max(tokens, requests * CURVE_SPAN)
            c0, c1 = self.coefficients()
            per_draft = max(c1, self.draft_token_s or 0.0)
            known = {t: m for t in range(requests, hi + 1) if (m := self.measured(t, requests)) is not None}
            pts = sorted(known)
            curve = []
            for t in range(requests, hi + 1):
                i = bisect.bisect_left(pts, t)
                if i < len(pts) and pts[i] == t:
                    v = known[t]
                elif i == 0:  # below every measurement of this batch size
                    v = c0 + c1 * t
                elif i == len(pts):  # beyond the last one
                    v = max(c0 + c1 * t, curve[pts[-1] - requests] + per_draft * (t - pts[-1]))
                else:  # between two measurements
                    t1, t2 = pts[i - 1], pts[i]
                    v = known[t1] + (known[t2] - known[t1]) * (t - t1) / (t2 - t1)
                curve.append(max(v, curve[-1] if curve else MIN_STEP_S))
            self._curves[requests] = curve
        return curve[tokens - requests]

    def as_dict(self) -> dict[str, Any]:
        c0, c1 = self.coefficients()
        ok = max(1, self.bucket_min_samples)
        table = {str(b): round(e[0], 6) for b, e in sorted(self._table.items()) if e[1] >= ok}
        by_batch = {f"{r}x{b}": round(e[0], 6) for (r, b), e in sorted(self._by_batch.items()) if e[1] >= ok}
        ratio = {f"{r}x{b}": round(e[0], 4) for (r, b), e in sorted(self._ratio.items()) if e[1] >= ok}
        return {
            "base_s": c0,
            "per_token_s": c1,
            "draft_token_s": self.draft_token_s,
            "prefill_token_s": self.prefill_token_s,
            "num_samples": self.num_samples,
            "measured_s_by_bucket": table,
            "measured_s_by_batch_bucket": by_batch,
            "verify_over_plain_by_batch_bucket": ratio,
        }
