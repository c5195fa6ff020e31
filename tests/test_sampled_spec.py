"""Sampled speculative decoding through the engine is exact in distribution: the law of the first
three tokens matches the filtered, penalized target law computed independently (transformers'
logits, a plain numpy filter), for several K, filters and penalties."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hf_fixtures import FIT_PROMPTS, hf_logits

import nextn

PROMPT = list(FIT_PROMPTS[0])


def _filtered(logits: np.ndarray, history: list[int], gen: list[int], cfg: dict) -> np.ndarray:
    """Independent reference of the target law of one token (float64)."""
    x = logits.astype(np.float64).copy()
    rp = cfg.get("repetition_penalty", 1.0)
    for t in set(history):
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    counts = Counter(gen)
    for t, c in counts.items():
        x[t] -= cfg.get("frequency_penalty", 0.0) * c + cfg.get("presence_penalty", 0.0)
    p = np.exp((x - x.max()) / cfg["temperature"])
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    top_k = cfg.get("top_k", 0) or len(p)
    keep[order[:top_k]] = True
    if cfg.get("top_p", 1.0) < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        before = np.cumsum(q[order]) - q[order]
        keep[order[before >= cfg["top_p"]]] = False
    if cfg.get("min_p", 0.0) > 0:
        keep &= p >= cfg["min_p"] * p.max()
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def exact_law(ckpt, cfg: dict, n: int = 3) -> dict[tuple, float]:
    law = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, mass in law.items():
            p = _filtered(hf_logits(ckpt, PROMPT + list(seq))[-1].numpy(), PROMPT + list(seq), list(seq), cfg)
            for t in np.nonzero(p)[0]:
                nxt[seq + (int(t),)] = mass * p[t]
        law = nxt
    return law


def _tv_limit(law: dict, n: int, q: float = 0.99, sims: int = 300) -> float:
    probs = np.array(list(law.values()))
    rng = np.random.default_rng(0)
    tvs = [0.5 * np.abs(rng.multinomial(n, probs) / n - probs).sum() for _ in range(sims)]
    return float(np.quantile(tvs, q))


CASES = [
    (2, dict(temperature=0.9, top_k=8), 2500),
    (1, dict(temperature=0.8, top_p=0.8), 800),
    (4, dict(temperature=1.0, min_p=0.05, top_k=12), 800),
    (2, dict(temperature=0.9, top_k=6, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3), 800),
]


def draw(ckpt, cfg: dict, draws: int, prompt: list[int] = PROMPT, **llm_kwargs) -> tuple[Counter, int, int]:
    """The first 3 tokens of `draws` seeded requests (seeds 0..draws-1): (Counter of the sequences,
    drafts accepted, drafts drafted). The requests run batched, up to 64 at a time, about twice as
    fast as one by one and the same draws: a seeded request's tokens do not depend on its
    neighbours (test_batching holds every K to it, sampled requests included); a few seeds run
    alone here too and must reproduce their batched draws. llm_kwargs: the engine's settings."""
    kwargs = dict(model=ckpt, max_model_len=64, **llm_kwargs)
    llm = nextn.LLM(max_num_seqs=64, **kwargs)
    params = [nextn.SamplingParams(max_tokens=3, seed=seed, ignore_eos=True, **cfg) for seed in range(draws)]
    outs = llm.generate([list(prompt)] * draws, params)
    alone = nextn.LLM(max_num_seqs=1, **kwargs)
    for seed in range(0, draws, max(1, draws // 6)):
        assert alone.generate(prompt_token_ids=list(prompt), params=params[seed]).token_ids == outs[seed].token_ids
    seen = Counter(tuple(out.token_ids) for out in outs)
    return seen, sum(out.num_accepted for out in outs), sum(out.num_drafted for out in outs)


@pytest.mark.parametrize("k,cfg,draws", CASES)
def test_sampled_spec_matches_the_exact_law(dense_fitted_ckpt, k, cfg, draws):
    law = exact_law(dense_fitted_ckpt, cfg)
    engine = dict(device="cpu", dtype="float32", num_speculative_tokens=k)
    seen, accepted, drafted = draw(dense_fitted_ckpt, cfg, draws, **engine)
    assert sum(seen.values()) == draws
    assert all(seq in law for seq in seen), "a draw outside the filtered support"
    tv = 0.5 * sum(abs(seen.get(s, 0) / draws - p) for s, p in law.items())
    assert tv <= _tv_limit(law, draws), tv
    assert 0 < accepted < drafted  # drafts were accepted and rejected: the rejection path ran both ways


def test_seeded_requests_reproduce_and_greedy_is_untouched(dense_fitted_ckpt):
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3)
    params = nextn.SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=1234, ignore_eos=True)
    a = llm.generate(prompt_token_ids=PROMPT, params=params).token_ids
    llm.generate(prompt_token_ids=PROMPT[:5], params=nextn.SamplingParams(max_tokens=7, temperature=1.0))  # other work
    assert llm.generate(prompt_token_ids=PROMPT, params=params).token_ids == a
    plain = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0)
    greedy = nextn.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert (
        llm.generate(prompt_token_ids=PROMPT, params=greedy).token_ids
        == plain.generate(prompt_token_ids=PROMPT, params=greedy).token_ids
    )
    unseeded = {
        tuple(
            llm.generate(
                prompt_token_ids=PROMPT, params=nextn.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
            ).token_ids
        )
        for _ in range(4)
    }
    assert len(unseeded) > 1
