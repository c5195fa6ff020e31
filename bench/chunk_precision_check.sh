#!/bin/bash
# Which of the chunked rule's dot precisions (nextn.ops.triton_gdn_chunk.PRECISIONS) run, and how close to the
# float32 reference, at heads of 16-128 (K = V; 70 rows from a state): each variant one group of dots in tf32,
# the rest tf32x3, one process a variant (an illegal address is sticky). Run 197. Usage (device): bash $0
source bench/device_env.sh
for v in "O=tf32" "INV=tf32" "O=tf32,INV=tf32" "S=tf32" "A=tf32" "UW=tf32"; do
  for kv in 16 32 64 128; do
    python3 - "$v" "$kv" <<'PY' 2>&1 | tail -1
import sys, torch
from nextn.ops import triton_gdn_chunk as rule
from nextn.ops.gdn import chunk_gated_delta_rule as ref
rule.PRECISIONS.update({k: "tf32x3" for k in rule.PRECISIONS})
rule.PRECISIONS.update(dict(x.split("=") for x in sys.argv[1].split(",")))
K = int(sys.argv[2]); B, T, H, HV = 1, 70, 1, 2
g = torch.Generator().manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).cuda()
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).cuda()
v = torch.randn(B, T, HV, K, generator=g).cuda(); gate = -torch.rand(B, T, HV, generator=g).cuda() * 0.1
beta = torch.rand(B, T, HV, generator=g).cuda(); h0 = torch.randn(B, HV, K, K, generator=g).cuda() * 0.1
try:
    o, s = rule.chunk_gated_delta_rule(q, k, v, gate, beta, h0); torch.cuda.synchronize()
    ro, rs = ref(q, k, v, gate, beta, h0)
    print(sys.argv[1], K, "ok", f"{(o - ro).abs().max().item():.1e} {(s - rs).abs().max().item():.1e}")
except Exception as e:
    print(sys.argv[1], K, "FAILED", str(e)[:80])
PY
  done
done
