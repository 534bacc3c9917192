#!/usr/bin/env bash
# Create a TPU VM or a queued resource, or reuse it if it already exists.
#   create.sh --name NAME --zone ZONE --type v5p-8 [--queued] [--spot]
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: create.sh --name NAME --zone ZONE --type TYPE [--queued] [--spot] [--wait S]"
  usage_common
}

parse_args "$@"
loc_flags

exists() {
  [[ "$DRY_RUN" == 1 ]] && return 1
  if [[ "$QUEUED" == 1 ]]; then
    gcloud compute tpus queued-resources describe "$NAME" "${LOC[@]}" >/dev/null 2>&1
  else
    gcloud compute tpus tpu-vm describe "$NAME" "${LOC[@]}" >/dev/null 2>&1
  fi
}

if exists; then
  echo "reusing $NAME" >&2
else
  extra=()
  if [[ "$QUEUED" == 1 ]]; then
    if [[ "$SPOT" == 1 ]]; then extra+=(--spot); fi
    run gcloud compute tpus queued-resources create "$NAME" "${LOC[@]}" --node-id="$NAME" \
      --accelerator-type="$TYPE" --runtime-version="$VERSION" "${extra[@]}"
  else
    if [[ "$SPOT" == 1 ]]; then extra+=(--spot); fi
    run gcloud compute tpus tpu-vm create "$NAME" "${LOC[@]}" \
      --accelerator-type="$TYPE" --version="$VERSION" "${extra[@]}"
  fi
fi

# A queued resource is usable once ACTIVE; wait for it (capacity can take a while).
if [[ "$QUEUED" == 1 ]]; then
  if [[ "$DRY_RUN" == 1 ]]; then
    run gcloud compute tpus queued-resources describe "$NAME" "${LOC[@]}" --format='value(state.state)'
  else
    deadline=$((SECONDS + WAIT_S))
    while :; do
      state=$(gcloud compute tpus queued-resources describe "$NAME" "${LOC[@]}" \
        --format='value(state.state)')
      [[ "$state" == ACTIVE ]] && break
      case "$state" in
        FAILED | SUSPENDED) die "queued resource $NAME is $state" ;;
      esac
      ((SECONDS < deadline)) || die "queued resource $NAME not ACTIVE after ${WAIT_S}s ($state)"
      sleep 30
    done
  fi
fi
