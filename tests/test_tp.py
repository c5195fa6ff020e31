"""Tensor parallelism (nextn.parallel) on 2 ranks: gloo on the CPU, NCCL where torch sees 2 GPUs.
This process is rank 0 and nextn starts rank 1 (nextn.parallel.launch). A sharded forward (trunk and
MTP head) equals the unsharded one within float32 tolerance and is bitwise the same on both ranks;
the fused Triton step (Triton's interpreter on the CPU) equals the reference step under TP=2; greedy
tokens at TP=2 equal TP=1 on dense, MoE and Qwen3-Next checkpoints, seeded sampled ones too, and
greedy spec == plain under TP=2 for K = 1 and 3, with several requests in one batch; the CLI runs
it; sizes the heads or the devices refuse are one-line errors; the shard plan cuts blocks and pads
the vocabulary; random bench weights at TP=2 are the TP=1 weights cut.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import triton_interp  # noqa: F401  (before triton: the interpreter on the CPU)
from hf_fixtures import FIT_PROMPTS, text_config

import nextn
from nextn.bench import offline as bench
from nextn.cli import main
from nextn.config import EngineConfig, SpecConfig
from nextn.engine.engine import build_core
from nextn.engine.sequence import Sequence
from nextn.models.loader import load_model
from nextn.parallel import launch
from nextn.parallel.shard import Split, shard_tensor

DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
PROMPT = [7, 81, 3, 199, 42, 5, 260, 11, 90, 17]


def _on_two_ranks(fn, *args):
    """fn(*args) on ranks 0 (here) and 1: (rank 0's result, rank 1's)."""
    ranks = launch.start(2, DEVICE, _follower, fn, *args)
    try:
        return fn(*args), ranks.receive()[0]
    finally:
        ranks.close()


def _follower(conn, fn, *args):
    conn.send(fn(*args))


def _sharded(ckpt):
    return load_model(ckpt, device=launch.rank_device(DEVICE), tp=(launch.rank(), 2))


@torch.inference_mode()
def _logits(ckpts, tp: bool = True) -> dict:
    """Per checkpoint, the trunk logits of PROMPT [T, V] and the MTP head's over its rows 1..
    [T-1, V] (whole-sequence forwards, no cache), as numpy arrays."""
    out = {}
    for ckpt in ckpts:
        model = _sharded(ckpt) if tp else load_model(ckpt, device=DEVICE)
        ids = torch.tensor([PROMPT], device=model.lm_head_weight.device)
        normed = model.final_norm(model(ids))
        rope = model.rotary.cos_sin(torch.arange(1, len(PROMPT), device=ids.device), normed.dtype)
        head = model.mtp(model.embed(ids[:, 1:]), normed[:, :-1], rope, None, 0)
        out[(ckpt.name, "trunk")] = model.logits(normed)[0].cpu().numpy()
        out[(ckpt.name, "head")] = model.logits(model.mtp.norm(head))[0].cpu().numpy()
    return out


@pytest.fixture(scope="module")
def sharded_logits(dense_ckpt, moe_ckpt, next_ckpt):
    """_logits of the three checkpoints at TP=2: (rank 0's, rank 1's)."""
    return _on_two_ranks(_logits, [dense_ckpt, moe_ckpt, next_ckpt])


@pytest.mark.parametrize("name", ["dense_ckpt", "moe_ckpt", "next_ckpt"])
def test_sharded_forward_equals_unsharded(name, request, sharded_logits):
    ckpt = request.getfixturevalue(name)
    expected, (mine, theirs) = _logits([ckpt], tp=False), sharded_logits
    for part in ("trunk", "head"):
        key = (ckpt.name, part)
        assert (mine[key] == theirs[key]).all(), f"{part} logits differ between ranks"
        torch.testing.assert_close(torch.from_numpy(mine[key]), torch.from_numpy(expected[key]), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def _triton_and_reference_steps(ckpts) -> dict:
    """Per checkpoint, one uncommitted trunk step of 3 rows after a prefill, by the reference step
    and by the fused Triton step over the same shard and cache: logits [3, V] of each."""
    from nextn.models.qwen3_5_step import TritonStep

    out = {}
    for ckpt in ckpts:
        model = _sharded(ckpt)
        device = model.lm_head_weight.device
        config = EngineConfig(str(ckpt), str(device), "float32", SpecConfig(2), 64, 1, "torch", tensor_parallel_size=2)
        _, runner, _ = build_core(model, config)
        runner.slot(0).reset()
        runner.extend(Sequence(0, heads=False), PROMPT)
        batch, ids = runner.batch([runner.slot(0)], [3]), torch.tensor([5, 77, 300], device=device)
        for kernels, step in (("torch", runner.step), ("triton", TritonStep(model))):
            logits = torch.empty(3, model.cfg.vocab_size, device=device)
            step.trunk(batch, ids, logits, torch.empty(3, model.cfg.hidden_size, device=device))
            out[(ckpt.name, kernels)] = logits.cpu().numpy()
    return out


def test_triton_step_equals_reference_step_under_tp(dense_ckpt, moe_ckpt):
    pytest.importorskip("triton")
    mine, theirs = _on_two_ranks(_triton_and_reference_steps, [dense_ckpt, moe_ckpt])
    for ckpt in (dense_ckpt, moe_ckpt):
        ref, fast = mine[(ckpt.name, "torch")], mine[(ckpt.name, "triton")]
        assert (fast == theirs[(ckpt.name, "triton")]).all()
        torch.testing.assert_close(torch.from_numpy(fast), torch.from_numpy(ref), rtol=1e-4, atol=1e-4)


_SAMPLED = dict(temperature=0.8, top_k=20, seed=5)


def _runs(llm, ks: list[int]) -> dict:
    """For each K: the FIT_PROMPTS (greedy) and one seeded sampled request, all in one batch at
    once -> (token ids of each, drafts accepted in all)."""
    out = {}
    for k in ks:
        cases = [(list(p), {"temperature": 0.0}) for p in FIT_PROMPTS] + [(PROMPT, _SAMPLED)]
        reqs = [
            llm.engine.add(p, nextn.SamplingParams(max_tokens=20, ignore_eos=True, **s), num_speculative_tokens=k)
            for p, s in cases
        ]
        done = {}
        while len(done) < len(reqs):
            for req, ev in llm.engine.step():
                if isinstance(ev, BaseException):
                    raise ev
                if ev.output is not None:
                    done[req.request_id] = ev.output
        outputs = [done[r.request_id] for r in reqs]
        out[k] = ([o.token_ids for o in outputs], sum(o.spec.num_accepted for o in outputs))
    return out


@pytest.mark.parametrize("name", ["dense_fitted_ckpt", "moe_fitted_ckpt", "next_ckpt"])
def test_tp2_tokens_equal_tp1_and_spec_equals_plain(name, request):
    ckpt = request.getfixturevalue(name)
    kwargs = dict(model=ckpt, device=DEVICE, dtype="float32", num_speculative_tokens=3, max_model_len=96)
    expected = _runs(nextn.LLM(**kwargs, max_num_seqs=4), [0])[0][0]
    llm = nextn.LLM(**kwargs, max_num_seqs=4, tensor_parallel_size=2)
    try:
        runs = _runs(llm, [0, 1, 3])
    finally:
        llm.close()
    assert runs[0][0] == expected
    for k in (1, 3):
        assert runs[k][0][: len(FIT_PROMPTS)] == expected[: len(FIT_PROMPTS)], f"greedy spec K={k} != plain"
    if "fitted" in name:  # the head's drafts are accepted: the spec path keeps tokens, not only the bonus
        assert runs[3][1] > 0


def test_cli_generate_with_two_ranks(dense_ckpt, capsys):
    argv = ["generate", str(dense_ckpt), "--device", DEVICE, "--dtype", "float32", "--prompt-ids"]
    argv += [",".join(map(str, PROMPT)), "--max-tokens", "10", "--temperature", "0", "--spec-k", "2", "--json"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(two["token_ids"]) == 10 and two["token_ids"] == one["token_ids"]
    assert not launch.initialized()  # the CLI stopped its ranks and left the group


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_sizes_the_heads_refuse_are_one_line_errors(command, dense_ckpt, capsys):
    argv = [command, "--model", str(dense_ckpt), "--device", "cpu", "--tensor-parallel-size", "3"]
    argv += ["--prompt-ids", "1,2"] if command == "generate" else ["--gen-len", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nextn: error: tensor_parallel_size 3 does not divide num_attention_heads 4"]
    assert not launch.initialized()


def test_more_ranks_than_gpus_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs; torch sees 1"):
        launch.check_ranks(2, "cuda")
    with pytest.raises(ValueError, match="rank r on cuda:r"):
        launch.check_ranks(2, "cuda:1")


def test_shard_plan_cuts_blocks_and_pads_the_vocabulary():
    vocab = torch.arange(14.0).view(7, 2)  # 7 rows over 3 ranks: 3, 3 and 1 + 2 zero rows
    parts = [Split(0, pad=True).take(vocab, r, 3) for r in range(3)]
    assert [tuple(p.shape) for p in parts] == [(3, 2)] * 3
    assert torch.equal(torch.cat(parts)[:7], vocab) and not parts[2][1:].any()
    qkv = torch.arange(6)  # blocks [0 1 | 2 3 4 5]: each rank takes its half of each
    assert Split(0, (2, 4)).take(qkv, 0, 2).tolist() == [0, 2, 3]
    assert Split(0, (2, 4)).take(qkv, 1, 2).tolist() == [1, 4, 5]


def test_random_bench_weights_at_tp2_are_the_tp1_weights_cut(monkeypatch):
    monkeypatch.setitem(bench.PRESETS, "tiny-moe", text_config("moe").to_dict())
    whole = bench.random_model("tiny-moe", "cpu", "float32")
    cfg, whole = whole.cfg, whole.state_dict()
    for r in range(2):
        part = bench.random_model("tiny-moe", "cpu", "float32", tp=(r, 2))
        assert part.cfg.tp_size == 2 and part.cfg.linear_num_value_heads == cfg.linear_num_value_heads // 2
        for name, t in part.state_dict().items():
            assert torch.equal(t, shard_tensor(name, whole[name], cfg, r, 2)), name


class _Recorder:
    """A Leader that keeps what it would send."""

    def __init__(self):
        self.sent = []

    def added(self, request_id, args):
        self.sent.append(args)

    def aborted(self, request_id):
        pass

    def step(self):
        pass


def test_rank_zero_sends_sampled_requests_with_a_seed(dense_ckpt):
    """Every rank must draw a sampled request's uniforms alike: rank 0 draws an unseeded request's
    seed and sends it; a rank that cannot draw for the others (torchrun) refuses such a request."""
    from nextn.engine.engine import Engine

    llm = nextn.LLM(model=dense_ckpt, device="cpu", max_model_len=64, max_num_seqs=2)
    config = dataclasses.replace(llm.config, tensor_parallel_size=2)
    recorder = _Recorder()
    leader = Engine(llm.model, llm.tokenizer, config, leader=recorder)
    sampled = leader.add(PROMPT, nextn.SamplingParams(temperature=0.8))
    greedy = leader.add(PROMPT, nextn.SamplingParams(temperature=0.0))
    assert sampled.params.seed is not None and recorder.sent[0]["params"] == sampled.params
    assert greedy.params.seed is None and recorder.sent[1]["params"] == greedy.params
    with pytest.raises(ValueError, match="a sampled request needs a seed"):
        Engine(llm.model, llm.tokenizer, config).add(PROMPT, nextn.SamplingParams(temperature=0.8))
