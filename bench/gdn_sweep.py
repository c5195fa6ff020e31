"""The GDN step kernel (nextn.ops.triton_gdn.gdn_step) at a model's shape, per block size and warp
count: microseconds per layer in a CUDA graph of one call per layer (each layer its own window,
states and gates, as a step runs them).

Two kinds of call, as the engine makes them:
- a verify / decode (`--tokens 1 4`, store_all): B sequences of T rows each, every row's gates
  and the base state kept (T at most the slots' rows);
- a "steps" prefill (`--prefill-tokens 256 512`, store_all=False): B sequences of T rows each,
  only the state after the last row kept. Its rows run one after another in each program, so a
  prefill step's GDN time is about T times a row's latency (issue 44's TTFT: bench/NOTES.md).

    python bench/gdn_sweep.py [--out F] [--tokens 1 4] [--prefill-tokens 256 512] [--batch 1 6]
        [--block-v 16 32 64] [--warps 1 2 4 8] [--shapes default_model qwen3.5-9b]
        [--kernel FILE --label NAME] [--check] [--preconv]

--chunk: also time the chunked delta rule (nextn.ops.triton_gdn_chunk.chunk_gated_delta_rule, tensor-core
dots by chunks of 64 rows, what `--prefill chunked` runs) at each prefill case: B sequences of T rows from
a state, the rule alone (no conv, gates or gated norm, which the step kernel fuses: a lower bound of a
chunked GDN launch), us a layer, beside the step kernel's rows one after another.
--kernel: time the gdn_step of another copy of the module (`git show REV:nextn/ops/triton_gdn.py
> FILE`), so a change is measured against its parent in one run; results are keyed by --label.
--check: also run the checked-in module on the same inputs and report whether the outputs, states
and windows are bitwise equal (a change meant to keep the arithmetic must keep them).
--preconv: the prefill calls run the conv pre-pass (`gdn_step(preconv=T)`), the --kernel module's too
where its gdn_step takes one; with --check --kernel <a module before the pre-pass>, whether the
pre-pass gives the in-loop conv's bits (run 158: it did not before `triton_gdn._rounded`). With
--kernel, the timings are the --kernel module's."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import itertools
import json

import torch

from nextn.ops import triton_gdn

SHAPES = {"qwen3.5-9b": (16, 32, 128, 128, 24), "default_model": (4, 4, 64, 64, 6)}  # H, HV, K, V, layers
W = 4  # conv taps (every released Qwen3.5 / Qwen3-Next config)


def make_case(H, HV, K, V, layers, B, T, store_all, device, seed=0):
    """Inputs of `layers` calls: proj [B*T, conv | z | b | a], per layer a window, states and gates of
    B slots (slot b: base in half 0, written to half 1), weights shared."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch.bfloat16

    def rand(*shape, scale=1.0, dtype=dt):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    conv_dim = 2 * H * K + HV * V
    R = max(T, 8) if store_all else 8  # rows a half of gates holds (a prefill keeps no rows' gates)
    NW = 2 * (W - 1 + R)
    layer = [
        dict(
            window=rand(B, conv_dim, NW),
            states=rand(B, 2, HV, K, V, scale=0.1, dtype=torch.float32),
            gates=rand(B, 2 * R, 2 * HV),
        )
        for _ in range(layers)
    ]
    ctl = torch.tensor(
        [[0, 1, 0, W - 1 + R, 0]] * B, dtype=torch.int32, device=device
    )  # at, write, conv at/write, pending
    seqs = torch.tensor([list(range(B)), [b * T for b in range(B)], [T] * B], dtype=torch.int32, device=device)
    return dict(
        proj=rand(B * T, conv_dim + HV * V + 2 * HV),
        conv_weight=rand(conv_dim, W, scale=0.5),
        A_log=rand(HV, scale=0.5),
        dt_bias=rand(HV, scale=0.5),
        norm_weight=(1.0 + rand(V, scale=0.1, dtype=torch.float32)).to(dt),
        layer=layer,
        slots=ctl,
        seqs=seqs,
        out=torch.empty(B * T, HV * V, device=device, dtype=dt),
        H=H,
        store_all=store_all,
    )


def run(step_fn, c, block_v, warps, **kw):
    for buf in c["layer"]:
        step_fn(
            c["proj"],
            c["conv_weight"],
            buf["window"],
            c["A_log"],
            c["dt_bias"],
            buf["states"],
            buf["gates"],
            c["norm_weight"],
            c["H"],
            1e-6,
            slots=c["slots"],
            seqs=c["seqs"],
            pending_col=4,
            out=c["out"],
            store_all=c["store_all"],
            block_v=block_v,
            num_warps=warps,
            **kw,
        )


def layer_us(step_fn, c, block_v, warps, **kw) -> float:
    return replayed_us(lambda: run(step_fn, c, block_v, warps, **kw), len(c["layer"]))


