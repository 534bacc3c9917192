"""Verifiers by name; reward scale; batched scoring; format and overlong shaping."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from rl_jax.rewards import _code, _gym, _math
from rl_jax.rewards._arith import arith_score, arith_well_formed
from rl_jax.rewards._countdown import countdown_score, countdown_well_formed
from rl_jax.rewards._numeric import last_boxed, numeric_score, numeric_well_formed
from rl_jax.rewards._sandbox import WORKER_MEMORY_MB, shared_pool
from rl_jax.rewards._text import bounded_text

if TYPE_CHECKING:  # rl_jax.config.rewards checks names against this registry
    from rl_jax.config.rewards import RewardConfig

log = logging.getLogger(__name__)

SCALES: dict[str, tuple[float, float]] = {"pm1": (1.0, -1.0), "01": (1.0, 0.0)}


class RewardFn:
    """`fn(completion, answer) -> float`: the scale's high value for a correct answer,
    its low value otherwise (partial credit, where a scorer gives it, in between).

    Never raises on any completion: malformed, hostile or timed-out output is no credit.
    """

    def __init__(self, name: str, scale: str, *, well_formed: Callable[[object], bool]):
        if scale not in SCALES:
            raise ValueError(f"reward scale {scale!r} is not one of {list(SCALES)}")
        self.name, self.scale = name, scale
        self.high, self.low = SCALES[scale]
        self._well_formed = well_formed

    def scores(self, completions: Sequence[object], answers: Sequence[str]) -> np.ndarray:
        """Correctness in [0, 1] per completion (1 = right), before scaling."""
        raise NotImplementedError

    def batch(self, completions: Sequence[object], answers: Sequence[str]) -> np.ndarray:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        s = self.scores(completions, answers)
        return (self.low + s * (self.high - self.low)).astype(np.float32)

    def __call__(self, completion: object, answer: str) -> float:
        return float(self.batch([completion], [answer])[0])

    def well_formed(self, completion: object) -> bool:
        """Whether an answer can be read from the completion at all (format reward)."""
        try:
            return bool(self._well_formed(completion))
        except Exception:
            return False

    def close(self) -> None:
        """Release worker processes, if any."""

    def __repr__(self) -> str:
        return f"RewardFn({self.name!r}, scale={self.scale!r})"


class _LocalRewardFn(RewardFn):
    """Pure-Python verifiers: bounded by construction, cheap enough to run in the caller."""

    def __init__(self, name, scale, *, score, well_formed):
        super().__init__(name, scale, well_formed=well_formed)
        self._score = score

    def scores(self, completions, answers):
        out = np.zeros(len(completions), np.float32)
        for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
            try:
                out[i] = self._score(c, a)
            except Exception as e:
                # Verifiers do not raise on completions; this is a malformed *answer* (a data
                # bug): log it and give no credit rather than stop the training loop.
                log.warning("%s verifier: no credit for answer %r (%s)", self.name, str(a)[:80], e)
        return out


class _PooledRewardFn(RewardFn):
    """Verifiers that may spin on hostile input: each call runs in a sandbox worker with a
    hard time limit (see _sandbox)."""

    def __init__(self, name, scale, *, target, prepare, preload, workers, timeout_s, well_formed):
        super().__init__(name, scale, well_formed=well_formed)
        self._target, self._prepare, self._preload = target, prepare, preload
        self._workers, self.timeout_s = workers, timeout_s

    @property
    def pool(self):
        return shared_pool(workers=self._workers, preload=self._preload)

    def scores(self, completions, answers):
        args = [self._prepare(c, a) for c, a in zip(completions, answers, strict=True)]
        res = self.pool.run(self._target, args, timeout_s=self.timeout_s)
        return np.asarray(
            [float(r) if isinstance(r, int | float) else 0.0 for r in res], np.float32
        )

    def close(self) -> None:
        self.pool.close()


_Factory = Callable[..., RewardFn]  # factory(scale, timeout_s, workers, **options)
_REGISTRY: dict[str, _Factory] = {}
_OPTIONS: dict[str, tuple[str, ...]] = {}


def register(name: str, *, options: tuple[str, ...] = ()) -> Callable[[_Factory], _Factory]:
    """Register `factory(scale, timeout_s, workers, **options) -> RewardFn` under `name`;
    `options` are the keyword options it takes (rl_jax.rewards.get refuses others)."""

    def deco(factory: _Factory) -> _Factory:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name], _OPTIONS[name] = factory, tuple(options)
        return factory

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def options(name: str) -> tuple[str, ...]:
    """The keyword options verifier `name` takes (e.g. code: partial, memory_mb)."""
    return _OPTIONS[name]


def get(
    name: str, *, scale: str = "pm1", timeout_s: float = 2.0, workers: int = 2, **opts
) -> RewardFn:
    """The verifier `name` as `fn(completion, answer) -> float` at `scale` ('pm1' or '01');
    `opts` are its own options (`options(name)`)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; known rewards: {names()}")
    unknown = sorted(set(opts) - set(_OPTIONS[name]))
    if unknown:
        raise ValueError(
            f"reward {name!r} takes no option {unknown[0]!r}; its options: {list(_OPTIONS[name])}"
        )
    return _REGISTRY[name](scale, timeout_s, workers, **opts)


