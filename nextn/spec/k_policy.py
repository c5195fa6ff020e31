"""Batch K policy: how many tokens the requests of one engine step draft, chosen for the most
tokens per second of the whole batch, from k_max (`--spec-k`, the cap) down to 0 (plain decoding).

Why: at a small batch a step is memory-bound, so its verify rows are nearly free and deep drafts
pay; at a large batch the step is compute-bound, the B * (K + 1) verify rows cost in proportion,
and drafts that are often rejected cost more than they return. (nextn.spec.adaptive is another
thing: one request's K from its own last round.)

The objective. With a_j = P(draft j accepted | drafts 1..j-1 accepted), a round that drafts K
tokens emits E(K) = 1 + sum_{j=1..K} prod_{i<=j} a_i tokens per request (the bonus or recovered
token plus the accepted drafts), so a step of B requests at K yields B * E(K) / t(B, K) tokens/s.
`choose(B)` takes the K in 0..k_max that maximises it (ties: the smaller K), subject to the
exploration and hysteresis below.

Acceptance (`observe_round(k, n)`: a request's round drafted k, n were accepted): position j was
tried when drafts 1..j-1 were accepted (j <= min(n + 1, k)), and accepted when j <= n. Per
position, decayed counts (each new try first multiplies the old ones by `accept_decay`: a window of
about 1 / (1 - decay) tries) under a Beta prior of `prior_weight` pseudo-tries at `prior[j]`:
a_j = (accepted_j + w * prior_j) / (tried_j + w). The prior (0.7, 0.6, 0.5, later positions 0.5)
makes a fresh policy speculate; a position never tried keeps it.

Cost (`observe_step(B, k, seconds)`): per (batch bucket, K) an exponentially weighted mean of the
step's seconds, the n-th sample weighted max(1/n, cost_alpha) (a plain mean at first). A sample
above `spike` times the mean counts as that (a hiccup moves it a bounded step); one below the mean
over `spike` restarts the cell (what came before was warm-up: a capture, a cold cache). An
unmeasured (bucket, K): between the bucket's measured Ks, linear in K; beyond them, the line
through the nearest two, kept between flat (rows are free: memory-bound) and proportional to the
rows B * (K + 1) (every row costs the same: compute-bound). With fewer than two measured Ks a
bucket takes the shape in K of the nearest bucket that has two, scaled to its one measured K; with
none to borrow it is flat. Flat is optimistic: an unmeasured deeper K looks free, so the policy
goes and measures it when its acceptance promises more tokens.

Buckets: 1, 2, 4, 8, then multiples of 8 (the batch sizes vLLM captures CUDA graphs at); a batch of
B counts in the smallest bucket >= B.

Exploration and stability, per bucket and deterministic. E(K) is concave in K (its increments
prod a_i shrink) and t(B, K) convex (flat, then linear in the rows once compute-bound), so E / t
is unimodal: a K at least as good as both neighbours is the best. The bucket keeps a choice; the
best estimate replaces it only when its tokens/s exceed the choice's by `margin` (every new
(B, K) costs a CUDA graph capture, and noise must not flip it). The choice and its neighbours
K - 1, K + 1 are measured `min_samples` times before anything else (least measured first), so the
choice walks to the optimum from any start. Every `recheck_every`-th step of the bucket runs a
neighbour of the choice (K - 1 and K + 1 in turn): a stale or misleading estimate is corrected,
and a deeper position's acceptance re-measured (a round at K = 0 tells nothing of acceptance), so
the policy never locks into K = 0 on a bad early estimate; it costs at most 1 / recheck_every of
the steps.

Exactness: what the engine applies the choice to (`request_k`):
- greedy output does not depend on K, and sampled output is exact in law at any K, so greedy and
  unseeded sampled requests follow the choice;
- a seeded sampled request's exact tokens depend on K, and the choice depends on load and timing,
  so such a request keeps its own K (an adaptive K is a function of the request's own rounds, so it
  keeps a seeded output reproducible; the choice would not);
- a request that asked for its own K (num_speculative_tokens below the cap) drafts min(its K,
  choice); with `adaptive` (nextn.spec.adaptive) the choice is a cap over the batch and each
  request's adaptive K works under it: min(adaptive K, choice).
Under tensor parallelism rank 0 chooses and sends the K (each rank's wall times differ); the seed
the leader draws for an unseeded request (nextn.engine.replica.seeded) is not the user's, so
`request_k` takes the params as the user gave them.

Driving it (`make_policy(spec)`: None when every round runs at the cap, k_policy "fixed"): call
`choose(B)` once per step before its round is launched (B: the requests in the round), then
`observe_step(B, choice, seconds)` with the step's wall time (requests drafting less under the
choice are part of what it costs; leave out steps that prefilled or captured a CUDA graph: their
time is not the round's), and `observe_round(drafted, accepted)` for each round read (drafted: the
drafts that counted after a confidence gate). `snapshot()` for metrics and logs.
This module is host arithmetic only: it knows nothing of torch, the runner or tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nextn.config import SpecConfig
    from nextn.core import SamplingParams

PRIOR = (0.7, 0.6, 0.5)  # a_j before any round is seen; later positions take the last


def bucket(batch_size: int) -> int:
    """The cost table's bucket of a batch of `batch_size` requests: 1, 2, 4, 8, then multiples of 8."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length() if batch_size <= 8 else -(-batch_size // 8) * 8


