#!/usr/bin/env bash
# Copy this checkout to every host of a TPU slice and install it with the tpu and gcs
# extras (gcs: model, data and split paths may be gs:// URLs).
# Reinstalls only when the sources changed (a stamp holds their hash).
#   install.sh --name NAME --zone ZONE [--src DIR] [--venv DIR]
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: install.sh --name NAME --zone ZONE [--src DIR] [--venv DIR]"
  usage_common
}

parse_args "$@"
SRC="${SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
loc_flags

tarball="${TMPDIR:-/tmp}/rl_jax_src_${NAME}.tgz"
excludes=(--exclude=.git --exclude=.venv --exclude=.cache --exclude=runs --exclude=grids
  --exclude='*.egg-info' --exclude=__pycache__)
run tar -czf "$tarball" "${excludes[@]}" -C "$SRC" .
if [[ "$DRY_RUN" == 1 ]]; then
  stamp="DRY_RUN"
else
  stamp=$(sha256sum "$tarball" | cut -c1-16)
fi

run gcloud compute tpus tpu-vm scp "$tarball" "$NAME:rl_jax_src.tgz" "${LOC[@]}" --worker=all
# On each host: unpack and install unless this exact tarball is installed already.
remote="set -e; if [ \"\$(cat ~/rl_jax/.stamp 2>/dev/null)\" != $stamp ]; then"
remote+=" rm -rf ~/rl_jax && mkdir -p ~/rl_jax && tar -xzf ~/rl_jax_src.tgz -C ~/rl_jax"
remote+=" && python3 -m venv ~/$VENV && ~/$VENV/bin/pip install -q -U pip"
remote+=" && ~/$VENV/bin/pip install -q -e ~/rl_jax'[tpu,gcs]' && echo $stamp > ~/rl_jax/.stamp; fi"
tpu_ssh all "$remote"