def replayed_us(call, layers: int) -> float:
    """us a layer of call (`layers` layers' launches) in a CUDA graph: the median of 7 timings of 5 replays."""
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    g.replay()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 5 / layers)
    return sorted(times)[3]


def chunk_us(H, HV, K, V, layers, B, T) -> float:
    """us a layer of the chunked delta rule over B sequences of T rows from a state (graphed, `layers` calls)."""
    from nextn.ops.triton_gdn_chunk import chunk_gated_delta_rule

    g = torch.Generator(device="cpu").manual_seed(1)
    dt = torch.bfloat16

    def unit(*shape):  # l2-normalised rows of the key dim, as the layer feeds the rule
        x = torch.randn(*shape, generator=g)
        return (x / x.norm(dim=-1, keepdim=True)).to(device="cuda", dtype=dt)

    q, k = unit(B, T, H, K), unit(B, T, H, K)
    v = (torch.randn(B, T, HV, V, generator=g) * 0.5).to(device="cuda", dtype=dt)
    decay = (-torch.rand(B, T, HV, generator=g) * 0.1).cuda()
    beta = torch.rand(B, T, HV, generator=g).cuda()
    states = [(torch.randn(B, HV, K, V, generator=g) * 0.1).cuda() for _ in range(layers)]

    def call():
        for h0 in states:
            chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=h0)

    return replayed_us(call, layers)


def same_bits(fn_a, fn_b, make, block_v, warps, kw_a, kw_b) -> bool | str:
    """Both modules from the same inputs: True where the outputs, states and windows are bitwise
    equal, else which differ first (the output's first row that differs, a layer's states / window)."""
    results = []
    for fn, kw in ((fn_a, kw_a), (fn_b, kw_b)):
        c = make()
        run(fn, c, block_v, warps, **kw)
        results.append([c["out"]] + [t for buf in c["layer"] for t in (buf["states"], buf["window"])])

    def bits(x):
        return x.view(torch.int16 if x.element_size() == 2 else torch.int32)

    names = ["out"] + [f"layer {i} {n}" for i in range(len(results[0]) // 2) for n in ("states", "window")]
    for name, x, y in zip(names, *results, strict=True):
        if not torch.equal(bits(x), bits(y)):
            if name == "out":
                row = int((bits(x) != bits(y)).any(dim=-1).nonzero()[0])
                return f"out differs from row {row} (max |diff| {(x.float() - y.float()).abs().max().item():.3g})"
            return f"{name} differs"
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[256, 512])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 6])
    ap.add_argument("--block-v", type=int, nargs="+", default=[32])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--kernel", help="a copy of nextn/ops/triton_gdn.py to time instead")
    ap.add_argument("--label", default="")
    ap.add_argument("--check", action="store_true", help="bitwise against the checked-in module")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preconv", action="store_true", help="prefill calls with the conv pre-pass")
    ap.add_argument("--chunk", action="store_true", help="also the chunked delta rule at each prefill case")
    args = ap.parse_args()
    step_fn = triton_gdn.gdn_step
    if args.kernel:
        spec = importlib.util.spec_from_file_location("gdn_under_test", args.kernel)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        step_fn = module.gdn_step
    preconv_too = "preconv" in inspect.signature(step_fn).parameters
    cases = [(T, True) for T in args.tokens] + [(T, False) for T in args.prefill_tokens]
    res = {}
    for name in args.shapes:
        H, HV, K, V, layers = SHAPES[name]
        for (T, store_all), B, bv, warps in itertools.product(cases, args.batch, args.block_v, args.warps):
            if bv > V:
                continue
            kind = "T" if store_all else "prefill T"
            key = f"{args.label + ' ' if args.label else ''}{name} {kind}={T} B={B} block_v={bv} warps={warps}"
            shape = (H, HV, K, V)
            entry = {}
            own = {"preconv": T} if args.preconv and not store_all else {}  # (the checked-in module's calls)
            theirs = own if preconv_too else {}  # (the timed module's: a --kernel before the pre-pass has none)
            if args.device == "cuda":
                case = make_case(*shape, layers, B, T, store_all, "cuda")
                entry["us_per_layer"] = layer_us(step_fn, case, bv, warps, **theirs)
            if args.check:
                make = functools.partial(make_case, *shape, 1, B, T, store_all, args.device)
                entry["same_bits"] = same_bits(triton_gdn.gdn_step, step_fn, make, bv, warps, own, theirs)
            res[key] = entry
            print(f"gdn {key}: {entry}", flush=True)
        for T, B in itertools.product(args.prefill_tokens, args.batch) if args.chunk and args.device == "cuda" else ():
            key = f"{args.label + ' ' if args.label else ''}{name} chunk rule T={T} B={B}"
            res[key] = {"us_per_layer": chunk_us(H, HV, K, V, layers, B, T)}
            print(f"gdn {key}: {res[key]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