def expected_tokens(accept: list[float], k: int) -> float:
    """E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i: the tokens a request emits per round drafting k."""
    total, run = 1.0, 1.0
    for a in accept[:k]:
        run *= a
        total += run
    return total


def make_policy(spec: SpecConfig) -> KPolicy | None:
    """The engine's policy for these settings; None when every round runs at the cap."""
    auto = spec.k_policy == "auto" and spec.num_speculative_tokens > 0
    return KPolicy(spec.num_speculative_tokens) if auto else None


def request_k(k: int, choice: int, params: SamplingParams) -> int:
    """The K a request drafts in a step whose choice is `choice`. k: its own (its
    num_speculative_tokens, or its adaptive K); a seeded sampled request keeps it (module docstring)."""
    return k if params.seed is not None and not params.greedy else min(k, choice)


def _line(points: dict[int, float], k: int) -> float:
    """t at k from one bucket's measured points (>= 2): linear between them; beyond them the line
    through the nearest two, kept between flat and proportional to the rows (K + 1)."""
    if k in points:
        return points[k]
    ks = sorted(points)
    below, above = [x for x in ks if x < k], [x for x in ks if x > k]
    k0, k1 = (below[-1], above[0]) if below and above else (ks[-2], ks[-1]) if below else (ks[0], ks[1])
    t = points[k0] + (points[k1] - points[k0]) * (k - k0) / (k1 - k0)
    if below and above:
        return t
    anchor = k1 if below else k0
    flat, proportional = points[anchor], points[anchor] * (k + 1) / (anchor + 1)
    return min(max(t, min(flat, proportional)), max(flat, proportional))


def _seconds(table: dict[int, dict[int, float]], b: int, k: int) -> float:
    """t(b, k) from the measured table {bucket: {K: seconds}} (module docstring: measured, else
    estimated; in no unit when nothing is measured)."""
    own = table.get(b, {})
    if k in own or len(own) >= 2:
        return _line(own, k)
    shaped = [c for c, points in table.items() if c != b and len(points) >= 2]
    if not shaped:
        return next(iter(own.values()), 1.0)
    shape = table[min(shaped, key=lambda c: (abs(math.log2(c / b)), -c))]
    if not own:
        return _line(shape, k)
    ((k0, t0),) = own.items()
    return t0 * _line(shape, k) / _line(shape, k0)


@dataclass(frozen=True)
class PolicyTuning:
    """The policy's constants (the module docstring says what each does)."""

    prior: tuple[float, ...] = PRIOR  # a_j before any round is seen (later positions take the last)
    prior_weight: float = 4.0  # the prior's pseudo-tries
    accept_decay: float = 0.995  # each new try first multiplies a position's counts by this
    cost_alpha: float = 0.1  # the least weight of a new cost sample
    spike: float = 2.0  # a sample above spike * the mean counts as that; one below mean / spike restarts
    min_samples: int = 3  # the choice and its neighbours are measured this often before anything else
    recheck_every: int = 50  # every n-th step of a bucket runs a neighbour of the choice
    margin: float = 0.02  # the best estimate replaces the choice only when it beats it by this much

    def __post_init__(self):
        if self.min_samples < 1 or self.recheck_every < 2 or self.margin < 0 or self.spike < 1:
            raise ValueError("KPolicy: min_samples >= 1, recheck_every >= 2, margin >= 0, spike >= 1")
        prior, weight, decay = self.prior, self.prior_weight, self.accept_decay
        if not prior or not all(0.0 <= p <= 1.0 for p in prior) or weight <= 0 or not 0 < decay <= 1:
            raise ValueError("KPolicy: prior probabilities in [0, 1], prior_weight > 0, accept_decay in (0, 1]")


