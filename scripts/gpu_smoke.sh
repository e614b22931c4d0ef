#!/usr/bin/env bash
# The first command to run on a GPU node (docs/gpus.md): trains a matrix of
# layouts through main.py, each against `single` on the same global batch, seed and
# weights, and prints one table (scripts/smoke_table.py): per layout the max relative loss
# and pre-clip grad-norm difference, median step time, MFU, peak memory of every rank
# beside what `mode=plan` predicts for that layout, whether every replica holds the same
# weights, whether a second run was bitwise equal to the first, pass/fail; then which GPU
# model ran which rows. Exit status 1 if any layout differs, crashes or hangs.
#
#   bash scripts/gpu_smoke.sh                # tier = the GPUs nvidia-smi shows (1, 2, 4 or 8)
#   bash scripts/gpu_smoke.sh --gpus 4       # the 1-, 2- and 4-GPU rows
#   bash scripts/gpu_smoke.sh --nodes 2      # the two-node tier, on each of two 8-GPU nodes:
#       MASTER_ADDR=node0 MASTER_PORT=29400 NODE_RANK=0|1 (torchrun's static rendezvous,
#       from these variables; node 0 prints the table) SMOKE_SHARED_DIR=<a directory both
#       nodes see: the jobs' snapshots, as for any multi-node run>
#   bash scripts/gpu_smoke.sh --cpu          # the 1- and 2-process tiers on gloo, tiny sizes
#   bash scripts/gpu_smoke.sh [--cpu] --list # every tier's rows: tier|name|processes|args
#   SMOKE_LAYOUTS="single pp2-zbv" bash scripts/gpu_smoke.sh --cpu   # only those rows
#
# Tiers: 1 (one process on its device: the NCCL group of one rank and our ddp_bucket and
# fsdp3 collectives through it, fsdp3 and FSDP2 with CPU offload (host gradients beside the
# device's loss; fp16 too), bf16, fp16, recompute (full, selective), compile, the profiler with a CUDA
# memory snapshot, an async snapshot killed and resumed, dropout), 2 (every path: data
# parallelism, ZeRO 1-3, tp, pp schedules, cp, precisions, recompute, compile, async
# snapshots killed and resumed, dropout, PyTorch's DDP, FSDP2 and TP on the same model),
# 4 and 8 (2-D and 3-D compositions), 2x8 (all four dimensions
# across two nodes). A tier runs its rows and those of the tiers below it.
#
# Every job runs with a deadline (SMOKE_JOB_TIMEOUT seconds) and collectives with a
# shorter one (parallel.timeout_s); a job past its deadline is killed with its whole
# process tree: torchrun starts each worker in a session of its own, so every process a
# job starts carries SMOKE_JOB_TAG=<its tag> and is found by it. A row that fails runs
# once more with NCCL_DEBUG=WARN, TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL's flight
# recorder on (dumped on a timeout), its logs kept under <row>/debug/. On GPUs every row
# runs twice and the second run must be bitwise equal to the first (losses, gradient
# norms, weights); with --cpu only the rows in SMOKE_RERUN (default: single) do. Two nodes
# run every row exactly twice, so that both start the same jobs: the second run is the
# determinism rerun where this node's first passed, else the debug rerun.
#
# SMOKE_DEADLINE=<seconds from the start> (a device call's limit): no row starts after it, a
# job's deadline is cut to what is left of it, and the rows not run are named above the
# table; SMOKE_ROWS=<file>: each row's exit statuses and seconds are appended to it the
# moment the row ends (the table comes at the end: a call cut short keeps these lines);
# SMOKE_TABLE=<file>: the table is also written there.
#
# Every job writes under a fresh temporary directory (printed), never into the checkout.
# PYTHON: the interpreter every job and the table run with (`python` from PATH by
# default; a relative path is taken from the checkout's root, where the script runs).
# The tests set it to the one running pytest:
#   PYTHON=.venv/bin/python bash scripts/gpu_smoke.sh --cpu
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"

MODE=gpu
LIST=0
GPUS=""
NODES=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --list) LIST=1 ;;
    --gpus) GPUS="${2:-}"; shift ;;
    --nodes) NODES="${2:-}"; shift ;;
    *) echo "gpu_smoke.sh: unknown argument $1 (--cpu, --list, --gpus 1|2|4|8, --nodes 2)" >&2; exit 2 ;;
  esac
  shift
