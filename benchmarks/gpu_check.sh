#!/usr/bin/env bash
# The GPU check's entry point (benchmarks/gpu_check.py; benchmarks/README.md, "The GPU check").
#   benchmarks/gpu_check.sh download-wheels  where pip reaches a registry: the wheels the GPU machine lacks
#                                            (gpu_check.py --wheels) into .whl/, which .gitignore keeps out of git
#   benchmarks/gpu_check.sh [ARGS...]        on the GPU machine: install .whl/ into /tmp/site, then gpu_check.py ARGS
#                                            (by default --device cuda --require-trl); its JSON lines also into
#                                            $OUT/gpu_check.jsonl and its console into $OUT/gpu_check.log where $OUT is set
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == download-wheels ]]; then
  # For the GPU machine's Python, 3.12 on x86-64; one version of each package, or the install there stops.
  rm -rf .whl
  for folder in .whl .whl/datasets; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$folder" $(python3 benchmarks/gpu_check.py --wheels | awk -v folder="$folder" '$1 == folder {print $2}')
  done
  ls -l .whl .whl/datasets
  du -sh .whl
  exit
fi
[[ -d .whl ]] || { echo "error: no .whl/: run 'benchmarks/gpu_check.sh download-wheels' where pip works, and carry .whl" >&2; exit 2; }
install() { python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
install .whl/*.whl
python3 -c "import datasets" 2>/dev/null || install .whl/datasets/*.whl  # TRL's, where the image lacks it
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! error=$(python3 -c "import transformers" 2>&1); then
  # The carried transformers checks the versions of the image's packages as it imports; fall back to the image's.
  echo "warning: the carried transformers does not import here, so the image's is used: ${error##*$'\n'}" >&2
  rm -rf /tmp/site/transformers /tmp/site/transformers-*.dist-info
fi
[[ $# -gt 0 ]] || set -- --device cuda --require-trl
if [[ -n "${OUT:-}" ]]; then
  python3 benchmarks/gpu_check.py "$@" 2> >(tee "$OUT/gpu_check.log" >&2) | tee "$OUT/gpu_check.jsonl"
else
  python3 benchmarks/gpu_check.py "$@"
fi
