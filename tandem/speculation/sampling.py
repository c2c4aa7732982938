"""Logits processing shared by the target and the drafter, so that p and q see identical rules.

One pipeline, in the order transformers' `generate` applies the same stages:

  history stages (see `process`): repetition penalty, presence/frequency penalties, the
      min_new_tokens block on end-of-sequence, the exponential length penalty on end-of-sequence,
      then the grammar's mask (structured output; transformers runs a caller's processors last)
  warpers (see `probabilities`, sampling only): temperature, top-k, top-p, typical-p

History stages depend on the tokens before the position they process. Row i of a proposal's
logits is processed with the committed tokens plus proposed tokens 0..i-1, on the target and on
the drafter alike, so that rejection sampling compares p and q under the same rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.speculation.grammar import Guide

# The length penalty multiplies the end-of-sequence score by at most this much more: past it the
# score is beyond any other anyway, and an unbounded power overflows.
MAX_LENGTH_BOOST = 1e10
# The smallest temperature and repetition penalty a request may set: the logits are divided by
# them, and far smaller ones overflow float32 logits to infinity.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-3


class SamplingError(ValueError):
    """The processed distribution holds no finite probability mass: the request, not the worker, is at fault."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int = 0
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    typical_p: float = 1.0              # 1 = off; a warper, so sampling only
    repetition_penalty: float = 1.0     # 1 = off; over prompt and output (transformers' rule)
    presence_penalty: float = 0.0       # 0 = off; over output tokens (OpenAI's rule)
    frequency_penalty: float = 0.0      # 0 = off; over output tokens, per occurrence
    length_start: int = 0               # the length penalty's start_index, in output tokens
    length_decay: float = 1.0           # its decay_factor; 1 = off
    # Trailing prompt tokens that an earlier attempt of the same request generated (a migrated
    # request resumes with them appended to its prompt): they count as output for the penalties.
    resumed: int = 0
    # What to report with each token, from the target's raw distribution (see `logprobs_of`).
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    guide: Guide | None = None          # what the output must match (structured output)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reports(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


def process(logits: torch.Tensor, history: list[int], prompt_len: int, params: SamplingParams,
            eos_ids: list[int], proposed: list[int] = (), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The history stages. logits: [n, V] raw; row i is the distribution of the token after
    history + proposed[:i] (n <= len(proposed) + 1). history: every token so far, prompt_len of
    them the prompt as the worker got it. allowed: [>= n, V] bool, the tokens a grammar allows at
    each row (see tandem.speculation.grammar); where it allows nothing but end-of-sequence, the
    min_new_tokens block does not apply. Returns new logits [n, V] (the input when nothing applies).
    Raises SamplingError when the grammar allows no token at a row."""
    n, vocab = logits.shape
    if allowed is not None:
        allowed = allowed[:n]
        if not bool(allowed.any(dim=1).all()):
            raise SamplingError("the constraint allows no token at this position")
    output_start = prompt_len - params.resumed
    generated = len(history) - output_start           # output tokens before row 0
    rep, pres, freq = params.repetition_penalty, params.presence_penalty, params.frequency_penalty
    block = max(0, min(n, params.min_new_tokens + params.resumed - generated)) if eos_ids else 0
    lengthy = params.length_decay != 1.0 and eos_ids and generated + n - 1 > params.length_start
    if rep == 1.0 and pres == 0.0 and freq == 0.0 and not block and not lengthy:
        return logits if allowed is None else logits.float().masked_fill(~allowed, float("-inf"))
    x = logits.float().clone()
    extra = torch.tensor(list(proposed[:n - 1]), dtype=torch.long)            # [n-1]
    if rep != 1.0:
        seen = torch.zeros(n, vocab, dtype=torch.bool)
        seen[:, torch.tensor(history, dtype=torch.long)] = True
        for i in range(1, n):
            seen[i:, extra[i - 1]] = True
        x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    if pres != 0.0 or freq != 0.0:
        counts = torch.zeros(n, vocab)
        out = history[output_start:]
        if out:
            counts[:] = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab].float()
        for i in range(1, n):
            counts[i:, extra[i - 1]] += 1
        x = x - freq * counts - pres * (counts > 0).float()
    if block:
        blocked = x[:block, eos_ids]
        if allowed is not None:      # a grammar that allows only end-of-sequence here ends the output
            ending = ~allowed[:block].clone().index_fill_(1, torch.tensor(eos_ids), False).any(dim=1)
            blocked = torch.where(ending.unsqueeze(1), blocked, float("-inf"))
        else:
            blocked = torch.full_like(blocked, float("-inf"))
        x[:block, eos_ids] = blocked
    if lengthy:
        for i in range(n):
            over = generated + i - params.length_start
            if over > 0:
                boost = min(math.exp(over * math.log(params.length_decay)), MAX_LENGTH_BOOST) - 1
                eos = x[i, eos_ids]
                x[i, eos_ids] = torch.where(torch.isfinite(eos), eos + eos.abs() * boost, eos)
    if allowed is not None:
        x = x.masked_fill(~allowed, float("-inf"))
    return x


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warpers: temperature, top-k, top-p, typical-p (transformers' order). logits: [n, V]
    after `process` -> probabilities [n, V]."""
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
    if params.typical_p < 1.0:
        x = _typical(x, params.typical_p)
    probs = torch.softmax(x, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        raise SamplingError("the sampling parameters leave no finite distribution to sample from")
    return probs


def _typical(x: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022): keep the tokens whose surprisal is closest
    to the entropy, fewest first, until they hold `mass`; at least one is kept."""
    logp = torch.log_softmax(x, dim=-1)
    ent = -(logp * logp.exp()).nansum(-1, keepdim=True)              # [n, 1]
    distance = (-logp - ent).abs()
    sorted_d, order = torch.sort(distance, dim=-1)
    cum = torch.softmax(x.gather(-1, order), dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=-1, keepdim=True).clamp_(max=x.shape[-1] - 1)
    drop_sorted = sorted_d > sorted_d.gather(-1, last)
    drop_sorted[..., :1] = False
    return x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one processed row [1, V] or [V]: argmax when greedy, else a draw from the
    warped distribution."""
    row = logits.reshape(-1)
    if params.greedy:
        return int(row.argmax())
    return sample(probabilities(row[None], params)[0], generator)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int, stream: int = 0) -> torch.Generator:
    """A CPU generator per session; `stream` separates the drafter's randomness from the target's."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + stream) % (2**63))
    return g
