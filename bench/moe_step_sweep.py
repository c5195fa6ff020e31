"""The decode MoE block (`nextn.ops.triton_moe.moe_step`) at Qwen3.5-35B-A3B's shape (256 experts,
top 8 renormalised, H 2048, I 512, shared expert 512, bf16) over 1 and 4 rows, at the kernels'
block configs against their defaults. (Run 72 also timed the kernels before the slot-parallel down
kernel: bench/results/moe_step_sweep_run72.json, made by this file at commit 19a8f4f.)

Each config is timed in a CUDA graph of 50 calls cycling over LAYERS layers' own weights (1.6 GB of
experts each, so no call finds its weights in the 50 MB L2), the call as a step runs it: norm and
router, gate/up, down. The gate/up configs run with the default down config, and the other way
round. Reports microseconds per call, GB/s of the expert weights the call reads (its rows' distinct
routed experts and the shared expert, gate/up and down), and whether the output equals the
defaults' bit for bit (configs with BLOCK < 2 * num_warps lay an e4m3 tile out differently, so
there FP8 weights would sum in another order; bf16, timed here, keeps its order).

  python bench/moe_step_sweep.py --out moe_step_sweep.json
  python bench/moe_step_sweep.py --quantization q8_0 --out moe_step_sweep_q8_0.json   # experts in Q8_0 (or fp8)
  python bench/moe_step_sweep.py --preset qwen3-next-80b-a3b --quantization fp8   # another preset's block
  TRITON_INTERPRET=1 python bench/moe_step_sweep.py --check   # CPU: every config equals the defaults
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402

from nextn.models.random_weights import preset_config  # noqa: E402
from nextn.ops import triton_moe, triton_utils  # noqa: E402
from nextn.ops.fp8 import QuantWeight, quantize  # noqa: E402
from nextn.ops.linear_tune import graph_us  # noqa: E402
from nextn.ops.norm import rms_norm  # noqa: E402
from nextn.ops.triton_linear import skinny_linear  # noqa: E402
from nextn.ops.triton_moe import moe_step  # noqa: E402
from nextn.ops.triton_norm import rms_norm as triton_rms_norm  # noqa: E402

E, TOP_K, H, I, IS = 256, 8, 2048, 512, 512  # the block's sizes: qwen3.5-35b-a3b's, or --preset's
EPS = 1e-6
# (BLOCK, num_warps); the last three have BLOCK < 2 * num_warps, where FP8 tiles would sum in another order
GATE_UP = [(16, 4), (8, 4), (4, 2), (4, 1), (2, 1), (1, 1), (4, 4), (8, 8)]
DOWN = [(16, 4), (32, 8), (8, 4), (4, 2), (4, 1), (2, 1), (1, 1), (4, 4), (8, 8)]
ROUTER = [(2, 4), (4, 4), (1, 1), (2, 1), (4, 1), (2, 2)]  # (logits per program, num_warps) of the norm / router kernel


def variants(gate_up_configs, down_configs, router_blocks=()) -> dict:
    """name -> moe_step-like callable: the defaults, each gate/up config (the default down config),
    each down config (the default gate/up config) and each norm / router kernel size."""
    out = {
        "default": moe_step,
        "no pdl": lambda *a, **kw: moe_step(*a, pdl=False, **kw),
        "no asm round": lambda *a, **kw: moe_step(*a, asm_round=False, **kw),  # Triton's convert a value
    }
    for cfg in router_blocks:
        out[f"router {cfg}"] = lambda *a, c=cfg, **kw: moe_step(*a, router_blocks=c, **kw)
    for cfg in gate_up_configs:
        out[f"gate_up {cfg}"] = lambda *a, c=cfg, **kw: moe_step(*a, gate_up_blocks=c, **kw)
    for cfg in down_configs:
        out[f"down {cfg}"] = lambda *a, c=cfg, **kw: moe_step(*a, down_blocks=c, **kw)
    return out


def layer(E, H, I, Is, dtype, device, gen, quantization=None):
    """A layer's MoE weights, each matrix scaled by its fan-in^-1/2 (the block's arguments after x,
    norm, eps); quantization "q8_0" / "fp8": the experts' and the shared expert's quantized (the
    router's rows stay in dtype, as a quantized checkpoint keeps them)."""
    from nextn.ops.q8_0 import q8_0_quantize

    quant = {None: lambda t: t.to(dtype), "q8_0": q8_0_quantize, "fp8": quantize}[quantization]

    def w(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * shape[-1] ** -0.5

    gates = w(E + 1, H).to(dtype)
    return [gates, *(quant(w(*shape)) for shape in ((E, 2 * I, H), (E, H, I), (Is, H), (Is, H), (H, Is)))]


def nbytes(w) -> int:
    """A weight's bytes (a quantized one's values and scales)."""
    parts = (w.weight, w.scale) if isinstance(w, QuantWeight) else (w,)
    return sum(p.numel() * p.element_size() for p in parts)


def check() -> None:
    """The configs against the defaults on tiny shapes (the interpreter): bit for bit, bf16 and
    float32, with and without the residual, partial blocks of H, I and Is, H over two k-tiles."""
    gen = torch.Generator().manual_seed(0)
    cases = [  # (E, k, H, I, Is, T, dtype, residual, configs): the interpreter is slow, so few at a time
        (8, 3, 72, 40, 24, 2, torch.bfloat16, True, (GATE_UP, DOWN)),
        (8, 3, 72, 40, 24, 2, torch.bfloat16, False, (GATE_UP[:2], DOWN[:2])),
        (8, 3, 72, 40, 24, 2, torch.float32, True, (GATE_UP[:2], DOWN[:2])),
        (4, 2, 288, 40, 24, 1, torch.bfloat16, True, (GATE_UP[:2], DOWN[:2])),
    ]
    for E, k, H, I, Is, T, dtype, residual, configs in cases:
        ws = layer(E, H, I, Is, dtype, "cpu", gen)
        x, norm = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((T, H), (H,)))
        want = moe_step(x, norm, EPS, *ws, k, True, residual=residual)
        for name, fn in variants(*configs).items():
            assert torch.equal(fn(x, norm, EPS, *ws, k, True, residual=residual), want), (name, E, H, dtype, residual)
        print(
            f"E={E} H={H} I={I} Is={Is} {dtype} residual={residual}: {len(configs[0]) + len(configs[1])} configs "
            "equal the defaults bit for bit"
        )


def expert_bytes(ws, x, norm, top_k) -> int:
    """The expert weight bytes one call reads: its rows' distinct routed experts and the shared expert."""
    gates, gate_up, down, shared_gate, shared_up, shared_down = ws
    logits = torch.nn.functional.linear(rms_norm(x, norm, EPS), gates[:-1]).float()
    routed = logits.topk(top_k, dim=-1).indices.unique().numel()
    per_expert = (nbytes(gate_up) + nbytes(down)) // gate_up.shape[0]  # (a QuantWeight's shape: its values')
    return routed * per_expert + nbytes(shared_gate) + nbytes(shared_up) + nbytes(shared_down)


def first_launches(xs, norms, layers) -> dict:
    """The block's first launch alone, the norm / router kernel (which also routes) at each size,
    against the norm kernel and the skinny GEMM over the router and shared gate rows, which it
    replaced (the routing then ran in every gate/up program)."""
    T = xs[0].shape[0]
    stride = -(-(E + 1) // 16) * 16
    h, logits = torch.empty_like(xs[0]), torch.empty(T, stride, device=xs[0].device, dtype=xs[0].dtype)
    idx = torch.empty(T, TOP_K, device=h.device, dtype=torch.int32)
    rw = torch.empty(T, TOP_K + 1, device=h.device, dtype=h.dtype)
    counters = triton_utils.arrival_counters(h.device, T)
    calls = {
        "norm + router GEMM (before)": lambda i: skinny_linear(
            triton_rms_norm(xs[i], norms[i], EPS), layers[i][0], out=logits[:, : E + 1]
        )
    }
    for rows, warps in ROUTER:
        calls[f"norm_router {(rows, warps)}"] = lambda i, r=rows, w=warps: triton_moe._norm_router_kernel[
            (T, -(-(E + 1) // r))
        ](
            xs[i], norms[i], layers[i][0], h, logits, counters, idx, rw, EPS, H=H, E=E, LOGIT_STRIDE=stride,
            TOP_K=TOP_K, RENORM=True, BLOCK_R=r, BLOCK_H=H, BLOCK_E=E, WARPS=w, PDL=False, RELEASE=0, num_warps=w,
        )  # fmt: skip
    out = {}
    for name, call in calls.items():
        out[name] = graph_us(call, len(layers), 50)
        print(f"T={T} first launch: {name:28s} {out[name]:6.2f} us")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=4, help="layers of weights the graph cycles over")
    ap.add_argument("--check", action="store_true", help="CPU: every config equals the defaults (tiny shapes)")
    ap.add_argument("--quantization", choices=["q8_0", "fp8"], default=None, help="the experts' weights quantized")
    ap.add_argument("--preset", default="qwen3.5-35b-a3b", help="the MoE preset whose block sizes to time")
    args = ap.parse_args()
    if args.check:
        return check()
    global E, TOP_K, H, I, IS
    cfg = preset_config(args.preset)
    E, TOP_K, H, I, IS = (
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    )
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [layer(E, H, I, IS, torch.bfloat16, device, gen, args.quantization) for _ in range(args.layers)]
    defaults = {
        "gate_up": triton_moe.GATE_UP_BLOCKS,
        "down": triton_moe.DOWN_BLOCKS,
        "router": triton_moe.ROUTER_BLOCKS,
    }
    report = {
        "device": torch.cuda.get_device_name(),
        "quantization": args.quantization,
        "preset": args.preset,
        "block": {"experts": E, "top_k": TOP_K, "hidden": H, "intermediate": I, "shared_intermediate": IS},
        "defaults": defaults,
        "layers": args.layers,
        "rows": {},
    }
    for T in (1, 4):
        xs = [torch.randn(T, H, generator=gen, device=device).bfloat16() for _ in layers]
        norms = [torch.randn(H, generator=gen, device=device).bfloat16() for _ in layers]
        nbytes = sum(expert_bytes(ws, x, n, TOP_K) for ws, x, n in zip(layers, xs, norms, strict=True)) / len(layers)
        want = moe_step(xs[0], norms[0], EPS, *layers[0], TOP_K, True)
        entry = report["rows"][T] = {"expert_bytes_per_call": nbytes}
        for name, fn in variants(GATE_UP, DOWN, ROUTER).items():

            def call(i, fn=fn, xs=xs, norms=norms):
                fn(xs[i], norms[i], EPS, *layers[i], TOP_K, True)

            us = graph_us(call, len(layers), 50)
            same = torch.equal(fn(xs[0], norms[0], EPS, *layers[0], TOP_K, True), want)
            entry[name] = {"us": us, "GB/s": nbytes / us / 1e3, "equals_default": same}
            bits = "=" if same else "DIFFERS from"
            print(f"T={T} {name:16s} {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s  {bits} default")
        entry["first_launches"] = first_launches(xs, norms, layers)
        for kind in ("gate_up", "down", "router"):
            best = min((v["us"], k) for k, v in entry.items() if k.startswith(kind))
            print(f"T={T} fastest {kind}: {best[1]} ({best[0]:.1f} us; default {defaults[kind]})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
