"""The verification step of speculative decoding, as pure functions over tensors.

No gRPC and no model code here. Given k proposed tokens, the target's distributions at the k+1
positions they cover, and the draft distributions they were drawn from, decide how many are
accepted and which token comes next. See the glossary in `tandem/__init__.py`. Greedy verdicts,
on chains and trees alike, walk the target's choices (tandem/speculation/tree.py).

Sampling follows the standard rule (Leviathan et al. 2023; Chen et al. 2023): accept proposed x_i
with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample the corrected token
from normalize(max(0, p_i - q_i)); when all k are accepted sample the bonus token from p_k.
The output is then distributed exactly as sampling from p alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Outcome:
    accepted: int      # number of leading proposed tokens accepted (0..k)
    next_token: int    # the bonus (all accepted) or corrected (at the first rejection) token


def verify_sampled(proposed: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_probs: torch.Tensor, uniforms: torch.Tensor,
                   generator: torch.Generator) -> Outcome:
    """Lossless rejection sampling.

    proposed:     [k] int64, the proposed tokens
    draft_probs:  [k, V] q, or None when the proposal is deterministic (q one-hot on proposed)
    target_probs: [k+1, V] p
    uniforms:     [k] U(0, 1) draws deciding acceptance
    generator:    draws the corrected or bonus token
    """
    k = proposed.shape[0]
    rows = torch.arange(k)
    p_x = target_probs[rows, proposed]                                            # [k]
    q_x = draft_probs[rows, proposed] if draft_probs is not None else torch.ones(k)
    # u < p/q, written without a division so q_x = 0 (impossible draw) rejects cleanly.
    rejected = (uniforms * q_x >= p_x).nonzero()
    if not rejected.numel():
        return Outcome(k, _draw(target_probs[k], generator))
    i = int(rejected[0].item())
    if draft_probs is not None:
        residual = torch.clamp(target_probs[i] - draft_probs[i], min=0.0)
    else:
        residual = target_probs[i].clone()
        residual[proposed[i]] = 0.0
    if float(residual.sum()) <= 0.0:
        # Only reachable through rounding when p == q; then p itself is the right distribution.
        residual = target_probs[i]
    return Outcome(i, _draw(residual, generator))


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=generator).item())
