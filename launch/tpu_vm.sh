#!/usr/bin/env bash
# Run an ode-lm gin config on every worker of a Cloud TPU VM (single host or pod).
#
# Steps: [create the VM] -> copy the repo to all workers -> pip install '.[tpu]' ->
# start `python3 -m ode_lm.commands.train` on all workers (each logs to its own file) -> stream
# worker 0's log. With --retries N a failed or preempted run is restarted; the trainer
# resumes from the latest checkpoint in its model dir, so that dir must be shared storage
# (gs://...) for a restart on a re-created VM to continue where it stopped.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: launch/tpu_vm.sh --tpu NAME --zone ZONE [--project PROJECT]
                        --gin_file FILE [--gin_file FILE ...] [--gin.SCOPE.PARAM=VALUE ...]
                        [--create --accelerator-type TYPE --version VERSION [--spot]]
                        [--retries N] [--remote_dir DIR] [--skip_sync] [--skip_install]
                        [--dry-run]
       launch/tpu_vm.sh --tpu NAME --zone ZONE [--project PROJECT] --stop [--dry-run]

Runs `python3 -m ode_lm.commands.train` with the given gin files and bindings on every worker of
the TPU VM NAME, each worker writing DIR/logs/worker-<i>.log, and streams worker 0's log.

  --tpu NAME               TPU VM name (required)
  --zone ZONE              zone of the TPU VM (required)
  --project PROJECT        GCP project (default: gcloud's configured project)
  --gin_file FILE          gin file, relative to the repo root; repeatable
  --gin.X=Y                extra gin binding X = Y passed to the trainer; repeatable
  --create                 create the TPU VM first (needs --accelerator-type, --version)
  --accelerator-type TYPE  e.g. v5p-64, v5litepod-256, v4-64, v6e-256
  --version VERSION        TPU VM runtime, e.g. v2-alpha-tpuv5, tpu-ubuntu2204-base
  --spot                   create a Spot (preemptible) VM
  --retries N              restart up to N times after a failure or preemption; the
                           trainer auto-resumes from its latest checkpoint (default 0)
  --remote_dir DIR         repo location on the workers, relative to home (default ode-lm)
  --skip_sync              do not copy the repo (it is already on the workers)
  --skip_install           do not pip install (the environment is already set up)
  --stop                   kill the running job on all workers and exit
  --dry-run                print every command instead of running it
  -h, --help               show this text
EOF
}

die() {
  echo "tpu_vm.sh: error: $*" >&2
  echo "Run 'launch/tpu_vm.sh --help' for usage." >&2
  exit 2
}

TPU=""
ZONE=""
PROJECT=""
GIN_FILES=()
GIN_BINDINGS=()
CREATE=0
ACCEL=""
VERSION=""
SPOT=0
RETRIES=0
REMOTE_DIR="ode-lm"
SKIP_SYNC=0
SKIP_INSTALL=0
STOP=0
DRY_RUN=0

# Value of a flag given as `--flag value` or `--flag=value`; sets SHIFT_BY.
flag_value() {
  local arg="$1" next="${2-}" name="${1%%=*}"
  if [[ "$arg" == *=* ]]; then
    VALUE="${arg#*=}"
    SHIFT_BY=1
  else
    [[ $# -ge 2 && "$next" != --* ]] || die "flag $name needs a value"
    VALUE="$next"
    SHIFT_BY=2
  fi
  [[ -n "$VALUE" ]] || die "flag $name needs a non-empty value"
}

while [[ $# -gt 0 ]]; do
  SHIFT_BY=1
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --tpu|--tpu=*) flag_value "$@"; TPU="$VALUE" ;;
    --zone|--zone=*) flag_value "$@"; ZONE="$VALUE" ;;
    --project|--project=*) flag_value "$@"; PROJECT="$VALUE" ;;
    --gin_file|--gin_file=*) flag_value "$@"; GIN_FILES+=("$VALUE") ;;
    --gin.*=*) GIN_BINDINGS+=("${1#--gin.}") ;;
    --gin.*) die "gin binding '$1' must have the form --gin.SCOPE.PARAM=VALUE" ;;
    --create) CREATE=1 ;;
    --accelerator-type|--accelerator-type=*) flag_value "$@"; ACCEL="$VALUE" ;;
    --version|--version=*) flag_value "$@"; VERSION="$VALUE" ;;
    --spot) SPOT=1 ;;
    --retries|--retries=*) flag_value "$@"; RETRIES="$VALUE" ;;
    --remote_dir|--remote_dir=*) flag_value "$@"; REMOTE_DIR="$VALUE" ;;
    --skip_sync) SKIP_SYNC=1 ;;
    --skip_install) SKIP_INSTALL=1 ;;
    --stop) STOP=1 ;;
    --dry-run|--dry_run) DRY_RUN=1 ;;
    *) die "unknown argument '$1'" ;;
  esac
  shift "$SHIFT_BY"
