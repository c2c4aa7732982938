"""Per-token reports: what the target's own distribution said of each token.

Taken from the target's raw distribution, log_softmax of the model's logits before any
processing (temperature, top-k/top-p/typical-p, penalties), as vLLM reports by default: a token's
logprob then means the same whatever the request sampled with. The logits are the verify pass's
that decided the token, so reporting costs no extra forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 10


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int                                 # 1-based: 1 + tokens the model found strictly likelier
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), likeliest first


def logprobs_of(logits: torch.Tensor, chosen: list[int], top_n: int = 0) -> list[TokenLogprob]:
    """logits: [n, V] raw, row i the distribution chosen[i] was taken from (n >= len(chosen))."""
    n = len(chosen)
    if n == 0:
        return []
    logp = torch.log_softmax(logits[:n].float(), dim=-1)                    # [n, V]
    ids = torch.tensor(chosen, dtype=torch.long)
    own = logp.gather(-1, ids[:, None])                                      # [n, 1]
    ranks = (logp > own).sum(dim=-1) + 1                                     # [n]
    if top_n > 0:
        top = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        top_ids, top_lp = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_lp = [[] for _ in range(n)]
    return [TokenLogprob(t, lp, r, tuple(zip(ti, tl)))
            for t, lp, r, ti, tl in zip(chosen, own[:, 0].tolist(), ranks.tolist(), top_ids, top_lp)]