def config_options(cfg: RewardConfig, name: str) -> dict:
    """The options of verifier `name` that RewardConfig sets (rewards.code_*)."""
    given = {"partial": cfg.code_partial, "memory_mb": cfg.code_memory_mb}
    return {k: v for k, v in given.items() if k in _OPTIONS.get(name, ())}


def from_config(cfg: RewardConfig, *, task_reward: str = "") -> RewardFn:
    """The verifier a RewardConfig names; `rewards.name=auto` takes the task's default."""
    name = cfg.name
    if name == "auto":
        if not task_reward:
            raise ValueError("rewards.name=auto needs the task's reward name (Task.reward_name)")
        name = task_reward
    return get(
        name,
        scale=cfg.scale,
        timeout_s=cfg.timeout_s,
        workers=cfg.workers,
        **config_options(cfg, name),
    )


@register("arith")
def _arith(scale, timeout_s, workers):
    return _LocalRewardFn("arith", scale, score=arith_score, well_formed=arith_well_formed)


@register("countdown")
def _countdown(scale, timeout_s, workers):
    return _LocalRewardFn(
        "countdown", scale, score=countdown_score, well_formed=countdown_well_formed
    )


@register("numeric")
def _numeric(scale, timeout_s, workers):
    return _LocalRewardFn("numeric", scale, score=numeric_score, well_formed=numeric_well_formed)


def _math_prepare(completion: object, answer: str) -> tuple[str, str]:
    return bounded_text(completion, limit=_math.TAIL_CHARS, keep="tail"), str(answer)[:1024]


def _boxed_present(completion: object) -> bool:
    return last_boxed(bounded_text(completion, limit=_math.TAIL_CHARS, keep="tail")) is not None


@register("math")
def _math_reward(scale, timeout_s, workers):
    if not _math.available():
        raise ImportError("reward 'math' needs math-verify: pip install 'rl-jax[math]'")
    return _PooledRewardFn(
        "math",
        scale,
        target="rl_jax.rewards._math:math_verify_score",
        prepare=_math_prepare,
        preload=("math_verify", "rl_jax.rewards._math"),
        workers=workers,
        timeout_s=timeout_s,
        well_formed=_boxed_present,
    )


def _gym_prepare(completion: object, answer: str) -> tuple[str, str]:
    text = bounded_text(completion, limit=_gym.TAIL_CHARS, keep="tail")
    return _gym.extract_gym(text), str(answer)


def _gym_well_formed(completion: object) -> bool:
    return "</answer>" in bounded_text(completion, limit=_gym.TAIL_CHARS, keep="tail")


