"""The decode MoE block (`nextn.ops.triton_moe.moe_step`) at Qwen3.5-35B-A3B's shape (256 experts,
top 8 renormalised, H 2048, I 512, shared expert 512, bf16) over 1 and 4 rows, at the kernels'
block configs against the kernels before the slot-parallel down kernel (kept below as the
baseline: one down program per (row, block of H) walking the 9 slots in turn, and a gate/up kernel
whose 1-D x load goes through shared memory every tile).

Each config is timed in a CUDA graph of 50 calls cycling over LAYERS layers' own weights (1.6 GB of
experts each, so no call finds its weights in the 50 MB L2), the call as a step runs it: router
GEMM, gate/up, down. The gate/up configs run with the default down config, and the other way
round. Reports microseconds per call, GB/s of the expert weights the call reads (its rows' distinct
routed experts and the shared expert, gate/up and down), and whether the output equals the
baseline's bit for bit (configs with BLOCK < 2 * num_warps lay an e4m3 tile out differently, so
there FP8 weights would sum in another order; bf16, timed here, keeps its order).

  python bench/moe_step_sweep.py --out moe_step_sweep.json
  TRITON_INTERPRET=1 python bench/moe_step_sweep.py --check   # CPU: every config equals the baseline
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nextn.ops import triton_moe  # noqa: E402
from nextn.ops.triton_linear import _graph_us, skinny_linear  # noqa: E402
from nextn.ops.triton_moe import BLOCK_K, _route, moe_step  # noqa: E402
from nextn.ops.triton_utils import next_pow2  # noqa: E402

E, TOP_K, H, I, IS = 256, 8, 2048, 512, 512
# (BLOCK, num_warps); the last three have BLOCK < 2 * num_warps, where FP8 tiles would sum in another order
GATE_UP = [(16, 4), (8, 4), (4, 2), (2, 1), (1, 1), (4, 4), (8, 8)]
DOWN = [(16, 4), (32, 8), (8, 4), (4, 2), (4, 1), (2, 1), (1, 1), (4, 4), (8, 8)]


# the kernels before the slot-parallel down kernel, without their FP8 branches (constexpr False: no code)
@triton.jit
def _old_swiglu(x_ptr, wg_ptr, wu_ptr, act_ptr, offs_n, mask_n, H: tl.constexpr, BLOCK_K: tl.constexpr):
    gate = tl.zeros(offs_n.shape, tl.float32)
    up = tl.zeros(offs_n.shape, tl.float32)
    dtype = act_ptr.dtype.element_ty
    for k0 in tl.static_range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < H
        x = tl.load(x_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
        wmask = mask_n[:, None] & mk[None, :]
        wg = tl.load(wg_ptr + offs_n[:, None] * H + offs_k[None, :], mask=wmask, other=0.0)
        wu = tl.load(wu_ptr + offs_n[:, None] * H + offs_k[None, :], mask=wmask, other=0.0)
        gate += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(act_ptr + offs_n, (silu * up.to(dtype).to(tl.float32)).to(dtype), mask=mask_n)


@triton.jit
def _old_gate_up_kernel(x_ptr, logits_ptr, gate_up_ptr, shared_gate_ptr, shared_up_ptr, idx_ptr, rw_ptr, act_ptr,
                        stride_act, H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, E: tl.constexpr,
                        LOGIT_STRIDE: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    t = row // (TOP_K + 1)
    slot = row % (TOP_K + 1)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = rw_ptr.dtype.element_ty
    act = act_ptr + row * stride_act
    if slot == TOP_K:
        if tl.program_id(1) == 0:
            sg = tl.load(logits_ptr + t * LOGIT_STRIDE + E).to(tl.float32)
            tl.store(rw_ptr + row, (1.0 / (1.0 + tl.exp(-sg))).to(dtype))
        _old_swiglu(x_ptr + t * H, shared_gate_ptr, shared_up_ptr, act, offs_n, offs_n < Is, H, BLOCK_K)
    else:
        e, w = _route(logits_ptr, t, LOGIT_STRIDE, slot, E, TOP_K, RENORM, BLOCK_E)
        if tl.program_id(1) == 0:
            tl.store(idx_ptr + t * TOP_K + slot, e)
            tl.store(rw_ptr + row, w.to(dtype))
        base = gate_up_ptr + e.to(tl.int64) * (2 * I * H)
        _old_swiglu(x_ptr + t * H, base, base + I * H, act, offs_n, offs_n < I, H, BLOCK_K)


@triton.jit
def _old_down(act_ptr, w_ptr, rw_ptr, offs_n, mask_n, I: tl.constexpr, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros(offs_n.shape, tl.float32)
    for k0 in tl.static_range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < I
        a = tl.load(act_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n[:, None] * I + offs_k[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    rw = tl.load(rw_ptr).to(tl.float32)
    return (acc.to(dtype).to(tl.float32) * rw).to(dtype).to(tl.float32)


@triton.jit
def _old_down_combine_kernel(act_ptr, idx_ptr, rw_ptr, down_ptr, shared_down_ptr, res_ptr, out_ptr, stride_act,
                             H: tl.constexpr, I: tl.constexpr, Is: tl.constexpr, TOP_K: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RESIDUAL: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * (TOP_K + 1) + j
        e = tl.load(idx_ptr + t * TOP_K + j).to(tl.int64)
        y = _old_down(act_ptr + row * stride_act, down_ptr + e * (H * I), rw_ptr + row, offs_n, mask_n, I, dtype,
                      BLOCK_K)  # fmt: skip
        total = (total + y).to(dtype).to(tl.float32)
    row = t * (TOP_K + 1) + TOP_K
    y = _old_down(act_ptr + row * stride_act, shared_down_ptr, rw_ptr + row, offs_n, mask_n, Is, dtype, BLOCK_K)
    mlp = (total + y).to(dtype).to(tl.float32)
    if RESIDUAL:
        r = tl.load(res_ptr + t * H + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        mlp = r + mlp
    tl.store(out_ptr + t * H + offs_n, mlp.to(dtype), mask=mask_n)


def old_moe_step(x, h, gates, gate_up, down, shared_gate, shared_up, shared_down, top_k, renorm):
    """moe_step before the slot-parallel down kernel (bf16 or float32 weights), at its blocks (16, 4 warps)."""
    T, H = h.shape
    E, two_i, _ = gate_up.shape
    I, Is = two_i // 2, shared_gate.shape[0]
    stride = -(-(E + 1) // 16) * 16
    logits = torch.empty(T, stride, device=h.device, dtype=h.dtype)
    skinny_linear(h, gates, out=logits[:, : E + 1])
    idx = torch.empty(T, top_k, device=h.device, dtype=torch.int32)
    weights = torch.empty(T, top_k + 1, device=h.device, dtype=h.dtype)
    act = torch.empty(T, top_k + 1, max(I, Is), device=h.device, dtype=h.dtype)
    _old_gate_up_kernel[(T * (top_k + 1), triton.cdiv(max(I, Is), 16))](
        h, logits, gate_up, shared_gate, shared_up, idx, weights, act, act.stride(1), H=H, I=I, Is=Is, E=E,
        LOGIT_STRIDE=stride, TOP_K=top_k, RENORM=renorm, BLOCK_E=next_pow2(E), BLOCK_N=16, BLOCK_K=BLOCK_K,
        num_warps=4,
    )  # fmt: skip
    out = torch.empty_like(h)
    _old_down_combine_kernel[(T, triton.cdiv(H, 16))](
        act, idx, weights, down, shared_down, h if x is None else x, out, act.stride(1), H=H, I=I, Is=Is,
        TOP_K=top_k, BLOCK_N=16, BLOCK_K=BLOCK_K, RESIDUAL=x is not None, num_warps=4,
    )  # fmt: skip
    return out


def variants(gate_up_configs, down_configs) -> dict:
    """name -> moe_step-like callable: the baseline, each gate/up config (the default down config)
    and each down config (the default gate/up config)."""
    out = {"old": old_moe_step}
    for cfg in gate_up_configs:
        out[f"gate_up {cfg}"] = lambda *a, c=cfg: moe_step(*a, gate_up_blocks=c)
    for cfg in down_configs:
        out[f"down {cfg}"] = lambda *a, c=cfg: moe_step(*a, down_blocks=c)
    return out


def layer(E, H, I, Is, dtype, device, gen):
    """A layer's MoE weights, each matrix scaled by its fan-in^-1/2 (the block's arguments after x, h)."""

    def w(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * shape[-1] ** -0.5).to(dtype)

    return [w(E + 1, H), w(E, 2 * I, H), w(E, H, I), w(Is, H), w(Is, H), w(H, Is)]


def check() -> None:
    """The configs against the baseline on tiny shapes (the interpreter): bit for bit, bf16 and
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
        x, h = (torch.randn(T, H, generator=gen).to(dtype) for _ in range(2))
        res = x if residual else None
        want = old_moe_step(res, h, *ws, k, True)
        for name, fn in variants(*configs).items():
            assert torch.equal(fn(res, h, *ws, k, True), want), (name, E, H, dtype, residual)
        print(
            f"E={E} H={H} I={I} Is={Is} {dtype} residual={residual}: {len(configs[0]) + len(configs[1])} configs "
            "equal the baseline bit for bit"
        )


