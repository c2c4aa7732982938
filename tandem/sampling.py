"""Logits processing shared by the target and the drafter, so that p and q see identical rules."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int = 0
    max_new_tokens: int = 64
    min_new_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def suppress_eos(logits: torch.Tensor, eos_ids: list[int], first_index: int,
                 min_new_tokens: int) -> torch.Tensor:
    """Forbids end-of-sequence at rows that would produce generated token number < min_new_tokens.

    logits: [n, V]; row i produces generated token number first_index + i (0-based).
    """
    blocked_rows = max(0, min(logits.shape[0], min_new_tokens - first_index))
    if blocked_rows and eos_ids:
        logits = logits.clone()
        logits[:blocked_rows, eos_ids] = float("-inf")
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order transformers uses). logits: [n, V] -> [n, V]."""
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]   # [n, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p     # mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p                      # the best token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int, stream: int = 0) -> torch.Generator:
    """A CPU generator per session; `stream` separates the drafter's randomness from the target's."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + stream) % (2**63))
    return g
