"""Can a layer's first weight rows wait in L2 through the MoE block before its GEMM reads them?

The 35B-A3B step's MoE block leaves the memory bus idle for ~5 us a layer while its router computes
(1 MB of gate rows, then the norm, the logits and the top-k), and the next layer's first GEMM
(in_proj, 12352x2048, 50.6 MB) then streams its whole weight from HBM. If the router's idle time
read the first P MB of that weight into L2 with the evict_last hint, and the MoE experts' weights
(~57 MB a layer) streamed with evict_first, the GEMM would find those rows in L2. This probe times
that on its own before anything is built, per call in a CUDA graph cycling over 4 copies of every
buffer (`linear_tune.graph_us`, nothing left in L2 from the previous call):
- `stream`: one read of 56 MB (the experts' bytes), with the default policy or evict_first;
- `prefetch`: one read of the weight's first P MB with evict_last;
- the GEMM's time after them: (prefetch + stream + GEMM) - (prefetch + stream), against
  (stream + GEMM) - stream.
The prefetch's own time is reported too; in the step it would overlap the router.

    python bench/l2_prefetch_probe.py --out l2_prefetch_probe.json
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

from nextn.ops.linear_tune import graph_us  # noqa: E402
from nextn.ops.triton_linear import skinny_linear  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_qwen3.5-35b-a3b_run102_main.json"
N, K = 12352, 2048  # the 35B-A3B GDN in_proj
STREAM_MB = 56
PREFETCH_MB = (8, 16, 24, 32)
COPIES = 4
BLOCK = 8192  # bf16 elements a program reads (16 KB)


@triton.jit
def _read_kernel(ptr, sums_ptr, POLICY: tl.constexpr, BLOCK: tl.constexpr):
    """Reads BLOCK elements a program with the L2 eviction hint POLICY; stores their sum (so the
    loads are not dropped)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ptr + offs, eviction_policy=POLICY)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), axis=0))


def read(buf: torch.Tensor, nbytes: int, sums: torch.Tensor, policy: str) -> None:
    programs = nbytes // (2 * BLOCK)
    _read_kernel[(programs,)](buf, sums, POLICY=policy, BLOCK=BLOCK, num_warps=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = tuple(json.loads(RESULTS.read_text())["linear_configs"][f"{N}x{K}"]["config"])
    ws = [torch.empty(N, K, device=dev, dtype=torch.bfloat16).normal_(std=K**-0.5) for _ in range(COPIES)]
    stream_bytes = STREAM_MB << 20
    streams = [torch.randn(stream_bytes // 2, device=dev).to(torch.bfloat16) for _ in range(COPIES)]
    sums = torch.empty(stream_bytes // (2 * BLOCK), device=dev)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)

    def time(seq) -> float:
        return graph_us(seq, COPIES, 64)

    def gemm(i):
        skinny_linear(x, ws[i], out=out, config=config)

    result = {"device": torch.cuda.get_device_name(), "config": config, "stream_MB": STREAM_MB, "rows": {}}
    base = {}
    for policy in ("", "evict_first"):
        s = time(lambda i, p=policy: read(streams[i], stream_bytes, sums, p))
        sg = time(lambda i, p=policy: (read(streams[i], stream_bytes, sums, p), gemm(i)))
        base[policy or "default"] = {"stream_us": round(s, 3), "gemm_us": round(sg - s, 3)}
        print(f"no prefetch, stream {policy or 'default':11s}: stream {s:6.2f} us, GEMM after it {sg - s:6.2f} us",
              flush=True)  # fmt: skip
    result["no prefetch"] = base
    result["gemm alone us"] = round(time(gemm), 3)
    print(f"GEMM alone {result['gemm alone us']:.2f} us", flush=True)
    for mb in PREFETCH_MB:
        pbytes = mb << 20
        pre = time(lambda i, b=pbytes: read(ws[i], b, sums, "evict_last"))
        for policy in ("", "evict_first"):

            def ps(i, b=pbytes, p=policy):
                read(ws[i], b, sums, "evict_last")
                read(streams[i], stream_bytes, sums, p)

            t_ps = time(ps)
            t_psg = time(lambda i, f=ps: (f(i), gemm(i)))
            row = {
                "prefetch_us": round(pre, 3),
                "prefetch_stream_us": round(t_ps, 3),
                "gemm_us": round(t_psg - t_ps, 3),
            }
            result["rows"][f"{mb} MB, stream {policy or 'default'}"] = row
            print(f"prefetch {mb:2d} MB ({pre:5.2f} us), stream {policy or 'default':11s}: GEMM after them "
                  f"{t_psg - t_ps:6.2f} us", flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
