"""Token selection math: logits -> the filtered target distribution, seeded uniforms, draws.

Owns: the penalty and filter pipeline (`probs_from_logits`, `penalized_logits`, `greedy_ids`),
the per-request token history the penalties read (`TokenHistory`), the counter-based random
numbers of a seeded request (`RequestRng`), inverse-CDF drawing (`sample`) and logprobs.
Does not know models, caches, the engine loop or speculation; `nextn.sample.verifier` builds on it.
Everything is pure torch on whatever device the logits live on; nothing here reads a device
tensor back to the host.

Pipeline, in this fixed order (vLLM's classic order, also Hugging Face's):
  1. repetition penalty: for every token seen in prompt + generated tokens, a positive logit is
     divided by the penalty, a negative one multiplied by it;
  2. frequency and presence penalties over *generated* tokens only (OpenAI/vLLM semantics):
     logit -= frequency_penalty * count + presence_penalty * (count > 0);
  3. temperature: temperature 0 is greedy -> a one-hot at the argmax of the penalized logits
     (penalties still apply under greedy; ties go to the lowest id); otherwise logits / T, softmax;
  4. top-k: keep the k most probable tokens (ties broken towards the lower id, exactly k kept);
  5. top-p: keep the smallest most-probable-first set whose mass (renormalised after top-k)
     reaches top_p; the top token is always kept;
  6. min-p: drop tokens whose probability is below min_p * the top probability (ratios do not
     change under renormalisation, so this is the same on the raw or the renormalised mass);
  7. renormalise.
vLLM V1 applies min-p before top-k/top-p; the two orders differ only when top-p and min-p are both
set. Plain decoding and both sides of speculative decoding use this one function, so they agree.

Which steps run is structure (`SamplerKind`, from the request's SamplingParams); their values may
be Python numbers (SamplingParams) or device scalars (the engine's per-slot values, so one CUDA
graph serves every request of a kind): the same ops either way.

Randomness: `RequestRng(seed)` is a counter-based generator (Philox-4x32-10, Random123's). The
uniform used for "generated token number i, purpose `stream`" is a pure function of
(seed, i, stream): the same whatever else runs in the process and however tokens are grouped into
rounds. Streams: DRAFT (draw draft token i from q), ACCEPT (accept test of the draft for token i),
SAMPLE (plain draw, recovered or bonus token i). A plain-decoding step and a zero-draft speculative
round both draw token i from p with SAMPLE's uniform i, so they give the same token.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from nextn.core import SamplingParams


class Law(NamedTuple):
    """temperature_sample's law: softmax(logits / temperature), then top-k, top-p and min-p; each
    value a device scalar (the request's, read at replay), a filter None where it is off."""

    temperature: torch.Tensor  # [] float32 > 0
    top_k: torch.Tensor | None = None  # [] long >= 1
    top_p: torch.Tensor | None = None  # [] float32 in (0, 1]
    min_p: torch.Tensor | None = None  # [] float32


# ---------------------------------------------------------------------------------------------
# Token history and penalties


@dataclass
class TokenHistory:
    """What the penalties of one request read, kept over the vocabulary on the logits' device."""

    prompt_mask: Tensor  # [V] bool: the token occurs in the prompt (repetition penalty only)
    output_counts: Tensor  # [V] int32: occurrences among generated tokens

    @classmethod
    def from_ids(
        cls,
        prompt_ids: Sequence[int] | Tensor,
        output_ids: Sequence[int] | Tensor,
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> TokenHistory:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(-1)
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[prompt] = True
        hist = cls(mask, torch.zeros(vocab_size, dtype=torch.int32, device=device))
        hist.append(output_ids)
        return hist

    def append(self, ids: Sequence[int] | Tensor) -> None:
        """Count newly generated tokens (in place; a device op, no host read)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.output_counts.device).reshape(-1)
        ones = torch.ones_like(ids, dtype=torch.int32)
        self.output_counts.index_add_(0, ids, ones)

    def rows(self, num_rows: int, extra_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-row (seen [N, V] bool, counts [N, V] int32) for N rows of logits.

        With extra_ids [M] (candidate tokens following the history, M >= N - 1), row r sees the
        history plus extra_ids[: M - N + 1 + r]. Verify (N = K + 1 rows, extra = the K drafts):
        row j sees the first j drafts. One draft step (N = 1, extra = drafts so far): all of them.
        """
        counts = self.output_counts.expand(num_rows, -1)  # [N, V]
        if extra_ids is not None and extra_ids.numel() > 0:
            extra_ids = extra_ids.to(counts.device, torch.long)
            m = extra_ids.numel()
            if m < num_rows - 1:
                raise ValueError(f"{num_rows} rows need at least {num_rows - 1} extra ids, got {m}")
            # extra token m' first counts in row max(0, m' - (M - N)); cumsum carries it down.
            first_row = (torch.arange(m, device=counts.device) - (m - num_rows)).clamp_(min=0)
            delta = torch.zeros(num_rows, counts.shape[1], dtype=torch.int32, device=counts.device)
            ones = torch.ones_like(first_row, dtype=torch.int32)
            delta.index_put_((first_row, extra_ids), ones, accumulate=True)
            counts = counts + delta.cumsum(0, dtype=torch.int32)
        seen = self.prompt_mask | (counts > 0)  # [N, V]
        return seen, counts


@dataclass(frozen=True)
class SamplerKind:
    """Which steps of the pipeline a request runs (the rest are off)."""

    greedy: bool
    repetition: bool = False
    frequency: bool = False
    presence: bool = False
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    min_tokens: bool = False  # stop tokens banned before min_tokens tokens (the engine's sampler masks them)
    grammar: bool = False  # structured outputs: the engine's sampler masks each row to the grammar's tokens

    @classmethod
    def of(cls, params: SamplingParams) -> SamplerKind:
        return cls(
            params.greedy,
            params.repetition_penalty != 1.0,
            params.frequency_penalty != 0.0,
            params.presence_penalty != 0.0,
            params.top_k > 0,
            params.top_p < 1.0,
            params.min_p > 0.0,
            params.min_tokens > 0,
            params.structured_outputs is not None,
        )

    @property
    def penalties(self) -> bool:
        return self.repetition or self.frequency or self.presence


def penalized_logits(
    logits: Tensor,
    params,
    history: TokenHistory | None = None,
    extra_ids: Tensor | None = None,
    kind: SamplerKind | None = None,
) -> Tensor:
    """Steps 1-2 of the pipeline. logits [N, V] -> float32 [N, V]; never writes into `logits`
    (returns it as is when it is float32 and no penalty is set)."""
    kind = kind or SamplerKind.of(params)
    logits = logits.float()  # [N, V]
    if not kind.penalties:
        return logits
    if history is None:
        raise ValueError("penalties are set but no TokenHistory was given")
    seen, counts = history.rows(logits.shape[0], extra_ids)  # [N, V] each
    if kind.repetition:
        rp = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if kind.frequency:
        logits = logits - params.frequency_penalty * counts.float()
    if kind.presence:
        logits = logits - params.presence_penalty * (counts > 0).float()
    return logits


def greedy_ids(
    logits: Tensor,
    params,
    history: TokenHistory | None = None,
    extra_ids: Tensor | None = None,
    kind: SamplerKind | None = None,
) -> Tensor:
    """Argmax of the penalized logits, per row: [N, V] -> [N] long. Ties go to the lowest id."""
    return penalized_logits(logits, params, history, extra_ids, kind).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# Temperature and filters


def _top_k_top_p_keep(probs: Tensor, top_k, top_p, kind: SamplerKind) -> Tensor:
    """keep mask [N, V] of top-k then top-p, computed on one stable descending sort."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [N, V]
    rank = torch.arange(probs.shape[-1], device=probs.device)  # [V]
    keep_sorted = torch.ones_like(sorted_p, dtype=torch.bool)
    if kind.top_k:  # top_k >= V keeps every rank
        keep_sorted &= rank < top_k
    if kind.top_p:
        kept = sorted_p * keep_sorted  # mass left after top-k, most probable first
        mass_before = kept.cumsum(-1) - kept  # [N, V] exclusive prefix mass
        # keep while the tokens before this one have not yet reached top_p of the kept mass;
        # mass_before is 0 for the top token, so it always stays
        keep_sorted &= mass_before < top_p * kept.sum(-1, keepdim=True)
    return torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)


def filter_probs(probs: Tensor, params, kind: SamplerKind | None = None) -> Tensor:
    """Steps 4-7: top-k, top-p, min-p on probabilities [N, V], renormalised."""
    kind = kind or SamplerKind.of(params)
    keep = None
    if kind.top_k or kind.top_p:
        keep = _top_k_top_p_keep(probs, params.top_k, params.top_p, kind)
    if kind.min_p:
        # p / max(p) is unchanged by renormalising after top-k/top-p, and the max is always kept
        above = probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
        keep = above if keep is None else keep & above
    if keep is None:
        return probs
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


def probs_from_logits(
    logits: Tensor,
    params,
    history: TokenHistory | None = None,
    extra_ids: Tensor | None = None,
    kind: SamplerKind | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """The distribution a token is drawn from: logits [N, V] -> float32 probs [N, V], rows sum to 1
    (written into `out` when given).

    history/extra_ids: see `TokenHistory.rows`; needed only when a penalty is set.
    Greedy (temperature 0) gives a one-hot at the penalized argmax.
    """
    kind = kind or SamplerKind.of(params)
    logits = penalized_logits(logits, params, history, extra_ids, kind)  # [N, V]
    if kind.greedy:
        probs = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs if out is None else out.copy_(probs)
    if not (kind.top_k or kind.top_p or kind.min_p):
        return torch.softmax(logits / params.temperature, dim=-1, out=out)  # [N, V]
    probs = filter_probs(torch.softmax(logits / params.temperature, dim=-1), params, kind)
    return probs if out is None else out.copy_(probs)


# ---------------------------------------------------------------------------------------------
# Drawing


def _cdf_dtype(device: torch.device) -> torch.dtype:
    # float64 keeps a 250k-token cumsum exact enough for tail tokens; MPS has no float64
    return torch.float32 if device.type == "mps" else torch.float64


def sample(probs: Tensor, u: Tensor | float, out: Tensor | None = None) -> Tensor:
    """Inverse-CDF draw: probs [N, V] (or [V]), u [N] (or a scalar) in [0, 1) -> ids [N] (or []),
    written into `out` ([N] long) when given.

    probs need not be normalised. Never returns a zero-probability token: a token is picked only
    where the float cumsum strictly rises, and u close to 1 is clamped to the last token with
    positive mass. Returns a device tensor (call int() on a 0-dim result to read it).
    """
    squeeze = probs.dim() == 1
    probs = probs.reshape(-1, probs.shape[-1])  # [N, V]
    dtype = _cdf_dtype(probs.device)
    cdf = probs.to(dtype).cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    u = torch.as_tensor(u, dtype=dtype, device=probs.device).reshape(-1, 1)  # [N or 1, 1]
    idx = torch.searchsorted(cdf, (u * total).expand(cdf.shape[0], 1).contiguous(), right=True)
    last_positive = (cdf < total).sum(-1, keepdim=True)  # first index where cdf reaches total
    if out is not None:
        return torch.minimum(idx, last_positive, out=out.view(-1, 1)).view(out.shape)
    ids = torch.minimum(idx, last_positive).squeeze(-1)  # [N]
    return ids[0] if squeeze else ids


class TopLogprobs(NamedTuple):
    logprobs: Tensor  # [N, n] float32, descending
    ids: Tensor  # [N, n] long


def top_logprobs(logits: Tensor, n: int) -> TopLogprobs:
    """The n most likely tokens of log_softmax(logits) per row (all V of them when n > V: a request's
    logprobs past the vocabulary ask for the whole distribution). logits [N, V].

    Pass raw logits for the model's own logprobs (vLLM's default `raw_logprobs`), or penalized /
    tempered logits for the sampled distribution; this function applies nothing itself.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    values, ids = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
    return TopLogprobs(values, ids)


def token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """log_softmax(logits) [N, V] at ids [N] -> [N] float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, ids.long().reshape(-1, 1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Counter-based random numbers

_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUNDS = 10


class Stream(IntEnum):
    """Purpose of a uniform; the third Philox counter word."""

    DRAFT = 0  # draw the draft token for generated index i from q
    ACCEPT = 1  # accept/reject test of the draft for generated index i
    SAMPLE = 2  # plain draw, recovered token or bonus token for generated index i


def philox4x32(counter: Sequence[int], key: Sequence[int]) -> tuple[int, int, int, int]:
    """Philox-4x32-10 on Python ints (the reference the tensor version is tested against)."""
    c0, c1, c2, c3 = (c & _MASK32 for c in counter)
    k0, k1 = (k & _MASK32 for k in key)
    for _ in range(_PHILOX_ROUNDS):
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * m for int64 tensors a < 2**32, without int64 overflow."""
    lo_part = a * (m & 0xFFFF)  # < 2**48
    t = a * (m >> 16) + (lo_part >> 16)  # < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox4x32_tensor(counter: Sequence[Tensor], key: Sequence[int]) -> tuple[Tensor, ...]:
    """Philox-4x32-10 elementwise on four int64 tensors (any device) or numpy int64 arrays of 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = (k & _MASK32 for k in key)
    for _ in range(_PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(c0, _PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def _bits53(w0, w1):
    """Two 32-bit words -> an integer in [0, 2**53); divided by 2**53 it is a uniform in [0, 1)."""
    return (w0 >> 5) * 67108864 + (w1 >> 6)


_TWO53 = 9007199254740992.0


class RequestRng:
    """Seeded uniforms of one request: uniform(i, stream) depends only on (seed, i, stream).

    Philox counter = (i low 32 bits, i high 32 bits, stream, 0), key = the seed's 64-bit two's
    complement: one-to-one on the signed 64-bit seeds SamplingParams takes (core.SEED_RANGE).
    Unseeded requests get a fresh 64-bit seed from the OS (`secrets`).
    """

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(64) if seed is None else seed & 0xFFFFFFFFFFFFFFFF
        self._key = (self.seed & _MASK32, self.seed >> 32)

    def uniform(self, index: int, stream: int) -> float:
        w = philox4x32((index & _MASK32, index >> 32, int(stream), 0), self._key)
        return _bits53(w[0], w[1]) / _TWO53

    def uniforms(self, indices: Tensor, stream: int) -> Tensor:
        """Vectorised `uniform`: indices [...] int64 (>= 0) -> float64 [...] on their device."""
        idx = indices.long()
        c2 = torch.full_like(idx, int(stream))
        w = philox4x32_tensor((idx & _MASK32, idx >> 32, c2, torch.zeros_like(idx)), self._key)
        return _bits53(w[0], w[1]).to(torch.float64) / _TWO53

    def table(self, start: int, count: int, device: torch.device | str = "cpu") -> Tensor:
        """Uniforms for indices start..start+count-1 of every stream: float64 [len(Stream), count].

        One call at request start (count = max_tokens + K + 1) lets the loop slice per round with
        host ints: no per-round RNG kernels, no host read. Computed on the host in one vectorised
        numpy pass over every stream, then copied once: as GPU launches its ~700 small ops cost
        ~9 ms per request.
        """
        idx = np.arange(start, start + count, dtype=np.int64)[None]  # [1, count]
        shape = (len(Stream), count)
        counter = [
            np.broadcast_to(w, shape)
            for w in (idx & _MASK32, idx >> 32, np.arange(len(Stream), dtype=np.int64)[:, None], np.zeros(1, np.int64))
        ]
        w = philox4x32_tensor(counter, self._key)  # operators only: numpy int64 arrays work as they are
        # (a pageable copy queued without waiting for the stream: nextn.cache.hybrid.to_device)
        return torch.from_numpy(_bits53(w[0], w[1]).astype(np.float64) / _TWO53).to(device, non_blocking=True)
