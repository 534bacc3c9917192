#!/usr/bin/env bash
# Delete a TPU VM or a queued resource (and its node).
#   teardown.sh --name NAME --zone ZONE [--queued]
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: teardown.sh --name NAME --zone ZONE [--queued]"
  usage_common
}

parse_args "$@"
loc_flags
if [[ "$QUEUED" == 1 ]]; then
  run gcloud compute tpus queued-resources delete "$NAME" "${LOC[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$NAME" "${LOC[@]}" --quiet
fi
