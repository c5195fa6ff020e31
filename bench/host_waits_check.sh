#!/bin/bash
# The host-wait and compile fixes of the thirtieth session on the device, one call (~5 min on an H100):
#   1. tests/test_batching.py's GPU-marked test that steps make no implicit synchronizing call, on the
#      tree and on a copy with RequestRounds._settle's old synchronizing copy put back (it must fail there:
#      the test catches what it names);
#   2. bench/sync_probe.py (its log also names any Triton compile after the warm-up);
#   3. the bundled model served, spec on / off (bench/serve_bench.sh, serve's default prefill, then
#      `--prefill chunked` at 128 output tokens), merged into $OUT/serve_cells.json (<= 8 files return).
# Carry .whl. Usage: bash bench/host_waits_check.sh   Env: DEADLINE (s, default 480).
set -o pipefail
DEADLINE=${DEADLINE:-480}
source bench/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
stage "sync test, the tree"
timeout 90 python3 -m pytest -q -m gpu tests/test_batching.py 2>&1 | tail -2
rm -rf /tmp/old && cp -r . /tmp/old && python3 - <<'PY'
p = "/tmp/old/nextn/engine/rounds.py"; s = open(p).read()
new = "        cache.ctl.copy_(to_device(ctl, cache.ctl.device, torch.int32))"
assert s.count(new) == 1, "rounds.py changed: update bench/host_waits_check.sh"
open(p, "w").write(s.replace(new, "        cache.ctl.copy_(ctl.to(cache.ctl.device))"))
PY
stage "sync test, _settle's old copy (must fail)"
(cd /tmp/old && timeout 60 python3 -m pytest -q -m gpu tests/test_batching.py -k wait_for_the_gpu 2>&1 | grep -E "^E .*assert|passed|failed" | head -4)
fits 100 "sync probe" && timeout 100 python3 bench/sync_probe.py --requests 32 --json $OUT/sync_probe.json 2>&1 \
  | grep -E "synchronizing|^ +[0-9]+ |compiled a kernel" | cut -c1-160 | tail -30
fits 150 "bundled served, serve's default prefill" && NUM_PER_STREAM=8 bash bench/serve_bench.sh default 3 0
fits 80 "bundled served, chunked, 128 out" && SERVE_FLAGS="--prefill chunked" OUTS=128 NUM_PER_STREAM=8 bash bench/serve_bench.sh chunked 3 0
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
cells = {}
for f in sorted(glob.glob(f"{out}/serve_*.json")):
    cells[os.path.basename(f)[:-5]] = json.load(open(f))
    os.remove(f)
for f in glob.glob(f"{out}/server_*.log"):
    os.remove(f)
json.dump({"cells": cells}, open(f"{out}/serve_cells.json", "w"), indent=1)
for k, c in cells.items():
    print(k, round(c["output_throughput"]), round(c["median_ttft_ms"], 1), round(c["median_tpot_ms"], 2),
          c.get("mean_acceptance_length"), c.get("graph_metrics", {}).get("nextn:graph_kernel_compiles_total"))
PY
