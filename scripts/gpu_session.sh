#!/usr/bin/env bash
# What a session with a lent GPU runs, one part per device call (each fits in a call of
# 10 minutes; docs/benchmarks-gpu.md says what each shows and where its results go):
#
#   bash scripts/gpu_session.sh side    # ours against nanoGPT's bench.py, GPT-2 124M shape
#   bash scripts/gpu_session.sh curve   # Shakespeare, character level: ours and nanoGPT's train.py
#   bash scripts/gpu_session.sh smoke   # the 1-GPU smoke tier: parity, step time, peak memory
#                                       #   against the plan, full and selective recompute
#   bash scripts/gpu_session.sh suite   # the test suite, on the GPU machine
#
# Before the call, on the machine with the checkout (both paths are git-ignored):
#   git clone https://github.com/karpathy/nanoGPT peers/nanoGPT
#   cp ../shared/data/tinyshakespeare.txt peers/   # or any copy of tinyshakespeare
# and carry `peers` (and a built virtual environment, if the GPU image lacks the
# requirements). NANOGPT, TEXT, OUT (results; $OUT on the device machine) and PYTHON
# (the interpreter: a GPU image's own CUDA build of torch) override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
NANOGPT="${NANOGPT:-peers/nanoGPT}"
TEXT="${TEXT:-peers/tinyshakespeare.txt}"
OUT="${OUT:-bench/results/gpu-session}"
case "${1:-}" in side|curve|smoke|suite) ;; *)
  echo "usage: bash scripts/gpu_session.sh side|curve|smoke|suite" >&2; exit 2 ;; esac
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1 || true
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
  | tee "$OUT/torch.txt"

case "${1:-}" in
  side)
    "$PYTHON" -m bench.gpu_vs_nanogpt --nanogpt "$NANOGPT" --out "$OUT/gpu-vs-nanogpt" ;;
  curve)
    "$PYTHON" -m bench.shakespeare_curve --data "$TEXT" --nanogpt "$NANOGPT" --out "$OUT/shakespeare" ;;
  smoke)
    PYTHON="$PYTHON" bash scripts/gpu_smoke.sh --gpus 1 2>&1 | tee "$OUT/smoke.txt" ;;
  suite)
    "$PYTHON" -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/suite.txt" ;;
esac
