"""Adaptive draft length: the K a request's next round drafts, from what its last round accepted.

The reference design's law (its "accepted-run" rule, host arithmetic on the count each round
already reads back, so it costs no device work): the next round drafts the last round's accepted
drafts + 1, clamped to [floor, cap]. A rejection shrinks the next chain to just past where it
failed; a full accept deepens it one step per round.
- cap: min(K, 7);
- floor, by the model's hidden size (a model with an expensive verify keeps deep drafts after a
  miss): 4 from 3500, 2 from 2500, else 1;
- at long context (from 1024 committed tokens) a floor of 4 or more relaxes to 1: forced-deep
  drafts stop paying at depth.
A round whose drafts a confidence gate cut accepted at most what was kept, so the law sees the cut.
Without `adaptive`, K stays the request's K. Exactness does not depend on K.
"""

from __future__ import annotations

K_CAP = 7  # the deepest adaptive chain
FLOOR_TIERS = ((3500, 4), (2500, 2))  # (hidden size from, floor); below them 1
FLOOR_CONTEXT = 1024  # committed tokens from which a floor of 4 or more relaxes to 1


def floor_for(hidden_size: int) -> int:
    return next((floor for size, floor in FLOOR_TIERS if hidden_size >= size), 1)


class AdaptiveK:
    """The draft length `k` of a request's next round (k_max: the request's K, 0 for plain decoding)."""

    def __init__(self, k_max: int, adaptive: bool, hidden_size: int):
        self.adaptive = adaptive and k_max > 0
        self.cap = min(k_max, K_CAP) if self.adaptive else k_max
        self.floor = floor_for(hidden_size)
        self.k = self.cap

    def floor_at(self, committed: int) -> int:
        """The floor with `committed` tokens in the context."""
        return 1 if committed >= FLOOR_CONTEXT and self.floor >= 4 else self.floor

    def update(self, accepted: int, committed: int) -> None:
        """After a round that accepted `accepted` drafts and left `committed` tokens committed."""
        if self.adaptive:
            self.k = max(min(accepted + 1, self.cap), min(self.floor_at(committed), self.cap))