def expert_bytes(ws, h, top_k) -> int:
    """The expert weight bytes one call reads: its rows' distinct routed experts and the shared expert."""
    gates, gate_up, down, shared_gate, shared_up, shared_down = ws
    logits = torch.nn.functional.linear(h, gates[:-1]).float()
    routed = logits.topk(top_k, dim=-1).indices.unique().numel()
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    shared = (shared_gate.numel() + shared_up.numel() + shared_down.numel()) * shared_gate.element_size()
    return routed * per_expert + shared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=4, help="layers of weights the graph cycles over")
    ap.add_argument("--check", action="store_true", help="CPU: every config equals the baseline (tiny shapes)")
    args = ap.parse_args()
    if args.check:
        return check()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [layer(E, H, I, IS, torch.bfloat16, device, gen) for _ in range(args.layers)]
    defaults = {"gate_up": triton_moe.GATE_UP_BLOCKS, "down": triton_moe.DOWN_BLOCKS}
    report = {"device": torch.cuda.get_device_name(), "defaults": defaults, "layers": args.layers, "rows": {}}
    for T in (1, 4):
        xs = [torch.randn(T, H, generator=gen, device=device).bfloat16() for _ in layers]
        hs = [torch.randn(T, H, generator=gen, device=device).bfloat16() for _ in layers]
        nbytes = sum(expert_bytes(ws, h, TOP_K) for ws, h in zip(layers, hs, strict=True)) / len(layers)
        want = old_moe_step(xs[0], hs[0], *layers[0], TOP_K, True)
        entry = report["rows"][T] = {"expert_bytes_per_call": nbytes}
        for name, fn in variants(GATE_UP, DOWN).items():

            def call(i, fn=fn, xs=xs, hs=hs):
                fn(xs[i], hs[i], *layers[i], TOP_K, True)

            us = _graph_us(call, len(layers), 50)
            same = torch.equal(fn(xs[0], hs[0], *layers[0], TOP_K, True), want)
            entry[name] = {"us": us, "GB/s": nbytes / us / 1e3, "equals_old": same}
            print(f"T={T} {name:16s} {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s  {'=' if same else 'DIFFERS from'} old")
        for kind in ("gate_up", "down"):
            best = min((v["us"], k) for k, v in entry.items() if k.startswith(kind))
            print(f"T={T} fastest {kind}: {best[1]} ({best[0]:.1f} us; default {defaults[kind]})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
