"""The step attention (nextn.ops.triton_attention.attend_step: the chunk kernel and the combine) timed
at the 9B's heads (16 q heads over 4 kv heads of 256) in CUDA graphs: decodes of one and sixteen
sequences, a verify of sixteen, a prefill of one and of sixteen prompts of 512 rows (a served wave's),
each row in its own slot of a bf16 cache. It imports the nextn on the path, so the same probe times
another tree's kernel: PYTHONPATH=.base python3 bench/attention_probe.py (bench/NOTES.md, run 182).

Usage (device): python3 bench/attention_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nextn.ops.linear_tune import graph_us
from nextn.ops.triton_attention import attend_step

HQ, HKV, D = 16, 4, 256
# name -> (sequences, rows a sequence, position of each sequence's first row)
CASES = {
    "decode B=1 at 511": (1, 1, 511),
    "decode B=1 at 4095": (1, 1, 4095),
    "decode B=16 at 600": (16, 1, 600),
    "verify B=16 T=4 at 600": (16, 4, 600),
    "prefill 1 x 512": (1, 512, 0),
    "prefill 16 x 512": (16, 512, 0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cap = 4096
    key = torch.randn(16, cap, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn(16, cap, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    result = {"device": torch.cuda.get_device_name(), "module": attend_step.__module__, "us": {}}
    for name, (B, T, start) in CASES.items():
        rows = B * T
        q = torch.randn(rows, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        qkv = torch.randn(rows, HQ * 2 * D, device="cuda", dtype=torch.bfloat16, generator=g)
        row_slot = torch.arange(B, device="cuda", dtype=torch.int32).repeat_interleave(T)
        row_pos = (start + torch.arange(T, device="cuda", dtype=torch.int32)).repeat(B)
        out = torch.empty(rows, HQ * D, device="cuda", dtype=torch.bfloat16)
        max_pos = start + T - 1 if T > 1 else None  # (an eager prefill's bound; graphed rounds take the cache's)

        def call(i, q=q, qkv=qkv, row_slot=row_slot, row_pos=row_pos, out=out, max_pos=max_pos):
            return attend_step(q, qkv, key, value, row_slot, row_pos, out=out, max_pos=max_pos)

        us = graph_us(call, 1, 20 if rows < 1024 else 3)
        result["us"][name] = round(us, 2)
        print(f"attention: {name}: {us:.1f} us ({us * 1e3 / rows:.0f} ns a row)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
