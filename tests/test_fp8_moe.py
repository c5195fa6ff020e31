"""The largest presets one GPU holds in FP8 (issue 50), on the CPU: Qwen3-Next-80B-A3B (512 experts,
10 routed) and Qwen3.5-122B-A10B (256, 8 routed), their shapes as published, drawn at small scale
with the same expert counts straight into FP8 (no whole copy in the model's dtype), the fit line
before any weight is drawn, the FP8 MoE kernels at 512 experts and top-10 against their references
(the decode block's rows invariant, the prefill's grouped GEMM reading e4m3), the spec == plain
contract through the Triton step with an FP8 MoE trunk, and the bench's roofline counted from the
routing. On CPU the Triton kernels run under Triton's interpreter (triton_interp.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
import triton_interp  # noqa: F401  (before triton)
from hf_fixtures import tiny_preset

from nextn.bench.roofline import distinct_experts, routing, verify_steps
from nextn.layers.ffn import QuantExperts, SparseMoeBlock
from nextn.layers.linear import QuantLinear
from nextn.models import random_weights
from nextn.models.qwen3_5 import CausalLM
from nextn.ops.fp8 import QuantWeight, dequantize, quantize
from nextn.ops.moe import routed_experts

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _small(preset: str, **sizes) -> dict:
    """A released MoE preset at test scale: the same expert counts, top-k and shared expert, the tiny
    preset's sizes (what it changes of the 9B's: heads, four layers, three GDN and one attention),
    128 wide (one FP8 block), experts 32 wide."""
    tiny, nine = tiny_preset(vocab_size=512), random_weights.PRESETS["qwen3.5-9b"]
    small = {key: v for key, v in tiny.items() if v != nine[key]}
    small |= dict(hidden_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return dict(random_weights.PRESETS[preset], **(small | sizes))


def _params(preset: str) -> tuple[int, int]:
    """(parameters without the MTP head, of them active: all but the experts a token does not route to)."""
    with torch.device("meta"):
        m = CausalLM(random_weights.preset_config(preset), num_mtp_layers=1)
    cfg = m.cfg
    trunk = {n: p.numel() for n, p in m.named_parameters() if not n.startswith("mtp.")}
    active = sum(
        n * (cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name else 1) for name, n in trunk.items()
    )
    return sum(trunk.values()), int(active)


def test_released_presets_have_the_published_sizes():
    """The sizes the names and model cards state: 122.11B parameters without the MTP head (the
    figure of the GGUF conversions; it fixes the GDN heads the preset could not source), about 10B
    active; Qwen3-Next 80B (79.7B without the head, 81B with it), about 3B active (the names round);
    the expert counts."""
    total, active = _params("qwen3.5-122b-a10b")
    assert round(total / 1e9, 2) == 122.11 and 9.5 < active / 1e9 < 10.5  # 9.77B, embeddings counted
    total, active = _params("qwen3-next-80b-a3b")
    assert round(total / 1e9) == 80 and 3 < active / 1e9 < 4  # 3.87B (3.26B without the vocabulary's rows)
    next80, q122 = (random_weights.preset_config(p) for p in ("qwen3-next-80b-a3b", "qwen3.5-122b-a10b"))
    assert (next80.family, next80.num_experts, next80.num_experts_per_tok) == ("qwen3_next", 512, 10)
    assert (q122.family, q122.num_experts, q122.num_experts_per_tok) == ("qwen3_5_moe", 256, 8)
    assert next80.layer_types.count("full_attention") == q122.layer_types.count("full_attention") == 12
    assert "qwen3.5-27b" in random_weights.PRESETS


@pytest.mark.parametrize("preset", ["qwen3-next-80b-a3b", "qwen3.5-122b-a10b"])
def test_presets_draw_at_small_scale_straight_into_fp8(preset, monkeypatch, caplog):
    """FP8 weights drawn a chunk of experts at a time (a chunk here: 3 experts' float32), quantized
    as the loader quantizes (every 128x128 block's scale its amax / 448), the fit line logged first;
    the trunk's experts QuantExperts, the MTP head's in the model dtype (as quantized_at_load leaves them)."""
    monkeypatch.setitem(random_weights.PRESETS, "small", _small(preset))
    cfg = random_weights.preset_config("small")
    monkeypatch.setattr(random_weights, "FP8_DRAW_BYTES", 3 * 4 * 2 * cfg.moe_intermediate_size * cfg.hidden_size)
    drawn = []
    real = random_weights.quantize_weight
    monkeypatch.setattr(
        random_weights, "quantize_weight", lambda n, w, *f: drawn.append((n, w.shape)) or real(n, w, *f)
    )
    with caplog.at_level(logging.INFO, logger=random_weights.__name__):
        model = random_weights.random_model("small", "cpu", "float32", quantization="fp8")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fit:")]
    assert "the small preset in float32 with FP8 weights: weights" in line and "sequences fit" in line
    assert "a sequence of 8192 tokens at K=3" in line
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts) and experts.gate_up_proj.shape[0] == cfg.num_experts
    assert isinstance(model.model.layers[0].mlp.shared_expert.down_proj, QuantLinear)
    assert not isinstance(model.mtp.layers[0].mlp.experts, QuantExperts)
    chunks = {}
    for name, shape in drawn:
        if ".experts." in name:
            chunks.setdefault(name.rpartition(".")[2], set()).add(shape[0])
    E = cfg.num_experts  # never a whole stack: chunks of 3 experts' gate/up, 6 experts' down (half the size)
    assert chunks == {
        "gate_up_proj": {min(3, E - e) for e in range(0, E, 3)},
        "down_proj": {min(6, E - e) for e in range(0, E, 6)},
    }
    w = dequantize(experts.down_proj, experts.down_proj_scale, torch.float32)
    amax = w[:, :128, :].abs().amax(dim=(1, 2))  # the first block of each expert's down_proj
    torch.testing.assert_close(amax / experts.down_proj_scale[:, 0, 0], torch.full_like(amax, 448.0))
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    assert random_weights.weight_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_fp8_under_tensor_parallelism_is_refused_before_a_weight_is_drawn(monkeypatch):
    monkeypatch.setitem(random_weights.PRESETS, "small", _small("qwen3.5-122b-a10b"))
    monkeypatch.setattr(random_weights, "_random_", lambda *a: pytest.fail("a weight was drawn"))
    with pytest.raises(ValueError, match=r"does not shard quantized \(fp8\) weights"):
        random_weights.random_model("small", "cpu", "float32", quantization="fp8", tp=(0, 2))


def test_the_fit_check_counts_fp8_bytes_and_refuses_in_one_line(monkeypatch):
    """A shape whose FP8 weights do not fit the free memory is refused before a weight is drawn,
    naming the FP8 bytes; the fit plan's cache arithmetic is nextn.engine.memory's."""
    monkeypatch.setitem(random_weights.PRESETS, "small", _small("qwen3-next-80b-a3b"))
    monkeypatch.setattr(random_weights, "_random_", lambda *a: pytest.fail("a weight was drawn"))
    monkeypatch.setattr(random_weights, "available_bytes", lambda device: 2**20)
    with pytest.raises(ValueError, match=r"weights take 0\.\d GiB in float32 with FP8 weights, more than the 0\.0"):
        random_weights.random_model("small", "cpu", "float32", quantization="fp8")


# ---------------------------------------------------------------------------------------------
# the FP8 MoE kernels at 512 experts, top-10


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on the interpreter; on a GPU Triton lays an e4m3 tile out by its element size, so
    the in-tile sums of FP8 weights may add in another order than the dequantized copies' (test_fp8)."""
    if not CUDA:
        return torch.equal(a, b)
    tol = 1e-5 if a.dtype == torch.float32 else 2**-7
    return bool(((a.float() - b.float()).abs() <= tol * (1 + b.float().abs())).all())


def _fp8_stack(E, n, k, g):
    w = torch.randn(E, n, k, generator=g, device=DEVICE) * k**-0.5
    q = quantize(w)
    return q, dequantize(q.weight, q.scale, torch.float32).contiguous()  # (a partial block: a view)


def test_fp8_moe_decode_block_at_512_experts_top_10():
    """The decode block (router, experts' gate/up and down, shared expert, nextn.ops.triton_moe) over
    FP8 weights at Qwen3-Next's expert count and top-k: bit for bit the same kernels over the
    dequantized copies (the interpreter sums tiles alike), each row alone bit for bit its row of the
    batch, and the reference block's values (float32: up to the in-tile summation order)."""
    from nextn.ops.triton_moe import moe_step

    g = torch.Generator(device=DEVICE).manual_seed(1)
    E, k, H, I, Is, T = 512, 10, 128, 32, 32, 2
    (gu8, gu), (dn8, dn) = _fp8_stack(E, 2 * I, H, g), _fp8_stack(E, H, I, g)
    shared = [_fp8_stack(1, *shape, g) for shape in ((Is, H), (Is, H), (H, Is))]
    s8 = [QuantWeight(q.weight[0], q.scale[0]) for q, _ in shared]
    s = [d[0] for _, d in shared]
    gates = torch.randn(E + 1, H, generator=g, device=DEVICE) * H**-0.5
    x, norm = torch.randn(T, H, generator=g, device=DEVICE), torch.zeros(H, device=DEVICE)

    def run(rows, *ws):
        return moe_step(rows, norm, 1e-6, gates, *ws, k, True)

    out = run(x, gu8, dn8, *s8)
    assert _same(out, run(x, gu, dn, *s))
    for t in range(T):
        assert torch.equal(run(x[t : t + 1], gu8, dn8, *s8)[0], out[t]), t
    block = _reference_block(E, k, H, I, Is, gates, gu, dn, s).to(DEVICE)
    torch.testing.assert_close(out, x + block(torch.nn.functional.rms_norm(x, (H,), eps=1e-6)), rtol=1e-5, atol=1e-5)


def _reference_block(E, k, H, I, Is, gates, gu, dn, s) -> SparseMoeBlock:
    from nextn.config.model import ModelConfig

    cfg = ModelConfig.from_dict(_small("qwen3-next-80b-a3b", hidden_size=H, moe_intermediate_size=I))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (E, k, Is)
    block = SparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(gates[:E])
        block.shared_expert_gate.weight.copy_(gates[E:])
        block.experts.gate_up_proj.copy_(gu)
        block.experts.down_proj.copy_(dn)
        se = block.shared_expert
        for p, w in zip((se.gate_proj, se.up_proj, se.down_proj), s, strict=True):
            p.weight.copy_(w)
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_grouped_experts_at_512_experts_top_10(dtype):
    """The prefill's grouped GEMMs read e4m3 experts and dequantize each tile as `dequantize` does:
    the grouped GEMMs over the dequantized copies (bit for bit on the interpreter), and the reference's values; the
    reference over QuantWeight (one routed expert dequantized at a time) is bit for bit the reference
    over the whole dequantized stack."""
    from nextn.ops.triton_moe_grouped import grouped_experts

    g = torch.Generator(device=DEVICE).manual_seed(3)
    E, k, H, I, N = 512, 10, 128, 64, 9
    (gu8, gu), (dn8, dn) = _fp8_stack(E, 2 * I, H, g), _fp8_stack(E, H, I, g)
    x, top_idx, top_w = grouped_matches_dequantized(gu8, dn8, gu, dn, k, N, dtype, g)
    with pytest.raises(ValueError, match="both be FP8"):
        grouped_experts(x, top_idx, top_w, gu8, dn)


def grouped_matches_dequantized(gu8, dn8, gu, dn, k, N, dtype, g):
    """The grouped GEMMs over quantized experts (gu8, dn8: QuantWeight) against the same over their
    dequantized float32 copies (gu, dn), and against the reference; N random rows routed to k of
    them. Returns the rows and their routing."""
    from nextn.ops.triton_moe_grouped import grouped_experts

    E, _, H = gu.shape
    gu, dn = gu.to(dtype), dn.to(dtype)
    x = torch.randn(N, H, generator=g, device=DEVICE).to(dtype)
    top_w, top_idx = torch.topk(torch.softmax(torch.randn(N, E, generator=g, device=DEVICE), -1), k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dtype)
    out = grouped_experts(x, top_idx, top_w, gu8, dn8)
    assert _same(out, grouped_experts(x, top_idx, top_w, gu, dn))
    ref = routed_experts(x, top_idx, top_w, gu8, dn8)
    assert torch.equal(ref, routed_experts(x, top_idx, top_w, gu, dn))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    return x, top_idx, top_w


# ---------------------------------------------------------------------------------------------
# the roofline from the routing


def test_routing_counts_the_distinct_experts_a_step_reads(monkeypatch):
    """One row routes to top-k distinct experts a layer; a verify window of K + 1 rows to their
    union (more than top-k, at most (K + 1) * top-k); B copies of one row to top-k. The bytes follow
    the counts: a verify step reads more than a decode step, less than (K + 1) of them."""
    monkeypatch.setitem(random_weights.PRESETS, "small", _small("qwen3-next-80b-a3b"))
    model = random_weights.random_model("small", "cpu", "float32", quantization="fp8")
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    routed = routing(model, ids)
    assert len(routed) == 4 and routed[0].shape == (24, 10)
    assert distinct_experts(routed, [[p] for p in range(24)]) == [10.0] * 4
    assert distinct_experts(routed, [[5] * 8]) == [10.0] * 4
    union = distinct_experts(routed, verify_steps(8, 24, 3))
    assert verify_steps(8, 24, 3) == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    assert all(10 < u <= 40 for u in union)
    one, four = (random_weights.weight_bytes_per_token(model, c) for c in ([10.0] * 4, union))
    assert one == random_weights.weight_bytes_per_token(model) and one < four < 4 * one
    with pytest.raises(ValueError, match="4 MoE layers"):
        random_weights.weight_bytes_per_token(model, [10.0])
