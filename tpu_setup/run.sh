#!/usr/bin/env bash
# One grid run on a TPU slice: create or reuse the slice, install this checkout
# on every host, run the command on all hosts, fetch the run directory back (or,
# for a run in a bucket, --remote-out gs://..., only the hosts' logs).
# Used by `rl-jax grid SPEC --backend tpu`; runnable by hand too:
#   run.sh --name NAME --zone ZONE --type v6e-8 --run-name RUN --local-out grids/G/runs \
#          [--remote-out rl_jax_runs/G/runs] -- rl-jax train RECIPE key=value ...
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: run.sh --name NAME --zone ZONE --type TYPE --run-name RUN --local-out DIR"
  echo "              [--remote-out DIR] [--src DIR] [--queued] [--spot] -- COMMAND ..."
  usage_common
}

parse_args "$@"
((${#CMD[@]})) || die "no command after --"
here="$(dirname "${BASH_SOURCE[0]}")"
common=(--name "$NAME" --zone "$ZONE" --type "$TYPE" --version "$VERSION")
if [[ -n "$PROJECT" ]]; then common+=(--project "$PROJECT"); fi
slice=()
if [[ "$QUEUED" == 1 ]]; then slice+=(--queued); fi
if [[ "$SPOT" == 1 ]]; then slice+=(--spot); fi
src=()
if [[ -n "$SRC" ]]; then src+=(--src "$SRC"); fi

bash "$here/create.sh" "${common[@]}" "${slice[@]}" --wait "$WAIT_S"
bash "$here/install.sh" "${common[@]}" "${src[@]}" --venv "$VENV"
rc=0
bash "$here/launch.sh" "${common[@]}" --venv "$VENV" --run-name "$RUN_NAME" -- "${CMD[@]}" || rc=$?
# Fetch after failures too: the curve so far and the logs say what went wrong.
bash "$here/fetch.sh" "${common[@]}" --remote-out "$REMOTE_OUT" --run-name "$RUN_NAME" \
  --local-out "$LOCAL_OUT" || echo "run.sh: fetching $RUN_NAME failed" >&2
exit "$rc"
