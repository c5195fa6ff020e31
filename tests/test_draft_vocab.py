"""A reduced draft vocabulary (FR-Spec): built from a corpus and refused when it cannot serve the
model; the head drafts over the subset (greedy: d2t[argmax over the subset]; sampled: its law
scattered onto target ids, zero elsewhere) while output stays exact: greedy spec == plain, and
sampled spec follows the exact target law even where that law puts mass off the subset."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (before triton: the Triton head test runs under the interpreter on CPU)
from hf_fixtures import FIT_PROMPTS, VOCAB_SIZE, special_token_ids
from test_replay import _live_drafts
from test_sampled_spec import _tv_limit, draw, exact_law

import nextn
from nextn.bench import offline as bench
from nextn.cache.hybrid import KV, NUM_GEN
from nextn.cli import main
from nextn.config import DEFAULT_MODEL_DIR, SpecConfig
from nextn.engine.device_round import Buffers, Member
from nextn.engine.scheduler import Request, RoundSettings
from nextn.sample.sampler import SlotSampler
from nextn.spec.draft_vocab import DraftVocab, DraftVocabError, load_draft_vocab, tokenizer_fingerprint
from nextn.spec.replay import ReplaySettings, replay, replay_rounds, trunk_pass
from nextn.tokenizer import Tokenizer

GREEDY = dict(temperature=0, ignore_eos=True)


def _greedy(llm, prompt, max_tokens=32, **kw):
    params = nextn.SamplingParams(max_tokens=max_tokens, **{**GREEDY, **kw})
    return llm.generate(prompt_token_ids=list(prompt), params=params)


def _vocab(ckpt, ids) -> DraftVocab:
    return DraftVocab(tuple(sorted(set(ids))), tokenizer_fingerprint(Tokenizer(ckpt)))


# --- building and files


def test_cli_ranks_token_frequencies_of_files_folders_and_chats(dense_ckpt, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / ".git").mkdir()
    texts = ["def push(self, item):\n    self.items.append(item)\n" * 3, "The quick brown fox. " * 5]
    (corpus / "pkg" / "a.py").write_text(texts[0])
    (corpus / "b.txt").write_text(texts[1])
    (corpus / ".git" / "c.py").write_text("zzzz " * 100)  # hidden folder: skipped
    (corpus / "blob.bin").write_bytes(b"\xff\xfe\x00" * 50)  # not UTF-8: skipped
    chats = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "Hello, world!"}, {"role": "assistant", "content": "How are you?"}]
    chats.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"text": "It is ten past three."}) + "\n")
    out = tmp_path / "vocab.json"
    argv = ["draft-vocab", str(dense_ckpt), "--data", str(corpus), str(chats), "--size", "30", "--out", str(out)]
    assert main(argv) == 0
    assert "draft-vocab: 30 of 352 ids hold" in capsys.readouterr().err

    tok = Tokenizer(dense_ckpt)
    rendered = tok.apply_chat_template(chat, add_generation_prompt=False)
    counts = Counter(t for text in [*texts, rendered, "It is ten past three."] for t in tok.encode(text))
    eos = sorted({special_token_ids()["<|im_end|>"], special_token_ids()["<|endoftext|>"]})
    ranked = sorted((t for t in counts if t not in eos), key=lambda t: (-counts[t], t))
    vocab = load_draft_vocab(out, VOCAB_SIZE, tok)
    assert vocab.d2t == tuple(sorted(eos + ranked[: 30 - len(eos)]))  # ascending, EOS always in
    s = vocab.settings
    assert (s["files"], s["texts"], s["tokens"], s["size"]) == (4, 4, sum(counts.values()), 30)  # blob.bin: no text
    assert s["coverage"] == pytest.approx(sum(counts[t] for t in vocab.d2t) / sum(counts.values()))
    assert vocab.tokenizer_sha256 == tokenizer_fingerprint(tok)
    vocab.save(tmp_path / "again.json")
    assert load_draft_vocab(tmp_path / "again.json", VOCAB_SIZE, tok) == vocab
    # an --out whose folder is missing is refused before the corpus is counted (it failed after, with [Errno 2])
    assert main([*argv[:-1], str(tmp_path / "missing" / "vocab.json")]) == 2
    assert "its folder does not exist" in capsys.readouterr().err


def test_a_vocabulary_that_cannot_serve_the_model_is_refused(dense_ckpt, tmp_path, capsys):
    tok = Tokenizer(dense_ckpt)
    ours, other = tokenizer_fingerprint(tok), tokenizer_fingerprint(Tokenizer(DEFAULT_MODEL_DIR))
    assert ours != other

    def refused(d2t, sha=ours, **extra) -> str:
        path = tmp_path / "v.json"
        path.write_text(
            json.dumps({"format": "nextn-draft-vocab", "version": 1, "tokenizer_sha256": sha, "d2t": d2t, **extra})
        )
        with pytest.raises(DraftVocabError) as e:
            load_draft_vocab(path, VOCAB_SIZE, tok)
        assert str(path) in str(e.value)
        return str(e.value)

    assert "another tokenizer" in refused([1, 2, 3], sha=other)
    assert "out of range [0, 352): [352, 900]" in refused([5, 352, 900])
    assert "empty" in refused([])
    assert "more than once: [7]" in refused([7, 3, 7])
    assert ">= 0" in refused([-1, 4])
    assert "version" in refused([1], version=2)
    (tmp_path / "v.json").write_text("{not json")
    with pytest.raises(DraftVocabError, match="not JSON"):
        load_draft_vocab(tmp_path / "v.json", VOCAB_SIZE, tok)
    with pytest.raises(ValueError, match="needs speculative decoding"):
        SpecConfig(0, draft_vocab=DraftVocab((1, 2)))
    with pytest.raises(ValueError, match="must be a DraftVocab"):
        SpecConfig(2, draft_vocab="vocab.json")
    # the CLI: one line naming the file and the reason
    DraftVocab((1, 2, 3), other).save(tmp_path / "other.json")
    argv = ["generate", str(dense_ckpt), "--prompt-ids", "5,6", "--draft-vocab", str(tmp_path / "other.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other.json: made for another tokenizer" in err[0]


# --- greedy


def test_greedy_drafts_are_the_subset_argmax(dense_fitted_ckpt):
    """Live drafts == replay's drafts over the subset == d2t[argmax of the full head's logits on
    the subset], and where the subset lacks the full head's pick, the drafts differ from it."""
    full = nextn.LLM(model=dense_fitted_ckpt, device="cpu", num_speculative_tokens=3)  # replay runs on the CPU
    text = list(FIT_PROMPTS[0]) + _greedy(full, FIT_PROMPTS[0], 20).token_ids
    model = full.model
    trunk = trunk_pass(model, text)
    positions = range(1, len(text) - 3, 3)
    with torch.inference_mode():
        full_drafts = {p: d for p, d, _ in replay_rounds(model, trunk, 3, positions)}
    # every token but the full head's first drafts
    vocab = _vocab(dense_fitted_ckpt, set(range(VOCAB_SIZE)) - {int(d[0]) for d in full_drafts.values()})
    reduced = nextn.LLM(model=dense_fitted_ckpt, device="cpu", num_speculative_tokens=3, draft_vocab=vocab)
    head = reduced.engine.proposer.draft
    assert head.lm_head.is_contiguous() and torch.equal(head.lm_head, model.lm_head_weight[head.d2t])
    with torch.inference_mode():
        rounds = list(replay_rounds(model, trunk, 3, positions, draft=head))
        kv = KV(*(torch.zeros(len(text) + 4, model.cfg.num_key_value_heads, model.cfg.head_dim) for _ in range(2)))
        logits = model.head_rows(kv, torch.tensor(text[1:]), trunk.hidden[:-1], 1, last_only=False).logits
    for p, drafts, _ in rounds:
        assert _live_drafts(reduced, text[:p], text[p], 3) == drafts.tolist(), p
        assert all(int(t) in vocab.d2t for t in drafts)
        assert int(drafts[0]) == vocab.d2t[int(logits[p - 1, head.d2t].argmax())]
        assert drafts[0] != full_drafts[p][0]