done
export OMP_NUM_THREADS=1
if [[ $MODE == cpu ]]; then
  SIZE=(trainer.device=cpu model.n_layer=4 model.n_head=4 model.n_embd=32 data.block_size=16
        trainer.batch_size=16 trainer.max_steps=3)
  RTOL=1e-5; JOB_TIMEOUT=${SMOKE_JOB_TIMEOUT:-180}; KR_STEPS=8
else
  # one pipeline message: 8 sequences x 256 tokens x 768 x 4 bytes = 6 MiB, more than
  # NCCL buffers (4 MiB), so a send really waits for its receive, as at scale
  SIZE=(trainer.device=cuda model.n_layer=4 model.n_head=12 model.n_embd=768 data.block_size=256
        trainer.batch_size=32 trainer.max_steps=10)
  # fp32 on GPUs: cuBLAS picks other kernels for other shapes (TP's split matrices), so
  # sums round differently; broken parallelism shows as 1e-3 and more
  RTOL=${SMOKE_RTOL:-1e-4}; JOB_TIMEOUT=${SMOKE_JOB_TIMEOUT:-900}; KR_STEPS=40
fi
BF16_RTOL=2e-2  # bf16 autocast against the fp32 reference: a few steps drift ~1e-3
FP16_RTOL=5e-2  # fp16 (loss scaling from 1024): the norm drifts further (tests/test_precision.py)
# trainer.deterministic: the rerun column asks for bitwise-equal reruns, which GPU kernels
# with atomics (attention's backward, some cuBLAS paths) do not give without it
COMMON=("${SIZE[@]}" model.dropout=0.0 trainer.warmup_steps=2 trainer.log_every=1
        trainer.eval_every=0 trainer.save_every=0 sample.length=0 wandb.mode=disabled
        parallel.timeout_s=120 trainer.deterministic=true)
PP=(parallel.dp=single parallel.pp=2 parallel.microbatches=4)
SP=(parallel.tp=2 parallel.sequence_parallel=true)

