#!/usr/bin/env bash
# The first command to run on a GPU node (docs/gpus.md): trains a short
# matrix of layouts through main.py, each against `single` on the same global batch,
# seed and weights, and prints one table: layout, max relative loss and pre-clip
# grad-norm difference, median step time, peak memory, pass/fail. Exit status 1 if
# any layout differs, crashes or hangs (each job has a timeout, and collectives a
# shorter one: parallel.timeout_s).
#
#   bash scripts/gpu_smoke.sh          # 2 GPUs, nccl; activations above NCCL's buffering
#   bash scripts/gpu_smoke.sh --cpu    # 2 CPU processes, gloo, tiny sizes (tests/test_gpu_smoke.py)
#   SMOKE_LAYOUTS="single pp2-zbv" bash scripts/gpu_smoke.sh --cpu   # only those layouts
#   bash scripts/gpu_smoke.sh [--cpu] --list   # print each row's processes and main.py
#                                                # arguments, run nothing (tests check them)
#
# Every job writes under a fresh temporary directory (printed), never into the checkout.
#
# PYTHON: the interpreter every job and the table run with (`python` from PATH by
# default; a relative path is taken from the checkout's root, where the script runs).
# The tests set it to the one running pytest, so nothing depends on an activated
# environment:
#   PYTHON=.venv/bin/python bash scripts/gpu_smoke.sh --cpu
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

MODE=gpu
LIST=0
for arg in "$@"; do
  [[ $arg == "--cpu" ]] && MODE=cpu
  [[ $arg == "--list" ]] && LIST=1
done
export OMP_NUM_THREADS=1
if [[ $MODE == cpu ]]; then
  SIZE=(trainer.device=cpu model.n_layer=4 model.n_head=2 model.n_embd=32 data.block_size=16
        trainer.batch_size=8 trainer.max_steps=3)
  RTOL=1e-5; JOB_TIMEOUT=180
else
  # one pipeline message: 8 sequences x 256 tokens x 768 x 4 bytes = 6 MiB, more than
  # NCCL buffers (4 MiB), so a send really waits for its receive, as at scale
  SIZE=(trainer.device=cuda model.n_layer=4 model.n_head=12 model.n_embd=768 data.block_size=256
        trainer.batch_size=32 trainer.max_steps=10)
  # fp32 on GPUs: cuBLAS picks other kernels for other shapes (TP's split matrices), so
  # sums round differently; broken parallelism shows as 1e-3 and more
  RTOL=${SMOKE_RTOL:-1e-4}; JOB_TIMEOUT=900
fi
BF16_RTOL=2e-2  # bf16 autocast against the fp32 reference: a few steps drift ~1e-3
COMMON=("${SIZE[@]}" model.dropout=0.0 trainer.warmup_steps=2 trainer.log_every=1
        trainer.eval_every=0 trainer.save_every=0 sample.length=0 wandb.mode=disabled
        parallel.timeout_s=120)
PP=(parallel.dp=single parallel.pp=2 parallel.microbatches=4)

# name | processes | tolerance | overrides
MATRIX=(
  "single|1|0|parallel.dp=single"
  "ddp_bucket|2|$RTOL|parallel.dp=ddp_bucket"
  "ddp_bucket-ring|2|$RTOL|parallel.dp=ddp_bucket parallel.allreduce=ring"
  "fsdp3-prefetch|2|$RTOL|parallel.dp=fsdp parallel.zero_stage=3 parallel.prefetch=true"
  "tp2-sp|2|$RTOL|parallel.dp=single parallel.tp=2 parallel.sequence_parallel=true"
  "pp2-gpipe|2|$RTOL|${PP[*]} parallel.pp_schedule=gpipe"
  "pp2-1f1b|2|$RTOL|${PP[*]} parallel.pp_schedule=1f1b"
  "pp2-interleaved-v2|2|$RTOL|${PP[*]} parallel.pp_schedule=interleaved parallel.pp_virtual_stages=2"
  "pp2-zb1p|2|$RTOL|${PP[*]} parallel.pp_schedule=zb1p"
  "pp2-zbv|2|$RTOL|${PP[*]} parallel.pp_schedule=zbv"
  "ddp_bucket-bf16|2|$BF16_RTOL|parallel.dp=ddp_bucket trainer.precision=bf16"
  "cp2|2|$RTOL|parallel.dp=ddp_bucket parallel.cp=2"
)

if [[ $LIST == 1 ]]; then  # name|processes|main.py arguments, one row a line
  for row in "${MATRIX[@]}"; do
    IFS='|' read -r name nproc rtol overrides <<<"$row"
    echo "$name|$nproc|${COMMON[*]} $overrides"
  done
  exit 0
fi

OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_smoke.XXXXXX")
echo "gpu_smoke ($MODE): jobs under $OUT"
ROWS=()
for row in "${MATRIX[@]}"; do
  IFS='|' read -r name nproc rtol overrides <<<"$row"
  # SMOKE_LAYOUTS="single cp2 ...": only those rows (tests/test_gpu_smoke.py runs a few)
  if [[ -n "${SMOKE_LAYOUTS:-}" && " $SMOKE_LAYOUTS " != *" $name "* ]]; then continue; fi
  dir="$OUT/$name"
  mkdir -p "$dir"
  if [[ $nproc == 1 ]]; then
    launch=("$PYTHON" main.py)
  else  # --standalone: a free port for the rendezvous
    launch=("$PYTHON" -m torch.distributed.run --standalone "--nproc_per_node=$nproc" main.py)
  fi
  # shellcheck disable=SC2086  # $overrides is a list of key=value words
  timeout -k 20 "$JOB_TIMEOUT" "${launch[@]}" "${COMMON[@]}" $overrides \
    "trainer.run_dir=$dir/run" >"$dir/log" 2>&1
  echo $? >"$dir/status"
  ROWS+=("$name:$rtol")
done
"$PYTHON" scripts/smoke_table.py "$OUT" "${ROWS[@]}"
