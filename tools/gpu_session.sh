#!/usr/bin/env bash
# One prepared accelerator session for ode-lm: install, environment, correctness, speed, a
# real run; every step time-boxed, everything under $OUT, one summary.json.
#
# On an accelerator host, from a checkout (the host's Python already has jax with its
# accelerator plugin, flax, optax, orbax; wheels/ holds the rest, see tools/gpu_wheels.sh):
#   OUT=/path/to/results bash tools/gpu_session.sh 2>&1
# The script keeps to TOTAL_BUDGET_S = 450 s of its own. A rerun of part of it:
#   SKIP=attention,parity,determinism,resume OUT=/path/to/results bash tools/gpu_session.sh
# If smoke (import + one compile on the host's jax) fails, the script stops right there.
#
# CPU dry run (what tests/pod/test_gpu_session.py runs; micro sizes, short boxes):
#   OUT=/tmp/out tools/gpu_session.sh --dry-run
#
# What it leaves in $OUT (a few plain files, easy to copy off the host): summary.json (every
# figure and each step's rc, seconds and result), session.log (all output), steps.tar.gz
# (each step's JSON, log and the real run's metrics + TensorBoard events), and trace.tar.gz
# (the jax.profiler trace) when it is under 15 MiB.
set -uo pipefail

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
SKIP=",${SKIP:-},"  # a rerun: SKIP=attention,parity,determinism,resume skips those steps

# ---- budgets (seconds); each step also stops when TOTAL_BUDGET_S is spent
TOTAL_BUDGET_S=450
INSTALL_S=60
ENV_S=45
SMOKE_S=90
ATTENTION_S=75
PARITY_S=75
DETERMINISM_S=75
RESUME_S=90
BENCH_S=150          # ode-lm bench --config gpu_large: ODE vs vanilla
DATA_S=120           # built-in corpus, prepared in the background from the start
REAL_RUN_S=150       # ode-lm train: compile + REAL_RUN_TRAIN_S of training, then SIGTERM
REAL_RUN_TRAIN_S=120
PROFILE_S=60         # optional: only if the time is left
BENCH_VARIANTS_S=120 # optional: weight generation and remat variants
# ---- sizes
SIZE_FLAG=""
PARITY_STEPS=3
TRAIN_RUN_STEPS=12
BENCH_CONFIG=gpu_large
BENCH_STEPS=10
REAL_RUN_GIN=(--gin.D_MODEL=768 --gin.NUM_HEADS=12 --gin.SEQ_LEN=1024 --gin.BATCH_SIZE=32
              "--gin.ModelConfig.dtype='bfloat16'" --gin.TRAIN_STEPS=100000
              --gin.TrainConfig.log_every=20 --gin.CheckpointConfig.save_every=1000)
if (( DRY_RUN )); then
  # budgets ~1.6x what an idle small CPU host takes, so a loaded host (a parallel test run)
  # still finishes each step; the real run logs every step and trains long enough that a
  # loaded host times some steps after each of the recipe's variants compiled on first draw
  TOTAL_BUDGET_S=600; INSTALL_S=5; ENV_S=30; SMOKE_S=60; ATTENTION_S=45; PARITY_S=90
  DETERMINISM_S=90; RESUME_S=90; BENCH_S=90; DATA_S=90; REAL_RUN_S=140; REAL_RUN_TRAIN_S=100
  PROFILE_S=40; BENCH_VARIANTS_S=0
  SIZE_FLAG="--small"; PARITY_STEPS=2; TRAIN_RUN_STEPS=6; BENCH_CONFIG=tiny; BENCH_STEPS=2
  REAL_RUN_GIN=(--gin.SEQ_LEN=64 --gin.BATCH_SIZE=4 --gin.TRAIN_STEPS=100000
                --gin.TrainConfig.log_every=1 --gin.CheckpointConfig.save_every=1000)
fi

: "${OUT:?set OUT to the folder results go to}"
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_session.XXXXXX)   # run dirs, checkpoints: never in $OUT
STEPS="$OUT/steps"
mkdir -p "$STEPS"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export JAX_COMPILATION_CACHE_DIR="$WORK/xla_cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export ODE_LM_CACHE="$WORK/cache"
if (( DRY_RUN )); then export JAX_PLATFORMS=cpu; fi
PY=python3
START=$(date +%s)
CHECKS=(tools/gpu_checks.py)

