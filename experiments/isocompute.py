"""IsoCompute (arXiv 2603.12151): n x B_p under B_max at a fixed rollout budget, easy and hard.

C = B_p * n * M: for each (B_p, n) with B_p * n <= B_max (65,536 on the easy
split, 16,384 on the hard one), M is whatever the budget leaves. The report
takes the record-breaking points of each run, the upper envelope over runs as
the compute-optimal frontier, and fits log2 n* against log C with a sigmoid.

Healthy recipe of the paper: GRPO advantages, on-policy, 0/1 reward, truncated
importance sampling against the sampler, temperature 0.6, lr proportional to
sqrt(B_p * n) (1e-6 at B = 1024), 10 warm-up steps then constant, no KL or
entropy terms (they destabilize the hard split). Difficulty splits come from
the base model's avg@16 (rl_jax.data.splits.write_splits); point the grid at
the model, the data and the split file (gs:// URLs on TPU hosts: tpu_setup/README.md), e.g.

    rl-jax grid isocompute --set model.path=/ckpt/Qwen2.5-7B --set data.source=file \\
        --set data.path=/data/math.jsonl --set data.split_file=/data/splits.json
"""

from rl_jax.grid import Axis, Budget, GridSpec, ReportSpec

HEALTHY = {
    "loss.name": "grpo",
    "loss.advantage": "grpo",
    "loss.adv_norm": "prompt",
    "loss.aggregation": "sample",
    "loss.tis": True,
    "loss.kl_coef": 0.0,
    "loss.entropy_coef": 0.0,
    "train.off_policy": "on_policy",
    "train.off_policy_k": 1,
    "rewards.scale": "01",
    "sampling.temperature": 0.6,
    "sampling.length_control": "truncate",
    "train.lr": 1e-6,
    "train.lr_sqrt_batch_ref": 1024,  # lr * sqrt(B_p * n / 1024)
    "train.warmup_steps": 10,
    "train.schedule": "constant",
    "data.zero_variance_filter": False,
    "data.no_positive_resampling": False,
    "eval.k": 4,  # avg@4, best@4, worst@4
}

POW2 = [2**i for i in range(3, 12)]


def grid() -> GridSpec:
    return GridSpec(
        name="isocompute",
        recipe="isocompute",  # recipe() below; HEALTHY restates its choices at paper scale
        # One split file for both splits, in the base (with a split name the axis replaces):
        # `--set data.split_file=...` points every run at it (a gs:// URL on TPU hosts).
        base={
            **HEALTHY,
            "sampling.max_new_tokens": 4096,
            "data.split_file": "splits.json",
            "data.split_name": "easy",
        },
        axes=(
            Axis.variants(
                "split",
                {"easy": {"data.split_name": "easy"}, "hard": {"data.split_name": "hard"}},
                vars={"easy": {"B_max": 65536}, "hard": {"B_max": 16384}},
            ),
            Axis.of("sampling.n", POW2, short="n"),  # 8 .. 2048
            Axis.of("data.prompts_per_batch", [32, 64, 128, 256, 512, 1024], short="bp"),
        ),
        constraints=("B_p * n <= B_max",),
        budget=Budget(amount=2**23, unit="rollouts"),  # 128 steps at B = 65,536
        evals_per_run=16,
        checkpoints_per_run=16,
        report=ReportSpec(kind="isocompute", x="rollouts", metric="val/pass@1", split_by="split"),
        description="IsoCompute n x B_p x M frontier",
    )


def recipe():
    """The healthy recipe as a single run (`rl-jax train isocompute`), sized for the CPU:
    the same knobs as HEALTHY on the tiny model and the built-in arithmetic task (lr given
    at B = 1024 and scaled by sqrt(B_p * n / 1024))."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    from rl_jax.config import LossConfig, RewardConfig, RunConfig

    # The grid loader does not put experiments/ on sys.path: load the sizes by path.
    spec = importlib.util.spec_from_file_location("_cpu", Path(__file__).with_name("_cpu.py"))
    cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu)
    DATA, EVAL, MODEL, SAMPLING, TRAIN = cpu.DATA, cpu.EVAL, cpu.MODEL, cpu.SAMPLING, cpu.TRAIN
    CHECKPOINT = cpu.CHECKPOINT

    return RunConfig(
        name="isocompute",
        model=MODEL,
        sampling=dataclasses.replace(SAMPLING, temperature=0.6),
        loss=LossConfig(
            name="grpo",
            aggregation="sample",
            adv_norm="prompt",
            eps_low=0.2,
            eps_high=0.2,
            tis=True,
            tis_cap=2.0,
        ),
        rewards=RewardConfig(name="auto", scale="01"),
        data=dataclasses.replace(DATA, zero_variance_filter=False, no_positive_resampling=False),
        # 5e-5 at B = 128 (the other CPU recipes' rate), scaled by sqrt(B / 1024) as the
        # paper does; constant after 10 warm-up steps.
        train=dataclasses.replace(
            TRAIN, lr=1.4e-4, lr_sqrt_batch_ref=1024, warmup_steps=10, schedule="constant"
        ),
        eval=dataclasses.replace(EVAL, temperature=0.6),
        checkpoint=CHECKPOINT,
    )