# tier | name | processes | tolerance against single ("-": not compared: dropout draws
# other masks under other layouts; a kill-resume row trains KR_STEPS, so its learning-rate
# schedule is not single's: its check is that a step trained again after the resume is
# bitwise the one before the kill) | overrides
MATRIX=(
  "1|single|1|0|parallel.dp=single"
  "1|single-ddp_bucket|1|$RTOL|parallel.dp=ddp_bucket"
  "1|single-fsdp3|1|$RTOL|parallel.dp=fsdp parallel.zero_stage=3"
  "1|single-fsdp3-offload|1|$RTOL|parallel.dp=fsdp parallel.zero_stage=3 parallel.offload=true"
  "1|single-fsdp3-offload-fp16|1|$FP16_RTOL|parallel.dp=fsdp parallel.zero_stage=3 parallel.offload=true trainer.precision=fp16 trainer.fp16_init_scale=1024"
  "1|single-torch_fsdp-offload|1|$RTOL|parallel.dp=torch_fsdp parallel.offload=true"
  "1|single-bf16|1|$BF16_RTOL|parallel.dp=single trainer.precision=bf16"
  "1|single-fp16|1|$FP16_RTOL|parallel.dp=single trainer.precision=fp16 trainer.fp16_init_scale=1024"
  "1|single-recompute|1|$RTOL|parallel.dp=single trainer.activation_checkpointing=true"
  "1|single-recompute-selective|1|$RTOL|parallel.dp=single trainer.activation_checkpointing=true trainer.activation_checkpointing_mode=selective"
  "1|single-compile|1|$RTOL|parallel.dp=single trainer.compile=true"
  "1|single-profile|1|$RTOL|parallel.dp=single trainer.profile_from=3 trainer.profile_steps=2 trainer.memory_snapshot=true"
  "1|single-kill-resume|1|-|parallel.dp=single trainer.snapshot_async=true trainer.save_every=2 trainer.max_steps=$KR_STEPS"
  "1|single-dropout|1|-|parallel.dp=single model.dropout=0.1"
  "2|ddp_naive|2|$RTOL|parallel.dp=ddp_naive"
  "2|ddp_bucket|2|$RTOL|parallel.dp=ddp_bucket"
  "2|ddp_bucket-ring|2|$RTOL|parallel.dp=ddp_bucket parallel.allreduce=ring"
  "2|torch_ddp|2|$RTOL|parallel.dp=torch_ddp"
  "2|fsdp1|2|$RTOL|parallel.dp=fsdp parallel.zero_stage=1"
  "2|fsdp2|2|$RTOL|parallel.dp=fsdp parallel.zero_stage=2"
  "2|fsdp3-prefetch|2|$RTOL|parallel.dp=fsdp parallel.zero_stage=3 parallel.prefetch=true"
  "2|fsdp3-noprefetch|2|$RTOL|parallel.dp=fsdp parallel.zero_stage=3 parallel.prefetch=false"
  "2|torch_fsdp|2|$RTOL|parallel.dp=torch_fsdp"
  "2|tp2|2|$RTOL|parallel.dp=single parallel.tp=2"
  "2|tp2-torch|2|$RTOL|parallel.dp=single parallel.tp=2 parallel.tp_impl=torch"
  "2|tp2-sp|2|$RTOL|parallel.dp=single ${SP[*]}"
  "2|pp2-gpipe|2|$RTOL|${PP[*]} parallel.pp_schedule=gpipe"
  "2|pp2-1f1b|2|$RTOL|${PP[*]} parallel.pp_schedule=1f1b"
  "2|pp2-interleaved-v2|2|$RTOL|${PP[*]} parallel.pp_schedule=interleaved parallel.pp_virtual_stages=2"
  "2|pp2-zb1p|2|$RTOL|${PP[*]} parallel.pp_schedule=zb1p"
  "2|pp2-zbv|2|$RTOL|${PP[*]} parallel.pp_schedule=zbv"
  "2|cp2|2|$RTOL|parallel.dp=ddp_bucket parallel.cp=2"
  "2|cp2-allgather|2|$RTOL|parallel.dp=ddp_bucket parallel.cp=2 parallel.cp_impl=allgather"
  "2|ddp_bucket-fp16|2|$FP16_RTOL|parallel.dp=ddp_bucket trainer.precision=fp16 trainer.fp16_init_scale=1024"
  "2|ddp_bucket-bf16|2|$BF16_RTOL|parallel.dp=ddp_bucket trainer.precision=bf16"
  "2|tp2-sp-bf16|2|$BF16_RTOL|parallel.dp=single ${SP[*]} trainer.precision=bf16"
  "2|pp2-1f1b-bf16|2|$BF16_RTOL|${PP[*]} parallel.pp_schedule=1f1b trainer.precision=bf16"
  "2|cp2-bf16|2|$BF16_RTOL|parallel.dp=ddp_bucket parallel.cp=2 trainer.precision=bf16"
  "2|ddp_bucket-reduce-bf16|2|$BF16_RTOL|parallel.dp=ddp_bucket parallel.reduce_dtype=bf16"
  "2|fsdp2-reduce-bf16|2|$BF16_RTOL|parallel.dp=fsdp parallel.zero_stage=2 parallel.reduce_dtype=bf16"
  "2|ddp_bucket-recompute|2|$RTOL|parallel.dp=ddp_bucket trainer.activation_checkpointing=true"
  "2|tp2-sp-recompute|2|$RTOL|parallel.dp=single ${SP[*]} trainer.activation_checkpointing=true"
  "2|ddp_bucket-compile|2|$RTOL|parallel.dp=ddp_bucket trainer.compile=true"
  "2|snapshot-kill-resume|2|-|parallel.dp=fsdp parallel.zero_stage=2 trainer.snapshot_async=true trainer.save_every=2 trainer.max_steps=$KR_STEPS"
  "2|tp2-sp-dropout|2|-|parallel.dp=single ${SP[*]} model.dropout=0.1"
  "2|cp2-dropout|2|-|parallel.dp=ddp_bucket parallel.cp=2 model.dropout=0.1"
  "4|dp2-tp2|4|$RTOL|parallel.dp=ddp_bucket ${SP[*]}"
  "4|dp2-tp2-fsdp1|4|$RTOL|parallel.dp=fsdp parallel.zero_stage=1 ${SP[*]}"
  "4|dp2-pp2|4|$RTOL|parallel.dp=ddp_bucket parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=1f1b"
  "4|dp2-cp2|4|$RTOL|parallel.dp=ddp_bucket parallel.cp=2"
  "4|pp2-tp2|4|$RTOL|${PP[*]} parallel.pp_schedule=1f1b ${SP[*]}"
  "4|cp2-tp2|4|$RTOL|parallel.dp=ddp_bucket parallel.cp=2 ${SP[*]}"
  "4|dp4-ddp_bucket|4|$RTOL|parallel.dp=ddp_bucket"
  "4|dp4-torch_ddp|4|$RTOL|parallel.dp=torch_ddp"
  "4|dp4-fsdp3|4|$RTOL|parallel.dp=fsdp parallel.zero_stage=3"
  "4|dp4-torch_fsdp|4|$RTOL|parallel.dp=torch_fsdp"
  "4|tp4|4|$RTOL|parallel.dp=single parallel.tp=4"
  "4|tp4-torch|4|$RTOL|parallel.dp=single parallel.tp=4 parallel.tp_impl=torch"
  "8|dp2-pp2-tp2|8|$RTOL|parallel.dp=ddp_bucket parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=1f1b ${SP[*]}"
  "8|dp2-pp2-tp2-zbv|8|$RTOL|parallel.dp=fsdp parallel.zero_stage=1 parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=zbv ${SP[*]}"
  "8|dp2-cp2-tp2|8|$RTOL|parallel.dp=ddp_bucket parallel.cp=2 ${SP[*]}"
  "8|pp2-cp2-tp2|8|$RTOL|parallel.dp=ddp_bucket parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=1f1b parallel.cp=2 ${SP[*]}"
  "8|dp2-pp2-tp2-bf16|8|$BF16_RTOL|parallel.dp=ddp_bucket parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=1f1b ${SP[*]} trainer.precision=bf16"
  "8|dp8-fsdp3|8|$RTOL|parallel.dp=fsdp parallel.zero_stage=3"
  "8|dp8-torch_fsdp|8|$RTOL|parallel.dp=torch_fsdp"
  "2x8|dp2-pp2-cp2-tp2|16|$RTOL|parallel.dp=ddp_bucket parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=1f1b parallel.cp=2 ${SP[*]}"
  "2x8|dp2-pp2-tp4|16|$RTOL|parallel.dp=fsdp parallel.zero_stage=1 parallel.pp=2 parallel.microbatches=4 parallel.pp_schedule=interleaved parallel.pp_virtual_stages=2 parallel.tp=4 parallel.sequence_parallel=true"
  "2x8|dp16-ddp_bucket|16|$RTOL|parallel.dp=ddp_bucket"
  "2x8|dp16-torch_ddp|16|$RTOL|parallel.dp=torch_ddp"
  "2x8|dp16-fsdp3|16|$RTOL|parallel.dp=fsdp parallel.zero_stage=3"
  "2x8|dp16-torch_fsdp|16|$RTOL|parallel.dp=torch_fsdp"
)
# own strategy -> PyTorch's, timed side by side in the table's "vs torch" column
SPEED_PAIRS="single-fsdp3-offload=single-torch_fsdp-offload ddp_bucket=torch_ddp fsdp3-prefetch=torch_fsdp tp2=tp2-torch dp4-ddp_bucket=dp4-torch_ddp
  dp4-fsdp3=dp4-torch_fsdp tp4=tp4-torch dp8-fsdp3=dp8-torch_fsdp dp16-ddp_bucket=dp16-torch_ddp
  dp16-fsdp3=dp16-torch_fsdp"