class KPolicy:
    """The K of each engine step (see the module docstring). k_max: the cap, `--spec-k`."""

    def __init__(self, k_max: int, tuning: PolicyTuning = PolicyTuning()):
        if k_max < 0:
            raise ValueError(f"KPolicy: k_max >= 0, got {k_max}")
        self.k_max, self.tuning = k_max, tuning
        self.prior = [tuning.prior[min(j, len(tuning.prior) - 1)] for j in range(k_max)]
        self.tried, self.accepted = [0.0] * k_max, [0.0] * k_max  # decayed counts per position
        self.cost: dict[tuple[int, int], list] = {}  # (bucket, K) -> [mean seconds, samples]
        self.choice: dict[int, int] = {}  # bucket -> its current K
        self.steps: Counter[int] = Counter()  # bucket -> choose() calls

    def observe_round(self, k: int, n: int) -> None:
        """A request's round drafted k tokens (those that counted) and n of them were accepted."""
        if not 0 <= n <= k:
            raise ValueError(f"accepted {n} of {k} drafts")
        d = self.tuning.accept_decay
        for j in range(min(n + 1, k, self.k_max)):  # position j + 1 was tried
            self.tried[j] = self.tried[j] * d + 1.0
            self.accepted[j] = self.accepted[j] * d + (j < n)

    def observe_step(self, batch_size: int, k: int, seconds: float) -> None:
        """An engine step ran a round of batch_size requests at K = k in `seconds` of wall time."""
        if not 0 <= k <= self.k_max or seconds <= 0:
            raise ValueError(f"observe_step: k {k} outside 0..{self.k_max} or seconds {seconds} <= 0")
        cell = self.cost.setdefault((bucket(batch_size), k), [0.0, 0])
        spike = self.tuning.spike
        if seconds * spike < cell[0]:  # the cell's samples so far were warm-up
            cell[:] = [0.0, 0]
        cell[1] += 1
        x = seconds if cell[1] == 1 else min(seconds, spike * cell[0])
        cell[0] += max(1.0 / cell[1], self.tuning.cost_alpha) * (x - cell[0])

    def acceptance(self) -> list[float]:
        """a_j for j = 1..k_max: the decayed counts under the prior."""
        w = self.tuning.prior_weight
        return [(a + w * p) / (t + w) for a, t, p in zip(self.accepted, self.tried, self.prior, strict=True)]

    def rates(self, batch_size: int) -> list[float]:
        """Expected tokens per request-second at each K in 0..k_max for this batch: E(K) / t(B, K)."""
        b, accept, table = bucket(batch_size), self.acceptance(), {}
        for (c, k), (mean, _) in self.cost.items():
            table.setdefault(c, {})[k] = mean
        return [expected_tokens(accept, k) / _seconds(table, b, k) for k in range(self.k_max + 1)]

    def choose(self, batch_size: int) -> int:
        """The K this step of batch_size requests drafts (0..k_max)."""
        b = bucket(batch_size)
        self.steps[b] += 1
        rate = self.rates(batch_size)
        best = max(range(self.k_max + 1), key=lambda k: (rate[k], -k))
        current = self.choice.get(b, best)
        tuning = self.tuning
        if rate[best] > rate[current] * (1.0 + tuning.margin):
            current = best
        self.choice[b] = current
        near = [k for k in (current, current - 1, current + 1) if 0 <= k <= self.k_max]
        samples = {k: self.cost.get((b, k), (0.0, 0))[1] for k in near}
        unmeasured = [k for k in near if samples[k] < tuning.min_samples]
        if unmeasured:  # the least measured first; ties in the order current, current - 1, current + 1
            return min(unmeasured, key=samples.__getitem__)
        every = tuning.recheck_every
        if len(near) > 1 and self.steps[b] % every == 0:  # the neighbours in turn
            return near[1:][self.steps[b] // every % (len(near) - 1)]
        return current

    def snapshot(self) -> dict:
        """For metrics and logs: the acceptance estimates a_j, E(K), the measured cost table
        {bucket: {K: {"seconds", "samples"}}} and the current choice per bucket."""
        accept, table = self.acceptance(), {}
        for (b, k), (mean, n) in sorted(self.cost.items()):
            table.setdefault(b, {})[k] = {"seconds": mean, "samples": n}
        return {
            "k_max": self.k_max,
            "acceptance": accept,
            "expected_tokens": [expected_tokens(accept, k) for k in range(self.k_max + 1)],
            "cost": table,
            "choice": dict(sorted(self.choice.items())),
        }
