# Sourced by the device scripts (run_h200.sh, compare_heads.sh, distill_variants.sh): nextn on the
# path, the packages the image lacks (llguidance) from the wheels in .whl/ (carried, git-ignored),
# the Triton cache of earlier runs from .tcache/triton_cache.tgz when carried, and `stage`.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
fi
mkdir -p /tmp/triton_cache
if [ -f .tcache/triton_cache.tgz ]; then tar xzf .tcache/triton_cache.tgz -C /tmp/triton_cache; fi
t0=$(date +%s)  # the stages' clock: `stage NAME` prints a script stage's header and the seconds since
stage() { echo "=== $1 (+$(($(date +%s) - t0)) s)"; }
DEADLINE=${DEADLINE:-570}  # `fits SECONDS NAME`: whether a stage of at most SECONDS ends before DEADLINE s of the
# clock (its header printed, as `stage` prints it), else it says the stage is skipped
fits() {
  if [ $(($(date +%s) - t0 + $1)) -gt "$DEADLINE" ]; then echo "=== skipped: $2 (+$(($(date +%s) - t0)) s)"; return 1; fi
  stage "$2"
}
# `device_log`: the script's output from here on also into $OUT/log.txt (the whole log comes back: the tool returns
# only the output's tail), after the GPU's name
device_log() {
  exec > >(tee $OUT/log.txt) 2>&1
  nvidia-smi --query-gpu=name --format=csv,noheader
}
# `patched_tree DIR FILE OLD NEW`: a copy of this tree in DIR with the text OLD of FILE (a path in the tree) made
# NEW, for an A / B in one run; fails, saying so, where FILE no longer holds OLD exactly once
patched_tree() {
  rm -rf "$1" && cp -r . "$1" && python3 - "$1/$2" "$3" "$4" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"patched_tree: {path} no longer holds {old!r} once: update the script")
open(path, "w").write(text.replace(old, new))
PY
}
