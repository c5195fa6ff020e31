"""Whether a prefill's GEMMs and the decode round's run at once on one GPU (issue 44's 9B bar): the
9B's projections (random bf16 weights: per layer gate|up, down, the fused input projection and the
output projection; lm_head left out) run as (a) a decode round, 16 rows through every layer's GEMMs
(skinny 16-row tiles: memory-bound) captured in a CUDA graph, (b) a prefill pass of P rows through the
same weights (wide tiles: compute-bound), captured too, then (c) both from one start: the prefill
graph on a low-priority stream, as many rounds as its time holds on a high-priority stream. It
prints each alone, when each ends at once, and the gain: that work's time one after the other over
its time at once (bench/NOTES.md: the served 9B needs the prompts' compute under the rounds' weight
reads). --mixed P ...: a round of 16 + P rows through the same graphed GEMMs (the engine's tiles for
that row count), the premise of prefill rows riding in the decode steps: what P prompt rows add to a
round. --gdn B T: the 9B's GDN recurrence of a "steps" prefill (B sequences of T rows, 24 layers, the
conv pre-pass; bench/gdn_sweep.py's inputs) graphed, alone and on the low-priority stream beside the
rounds as the prefill GEMMs are: whether the row-by-row recurrence of prompt rows hides under the
rounds' weight reads. Counters: the 16-row GEMMs' split-K arrival counters are one buffer a device
(nextn.ops.triton_utils), used here by the decode stream alone (a wide tile sums its splits in its
program), so the concurrent launches do not share them; the --gdn launches get their own buffer. The
engine's steps do not run so today.

    python bench/overlap_probe.py [--rows 512 2048] [--mixed 48 112 240] [--gdn 6 512] [--layers 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's nextn, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gdn_sweep's inputs

import torch  # noqa: E402

from nextn.ops import triton_gdn  # noqa: E402
from nextn.ops.triton_linear import skinny_linear  # noqa: E402

# the Qwen3.5-9B's per-layer projections: (N, K, gate|up pair)
LAYER = [(12288, 4096, True), (4096, 12288, False), (12288, 4096, False), (4096, 4096, False)]


def _forward(ins: dict, outs: dict, weights: list) -> None:
    """Every weight's GEMM over the rows of ins (by input width) into outs (by output width): the
    values do not matter, the launches and bytes do."""
    for w, w2 in weights:
        n, k = w.shape
        skinny_linear(ins[k], w, up_weight=w2, out=outs[n])


def _buffers(rows: int, dev) -> tuple[dict, dict]:
    widths = {n for n, _, _ in LAYER} | {k for _, k, _ in LAYER}
    ins = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for k in widths}
    return ins, {n: torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for n in widths}


def _graph(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048], help="prefill rows a pass")
    ap.add_argument("--mixed", type=int, nargs="*", default=[], help="prompt rows riding in a 16-row round")
    ap.add_argument("--gdn", type=int, nargs=2, default=None, metavar=("B", "T"), help="a GDN prefill beside rounds")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = []
    for _ in range(args.layers):
        for n, k, dual in LAYER:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
            weights.append((w, torch.randn_like(w) * k**-0.5 if dual else None))
    nbytes = sum(w.numel() * 2 * (2 if w2 is not None else 1) for w, w2 in weights)
    dec_in, dec_out = _buffers(16, dev)
    decode = _graph(lambda: _forward(dec_in, dec_out, weights))
    t_dec = _ms(decode.replay)
    report = {
        "device": torch.cuda.get_device_name(0),
        "command": "python bench/overlap_probe.py " + " ".join(sys.argv[1:]),
        "weight_bytes": nbytes,
        "decode_round_ms": t_dec,
        "decode_GBps": nbytes / t_dec / 1e6,
        "prefill": {},
    }
    print(f"decode round (16 rows, {args.layers} layers): {t_dec:.3f} ms, {nbytes / t_dec / 1e6:.0f} GB/s")
    report["mixed"] = {}
    for extra in args.mixed:
        mix_in, mix_out = _buffers(16 + extra, dev)
        mixed = _graph(lambda mix_in=mix_in, mix_out=mix_out: _forward(mix_in, mix_out, weights))
        t_mix = _ms(mixed.replay)
        prompt_flops = 2 * extra * nbytes / 2
        report["mixed"][str(extra)] = {
            "round_ms": t_mix,
            "over_16_rows": t_mix / t_dec,
            "added_ms_per_prompt_row": (t_mix - t_dec) / extra,
        }
        margin = prompt_flops / (t_mix - t_dec) / 1e9 if t_mix > t_dec else float("inf")
        print(
            f"round of 16 + {extra} rows: {t_mix:.3f} ms ({t_mix / t_dec:.2f}x the 16-row round; "
            f"{(t_mix - t_dec) / extra * 1e3:.1f} us a prompt row, {margin:.0f} TFLOP/s at the margin)"
        )
        del mixed
    low, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)  # lower number: higher priority

    def beside(prefill: torch.cuda.CUDAGraph, t_pre: float) -> dict:
        """prefill on the low-priority stream and as many rounds as its time holds on the high one,
        from one start: when each ends, against one after the other."""
        n = max(1, round(t_pre / t_dec))

        def both() -> tuple[float, float]:
            start, end_pre, end_dec = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            torch.cuda.synchronize()
            start.record()
            for stream in (low, high):
                stream.wait_event(start)
            with torch.cuda.stream(low):
                prefill.replay()
                end_pre.record(low)
            with torch.cuda.stream(high):
                for _ in range(n):
                    decode.replay()
                end_dec.record(high)
            torch.cuda.synchronize()
            return start.elapsed_time(end_pre), start.elapsed_time(end_dec)

        both()  # warm
        pre_at_once, dec_at_once = sorted(both() for _ in range(3))[1]
        sequential = t_pre + n * t_dec
        return {
            "rounds": n,
            "at_once_prefill_ms": pre_at_once,
            "at_once_rounds_ms": dec_at_once,
            "at_once_round_ms": dec_at_once / n,
            "sequential_ms": sequential,
            "gain": sequential / max(pre_at_once, dec_at_once),
        }

    for rows in args.rows:
        pre_in, pre_out = _buffers(rows, dev)
        prefill = _graph(lambda pre_in=pre_in, pre_out=pre_out: _forward(pre_in, pre_out, weights))
        t_pre = _ms(prefill.replay)
        flops = 2 * rows * nbytes / 2
        row = {"prefill_ms": t_pre, "prefill_TFLOPs": flops / t_pre / 1e9, **beside(prefill, t_pre)}
        n, pre_at_once, dec_at_once, sequential = (
            row[k] for k in ("rounds", "at_once_prefill_ms", "at_once_rounds_ms", "sequential_ms")
        )
        print(
            f"prefill {rows} rows: {t_pre:.2f} ms ({row['prefill_TFLOPs']:.0f} TFLOP/s); at once with {n} rounds: "
            f"prefill ends at {pre_at_once:.2f} ms, the rounds at {dec_at_once:.2f} ({dec_at_once / n:.3f} a round "
            f"against {t_dec:.3f}); {sequential:.2f} ms one after the other: {row['gain']:.2f}x"
        )
        report["prefill"][str(rows)] = row
    if args.gdn:
        from gdn_sweep import SHAPES, make_case, run

        B, T = args.gdn
        H, HV, K, V, layers = SHAPES["qwen3.5-9b"]
        case = make_case(H, HV, K, V, layers, B, T, store_all=False, device=dev)
        # its own arrival counters (the per-head norm's last arrival): the device's one buffer is the
        # decode round's split-K GEMMs' on the other stream, and counts from both would mix
        own = torch.zeros(1 << 14, device=dev, dtype=torch.int32)
        shared, triton_gdn.arrival_counters = triton_gdn.arrival_counters, lambda device, n: own
        try:
            gdn = _graph(lambda: run(triton_gdn.gdn_step, case, *triton_gdn.launch_config(K, V), preconv=T))
        finally:
            triton_gdn.arrival_counters = shared
        t_gdn = _ms(gdn.replay)
        row = {
            "sequences": B,
            "rows": T,
            "layers": layers,
            "gdn_ms": t_gdn,
            "us_per_prompt_row": t_gdn * 1e3 / (B * T),
            **beside(gdn, t_gdn),
        }
        print(
            f"GDN prefill {B} x {T} rows, {layers} layers: {t_gdn:.2f} ms ({row['us_per_prompt_row']:.1f} us a prompt "
            f"row); at once with {row['rounds']} rounds: it ends at {row['at_once_prefill_ms']:.2f} ms, the rounds at "
            f"{row['at_once_rounds_ms']:.2f} ({row['at_once_round_ms']:.3f} a round against {t_dec:.3f}); "
            f"{row['sequential_ms']:.2f} ms one after the other: {row['gain']:.2f}x"
        )
        report["gdn"] = row
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