done

[[ -n "$TPU" ]] || die "--tpu NAME is required"
[[ -n "$ZONE" ]] || die "--zone ZONE is required"
[[ "$RETRIES" =~ ^[0-9]+$ ]] || die "--retries must be a non-negative integer, got '$RETRIES'"
[[ "$REMOTE_DIR" =~ ^[A-Za-z0-9._/-]+$ ]] || die "--remote_dir '$REMOTE_DIR' has unsafe characters"
if [[ $CREATE -eq 1 ]]; then
  [[ -n "$ACCEL" ]] || die "--create needs --accelerator-type (e.g. v5p-64)"
  [[ -n "$VERSION" ]] || die "--create needs --version (e.g. v2-alpha-tpuv5)"
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $STOP -eq 0 ]]; then
  [[ ${#GIN_FILES[@]} -gt 0 ]] || die "at least one --gin_file is required"
  for f in "${GIN_FILES[@]}"; do
    [[ -f "$REPO_ROOT/$f" ]] || die "--gin_file '$f' not found under $REPO_ROOT"
  done
fi

SCOPE=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && SCOPE+=(--project="$PROJECT")
TPU_VM=(gcloud compute tpus tpu-vm)
LOG_DIR="$REMOTE_DIR/logs"
PID_FILE="$LOG_DIR/train.pid"
# Worker index from the TPU VM metadata server (hostname as a fallback off GCE); expanded on
# the worker, hence single quotes.
# shellcheck disable=SC2016
WORKER_ID='$(curl -sf -H Metadata-Flavor:Google http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'

# One argument as the shell would need it: bare when safe, else single-quoted (a --flag=
# prefix stays outside the quotes so printed commands read naturally).
shell_quote() {
  local arg="$1" prefix="" sq="'\\''"
  if [[ "$arg" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
    printf '%s' "$arg"
    return
  fi
  if [[ "$arg" =~ ^(--[A-Za-z0-9_.-]+=)(.*)$ ]]; then
    prefix="${BASH_REMATCH[1]}"
    arg="${BASH_REMATCH[2]}"
  fi
  printf "%s'%s'" "$prefix" "${arg//\'/$sq}"
}

# Run a command, or with --dry-run print it (copy-pasteable).
run() {
  if [[ $DRY_RUN -eq 1 ]]; then
    local line="" a
    for a in "$@"; do line+="$(shell_quote "$a") "; done
    echo "${line% }"
  else
    "$@"
  fi
}

ssh_all() { run "${TPU_VM[@]}" ssh "$TPU" --worker=all "${SCOPE[@]}" --command="$1"; }
ssh_w0() { run "${TPU_VM[@]}" ssh "$TPU" --worker=0 "${SCOPE[@]}" --command="$1"; }

create_vm() {
  local cmd=("${TPU_VM[@]}" create "$TPU" "${SCOPE[@]}" --accelerator-type="$ACCEL"
             --version="$VERSION")
  [[ $SPOT -eq 1 ]] && cmd+=(--spot)
  run "${cmd[@]}"
}

sync_repo() {
  local tarball
  if [[ $DRY_RUN -eq 1 ]]; then
    tarball="/tmp/ode-lm-src.tar.gz"
  else
    tarball="$(mktemp -d)/ode-lm-src.tar.gz"
  fi
  # Tracked and untracked-but-not-ignored files: what the working tree would commit.
  if [[ $DRY_RUN -eq 1 ]]; then
    echo "git -C $REPO_ROOT ls-files -z --cached --others --exclude-standard" \
         "| tar -czf $tarball -C $REPO_ROOT --null -T -"
  else
    git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard \
      | tar -czf "$tarball" -C "$REPO_ROOT" --null -T -
  fi
  run "${TPU_VM[@]}" scp "$tarball" "$TPU:ode-lm-src.tar.gz" --worker=all "${SCOPE[@]}"
  ssh_all "mkdir -p $REMOTE_DIR && tar -xzf ode-lm-src.tar.gz -C $REMOTE_DIR"
}

install_pkg() {
  ssh_all "cd $REMOTE_DIR && python3 -m pip install -q -e \".[tpu]\""
}

train_command() {
  local args=(python3 -m ode_lm.commands.train) a f b line=""
  for f in "${GIN_FILES[@]}"; do args+=(--gin_file="$f"); done
  for b in "${GIN_BINDINGS[@]+"${GIN_BINDINGS[@]}"}"; do args+=("--gin.$b"); done
  for a in "${args[@]}"; do line+="$(shell_quote "$a") "; done
  echo "${line% }"
}

# Start the trainer in its own process group on every worker; the group id goes to a pid
# file (for --stop) and the exit status to logs/exit-<i> (for --retries).
start_job() {
  local train sq="'\\''"
  train="$(train_command)"
  train="${train//\'/$sq}"  # the command sits inside single quotes on the worker
  ssh_all "cd $REMOTE_DIR || exit 1; mkdir -p logs; W=$WORKER_ID; rm -f logs/exit-\$W \
/tmp/libtpu_lockfile; setsid nohup bash -c '$train; echo \$? > logs/exit-'\$W \
> logs/worker-\$W.log 2>&1 < /dev/null & echo \$! > logs/train.pid"
}

stream_worker0() {
  ssh_w0 "tail -n +1 --pid=\$(cat $PID_FILE) -F $LOG_DIR/worker-0.log"
}

stop_job() {
  ssh_all "if [ -f $PID_FILE ]; then kill -TERM -- -\$(cat $PID_FILE) 2>/dev/null || true; \
rm -f $PID_FILE; fi"
}

# Exit status of worker 0's trainer; 255 when unknown (VM gone, job killed).
worker0_status() {
  local out
  out="$("${TPU_VM[@]}" ssh "$TPU" --worker=0 "${SCOPE[@]}" \
         --command="cat $LOG_DIR/exit-0 2>/dev/null || echo 255" 2>/dev/null)" || out=255
  out="${out//[^0-9]/}"
  echo "${out:-255}"
}

vm_state() {
  "${TPU_VM[@]}" describe "$TPU" "${SCOPE[@]}" --format='value(state)' 2>/dev/null \
    || echo UNKNOWN
}

if [[ $STOP -eq 1 ]]; then
  stop_job
  exit 0
fi

[[ $CREATE -eq 1 ]] && create_vm
[[ $SKIP_SYNC -eq 1 ]] || sync_repo
[[ $SKIP_INSTALL -eq 1 ]] || install_pkg

attempt=0
while true; do
  start_job || echo "tpu_vm.sh: starting the job on $TPU failed" >&2
  stream_worker0 || true
  if [[ $DRY_RUN -eq 1 ]]; then
    exit 0
  fi
  status="$(worker0_status)"
  if [[ "$status" == 0 ]]; then
    echo "tpu_vm.sh: training finished on $TPU (attempt $((attempt + 1)))" >&2
    exit 0
  fi
  if [[ $attempt -ge $RETRIES ]]; then
    echo "tpu_vm.sh: training failed on $TPU with status $status after" \
         "$((attempt + 1)) attempt(s)" >&2
    exit 1
  fi
  attempt=$((attempt + 1))
  echo "tpu_vm.sh: training stopped with status $status; restart $attempt of $RETRIES" \
       "(the trainer resumes from its latest checkpoint)" >&2
  state="$(vm_state)"
  if [[ "$state" != READY ]]; then
    [[ $CREATE -eq 1 ]] || { echo "tpu_vm.sh: $TPU is $state and --create was not given;" \
                                  "cannot re-create it" >&2; exit 1; }
    echo "tpu_vm.sh: $TPU is $state; deleting and re-creating it" >&2
    run "${TPU_VM[@]}" delete "$TPU" "${SCOPE[@]}" --quiet
    create_vm
    sync_repo
    install_pkg
  else
    stop_job
  fi
done
