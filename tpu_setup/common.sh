#!/usr/bin/env bash
# The options set here are read by the scripts that source this file.
# shellcheck disable=SC2034
# Shared by the tpu_setup scripts: options, dry runs, gcloud wrappers.
# Every gcloud call goes through `run`, so DRY_RUN=1 prints the exact commands
# (shell-quoted, ready to paste) and runs none of them.
set -euo pipefail

DRY_RUN="${DRY_RUN:-0}"
NAME=""
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
TYPE="v5litepod-8"
VERSION=""
QUEUED=0
SPOT=0
SRC=""
REMOTE_OUT="rl_jax_runs"
RUN_NAME=""
LOCAL_OUT=""
VENV="rl_jax_venv"
WAIT_S=3600
CMD=()

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

usage_common() {
  cat <<'USAGE'
common options:
  --name NAME         TPU VM / queued resource name (required)
  --zone ZONE         e.g. us-central2-b (or env TPU_ZONE)
  --project PROJECT   GCP project (or env TPU_PROJECT; default: gcloud's)
  --type TYPE         accelerator type: v4-8, v5litepod-8 (v5e), v5p-8, v6e-8, ...
  --version VERSION   runtime image (default: by generation)
  --queued            use queued resources (waits for capacity)
  --spot              spot / preemptible capacity
environment: DRY_RUN=1 prints the gcloud commands instead of running them
USAGE
}

parse_args() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --name) NAME="$2"; shift 2 ;;
      --zone) ZONE="$2"; shift 2 ;;
      --project) PROJECT="$2"; shift 2 ;;
      --type) TYPE="$2"; shift 2 ;;
      --version) VERSION="$2"; shift 2 ;;
      --queued) QUEUED=1; shift ;;
      --spot) SPOT=1; shift ;;
      --src) SRC="$2"; shift 2 ;;
      --remote-out) REMOTE_OUT="$2"; shift 2 ;;
      --run-name) RUN_NAME="$2"; shift 2 ;;
      --local-out) LOCAL_OUT="$2"; shift 2 ;;
      --venv) VENV="$2"; shift 2 ;;
      --wait) WAIT_S="$2"; shift 2 ;;
      -h | --help) usage; exit 0 ;;
      --) shift; CMD=("$@"); break ;;
      *) die "unknown option $1 (see --help)" ;;
    esac
  done
  [[ -n "$NAME" ]] || die "--name is required"
  [[ -n "$ZONE" ]] || die "--zone is required (or set TPU_ZONE)"
  if [[ -z "$VERSION" ]]; then
    case "$TYPE" in
      v4-*) VERSION="tpu-ubuntu2204-base" ;;
      v5litepod-*) VERSION="v2-alpha-tpuv5-lite" ;;
      v5p-*) VERSION="v2-alpha-tpuv5" ;;
      v6e-*) VERSION="v2-alpha-tpuv6e" ;;
      *) die "unknown TPU type $TYPE; use v4-N, v5litepod-N, v5p-N or v6e-N" ;;
    esac
  fi
}

# shell_quote ARG: ARG as the shell reads it back; single quotes unless it is plain.
shell_quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./=:@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    local sq="'\\''"
    printf "'%s'" "${1//\'/$sq}"
  fi
}

# run CMD...: print it (one line, ready to paste) with DRY_RUN=1, else run it.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local out="" a
    for a in "$@"; do
      out+="$(shell_quote "$a") "
    done
    echo "${out% }"
  else
    "$@"
  fi
}

# Flags every `gcloud compute tpus ...` call takes.
loc_flags() {
  LOC=(--zone="$ZONE")
  if [[ -n "$PROJECT" ]]; then
    LOC+=(--project="$PROJECT")
  fi
}

# tpu_ssh WORKER COMMAND: run a shell command on one worker or on all (WORKER=all).
tpu_ssh() {
  loc_flags
  run gcloud compute tpus tpu-vm ssh "$NAME" "${LOC[@]}" --worker="$1" --command="$2"
}