pack() {  # $OUT stays a few plain files: fold the step files into one archive
  $PY tools/gpu_summary.py summary --steps_dir "$STEPS" --out "$OUT/summary.json" || true
  # the run's top-level files (metrics, events, run record; not its checkpoints)
  [[ -d "$WORK/real_run" ]] && find "$WORK/real_run" -maxdepth 1 -type f -exec cp {} "$STEPS/" \;
  tar -czf "$OUT/steps.tar.gz" -C "$OUT" steps && rm -rf "$STEPS"
  if [[ -d "$WORK/trace" ]]; then
    tar -czf "$OUT/trace.tar.gz" -C "$WORK" trace
    (( $(stat -c %s "$OUT/trace.tar.gz") > 15 * 2**20 )) && rm -f "$OUT/trace.tar.gz" &&
      echo "trace.tar.gz over 15 MiB: left out"
  fi
  rm -rf "$WORK"
  echo "session: $(( $(date +%s) - START )) s; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
}
trap pack EXIT

left() { echo $(( TOTAL_BUDGET_S - ($(date +%s) - START) )); }

# step NAME BUDGET [optional] -- CMD...: run CMD under `timeout`, log to steps/NAME.log, and
# leave steps/NAME.status ({rc, seconds, budget}); the check itself writes steps/NAME.json
step() {
  local name=$1 budget=$2 optional=0; shift 2
  [[ $1 == optional ]] && { optional=1; shift; }
  [[ $1 == -- ]] && shift
  local remaining; remaining=$(left)
  if [[ $SKIP == *",$name,"* ]]; then echo "== $name: skipped (SKIP)"; return 0; fi
  if (( budget <= 0 )) || { (( optional )) && (( remaining < budget )); }; then
    echo "== $name: skipped (budget $budget s, $remaining s left)"; return 0
  fi
  (( budget > remaining )) && budget=$remaining
  if (( budget < 5 )); then
    echo "== $name: skipped (session budget spent)"
    printf '{"rc": -1, "seconds": 0, "budget": %d, "skipped": true}\n' "$budget" \
      > "$STEPS/$name.status"
    return 0
  fi
  echo "== $name (budget $budget s, $remaining s left)"
  local t0 rc; t0=$(date +%s%N)
  timeout -k 10 "$budget" "$@" > "$STEPS/$name.log" 2>&1; rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local dt; dt=$(printf '%d.%03d' $(( ms / 1000 )) $(( ms % 1000 )))
  printf '{"rc": %d, "seconds": %s, "budget": %d, "command": %s}\n' "$rc" "$dt" "$budget" \
    "$($PY -c 'import json,sys; print(json.dumps(" ".join(sys.argv[1:])))' "$@")" \
    > "$STEPS/$name.status"
  tail -n 4 "$STEPS/$name.log"
  echo "   rc $rc, ${dt} s"
}

# ---- install: the wheels in wheels/ (if any), then ode-lm itself on top of the host's jax
install() {
  if (( DRY_RUN )); then echo "dry run: nothing installed"; return 0; fi
  if compgen -G "wheels/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site wheels/*.whl || return 1
    export PYTHONPATH="$REPO:/tmp/site"
  fi
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . ||
    echo "pip install -e . failed: ode-lm runs from PYTHONPATH=$REPO"
}
echo "== install"
install || { echo "install failed"; exit 1; }
export PYTHONPATH

# ---- the built-in corpus for the real run, prepared on the CPU meanwhile
DATA_DIR="$WORK/data/builtin-bpe2048"
( JAX_PLATFORMS=cpu timeout -k 10 "$DATA_S" $PY -m ode_lm prepare --source=builtin --tokenizer=bpe:2048 \
    --holdout_fraction=0.05 --data_dir="$DATA_DIR" --no_progress > "$WORK/prepare.log" 2>&1
  echo $? > "$WORK/prepare.rc" ) &
PREPARE_PID=$!

