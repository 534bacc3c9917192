"""What the sampler hands to the trainer: one row per sample, numpy arrays."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class FinishReason(enum.IntEnum):
    """Why a row ended (`Rollouts.finish_reason` holds these codes)."""

    RUNNING = 0  # not finished yet (only seen mid-decode) or a padding row
    STOP = 1  # emitted a stop token (kept in the completion, mask 1)
    LENGTH = 2  # hit max_new_tokens without a stop token (truncated)
    INTERRUPTED = 3  # forced interruption; then stopped, or ran out of answer budget


FINISH_NAMES = tuple(r.name.lower() for r in FinishReason)


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Sampled rows; B = P prompts x G samples, row b belongs to prompt b // G.

    `logprobs` are the sampler's log-probs of each completion token under the
    temperature-scaled distribution it sampled from, before top-k/top-p
    truncation (1.0 temperature for greedy); 0 where `completion_mask` is 0.
    """

    prompt_tokens: np.ndarray  # [B, Tp] int32, left-padded with pad_id
    prompt_mask: np.ndarray  # [B, Tp] bool
    completion_tokens: np.ndarray  # [B, Tg] int32, right-padded with pad_id
    completion_mask: np.ndarray  # [B, Tg] bool: policy tokens up to and incl. the stop token
    injected_mask: np.ndarray  # [B, Tg] bool: tokens injected by forced interruption
    logprobs: np.ndarray  # [B, Tg] float32
    versions: np.ndarray  # [B, Tg] int32 policy version per token, -1 where not sampled
    lengths: np.ndarray  # [B] int32 completion length (injected tokens included)
    finish_reason: np.ndarray  # [B] int32 FinishReason codes
    truncated: np.ndarray  # [B] bool: ended by a length limit, not a stop token
    group_ids: np.ndarray  # [B] int32 prompt index
    row_ids: np.ndarray  # [B] int32 ids the random keys were folded with
    # [B, Tp + Tg, L, k] the experts each token was routed to in every layer (a mixture
    # of experts sampled with routing replay: `Engine(record_routes=True)`), aligned with
    # prompt_tokens + completion_tokens; the last column (a completion's last token is
    # never fed) and padding are 0. None: not recorded.
    routes: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def finish_names(self) -> list[str]:
        return [FINISH_NAMES[int(c)] for c in self.finish_reason]

    def completion(self, row: int) -> list[int]:
        """Token ids of one row's completion (injected tokens included)."""
        return self.completion_tokens[row, : int(self.lengths[row])].tolist()


def concat_groups(groups: list[tuple[Rollouts, int]], G: int) -> Rollouts:
    """One Rollouts of the groups (rollouts, group index), renumbered 0..len-1.

    Prompt arrays are left-padded and completion arrays right-padded to the widest."""
    tp = max(rollouts.prompt_tokens.shape[1] for rollouts, _ in groups)
    tg = max(rollouts.completion_tokens.shape[1] for rollouts, _ in groups)
    parts: dict[str, list] = {}
    for new_g, (rollouts, g) in enumerate(groups):
        rows = slice(g * G, (g + 1) * G)
        for f in dataclasses.fields(rollouts):
            v = getattr(rollouts, f.name)
            if v is None:
                continue
            v = v[rows]
            if f.name == "routes":  # [prompt | completion] columns, padded as each
                at = rollouts.prompt_tokens.shape[1]
                v = np.pad(v, ((0, 0), (tp - at, tg - (v.shape[1] - at)), (0, 0), (0, 0)))
            elif f.name.startswith("prompt_"):
                v = np.pad(v, ((0, 0), (tp - v.shape[1], 0)))
            elif v.ndim == 2:
                fill = -1 if f.name == "versions" else 0
                v = np.pad(v, ((0, 0), (0, tg - v.shape[1])), constant_values=fill)
            if f.name == "group_ids":
                v = np.full_like(v, new_g)
            parts.setdefault(f.name, []).append(v)
    if len(parts.get("routes", ())) not in (0, len(groups)):
        raise ValueError("concat_groups: some groups have routes (routing replay), some not")
    return Rollouts(**{k: np.concatenate(v) for k, v in parts.items()})