if [[ $LIST == 1 ]]; then  # tier|name|processes|main.py arguments, one row a line
  for row in "${MATRIX[@]}"; do
    IFS='|' read -r tier name nproc rtol overrides <<<"$row"
    echo "$tier|$name|$nproc|${COMMON[*]} $overrides"
  done
  exit 0
fi

# ------------------------------------------------------------------ which rows run here
if [[ $NODES == 2 ]]; then
  : "${MASTER_ADDR:?--nodes 2 needs MASTER_ADDR (the address of node 0)}"
  : "${MASTER_PORT:?--nodes 2 needs MASTER_PORT}"
  : "${NODE_RANK:?--nodes 2 needs NODE_RANK (0 or 1)}"
  : "${SMOKE_SHARED_DIR:?--nodes 2 needs SMOKE_SHARED_DIR, a directory both nodes see (the jobs snapshots)}"
  TIERS=(2x8)
  PER_NODE=8
elif [[ $NODES != 1 ]]; then
  echo "gpu_smoke.sh: --nodes takes 2 (the two-node tier), got $NODES" >&2; exit 2
elif [[ $MODE == cpu ]]; then
  TIERS=(1 2)
else
  if [[ -z $GPUS ]]; then
    GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
    (( GPUS > 8 )) && GPUS=8
  fi
  case "$GPUS" in
    1) TIERS=(1) ;;
    2|3) TIERS=(1 2) ;;
    4|5|6|7) TIERS=(1 2 4) ;;
    8) TIERS=(1 2 4 8) ;;
    *) echo "gpu_smoke.sh: needs 1, 2, 4 or 8 GPUs (--gpus N), nvidia-smi shows ${GPUS:-none}" >&2; exit 2 ;;
  esac
