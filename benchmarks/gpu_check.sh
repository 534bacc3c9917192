#!/usr/bin/env bash
# The benchmarks on one GPU, in one short run (a lent device machine's whole check).
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
#   PLATFORM=cpu SMOKE=1 TRL_PYTHON=.cache/bench/trl-venv/bin/python bash benchmarks/gpu_check.sh
#                                           # the same plumbing here, at toy sizes
#
# Runs, each under its own time limit, results as JSON lines in $OUT/results.jsonl and
# everything printed in $OUT/log.txt:
#   1. rl_step.py --vs-trl: the RL step of issue 8's workload, ours against TRL's
#      GRPOTrainer, both on the GPU;
#   2. sampler.py: issue 4's sampler workload (bench preset, 64 rows x 64 tokens, float32)
#      against transformers' generate on the GPU;
#   3. sampler.py at a realistic size: Qwen2.5-0.5B's shape (random weights), bfloat16,
#      32 prompts x 8 samples, 128-token prompts, 256 new tokens.
# STEPS=tests runs the numerics tests on the GPU instead (sampler, model, HF parity,
# matmul precision, losses, the train loop; those that need 8 devices skip), its summary
# in results.jsonl and pytest's output in $OUT/tests.txt; STEPS="bench tests" runs both.
# (On an H200 the benchmarks took ~4 min and the first four test files ~2.5 min.)
# The machine has no package registry: packages it lacks travel as wheels in .whl/
# (installed into /tmp/site here), and the repository itself is put on PYTHONPATH.
set -u
OUT=${OUT:-/tmp/gpu_check}
PLATFORM=${PLATFORM:-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
RES="$OUT/results.jsonl"
: >"$LOG"
: >"$RES"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ "$PLATFORM" = gpu ]; then
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || echo "wheel install failed" >>"$LOG"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TRL_PYTHON=${TRL_PYTHON:-$PY}
STEPS=${STEPS:-bench}

{
  nvidia-smi -L 2>/dev/null
  "$PY" - <<'EOF'
import importlib
for m in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "datasets"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "missing:", type(e).__name__, e)
EOF
} >>"$LOG" 2>&1

# step NAME LIMIT_S ARGS...: one benchmark; its JSON line (the last line it prints) goes to
# results.jsonl tagged with NAME, or an error record when it fails.
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*" >>"$LOG"
  local t0=$SECONDS out rc
  out=$(timeout "$limit" "$PY" "$@" 2>>"$LOG")
  rc=$?
  echo "$out" >>"$LOG"
  local last
  last=$(printf '%s\n' "$out" | grep '^{' | tail -1)
  if [ $rc -eq 0 ] && [ -n "$last" ]; then
    echo "{\"bench\": \"$name\", \"wall_s\": $((SECONDS - t0)), \"result\": $last}" >>"$RES"
  else
    echo "{\"bench\": \"$name\", \"wall_s\": $((SECONDS - t0)), \"error_rc\": $rc}" >>"$RES"
  fi
}

if [[ " $STEPS " == *" tests "* ]]; then
  echo "=== tests" >>"$LOG"
  t0=$SECONDS
  [ "$PLATFORM" = gpu ] && tplat=cuda || tplat=cpu
  JAX_PLATFORMS=$tplat XLA_FLAGS= XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 420 \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_sampler.py tests/test_model.py \
    tests/test_hf.py tests/test_train_parts.py tests/test_precision.py tests/test_losses.py \
    tests/test_train_loop.py tests/test_policy_io.py >"$OUT/tests.txt" 2>&1
  summary=$(tail -1 "$OUT/tests.txt" | tr -d '"=')
  echo "{\"bench\": \"tests\", \"wall_s\": $((SECONDS - t0)), \"summary\": \"$summary\"}" >>"$RES"
fi

if [[ " $STEPS " != *" bench "* ]]; then
  :
elif [ -n "${SMOKE:-}" ]; then
  step rl_step_vs_trl 600 benchmarks/rl_step.py --platform "$PLATFORM" --smoke --vs-trl \
    --trl-python "$TRL_PYTHON" --no-restart
  step sampler_bench 300 benchmarks/sampler.py --platform "$PLATFORM" --repeats 1 \
    --prompts 2 --samples 2 --new-tokens 8
  step sampler_bf16 300 benchmarks/sampler.py --platform "$PLATFORM" --preset tiny \
    --dtype bfloat16 --repeats 1 --prompts 2 --samples 2 --prompt-len 16 --new-tokens 8
else
  step rl_step_vs_trl 200 benchmarks/rl_step.py --platform "$PLATFORM" --vs-trl \
    --trl-python "$TRL_PYTHON" --steps 6
  step sampler_bench 90 benchmarks/sampler.py --platform "$PLATFORM" --repeats 5
  step sampler_qwen05b_bf16 150 benchmarks/sampler.py --platform "$PLATFORM" \
    --preset qwen2.5-0.5b --dtype bfloat16 --prompts 32 --samples 8 --prompt-len 128 \
    --new-tokens 256 --repeats 3
fi
cat "$RES"
