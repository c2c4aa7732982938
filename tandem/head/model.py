"""A trained block drafter ("head") for one target model, after DeepSeek's DSpark.

The head reads the target's own hidden states: for every token the target has processed, the
outputs of a few of its layers (`target_layer_ids`) are concatenated, projected to the hidden size
(`fc`, then `hidden_norm`) and become that position's context. Each of the head's few decoder
layers attends from a block of `block_size` positions to the keys and values of the whole context
plus the block itself (no causal order inside the block). The block is the anchor (the last
committed token, which the target has not processed yet) followed by mask tokens; block position
j predicts the token j + 1 after the anchor. The target's embedding table and output layer are
shared and frozen: the head owns only its layers, its norms and two small heads:

- a low-rank Markov head (`markov_w1`: an r-dimensional embedding of the previous token,
  `markov_w2`: r -> vocabulary) adds a bias to position j's logits from the token drafted at j - 1,
  so the block is sampled left to right at the cost of a rank-r product per position;
- a confidence head (one linear layer over the position's hidden state and the previous token's
  Markov embedding) predicts the probability that the target accepts the position. It is trained
  on the sampling acceptance (1 - total variation); a greedy request is accepted only where the
  target's top choice is the drafted token, so a head may carry a second reading of the same logit
  for greedy requests, fitted per position (`greedy_calibration`: a scale and an offset each).

A head may draft from a subset of the vocabulary only (`draft_vocab`, as EAGLE-3's reduced draft
vocabulary): its logits are products with those rows of the output layer alone, which makes
training and drafting several times cheaper with a large vocabulary. The target still judges every
proposal against its whole vocabulary, so the subset changes acceptance, never the output.

Parameter names and the configuration's field names are DeepSpec's (`deepspec/modeling/dspark`),
so a checkpoint laid out as theirs loads with `tandem.head.checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int] = field(default_factory=list)   # 0-based target layers whose outputs are read
    num_target_layers: int = 0
    block_size: int = 8
    mask_token_id: int = 0
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def for_target(cls, target, layers: int = 2, block_size: int = 8, markov_rank: int = 64,
                   taps: list[int] | None = None, mask_token_id: int = 0) -> HeadConfig:
        """A head sized for a transformers target config: the target's width, attention shape and
        RoPE base; taps default to four layers spread from the second to the third-last."""
        n = target.num_hidden_layers
        if taps is None:
            taps = sorted({1, n // 3, (2 * n) // 3, n - 2})
        heads = target.num_attention_heads
        return cls(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                   num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=getattr(target, "num_key_value_heads", heads),
                   head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
                   vocab_size=target.vocab_size, target_layer_ids=list(taps), num_target_layers=n,
                   block_size=block_size, mask_token_id=mask_token_id, markov_rank=markov_rank,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=_rope_theta(target),
                   max_position_embeddings=getattr(target, "max_position_embeddings", 8192))

    @classmethod
    def from_dict(cls, d: dict) -> HeadConfig:
        """From our own metadata or a DeepSpec config.json (unknown fields are ignored; a missing
        head_dim is hidden_size / heads; rope_theta may sit in rope_parameters)."""
        d = dict(d)
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
        if not d.get("head_dim"):
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in d.items() if k in known})
        config.check()
        return config

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        if self.markov_head_type != "vanilla":
            raise ValueError(f"markov_head_type {self.markov_head_type!r} is not supported (only 'vanilla')")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if any(b <= a for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {self.target_layer_ids}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.confidence_head_with_markov and self.enable_confidence_head and self.markov_rank <= 0:
            raise ValueError("confidence_head_with_markov needs markov_rank > 0")


def state_indices(layer_ids: list[int]) -> tuple[int, ...]:
    """Where the tapped layers' outputs sit among a transformers forward's hidden states: index 0
    is the embeddings (DeepSpec's layer -1), i + 1 the output of layer i."""
    return tuple(i + 1 for i in layer_ids)


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [..., n, d] at positions [n]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float()[:, None] * inv[None, :]                    # [n, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x [n, hidden]: each [kv_heads, n, head_dim]."""
        c = self.c
        k = self.k_norm(self.k_proj(x).view(-1, c.num_key_value_heads, c.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(-1, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        return rope(k, positions, c.rope_theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [q, hidden] at positions [q] attends to the context's keys/values [kv_heads, n, d]
        and to x's own; mask [q, n + q] bool (True: may attend), None: everything."""
        c = self.c
        q = self.q_norm(self.q_proj(x).view(-1, c.num_attention_heads, c.head_dim)).transpose(0, 1)
        q = rope(q, positions, c.rope_theta)
        k, v = self.keys_values(x, positions)
        k, v = torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)   # [heads, q, d]
        return self.o_proj(out.transpose(0, 1).reshape(-1, c.num_attention_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Markov(nn.Module):
    """The low-rank bias on a position's logits from the token before it: w2(w1[prev])."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)      # training starts from the parallel drafter


class Confidence(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(size, 1)


class BlockHead(nn.Module):
    """The head's own weights. `embed` and `lm_head` are the target's (frozen, not owned)."""

    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        c.check()
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov_head = Markov(c) if c.markov_rank > 0 else None
        self.draft_vocab: torch.Tensor | None = None      # token ids it drafts from; None: all
        self.greedy_calibration: torch.Tensor | None = None   # [block_size, 2] scale, offset; None: as trained
        self.confidence_head = None
        if c.enable_confidence_head:
            width = c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0)
            self.confidence_head = Confidence(width)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The context vectors [n, hidden] of tapped target features [n, taps * hidden]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of context vectors [n, hidden] at positions [n]."""
        return [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, kv: list, mask: torch.Tensor | None) -> torch.Tensor:
        """The blocks' final hidden states [q, hidden] from their input embeddings x [q, hidden]."""
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, positions, k, v, mask)
        return self.norm(x)

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Logits [...] of the probability that the target accepts each position."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], -1)
        return self.confidence_head.proj(features).squeeze(-1)

    def acceptance(self, logits: torch.Tensor, positions: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The probabilities that the target accepts block positions `positions` (each given the
        ones before it), from their confidence logits: read through the greedy calibration for a
        greedy request when the head has one."""
        if greedy and self.greedy_calibration is not None:
            scale, offset = self.greedy_calibration[positions].unbind(-1)
            logits = logits * scale + offset
        return torch.sigmoid(logits)


def block_mask(anchors: torch.Tensor, context_len: int, block: int) -> torch.Tensor:
    """Training attention mask [A * block, context_len + A * block]: block i (anchored at
    anchors[i]) sees the context before its anchor and its own positions."""
    q = torch.arange(len(anchors) * block)
    owner = q // block                                                      # [Q]
    ctx = torch.arange(context_len)[None, :] < anchors[owner][:, None]      # [Q, L]
    own = owner[:, None] == owner[None, :]                                  # [Q, Q]
    return torch.cat([ctx, own], 1)
