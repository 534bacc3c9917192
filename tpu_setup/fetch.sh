#!/usr/bin/env bash
# Copy a run directory (config, curves, metrics, DONE; not checkpoints, which
# stay on the slice for resumes) and the hosts' logs back from worker 0. A run in
# a bucket (--remote-out gs://...) is read there: only the hosts' logs come back.
#   fetch.sh --name NAME --zone ZONE --remote-out DIR --run-name RUN --local-out DIR
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: fetch.sh --name NAME --zone ZONE --remote-out DIR --run-name RUN --local-out DIR"
  usage_common
}

parse_args "$@"
[[ -n "$RUN_NAME" && -n "$LOCAL_OUT" ]] || die "--run-name and --local-out are required"
loc_flags
if [[ "$REMOTE_OUT" == *://* ]]; then
  # The run directory lives in a bucket, where it is read: only the hosts' logs come back.
  :
else
  remote="tar -C ~/$REMOTE_OUT -cz --exclude=checkpoints $RUN_NAME"
  if [[ "$DRY_RUN" == 1 ]]; then
    tpu_ssh 0 "$remote"
    run tar -xzf - -C "$LOCAL_OUT"
  else
    mkdir -p "$LOCAL_OUT"
    tpu_ssh 0 "$remote" | tar -xzf - -C "$LOCAL_OUT"
  fi
fi
mkdir_cmd=(mkdir -p "$LOCAL_OUT/$RUN_NAME/host_logs")
run "${mkdir_cmd[@]}"
run gcloud compute tpus tpu-vm scp "$NAME:rl_jax_logs/$RUN_NAME.*" "$LOCAL_OUT/$RUN_NAME/host_logs/" \
  "${LOC[@]}" --worker=0