fi

# ------------------------------------------------------------------ running one job

DEADLINE=${SMOKE_DEADLINE:-0}

job_limit() {  # a job's deadline (s): JOB_TIMEOUT, or what is left of SMOKE_DEADLINE if less
  local limit=$JOB_TIMEOUT left
  if (( DEADLINE > 0 )); then
    left=$(( DEADLINE - SECONDS ))
    (( left < 1 )) && left=1
    (( left < limit )) && limit=$left
  fi
  echo "$limit"
}

past_deadline() { (( DEADLINE > 0 && SECONDS >= DEADLINE )); }

row_done() {  # $1: a row's name, $2: its directory, $3: SECONDS at its start -> SMOKE_ROWS
  [[ -n ${SMOKE_ROWS:-} ]] || return 0
  local what="exit $(cat "$2/status" 2>/dev/null || echo '?')" sub
  for sub in rerun debug resume; do
    [[ -f $2/$sub/status ]] && what+=", $sub exit $(cat "$2/$sub/status")"
  done
  echo "$1|$what|$((SECONDS - $3)) s" >>"$SMOKE_ROWS"
}

job_seq=0
JOB_TAG_PREFIX="gpu_smoke.$$.$RANDOM"

tagged() {  # the live processes whose environment holds SMOKE_JOB_TAG=$1
  local f pid
  for f in $(grep -lsxzF "SMOKE_JOB_TAG=$1" /proc/[0-9]*/environ); do
    pid=${f#/proc/}; pid=${pid%/environ}
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) == Z ]] || echo "$pid"
  done
}

kill_job() {  # $1: a job's launcher; $2: its tag. SIGKILL every process carrying the tag.
  kill -STOP "$1" 2>/dev/null  # no new workers while we look
  # shellcheck disable=SC2046  # a list of pids
  kill -KILL "$1" $(tagged "$2") 2>/dev/null
  wait "$1" 2>/dev/null
}

await_first() {  # $1: a job, $2: its timer -> DONE: the one that ended first; the job's status
  if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501 )); then  # bash 5.1: wait -n -p
    wait -n -p DONE "$1" "$2"
    return $?
  fi
  while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 1; done
  if kill -0 "$1" 2>/dev/null; then DONE=$2; return 0; fi
  DONE=$1
  wait "$1"
}

launcher() {  # $1: processes, $2: a port offset -> LAUNCH, the command that starts main.py
  local nproc=$1
  if [[ $nproc == 1 ]]; then  # one process: no rendezvous, whatever the node's environment says
    LAUNCH=(env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE "$PYTHON" main.py)
  elif [[ $NODES == 2 ]]; then  # static rendezvous: node 0 holds ranks 0-7, rank 0 writes
    LAUNCH=("$PYTHON" -m torch.distributed.run --nnodes=2 "--node_rank=$NODE_RANK"
            "--nproc_per_node=$PER_NODE" "--master_addr=$MASTER_ADDR"
            "--master_port=$((MASTER_PORT + $2))" main.py)
  else  # --standalone: a free port for the rendezvous
    LAUNCH=("$PYTHON" -m torch.distributed.run --standalone "--nproc_per_node=$nproc" main.py)
  fi
}

