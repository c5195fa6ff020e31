"""Automatic prefix caching (nextn.cache.prefix), on the bundled model: eight requests share a
1,500-token prefix cut from a Python file, each with its own 50-150-token tail. Served from the
cache (through LLM.generate and through the server, greedy and seeded at T=0.8) each emits what
the same request emits on an engine with the cache off, token for token, and requests 2..8 are
served at least 1,400 prompt tokens from it. Under a budget of a few blocks the cache evicts and
stays exact. Under prefill "chunked" (not row-invariant) it is off, and asking for it is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import pytest
import torch
from live_server import serving

import nextn
from nextn.config import DEFAULT_MODEL_DIR, EngineConfig
from nextn.config.serve import ServeConfig
from nextn.tokenizer import Tokenizer

PREFIX_LEN, NUM_REQUESTS, MAX_TOKENS = 1500, 8, 8
GREEDY = nextn.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# (top_k, top_p: the bundled checkpoint's generation_config, which the server applies)
SEEDED = nextn.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.95, seed=11, ignore_eos=True)
KW = dict(prefill="steps", max_model_len=2048)


@pytest.fixture(scope="module")
def source() -> list[int]:
    """argparse.py's source as the bundled tokenizer's ids (a Python file that does not change under us)."""
    return Tokenizer(DEFAULT_MODEL_DIR).encode(Path(argparse.__file__).read_text())


@pytest.fixture(scope="module")
def prompts(source) -> dict[str, list[list[int]]]:
    """The greedy and the seeded requests: the same prefix, each its own tail (the seeded ones' tails
    are others: a kept session of a greedy request cannot serve one)."""
    rng = random.Random(45)
    tails = [(2000 + 150 * i, rng.randrange(50, 151)) for i in range(2 * NUM_REQUESTS)]
    cut = [source[:PREFIX_LEN] + source[at : at + n] for at, n in tails]
    return {"greedy": cut[:NUM_REQUESTS], "seeded": cut[NUM_REQUESTS:]}


@pytest.fixture(scope="module")
def cold(prompts) -> dict[str, list[list[int]]]:
    """Each request on an engine with the cache off (run side by side: a request's output does not
    depend on its neighbours)."""
    llm = nextn.LLM(**KW, enable_prefix_caching=False)
    assert llm.engine.runner.prefix is None
    out = {}
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        outputs = llm.generate(prompts[name], params)
        assert all(o.num_cached_tokens == 0 for o in outputs)
        out[name] = [o.token_ids for o in outputs]
    return out


def test_llm_generate_served_from_the_cache_equals_cold(prompts, cold):
    llm = nextn.LLM(**KW)
    engine = llm.engine
    # all eight at once: the first computes the shared blocks, the others wait for them
    outputs = llm.generate(prompts["greedy"], GREEDY)
    assert [o.token_ids for o in outputs] == cold["greedy"]
    cached = [o.num_cached_tokens for o in outputs]
    assert cached[0] == 0 and min(cached[1:]) >= 1400, cached
    tails = sum(len(p) - c for p, c in zip(prompts["greedy"], cached, strict=True))
    assert engine.prefilled_tokens == tails  # the shared prefix computed once
    # one at a time, seeded: each served from what the greedy requests left
    outputs = [llm.generate(prompt_token_ids=p, params=SEEDED) for p in prompts["seeded"]]
    assert [o.token_ids for o in outputs] == cold["seeded"]
    cached += [o.num_cached_tokens for o in outputs]
    assert min(cached[NUM_REQUESTS:]) >= 1400
    counters = engine.runner.prefix.counters
    assert counters.queries == sum(map(len, prompts["greedy"] + prompts["seeded"])) and counters.hits == sum(cached)


def test_the_server_reports_cached_tokens_and_equals_cold(prompts, cold):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from nextn.config.serve import ServeConfig

    llm = nextn.LLM(**KW)
    with serving(llm, ServeConfig(api_key="k")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120)
        extra = {"ignore_eos": True, "return_token_ids": True}
        body = dict(model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, extra_body=extra)
        for i, p in enumerate(prompts["greedy"]):  # one after another: each served from the first's blocks
            r = client.completions.create(prompt=p, temperature=0.0, **body)
            assert r.choices[0].token_ids == cold["greedy"][i]
            got = r.usage.prompt_tokens_details.cached_tokens
            assert got >= 1400 if i > 0 else got == 0
        for i, p in enumerate(prompts["seeded"]):  # seeded, streamed: the usage chunk carries the cached tokens
            stream = client.completions.create(
                prompt=p, temperature=0.8, seed=11, stream=True, stream_options={"include_usage": True}, **body
            )
            chunks = list(stream)
            assert [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", None) or []] == cold[
                "seeded"
            ][i]
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 1400
        # chat: two conversations with one long system prompt
        system = llm.tokenizer.decode(prompts["greedy"][0][:400])
        chat = [
            client.chat.completions.create(
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                temperature=0.0,
                **body,
            )
            for q in ("What does this do?", "Summarize it.")
        ]
        assert chat[1].usage.prompt_tokens_details.cached_tokens >= 320
        text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer k"}, timeout=10).text
        metrics = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln[:1] != "#"}
        assert metrics["nextn:prefix_cache_hits_total"] >= 15 * 1400
        everything = sum(map(len, prompts["greedy"] + prompts["seeded"]))
        assert metrics["nextn:prefix_cache_queries_total"] >= everything
        assert metrics["nextn:prefix_cache_bytes"] == llm.engine.runner.prefix.nbytes > 0
        computed = metrics["nextn:prefill_tokens_computed_total"]
        assert computed == llm.engine.prefilled_tokens < everything - 15 * 1400 + 1000  # (+ the chats)


def test_n_and_best_of_share_their_prompts_prefill(prompts):
    """n > 1 and best_of: the choices are requests of one prompt, and the prompt's blocks are
    computed once (the choices wait for the first's), each choice what it is alone."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    llm = nextn.LLM(**KW)
    prompt, block = prompts["greedy"][0], llm.config.prefix_block_size
    alone = [llm.generate(prompt_token_ids=prompt, params=dataclasses.replace(SEEDED, seed=11 + i)) for i in range(3)]
    llm = nextn.LLM(**KW)  # a cold cache
    with serving(llm, ServeConfig()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        body = dict(model=client.models.list().data[0].id, max_tokens=MAX_TOKENS, prompt=prompt, temperature=0.8)
        extra = {"ignore_eos": True, "return_token_ids": True}
        r = client.completions.create(n=3, seed=11, extra_body=extra, **body)
        # the prompt computed once, and each choice's last partial block (no block is cached past the prompt)
        assert llm.engine.prefilled_tokens <= len(prompt) + 2 * block, llm.engine.prefilled_tokens
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        before = llm.engine.prefilled_tokens
        client.completions.create(n=1, best_of=3, seed=11, extra_body=extra, **body)
        assert llm.engine.prefilled_tokens - before <= 3 * block  # all three served from the cache
    seeds = {tuple(c.token_ids) for c in r.choices}
    assert seeds == {tuple(o.token_ids) for o in alone}  # choice i: seed 11 + i, as alone


def test_a_tiny_budget_evicts_and_stays_exact(source):
    """A budget of a few blocks: prompts of two different 320-token prefixes take turns, so each
    evicts the other's blocks (a path being extended stays); every output equals the cold one."""
    llm = nextn.LLM(**KW, prefix_cache_gb=2 * 2**20 / 2**30)
    prefix = llm.engine.runner.prefix
    assert prefix.budget == 2 * 2**20
    tails = [source[2000 + 100 * i : 2040 + 100 * i] for i in range(2)]
    prompts = [source[at : at + 320] + tail for at in (0, 5000) for tail in tails]
    expected = [o.token_ids for o in nextn.LLM(**KW, enable_prefix_caching=False).generate(prompts, GREEDY)]
    cached = []
    for _ in range(2):
        for p, expect in zip(prompts, expected, strict=True):
            out = llm.generate(prompt_token_ids=p, params=GREEDY)
            assert out.token_ids == expect
            cached.append(out.num_cached_tokens)
            assert 0 < prefix.nbytes == sum(b.nbytes for b in prefix.lru) <= prefix.budget
    # the second of each pair is served from the first; the first finds the other prefix's blocks in its place
    assert cached[1] > 0 and cached[3] > 0 and cached[4] < cached[1]
    assert prefix.counters.evicted_blocks > 0


def test_chunked_prefill_has_no_prefix_cache(prompts):
    """The chunked kernels' arithmetic depends on where a prompt is cut: a cached prefix would
    change the output, so the cache is off there (the LLM's default prefill) and asking is an error."""
    llm = nextn.LLM(max_model_len=2048)
    assert llm.config.prefill == "chunked" and not llm.config.enable_prefix_caching and llm.engine.runner.prefix is None
    assert llm.generate(prompt_token_ids=prompts["greedy"][0][:300], params=GREEDY).num_cached_tokens == 0
    assert llm.generate(prompt_token_ids=prompts["greedy"][0][:300], params=GREEDY).num_cached_tokens == 0
    with pytest.raises(ValueError, match="prefix caching needs prefill='steps'"):
        EngineConfig("m", prefill="chunked", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prefix_cache_gb would do nothing"):
        EngineConfig("m", prefill="steps", enable_prefix_caching=False, prefix_cache_gb=1.0)
    with pytest.raises(ValueError, match="prefix_block_size must be >= 1"):
        EngineConfig("m", prefill="steps", prefix_block_size=0)
    with pytest.raises(ValueError, match="enable_prefix_caching must be"):
        EngineConfig("m", prefill="steps", enable_prefix_caching="yes")
    assert EngineConfig("m", prefill="steps").prefix_block_size == 128


def test_serve_flags():
    from nextn.cli import parse_args

    assert parse_args(["serve"]).enable_prefix_caching is None
    args = parse_args(["serve", "--no-enable-prefix-caching"])
    assert args.enable_prefix_caching is False
    args = parse_args(["serve", "--enable-prefix-caching", "--prefix-block-size", "32", "--prefix-cache-gb", "2"])
    assert (args.enable_prefix_caching, args.prefix_block_size, args.prefix_cache_gb) == (True, 32, 2.0)


def test_bench_serve_shares_a_prefix_and_reads_the_cache_counters():
    from argparse import Namespace

    from nextn.bench.serve_metrics import parse_metrics, prefix_caching
    from nextn.bench.serve_workload import sample_prompts

    lengths = dict(random_input_len=20, random_output_len=8, random_range_ratio=0.5)
    args = Namespace(num_prompts=6, seed=3, prompt_file=None, prefix_len=40, **lengths)
    tok = Tokenizer(DEFAULT_MODEL_DIR)
    prompts = sample_prompts(args, tok)
    assert all(p.prompt[:40] == prompts[0].prompt[:40] and len(p.prompt) == p.input_len for p in prompts)
    assert len({tuple(p.prompt[40:]) for p in prompts}) == 6 and all(50 <= p.input_len <= 70 for p in prompts)
    before = parse_metrics("nextn:prefix_cache_queries_total 100\nnextn:prefix_cache_hits_total 20\n")
    after = parse_metrics(
        "nextn:prefix_cache_queries_total 300\nnextn:prefix_cache_hits_total 170\n"
        "nextn:prefill_tokens_computed_total 130\n"
    )
    assert prefix_caching(before, after) == {
        "prefix_caching": True,
        "prefix_cache_hit_rate": 150 / 200,
        "prefill_tokens_computed": 130,
    }
    off = parse_metrics("nextn:prefill_tokens_computed_total 7\n")
    assert prefix_caching(off, off)["prefix_caching"] is False and prefix_caching(None, off)["prefix_caching"] is None


def test_a_longer_cached_prefix_replaces_a_kept_session(source):
    """A kept session serves less of a prompt than the cache does: the slot is rebuilt from the cache
    (the session's checkpoint dropped with it), and the output still equals the cold one; a later
    rewind of that conversation finds no stale checkpoint."""
    llm = nextn.LLM(**KW)
    coldllm = nextn.LLM(**KW, enable_prefix_caching=False)
    first = source[:150]
    reply = llm.generate(prompt_token_ids=first, params=GREEDY, use_sessions=True).token_ids
    longer = first + reply + source[3000:3200]
    llm.generate(prompt_token_ids=longer, params=GREEDY)  # (no session: its blocks go to the cache)
    prompt = longer + source[4000:4030]
    out = llm.generate(prompt_token_ids=prompt, params=GREEDY, use_sessions=True)
    B = llm.config.prefix_block_size
    assert out.num_cached_tokens == len(longer) // B * B > len(first + reply)
    assert out.token_ids == coldllm.generate(prompt_token_ids=prompt, params=GREEDY).token_ids
    rewritten = prompt + out.token_ids[:2] + source[5000:5010]  # (the reply rewritten: a rewind)
    again = llm.generate(prompt_token_ids=rewritten, params=GREEDY, use_sessions=True)
    assert again.token_ids == coldllm.generate(prompt_token_ids=rewritten, params=GREEDY).token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton step in CUDA graphs")
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, top_k=20, seed=7)])
def test_served_from_the_cache_equals_cold_on_the_gpu(dense_fitted_ckpt, sampling):
    """The Triton path in bf16, greedy and seeded sampled, drafting: requests sharing a prefix, all at
    once (the later wait for the first's blocks) then one at a time, emit what a cache-off engine emits."""
    kw = dict(model=dense_fitted_ckpt, device="cuda", dtype="bfloat16", num_speculative_tokens=3, prefill="steps")
    warm, cold = nextn.LLM(**kw, prefix_block_size=32), nextn.LLM(**kw, enable_prefix_caching=False)
    params = nextn.SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    rng = random.Random(2)
    prefix = [rng.randrange(340) for _ in range(150)]
    prompts = [prefix + [rng.randrange(340) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    batched = warm.generate(prompts, params)
    assert [o.token_ids for o in batched] == expected and min(o.num_cached_tokens for o in batched[1:]) >= 128
    for p, expect in zip(prompts, expected, strict=True):
        out = warm.generate(prompt_token_ids=p, params=params)
        assert out.token_ids == expect and out.num_cached_tokens >= 128


def test_a_prefill_crosses_every_block_boundary_in_one_step(source):
    """With the cache on, a step's prefill runs a pass per block boundary: a 3.5-block prompt
    is in after one engine step (not one step a block), a boundary cached at each block; a second
    request with the same blocks waits for them and joins the pass after, the same step; both
    equal the cold outputs."""
    llm = nextn.LLM(**KW, prefix_block_size=32)
    engine, prefix = llm.engine, llm.engine.runner.prefix
    prompts = [source[:100] + source[3000 + 20 * i : 3012 + 20 * i] for i in range(2)]
    reqs = [engine.add(p, GREEDY) for p in prompts]
    engine.step()
    assert not engine.prefilling and all(r.request_id in engine.live for r in reqs)
    assert sorted(b.end for b in prefix.lru if b.boundary is not None) == [32, 64, 96]
    assert [r.cached for r in reqs] == [0, 96] and engine.prefilled_tokens == len(prompts[0]) + len(prompts[1]) - 96
    outputs = {}
    while engine.has_work:
        for req, event in engine.step():
            if event.output is not None:
                outputs[req.request_id] = event.output.token_ids
    expected = nextn.LLM(**KW, enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [outputs[r.request_id] for r in reqs] == [o.token_ids for o in expected]
