#!/bin/bash
# The working tree a device call carries is at most 64 MiB, and the tracked files are 43.7 MiB, 35.6 of
# them the bundled model's safetensors. A call that does not need the bundled model (bench/gguf_vs_llama.sh
# draws random weights) can leave them behind and carry llama.cpp (.llama/llama-bench.tgz, 42.3 MiB):
#   bash bench/device_tree.sh slim     # untrack the safetensors (index only; the files stay) and ignore them
#   ... the device call (carry .llama/llama-bench.tgz .llama/tok .llama/whl) ...
#   bash bench/device_tree.sh full     # track them again, as committed
#   bash bench/device_tree.sh prepare  # .llama/tok (Qwen3.5's tokenizer, tar.xz) and .llama/whl (gguf, pyyaml, tqdm, llguidance)
# `slim` refuses while other changes are staged, and `full` is safe to run twice; never commit in between
# (`slim` installs a local pre-commit hook that refuses a commit deleting the bundled model's files).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
MODEL=nextn/default_model
EXCLUDE=.git/info/exclude
PATTERN="/$MODEL/*.safetensors"
case "${1:-}" in
  slim)
    if ! git diff --cached --quiet; then
      echo "device_tree: changes are staged; commit or unstage them first" >&2
      exit 1
    fi
    grep -qxF "$PATTERN" "$EXCLUDE" || echo "$PATTERN" >> "$EXCLUDE"
    # a commit made while slim would delete the bundled model: a local hook refuses it (kept after `full`)
    HOOK=$(git rev-parse --git-path hooks)/pre-commit
    mkdir -p "$(dirname "$HOOK")"
    if ! grep -qs "device_tree" "$HOOK"; then
      if [ -e "$HOOK" ]; then
        echo "device_tree: $HOOK is not ours: commit nothing until 'bash bench/device_tree.sh full'" >&2
      else
        cat > "$HOOK" <<'SH'
#!/bin/sh
# installed by bench/device_tree.sh: never commit the deletion of the bundled model (a slim tree's index)
if git diff --cached --name-only --diff-filter=D | grep -q '^nextn/default_model/.*\.safetensors$'; then
  echo "pre-commit: the bundled model is untracked (bench/device_tree.sh slim): run 'bash bench/device_tree.sh full' first" >&2
  exit 1
fi
SH
        chmod +x "$HOOK"
      fi
    fi
    git rm -q --cached $MODEL/*.safetensors
    echo "device_tree: the bundled model's safetensors left out of the tree; run 'bash bench/device_tree.sh full' after the call"
    ;;
  full)
    git reset -q -- $MODEL
    grep -vxF "$PATTERN" "$EXCLUDE" > "$EXCLUDE.new" || true
    mv "$EXCLUDE.new" "$EXCLUDE"
    git diff --quiet -- $MODEL || { echo "device_tree: $MODEL differs from the commit" >&2; exit 1; }
    echo "device_tree: the bundled model is tracked again ($(git ls-files $MODEL | wc -l) files)"
    ;;
  prepare)
    [ -f .tok/qwen3.5/tokenizer.json ] || { echo "device_tree: no .tok/qwen3.5 (python bench/qwen_tokenizer.py --out .tok/qwen3.5)" >&2; exit 2; }
    mkdir -p .llama/tok .llama/whl
    tar cJf .llama/tok/tok.txz .tok/qwen3.5
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .llama/whl gguf pyyaml tqdm
    # nextn imports llguidance (not on the device image either): without it the bench on the file fails (run 144)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_31_x86_64 -d .llama/whl llguidance
    du -sh .llama/tok .llama/whl
    ;;
  *)
    echo "usage: bash bench/device_tree.sh slim|full|prepare" >&2
    exit 2
    ;;
esac