# run_job DIR PROCESSES "OVERRIDES" [debug] [RUN_DIR]: status (124: killed at its deadline)
# and log in DIR; the run directory is DIR/run unless given
run_job() {
  local dir=$1 nproc=$2 overrides=$3 debug=${4:-} run_dir=${5:-$1/run}
  mkdir -p "$dir"
  job_seq=$((job_seq + 1))
  local tag="$JOB_TAG_PREFIX.$job_seq" env=()
  if [[ -n $debug ]]; then
    env=(NCCL_DEBUG=WARN TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_NCCL_TRACE_BUFFER_SIZE=20000
         TORCH_NCCL_DUMP_ON_TIMEOUT=1 "TORCH_FR_DUMP_TEMP_FILE=$dir/nccl_trace_rank_"
         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$dir/nccl_trace_rank_")
  fi
  launcher "$nproc" "$PORT_OFFSET"
  local shared=()
  if [[ $NODES == 2 && $nproc != 1 ]]; then  # a snapshot every node's ranks write parts of
    local snap="$SMOKE_SHARED_DIR/gpu_smoke.$MASTER_PORT/${dir#"$OUT"/}"
    [[ $NODE_RANK == 0 ]] && rm -rf "$snap"  # before the rendezvous: node 1 waits for it
    shared=("trainer.snapshot_path=$snap")
  fi
  # shellcheck disable=SC2086  # $overrides is a list of key=value words
  env SMOKE_JOB_TAG="$tag" "${env[@]}" "${LAUNCH[@]}" "${COMMON[@]}" $overrides \
    "trainer.run_dir=$run_dir" "${shared[@]}" >"$dir/log" 2>&1 &
  local job=$! limit
  limit=$(job_limit)
  sleep "$limit" &
  local timer=$! status
  DONE=""
  await_first "$job" "$timer"
  status=$?
  if [[ $DONE == "$timer" ]]; then  # the deadline came first: the whole tree goes
    kill_job "$job" "$tag"
    status=124
    echo "gpu_smoke: killed after ${limit}s (every process tagged SMOKE_JOB_TAG=$tag)" >>"$dir/log"
  else
    kill "$timer" 2>/dev/null
    wait "$timer" 2>/dev/null
  fi
  local left
  left=$(tagged "$tag")
  if [[ -n $left ]]; then  # the launcher ended but left workers behind: kill them too
    kill -KILL $left 2>/dev/null
    echo "gpu_smoke: killed processes left behind: $left" >>"$dir/log"
  fi
  echo "$status" >"$dir/status"
  return "$status"
}

# the async snapshot row: train in the background, SIGKILL the whole job once a snapshot is
# committed and a few more steps are logged, resume with the same command to the end
run_kill_resume() {
  local dir=$1 nproc=$2 overrides=$3
  mkdir -p "$dir"
  job_seq=$((job_seq + 1))
  local tag="$JOB_TAG_PREFIX.$job_seq"
  launcher "$nproc" "$PORT_OFFSET"
  # shellcheck disable=SC2086
  env SMOKE_JOB_TAG="$tag" "${LAUNCH[@]}" "${COMMON[@]}" $overrides \
    "trainer.run_dir=$dir/run" >"$dir/log" 2>&1 &
  local job=$! deadline=$((SECONDS + $(job_limit))) lines=0
  while kill -0 "$job" 2>/dev/null && (( SECONDS < deadline )); do
    lines=$( { wc -l <"$dir/run/metrics.jsonl"; } 2>/dev/null || echo 0)
    [[ -f $dir/run/snapshot/latest.json ]] && (( lines >= 5 )) && break
    sleep 0.05
  done
  local alive=0
  kill -0 "$job" 2>/dev/null && alive=1
  kill_job "$job" "$tag"
  cp "$dir/run/metrics.jsonl" "$dir/killed.jsonl" 2>/dev/null
  echo "{\"killed_running\": $alive, \"logged_before_kill\": $lines}" >"$dir/kill.json"
  echo "gpu_smoke: SIGKILL after $lines logged steps (still running: $alive)" >>"$dir/log"
  run_job "$dir/resume" "$nproc" "$overrides" "" "$dir/run"
  local status=$?
  cat "$dir/resume/log" >>"$dir/log"
  echo "$status" >"$dir/status"
}

OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_smoke.XXXXXX")
echo "gpu_smoke ($MODE, tiers ${TIERS[*]}): jobs under $OUT"
SPECS=()
SKIPPED=()
row_index=0
for row in "${MATRIX[@]}"; do
  IFS='|' read -r tier name nproc rtol overrides <<<"$row"
  row_index=$((row_index + 1))
  # the rendezvous port of a row's runs (two nodes): the same on both, whatever ran before
  PORT_OFFSET=$((4 * row_index))
  wanted=0
  for t in "${TIERS[@]}"; do [[ $t == "$tier" ]] && wanted=1; done
  [[ $name == single ]] && wanted=1  # the reference, of every tier
  if [[ $NODES == 2 && $name == single && $NODE_RANK != 0 ]]; then wanted=0; fi
  # SMOKE_LAYOUTS="single cp2 ...": only those rows (tests/test_gpu_smoke.py runs a few)
  if [[ -n "${SMOKE_LAYOUTS:-}" && " $SMOKE_LAYOUTS " != *" $name "* ]]; then wanted=0; fi
  [[ $wanted == 1 ]] || continue
  if past_deadline; then  # SMOKE_DEADLINE: the call's time is up
    SKIPPED+=("$name")
    [[ -n ${SMOKE_ROWS:-} ]] && echo "$name|not run: SMOKE_DEADLINE ${DEADLINE} s|0 s" >>"$SMOKE_ROWS"
    continue
  fi
  dir="$OUT/$name"
  row_started=$SECONDS
  if [[ $name == *kill-resume ]]; then
    run_kill_resume "$dir" "$nproc" "$overrides"
  elif [[ $NODES == 2 && $nproc != 1 ]]; then
    # both nodes must start the same jobs in the same order, whatever each saw: always
    # two runs, the second the determinism rerun if this node's first passed, else the
    # debug rerun (a node cannot know whether the other's failed)
    run_job "$dir" "$nproc" "$overrides"
    PORT_OFFSET=$((PORT_OFFSET + 1))
    if [[ $(cat "$dir/status") == 0 ]]; then
      run_job "$dir/rerun" "$nproc" "$overrides"
    else
      echo "gpu_smoke: $name failed (exit $(cat "$dir/status")); its second run has NCCL_DEBUG=WARN," \
           "TORCH_DISTRIBUTED_DEBUG=DETAIL and the NCCL flight recorder: $dir/debug"
      run_job "$dir/debug" "$nproc" "$overrides" debug
    fi
    row_done "$name" "$dir" "$row_started"
    SPECS+=("$name:$rtol")
    continue
  else
    run_job "$dir" "$nproc" "$overrides"
    rerun=0
    if [[ $MODE == gpu ]]; then rerun=1; fi
    if [[ " ${SMOKE_RERUN-single} " == *" $name "* ]]; then rerun=1; fi
    if [[ $rerun == 1 && $(cat "$dir/status") == 0 ]] && ! past_deadline; then  # determinism
      run_job "$dir/rerun" "$nproc" "$overrides"
    fi
  fi
  if [[ $(cat "$dir/status") != 0 ]] && ! past_deadline; then  # once more, with debug output
    echo "gpu_smoke: $name failed (exit $(cat "$dir/status")); rerunning with NCCL_DEBUG=WARN," \
         "TORCH_DISTRIBUTED_DEBUG=DETAIL and the NCCL flight recorder: $dir/debug"
    run_job "$dir/debug" "$nproc" "$overrides" debug
  fi
  row_done "$name" "$dir" "$row_started"
  SPECS+=("$name:$rtol")
done
if (( ${#SKIPPED[@]} )); then
  echo "gpu_smoke: not run, SMOKE_DEADLINE ${DEADLINE} s reached: ${SKIPPED[*]}" \
       "(SMOKE_LAYOUTS=\"single ${SKIPPED[*]}\" runs them)"
fi
if [[ $NODES == 2 && $NODE_RANK != 0 ]]; then
  echo "gpu_smoke: node $NODE_RANK done; node 0 prints the table"
  exit 0
fi
if [[ -n ${SMOKE_TABLE:-} ]]; then  # the table also into that file (a device call's $OUT)
  SMOKE_SPEED_PAIRS="$SPEED_PAIRS" "$PYTHON" scripts/smoke_table.py "$OUT" "${SPECS[@]}" | tee "$SMOKE_TABLE"
  exit "${PIPESTATUS[0]}"
fi
SMOKE_SPEED_PAIRS="$SPEED_PAIRS" "$PYTHON" scripts/smoke_table.py "$OUT" "${SPECS[@]}"
