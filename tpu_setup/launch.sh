#!/usr/bin/env bash
# Run a command on every host of a TPU slice at once (one process per host, as
# jax.distributed expects) and wait for it; the exit status is the hosts'.
#   launch.sh --name NAME --zone ZONE [--run-name LOG] -- rl-jax train RECIPE key=value ...
#   launch.sh --name NAME --zone ZONE -- rl-jax train experiments/scalerl.py mesh.distributed=true
# Paths in the command are relative to the home directory on the hosts, where
# install.sh put the checkout (~/rl_jax) and its venv.
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  echo "usage: launch.sh --name NAME --zone ZONE [--run-name LOG] -- COMMAND ..."
  usage_common
}

parse_args "$@"
((${#CMD[@]})) || die "no command after --"
log="${RUN_NAME:-launch}"
printf -v quoted '%q ' "${CMD[@]}"
remote="cd ~ && export PATH=~/$VENV/bin:\$PATH && mkdir -p ~/rl_jax_logs"
remote+=" && { ${quoted% } 2>&1 | tee -a ~/rl_jax_logs/$log.\$(hostname).log; exit \${PIPESTATUS[0]}; }"
tpu_ssh all "$remote"