def test_greedy_spec_equals_plain_with_a_reduced_vocabulary(dense_fitted_ckpt):
    """Tokens the subset lacks cost acceptance, never output, penalties and min_tokens included."""
    plain = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0)
    refs = [_greedy(plain, p).token_ids for p in FIT_PROMPTS]
    seen = Counter(t for p, ref in zip(FIT_PROMPTS, refs, strict=True) for t in [*p, *ref])
    dropped = {t for t, _ in seen.most_common(4)}
    vocab = _vocab(dense_fitted_ckpt, set(seen) - dropped)
    accepted = {}
    for name, dv in (("full", None), ("reduced", vocab)):
        for k in (1, 2, 3, 4, 8):
            llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=k, draft_vocab=dv)
            for prompt, ref in zip(FIT_PROMPTS, refs, strict=True):
                out = _greedy(llm, prompt)
                assert out.token_ids == ref, (name, k, prompt)
                accepted[name] = accepted.get(name, 0) + out.num_accepted
    assert 0 < accepted["reduced"] < accepted["full"]
    llm = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=3, draft_vocab=vocab)
    penalties = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    for prompt in FIT_PROMPTS:
        assert _greedy(llm, prompt, **penalties).token_ids == _greedy(plain, prompt, **penalties).token_ids
    # min_tokens bans the stop ids on the subset's rows too
    stop = next(t for t in refs[0][2:] if t in vocab.d2t)
    banned = dict(min_tokens=10, stop_token_ids=[stop], ignore_eos=False)
    out = _greedy(llm, FIT_PROMPTS[0], **banned).token_ids
    assert out == _greedy(plain, FIT_PROMPTS[0], **banned).token_ids and stop not in out[:10]