# ---- environment
env_report() {
  nvidia-smi 2>&1 || echo "no nvidia-smi"
  echo "uname: $(uname -a)"; echo "nproc: $(nproc)"
  $PY -c 'import json, sys, jax; env = {"python": sys.version, "jax": jax.__version__,
"devices": [str(d) for d in jax.devices()], "backend": jax.default_backend()}; print(env)
json.dump(dict(env, ok=True), open(sys.argv[1], "w"))' "$STEPS/env.json"
  $PY -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda|flax|optax|orbax|tensorstore|grain|array.record|gin|clu|etils|numpy|ml.dtypes|protobuf|tensorboard|nvidia-cudnn|ml.collections|zstandard) '
  for f in --xla_gpu_deterministic_ops=true --xla_gpu_exclude_nondeterministic_ops=true; do
    XLA_FLAGS=$f $PY -c 'import jax.numpy as j; j.ones(2).sum().block_until_ready()' \
      > /dev/null 2>&1 && echo "XLA flag accepted: $f" || echo "XLA flag REFUSED: $f"
  done
}
export -f env_report; export PY STEPS
step env "$ENV_S" -- bash -c env_report
DET_FLAG=--xla_gpu_deterministic_ops=true
grep -q "REFUSED: $DET_FLAG" "$STEPS/env.log" && DET_FLAG=--xla_gpu_exclude_nondeterministic_ops=true

# ---- correctness
step smoke "$SMOKE_S" -- $PY "${CHECKS[@]}" smoke $SIZE_FLAG --out "$STEPS/smoke.json"
if [[ $SKIP != *",smoke,"* ]] && ! grep -q '"rc": 0' "$STEPS/smoke.status"; then
  echo "smoke failed (import or first compile on this jax): nothing else can pass; stopping"
  kill "$PREPARE_PID" 2>/dev/null; exit 1
fi
step attention "$ATTENTION_S" -- $PY "${CHECKS[@]}" attention $SIZE_FLAG \
  --out "$STEPS/attention.json"
step parity "$PARITY_S" -- $PY "${CHECKS[@]}" parity $SIZE_FLAG --steps "$PARITY_STEPS" \
  --out "$STEPS/parity.json"
step determinism "$DETERMINISM_S" -- env XLA_FLAGS="$DET_FLAG" XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  $PY "${CHECKS[@]}" determinism $SIZE_FLAG --steps "$TRAIN_RUN_STEPS" --workdir "$WORK/det" \
  --out "$STEPS/determinism.json"
step resume "$RESUME_S" -- env XLA_FLAGS="$DET_FLAG" XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  $PY "${CHECKS[@]}" resume $SIZE_FLAG --steps "$TRAIN_RUN_STEPS" --workdir "$WORK/det" \
  --reference "$WORK/det/a" --out "$STEPS/resume.json"

# ---- speed
step bench "$BENCH_S" -- $PY -m ode_lm bench --config "$BENCH_CONFIG" --platform \
  "$( (( DRY_RUN )) && echo cpu || echo gpu)" --sections compare --steps "$BENCH_STEPS" \
  --warmup 2 --json "$STEPS/bench.json"

# ---- a real run: the demo recipe scaled up, stopped by SIGTERM (it saves and exits)
wait "$PREPARE_PID"
echo "== data: prepare rc $(cat "$WORK/prepare.rc" 2>/dev/null || echo '?')"
tail -n 3 "$WORK/prepare.log"
real_run() {
  local args; eval "args=($REAL_RUN_ARGS)"
  timeout -s TERM -k 30 "$REAL_RUN_TRAIN_S" $PY -m ode_lm train \
    --gin_file=configs/runs/demo.gin --gin.MODEL_DIR="'$WORK/real_run'" \
    --gin.DATA_DIR="'$DATA_DIR'" "${args[@]}"
  local rc=$?
  (( rc == 124 )) && rc=0  # stopped by the time box: the trainer saved and exited
  $PY tools/gpu_summary.py run-figures --model_dir "$WORK/real_run" \
    --out "$STEPS/real_run.json" && return $rc
}
REAL_RUN_ARGS=$(printf '%q ' "${REAL_RUN_GIN[@]}")
export -f real_run; export WORK DATA_DIR REAL_RUN_TRAIN_S STEPS REAL_RUN_ARGS
step real_run "$REAL_RUN_S" -- bash -c real_run

# ---- if time is left: a profile of the bench model, the bench's variants
step profile "$PROFILE_S" optional -- $PY "${CHECKS[@]}" profile $SIZE_FLAG --steps 3 \
  --trace_dir "$WORK/trace" --out "$STEPS/profile.json"
step bench_variants "$BENCH_VARIANTS_S" optional -- $PY -m ode_lm bench \
  --config "$BENCH_CONFIG" --platform gpu --sections weight_gen,remat --steps "$BENCH_STEPS" \
  --warmup 2 --json "$STEPS/bench_variants.json"
