"""Two `nextn bench` reports of one model, at tensor_parallel_size 1 and N: plain decode speed-up,
how far the greedy outputs agree (in bf16 the ranks' partial sums round differently from one
device's sums, so the outputs may part), and whether spec == plain held at TP=N.

python bench/tp_compare.py TP1.json TPN.json [--out SUMMARY.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compare(one: dict, many: dict) -> dict:
    a, b = one["plain_token_ids"], many["plain_token_ids"]
    agree = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {
        "model": one["model"],
        "dtype": many["dtype"],
        "tensor_parallel_size": [one["tensor_parallel_size"], many["tensor_parallel_size"]],
        "decode_tokens_per_s": [one["decode_tokens_per_s"], many["decode_tokens_per_s"]],
        "plain_decode_speedup": many["decode_tokens_per_s"] / one["decode_tokens_per_s"],
        "roofline_fraction": [one.get("roofline_fraction"), many.get("roofline_fraction")],
        "greedy_tokens_agree": agree,  # leading plain tokens equal at both sizes
        "greedy_tokens_compared": min(len(a), len(b)),
        "spec_equals_plain": many["spec_equals_plain"],
        "profile_equals_plain": many.get("profile_equals_plain"),
        "profile_spec_speedup": many.get("profile_spec_speedup"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("one", help="the report at tensor_parallel_size 1")
    parser.add_argument("many", help="the report at tensor_parallel_size N")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    res = compare(*(json.loads(Path(p).read_text()) for p in (args.one, args.many)))
    n = res["tensor_parallel_size"][1]
    print(
        f"tp: {res['model']} plain decode TP=1 {res['decode_tokens_per_s'][0]:.1f} tok/s, TP={n} "
        f"{res['decode_tokens_per_s'][1]:.1f} tok/s ({res['plain_decode_speedup']:.2f}x); greedy tokens agree "
        f"for {res['greedy_tokens_agree']} of {res['greedy_tokens_compared']}; TP={n} spec == plain "
        f"{res['spec_equals_plain']}, profiled {res['profile_equals_plain']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