# --- sampled


def test_sampled_drafts_put_their_law_on_the_subset(dense_fitted_ckpt):
    """One sampled draft step: q is the subset's filtered, penalized law on target ids (zero off
    the subset) and the draft is a subset token."""
    vocab = _vocab(dense_fitted_ckpt, range(0, VOCAB_SIZE, 2))
    llm = nextn.LLM(model=dense_fitted_ckpt, device="cpu", num_speculative_tokens=2, draft_vocab=vocab)
    params = nextn.SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.5, seed=3)
    context = list(FIT_PROMPTS[0])
    engine = llm.engine
    req = Request(context, RoundSettings(params))
    engine.scheduler.add(req)
    engine.scheduler.admit()
    cache = engine.runner.slot(req.seq.slot)
    cache.reset()
    req.seq.heads = True
    with torch.inference_mode():
        engine.runner.extend(req.seq, context)
        engine.runner.catch_up(req.seq)
        buf, sampler = Buffers.of(cache), SlotSampler(cache)
        sampler.start(params, context)
        buf.verify_ids[0] = buf.head_ids[0] = 198
        buf.hidden[0] = req.seq.last_hidden
        cache.set(accepted=0, num_gen=1)
        engine.proposer.propose([Member(cache, sampler, buf, 2)])
        q, drafts = buf.draft_q[:2].clone(), buf.verify_ids[1:3].tolist()
        second = engine.proposer.logits[:1].clone()  # the chain's step wrote over draft 1's logits
    engine.scheduler.finish(req, keep=False)
    d2t = torch.tensor(vocab.d2t)
    off = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    off[d2t] = False
    assert all(t in vocab.d2t for t in drafts) and cache.get(NUM_GEN) == 1
    assert torch.all(q[:, off] == 0) and torch.allclose(q.sum(-1), torch.ones(2))
    assert (q[:, d2t] > 0).sum(-1).tolist() == [5, 5] and all(q[j, t] > 0 for j, t in enumerate(drafts))
    # the second draft's law, recomputed on the subset with the target history (prompt + draft 1)
    x = second[0].double()
    seen = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    seen[torch.tensor([*context, drafts[0]])] = True
    x = torch.where(seen[d2t], torch.where(x > 0, x / 1.5, x * 1.5), x)
    p = torch.softmax(x / 0.9, -1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[p.topk(5).indices] = True
    expected = torch.where(keep, p, 0.0)
    torch.testing.assert_close(q[1, d2t].double(), expected / expected.sum(), atol=1e-5, rtol=1e-4)


def test_sampled_spec_with_a_reduced_vocabulary_matches_the_exact_law(dense_fitted_ckpt):
    """The subset lacks two likely first tokens: they are still emitted as often as the target law
    says (their q is 0, so the residual keeps their mass), and drafts are accepted elsewhere."""
    cfg, draws = dict(temperature=0.9, top_k=8), 1200
    law = exact_law(dense_fitted_ckpt, cfg)
    first = Counter()
    for seq, mass in law.items():
        first[seq[0]] += mass
    dropped = [t for t, _ in first.most_common(3)[1:]]
    vocab = _vocab(dense_fitted_ckpt, set(range(VOCAB_SIZE)) - set(dropped))
    seen, accepted, drafted = draw(dense_fitted_ckpt, cfg, draws, num_speculative_tokens=2, draft_vocab=vocab)
    assert sum(seen.values()) == draws
    assert all(seq in law for seq in seen), "a draw outside the filtered support"
    tv = 0.5 * sum(abs(seen.get(s, 0) / draws - p) for s, p in law.items())
    assert tv <= _tv_limit(law, draws), tv
    emitted = sum(n for seq, n in seen.items() if seq[0] in dropped) / draws
    mass = sum(first[t] for t in dropped)
    assert mass > 0.1 and abs(emitted - mass) < 4 * np.sqrt(mass * (1 - mass) / draws)
    assert 0 < accepted < drafted


# --- replay, generate, bench, the Triton head


def test_replay_and_generate_take_a_draft_vocabulary_file(dense_fitted_ckpt, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def push(self, item):\n    self.items.append(item)\n\nclass Stack:\n    pass\n" * 4)
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", str(dense_fitted_ckpt), "--data", str(corpus), "--size", "24", "--out", str(out)]) == 0
    text = tmp_path / "eval.py"
    text.write_text("class Stack:\n    def push(self, item):\n        self.items.append(item)\n" * 3)
    results = {}
    for extra in ([], ["--draft-vocab", str(out)]):
        capsys.readouterr()
        argv = ["replay", str(dense_fitted_ckpt), "--file", str(text), "--k", "2", "--json", *extra]
        assert main(argv) == 0
        results[bool(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results[True]["draft_vocab_size"] == 24 and results[False]["draft_vocab_size"] is None
    assert results[True]["nll"] == results[False]["nll"]  # the trunk is untouched
    ids = Tokenizer(dense_fitted_ckpt).encode(text.read_text())
    model = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0).model
    vocab = load_draft_vocab(out, VOCAB_SIZE, Tokenizer(dense_fitted_ckpt))
    direct = replay(model, ids, ReplaySettings(2, draft_vocab=vocab), progress=False)
    assert direct.acceptance_per_position == results[True]["acceptance_per_position"]
    outs = {}
    for extra in ([], ["--draft-vocab", str(out)]):
        argv = ["generate", str(dense_fitted_ckpt), "--prompt-ids", ",".join(map(str, FIT_PROMPTS[1]))]
        assert main([*argv, "--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--json", *extra]) == 0
        outs[bool(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs[True]["token_ids"] == outs[False]["token_ids"] and outs[True]["num_drafted"] > 0


def test_bench_drafts_over_the_first_ids(dense_fitted_ckpt, tmp_path):
    """`--draft-vocab-size N` (meant for random presets): the head's engines draft over ids 0..N-1
    and the report records it."""
    out = tmp_path / "res.json"
    argv = ["bench", str(dense_fitted_ckpt), "--spec-k", "2", "--prompt-len", "8", "--gen-len", "6", "--repeats", "1"]
    assert main([*argv, "--draft-vocab-size", "64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["draft_vocab_size"] == 64 and res["spec_equals_plain"] == {"2": True} and res["draft_cost_ratio"] > 0
    model = nextn.LLM(model=dense_fitted_ckpt, num_speculative_tokens=0).model
    b = bench.Bench(model, [1, 2, 3], bench.BenchConfig(spec_ks=[2]), DraftVocab.first(64, VOCAB_SIZE))
    proposer = b.core(2)[2]
    assert proposer.logits.shape[1] == 64 and torch.equal(proposer.draft.lm_head, model.lm_head_weight[:64])
    assert b.core(0)[2] is None  # plain decoding has no head to reduce
    with pytest.raises(DraftVocabError, match=f"1..{VOCAB_SIZE}"):
        DraftVocab.first(VOCAB_SIZE + 1, VOCAB_SIZE)


def test_triton_head_scores_the_subset_rows(dense_ckpt):
    """The fused step's head over a draft vocabulary's rows == the reference step's, and both
    equal the full head's logits at those rows; greedy spec == plain on the Triton path."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter runs Triton on the CPU)
    vocab = _vocab(dense_ckpt, range(3, VOCAB_SIZE, 3))
    engines = {
        kernels: nextn.LLM(
            model=dense_ckpt,
            device=device,
            dtype="float32",
            kernels=kernels,
            num_speculative_tokens=2,
            max_model_len=64,
            max_num_seqs=1,
            draft_vocab=vocab,
        ).engine
        for kernels in ("torch", "triton")
    }
    H = engines["torch"].model.cfg.hidden_size
    ids = torch.tensor([5, 77, 300, 9], device=device)
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(0)).to(device)
    outs = []
    for engine in engines.values():
        cache, proposer = engine.runner.slot(0), engine.proposer
        for t in cache.draft_kv()[:2]:  # key, value
            t.zero_()
        full, sub = torch.empty(1, VOCAB_SIZE, device=device), torch.empty(1, vocab.size, device=device)
        chained = torch.empty(1, H, device=device)
        pos, row = torch.tensor([6], dtype=torch.int32, device=device), torch.tensor([2], device=device)
        with torch.inference_mode():
            batch = engine.runner.batch([cache], [4])
            engine.runner.step.head(batch, ids, hidden, pos, row, (sub, chained), proposer.lm_head)
            engine.runner.step.head(batch, ids, hidden, pos, row, (full, chained))
        torch.testing.assert_close(sub, full[:, proposer.draft.d2t], rtol=1e-5, atol=1e-5)
        outs.append(sub)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    prompt = [7, 81, 3, 199, 42, 5]
    plain = nextn.LLM(model=dense_ckpt, kernels="triton", num_speculative_tokens=0, max_model_len=64, max_num_seqs=1)
    triton = nextn.LLM(
        model=dense_ckpt,
        kernels="triton",
        num_speculative_tokens=2,
        max_model_len=64,
        max_num_seqs=1,
        draft_vocab=vocab,
    )
    # the random head's drafts are all rejected: 4 rounds of drafts over the subset rows, each rolled
    # back, and the next one drafting from the restored state (8 tokens ran 7 such rounds)
    out = _greedy(triton, prompt, 5)
    assert out.token_ids == _greedy(plain, prompt, 5).token_ids and out.spec.num_rounds >= 4 and out.num_drafted > 0
