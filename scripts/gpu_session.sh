#!/usr/bin/env bash
# One part of a GPU session per device call (docs/benchmarks-gpu.md says which calls, in
# which order, and what each returns):
#
#   bash scripts/gpu_session.sh smoke   # the 1-GPU smoke tier: parity, step time, peak memory
#   bash scripts/gpu_session.sh side    # ours against nanoGPT's bench.py, GPT-2 124M's shape
#   bash scripts/gpu_session.sh curve   # Shakespeare, character level: ours and nanoGPT's train.py
#   bash scripts/gpu_session.sh suite   # the test suite there (not in the 15-minute plan)
#
# Before the calls, here: `python scripts/gpu_kit.py` builds peers/ (git-ignored: the wheels
# the image lacks, nanoGPT from the fetched mirror, the text, the commit); every call
# carries it (`carry: ["peers"]`). There, this script:
#   - takes the image's interpreter (PYTHON, else python3, else python) and its torch;
#   - installs the kit's wheels whose module does not import into KIT_SITE (default
#     a new temporary folder) and puts that on PYTHONPATH: no registry there;
#   - records the commit the kit hashed (a copy without .git: MINGPT_COMMIT), checked
#     against the files, and the machine, torch and APIs (gpu_kit.py --check) in
#     $OUT/session.txt;
#   - runs the part within GPU_PART_S seconds (default 540: a call runs at most 600), its
#     own budget a little shorter, so that it ends and writes its tables; rows are written
#     under $OUT as each run or row ends, so a call cut short keeps what ran.
# $OUT (the device call's folder; here default runs/gpu-session) gets at most 5 files, 1
# folder down: session.txt, <part>.log and <part>/ (smoke: rows.txt, table.txt; side:
# rows.jsonl, results.json, results.md; curve: rows.tsv, results.json, results.md).
# SMOKE_ARGS, SIDE_ARGS, CURVE_ARGS: the part's own arguments (the tests' tiny sizes);
# GPU_SESSION_CPU=1 runs a part on a CPU (the tests' stand-in for the GPU machine);
# GPU_SESSION_DRY=1 prints the part's command instead of running it (nothing installed).
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-}
case "$PART" in smoke|side|curve|suite) ;; *)
  echo "usage: bash scripts/gpu_session.sh smoke|side|curve|suite" >&2; exit 2 ;; esac
STARTED=$SECONDS
KIT=${KIT:-peers}
PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-runs/gpu-session}
PART_S=${GPU_PART_S:-540}
mkdir -p "$OUT/$PART"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1 WANDB_MODE=disabled

session() {  # everything the part does; its output also lands in $OUT/<part>.log

  # the kit's wheels, for the modules that do not import here (one `pip install`, offline)
  local site=${KIT_SITE:-$(mktemp -d -t kit-site.XXXXXX)} wanted=() module wheel cpu=() status=0
  if [[ -f $KIT/wheels/modules.txt ]]; then
    while read -r module wheel; do
      [[ -n $module ]] || continue
      "$PY" -c "import $module" 2>/dev/null || wanted+=("$KIT/wheels/$wheel")
    done <"$KIT/wheels/modules.txt"
  else
    echo "gpu_session: no $KIT/wheels/modules.txt: build the kit first (python scripts/gpu_kit.py)"
  fi
  if (( ${#wanted[@]} )) && [[ ${GPU_SESSION_DRY:-0} != 1 ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wanted[@]}" || { echo "gpu_session: installing ${wanted[*]} failed"; return 3; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_session: installed ${wanted[*]##*/} into $site"
  fi
  MINGPT_COMMIT=$("$PY" scripts/gpu_kit.py --kit "$KIT" --commit)
  export MINGPT_COMMIT
  {
    echo "part $PART, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $MINGPT_COMMIT, GPU_PART_S $PART_S"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    if [[ ${GPU_SESSION_DRY:-0} == 1 ]]; then echo "dry run: no check"; else
      "$PY" scripts/gpu_kit.py --kit "$KIT" --check 2>&1; fi
  } >"$OUT/session.txt"
  cat "$OUT/session.txt"

  local left=$(( PART_S - (SECONDS - STARTED) ))  # the part's seconds; its own budget ends earlier
  (( left < 60 )) && left=60
  [[ ${GPU_SESSION_CPU:-0} == 1 ]] && cpu=(--cpu)
  run() {  # the part's command, within its seconds (GPU_SESSION_DRY=1: printed instead)
    if [[ ${GPU_SESSION_DRY:-0} == 1 ]]; then printf '%q ' "$@"; echo; return 0; fi
    timeout -k 10 "$left" "$@"
  }
  # shellcheck disable=SC2086  # *_ARGS are lists of words
  case "$PART" in
    smoke)
      run env PYTHON="$PY" SMOKE_DEADLINE=$(( left - 45 )) SMOKE_ROWS="$OUT/smoke/rows.txt" \
        SMOKE_TABLE="$OUT/smoke/table.txt" SMOKE_JOB_TIMEOUT="${SMOKE_JOB_TIMEOUT:-240}" \
        bash scripts/gpu_smoke.sh "${cpu[@]}" ${SMOKE_ARGS:---gpus 1} || status=$? ;;
    side)
      run "$PY" -m bench.gpu_vs_nanogpt --nanogpt "$KIT/nanoGPT" --out "$OUT/side" \
        --rows "$OUT/side/rows.jsonl" --budget-s $(( left - 30 )) ${SIDE_ARGS:-} || status=$? ;;
    curve)
      run "$PY" -m bench.shakespeare_curve --data "$KIT/tinyshakespeare.txt" --nanogpt "$KIT/nanoGPT" \
        --out "$OUT/curve" --rows "$OUT/curve/rows.tsv" --budget-s $(( left - 40 )) ${CURVE_ARGS:-} \
        || status=$? ;;
    suite)
      run "$PY" -m pytest -q -p no:cacheprovider -x ${SUITE_ARGS:-} || status=$? ;;
  esac
  echo "gpu_session: $PART ended with status $status after $(( SECONDS - STARTED )) s; results in $OUT"
  return "$status"
}

session 2>&1 | tee "$OUT/$PART.log"
exit "${PIPESTATUS[0]}"
