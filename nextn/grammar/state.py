"""One sequence's grammar matcher and the token masks of its round's rows.

A round verifies rows 0..k: row j predicts the token after the round's pending token and its first
j drafts, so its mask is the grammar state after those drafts; draft j is drawn after the same
prefix, so one mask buffer `masks` [R, V] serves the draft chain and the verify (row j for both).
The matcher stands after the emitted tokens (the pending one included) when a round starts; the
drafts are then walked speculatively (`drafted` during a grammar-masked chain, `walk` before the
verify, which re-walks from the first draft that differs from what was walked) and `commit` rolls
back the rejected ones and consumes what the round emitted. Rows after the first illegal draft
(or a draft outside the tokenizer) are all-allowed: greedy or sampled, acceptance cannot pass an
illegal draft (it is never the masked argmax, and its masked probability is 0), so no emitted token
is read from them.

EOS: the grammar's EOS bit is given to every EOS id of the engine. Ids at or past the tokenizer's
vocabulary (padding rows of the model's embedding) are never allowed.
"""

from __future__ import annotations

import numpy as np
import torch

from nextn.core import RequestError
from nextn.grammar.compile import CompiledGrammar


class GrammarState:
    def __init__(self, compiled: CompiledGrammar, masks: torch.Tensor, eos_ids: set[int], draft_mask: bool):
        self.matcher = compiled.matcher()
        self.masks = masks  # [R, V] bool: row j allowed after the pending token and drafts[:j]
        self.draft_mask = draft_mask  # the draft chain reads the masks too (else only the verify)
        self.ll_eos = compiled.tokenizer.eos_token
        self.vocab = min(compiled.tokenizer.vocab_size, masks.shape[1])  # ids a mask may allow
        self.eos_ids = sorted(t for t in {*eos_ids, self.ll_eos} if t < self.vocab)
        self.host = torch.zeros(masks.shape[1], dtype=torch.bool)  # [V] one row, built here
        self.walked: list[int] = []  # drafts consumed past the emitted tokens this round
        self.legal = True  # the walk has met no illegal draft
        self._write(0)

    def _write(self, row: int) -> None:
        """masks[row] = the tokens the matcher allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))
        if self.ll_eos < self.vocab and allowed[self.ll_eos]:
            allowed[self.eos_ids] = True
        self.host[: self.vocab] = allowed
        self.masks[row].copy_(self.host)

    def _allows(self, token: int) -> bool:
        """Whether the matcher's mask allows `token` now (its EOS standing for every EOS id)."""
        token = self.ll_eos if token in self.eos_ids else token
        bits = self.matcher.compute_bitmask()
        return 0 <= token < len(bits) * 8 and bool(bits[token >> 3] >> (token & 7) & 1)

    def _consume(self, token: int) -> bool:
        """Advance the matcher by one token; False (the matcher unchanged) when it is illegal."""
        if not 0 <= token < self.vocab:
            return False
        token = self.ll_eos if token in self.eos_ids else token
        return self.matcher.try_consume_tokens([token]) == 1

    def _step(self, token: int, num_rows: int) -> None:
        """Walk one more draft; write the next row's mask (all-allowed after an illegal draft)."""
        j = len(self.walked) + 1  # the row after this draft
        if self.legal and self._consume(token):
            self.walked.append(token)
            self._write(j)
            return
        self.legal = False
        self.masks[j:num_rows].fill_(True)

    def drafted(self, j: int, token: torch.Tensor) -> None:
        """Draft j (token [1] on the device) was drawn: mask row j + 1 for the next draft."""
        if self.legal and len(self.walked) == j:
            self._step(int(token), self.masks.shape[0])

    def walk(self, draft_ids: torch.Tensor) -> None:
        """Masks of rows 0..k for the drafts draft_ids [k] about to be verified (one host read)."""
        drafts = draft_ids.tolist()
        same = _common_prefix(self.walked, drafts)
        if same < len(self.walked) or not self.legal:  # walked drafts the chain did not keep
            self.matcher.rollback(len(self.walked) - same)
            del self.walked[same:]
            self.legal = True  # (row `same` still holds the mask after walked[:same])
        for t in drafts[len(self.walked) :]:
            if not self.legal:
                break
            self._step(t, len(drafts) + 1)

    def commit(self, token_ids: list[int]) -> None:
        """The round emitted token_ids (drafts accepted, then the bonus): keep the walked drafts they
        start with, roll back the rest, consume the others and mask row 0 of the next round."""
        same = _common_prefix(self.walked, token_ids)
        self.matcher.rollback(len(self.walked) - same)
        self.walked, self.legal = [], True
        for t in token_ids[same:]:
            if not self._consume(t):
                # a refused token leaves the matcher as it was; one in error failed on the request's
                # grammar itself (a regex such as a{1000}{1000} validates and masks its first token,
                # then outgrows llguidance's lexer limits): the request's fault, not the engine's
                if self.matcher.is_error():
                    error = self.matcher.get_error().splitlines()[0]
                    raise RequestError(f"structured_outputs: llguidance failed on the grammar ({error})")
                if self._allows(t):  # llguidance's mask and matcher disagree on this grammar (seen with
                    # literals a tokenizer cannot write, which nextn.grammar.limits refuses up front)
                    raise RequestError(f"structured_outputs: the grammar cannot be followed (token {t} was refused)")
                raise RuntimeError(f"token {t} was emitted against the grammar: {self.matcher.get_error()}")
        self._write(0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