@register("gym")
def _gym_reward(scale, timeout_s, workers):
    if not _gym.available():
        raise ImportError("reward 'gym' needs reasoning-gym: pip install 'rl-jax[gym]'")
    return _PooledRewardFn(
        "gym",
        scale,
        target="rl_jax.rewards._gym:gym_score",
        prepare=_gym_prepare,
        preload=("reasoning_gym", "rl_jax.rewards._gym"),
        workers=workers,
        timeout_s=timeout_s,
        well_formed=_gym_well_formed,
    )


# Past its time limit a program's worker still kills and reaps its process group and
# deletes its directory; the pool kills the worker only if that overruns this.
CODE_SLACK_S = 0.5


@register("code", options=("partial", "memory_mb"))
class _CodeRewardFn(RewardFn):
    """Programs run against their problems' tests in sandbox workers (rl_jax.rewards._code):
    1 when every test passes (with `partial`, the fraction passed). `last_outcomes` and
    `outcomes` (cumulative) count how each program ended (_code.OUTCOMES, plus
    'bad_tests' for an answer that is no code problem and 'error' for a worker lost)."""

    def __init__(self, scale, timeout_s, workers, *, partial=False, memory_mb=512):
        super().__init__("code", scale, well_formed=_code.well_formed)
        self.timeout_s, self._workers = timeout_s, workers
        self.partial, self.memory_mb = bool(partial), int(memory_mb)
        self.last_outcomes: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.refused = 0  # operations the sandbox refused, cumulative
        self._warned: set[str] = set()

    @property
    def pool(self):
        # A program's process is forked from its worker and cannot raise its limit above
        # the worker's (without CAP_SYS_RESOURCE): the worker's must cover memory_mb.
        mem = max(WORKER_MEMORY_MB, self.memory_mb)
        return shared_pool(
            workers=self._workers, preload=("rl_jax.rewards._code",), mem_limit_mb=mem
        )

    def _tests_ok(self, answer: str) -> bool:
        try:
            _code.CodeTests.parse(answer)
        except ValueError as e:
            if answer not in self._warned and len(self._warned) < 100:
                self._warned.add(answer)
                log.warning("code verifier: no credit for answer %r (%s)", answer[:80], e)
            return False
        return True

    def scores(self, completions, answers):
        n = len(completions)
        out = np.zeros(n, np.float32)
        outcomes = ["bad_tests"] * n
        idx, jobs = [], []
        for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
            a = str(a)
            if self._tests_ok(a):
                text = bounded_text(c, limit=_code.PROGRAM_CHARS, keep="tail")
                idx.append(i)
                jobs.append((text, a, self.timeout_s, self.memory_mb))
        limit = self.timeout_s + CODE_SLACK_S
        res = self.pool.run("rl_jax.rewards._code:code_score", jobs, timeout_s=limit)
        elapsed = self.pool.last_elapsed
        for j, (i, r) in enumerate(zip(idx, res, strict=True)):
            if r is None:
                # The pool's own limit (a worker that overran its program's), or a worker lost.
                outcomes[i] = "timeout" if elapsed[j] >= limit else "error"
                continue
            passed, total, outcomes[i], refused = r
            self.refused += refused
            if self.partial:
                out[i] = passed / total
            else:
                out[i] = float(passed == total and outcomes[i] == "pass")
        self.last_outcomes = outcomes
        self.outcomes.update(outcomes)
        return out

    def close(self) -> None:
        self.pool.close()


class TaskAnswer(str):
    """An answer that names the verifier it is checked with: a task mixture's problems
    carry theirs (rl_jax.data), and the `mixture` verifier routes each to it. Otherwise
    it is the answer string itself."""

    verifier: str

    def __new__(cls, text: str, verifier: str):
        obj = super().__new__(cls, text)
        obj.verifier = verifier
        return obj

    def __reduce__(self):
        return (TaskAnswer, (str(self), self.verifier))


@register("mixture", options=("partial", "memory_mb"))
class _MixtureRewardFn(RewardFn):
    """Each answer scored by the verifier it names (`TaskAnswer`), all at this scale; the
    verifiers are built on first use with this one's time limit, workers and options."""

    def __init__(self, scale, timeout_s, workers, **opts):
        super().__init__("mixture", scale, well_formed=self._any_well_formed)
        self.timeout_s, self._workers, self._opts = timeout_s, workers, opts
        self.verifiers: dict[str, RewardFn] = {}
        self._warned = False

    def verifier(self, name: str) -> RewardFn:
        fn = self.verifiers.get(name)
        if fn is None:
            own = {k: v for k, v in self._opts.items() if k in _OPTIONS[name]}
            fn = self.verifiers[name] = get(
                name, scale="01", timeout_s=self.timeout_s, workers=self._workers, **own
            )
        return fn

    def _any_well_formed(self, completion) -> bool:
        return any(fn.well_formed(completion) for fn in self.verifiers.values())

    def scores(self, completions, answers):
        out = np.zeros(len(completions), np.float32)
        groups: dict[str, list[int]] = {}
        for i, a in enumerate(answers):
            if isinstance(a, TaskAnswer) and a.verifier in _REGISTRY and a.verifier != "mixture":
                groups.setdefault(a.verifier, []).append(i)
            elif not self._warned:
                self._warned = True
                log.warning(
                    "mixture verifier: no credit for answer %r: it names no verifier (a task "
                    "mixture's problems do; rewards.name picks one for all)",
                    str(a)[:80],
                )
        for name, idx in groups.items():
            got = self.verifier(name).scores(
                [completions[i] for i in idx], [str(answers[i]) for i in idx]
            )
            out[idx] = got
        return out

    def close(self) -> None:
        for fn in self.verifiers.values():
            fn.close()


def score_batch(
    reward_fn: Callable[[object, str], float],
    completions: Sequence[object],
    answers: Sequence[str],
) -> np.ndarray:
    """Rewards [N] (float32) of N completions against their answers.

    A `RewardFn` scores the batch at once (pooled verifiers in parallel); any
    other callable is called per item, and an exception from it is no credit
    (reward 0.0) rather than a crash of the training loop.
    """
    if isinstance(reward_fn, RewardFn):
        return reward_fn.batch(completions, answers)
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    out = np.zeros(len(completions), np.float32)
    for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
        try:
            out[i] = reward_fn(c, a)
        except Exception as e:
            log.warning("reward function raised %s; no credit", type(e).__name__)
    return out


def overlong_penalty(lengths, *, l_max: int, l_cache: int) -> np.ndarray:
    """DAPO soft overlong penalty per sample: clip((L_max - |y|) / L_cache - 1, -1, 0).

    0 up to L_max - L_cache tokens, then linear down to -1 at L_max and beyond.
    """
    if l_cache <= 0 or l_max <= l_cache:
        raise ValueError(f"overlong penalty needs 0 < l_cache < l_max, got {l_cache}, {l_max}")
    y = np.asarray(lengths, np.float64)
    return np.clip((l_max - y) / l_cache - 1.0, -1.0, 0.0).astype(np.float32)


def shape_rewards(
    rewards: np.ndarray,
    *,
    cfg: RewardConfig,
    reward_fn: RewardFn,
    completions: Sequence[object],
    lengths=None,
) -> np.ndarray:
    """Verifier rewards plus the optional format reward (`format_coef` if an answer can be
    read) and DAPO overlong penalty (`overlong_penalty`, lengths in generated tokens).

    The curriculum's pass rates should see the verifier rewards, not these.
    """
    out = np.asarray(rewards, np.float32).copy()
    if cfg.format_coef:
        ok = np.asarray([reward_fn.well_formed(c) for c in completions], np.float32)
        out += np.float32(cfg.format_coef) * ok
    if cfg.overlong_penalty:
        if lengths is None:
            raise ValueError("rewards.overlong_penalty=true needs the completion lengths")
        out += overlong_penalty(lengths, l_max=cfg.overlong_max, l_cache=cfg.overlong_cache)
    return out
