"""A forward pass of a Llama-family decoder (Llama, Qwen2) without transformers' module calls.

It runs the operations of transformers' modeling code for these models, in the same order and on
the same modules' weights (the fused, packed or quantized Linear layers of tandem.engine.gemm and
the pool attention of tandem.engine.attention), so its logits and hidden states equal
transformers' bit for bit (tests/test_decoder.py proves it against the model's own forward). What
it leaves out is the per-call work of transformers' modules, hooks and output records, which on a
CPU is a tenth of a small draft model's step (docs/benchmarks.md, "A draft step without
transformers' modules"). A model it does not cover (`Decoder.of` answers None) runs through
transformers.
"""

from __future__ import annotations

import torch

from tandem.engine.attention import ForwardBatch, pool_attention
from tandem.engine.gemm import FusedPart

# Model types whose decoder layer is exactly: RMSNorm, q/k/v projections, rotary embedding on q and
# k, attention, o projection, residual; RMSNorm, down(act(gate) * up), residual. Qwen3 and others
# add norms on q and k; they are not covered.
COVERED = ("llama", "qwen2")
# Rotary kinds whose inverse frequencies are fixed at load ("dynamic" ones change with the length).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _projections(*parts):
    """x -> the outputs of `parts` (Linear modules over one input), with one call where
    tandem.engine.gemm fused exactly these into one layer."""
    fused = getattr(parts[0], "fused", None)
    if (all(isinstance(p, FusedPart) and p.fused is fused for p in parts)
            and [p.part for p in parts] == list(range(len(fused.columns)))):
        linear, columns = fused.linear, fused.columns
        return lambda x: [out[:, c] for out in (linear(x),) for c in columns]
    return lambda x: [p(x) for p in parts]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm, operation for operation."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Decoder:
    """The decoder of one loaded model (`of`), called once per forward pass."""

    def __init__(self, model) -> None:
        inner, config = model.model, model.config
        self.embed, self.lm_head = inner.embed_tokens, model.lm_head
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scale = inner.rotary_emb.attention_scaling
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = []
        for layer in inner.layers[:config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm, _projections(attn.q_proj, attn.k_proj, attn.v_proj),
                                attn, layer.post_attention_layernorm, _projections(mlp.gate_proj, mlp.up_proj),
                                mlp.down_proj, mlp.act_fn))
        self.norm = inner.norm

    @classmethod
    def of(cls, model) -> Decoder | None:
        """The model's Decoder, or None where its architecture is not one this module covers."""
        config = model.config
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if (config.model_type not in COVERED or getattr(rotary, "rope_type", None) not in STATIC_ROPE
                or getattr(config, "mlp_bias", False) or not hasattr(model, "lm_head")):
            return None
        return cls(model)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, batch: ForwardBatch,
                 taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids, positions: [T] the new tokens of the pass and their positions; keep: the indices of
        those whose logits are returned. Returns (logits [len(keep), V], the hidden states [T, H]
        that `taps` name, as CausalLM.forward_batch numbers them)."""
        x = self.embed(ids)
        freqs = positions[:, None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (angles.cos() * self.rope_scale).to(x.dtype), (angles.sin() * self.rope_scale).to(x.dtype)
        half, t = self.head_dim // 2, x.shape[0]

        def rotate(y: torch.Tensor) -> torch.Tensor:          # [1, heads, T, D]
            return y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin

        def heads(y: torch.Tensor, n: int) -> torch.Tensor:
            return y.view(t, n, self.head_dim).transpose(0, 1)[None]

        states = [x] if taps else []
        for norm1, qkv, attn, norm2, gate_up, down, act in self.layers:
            q, k, v = qkv(_rms(x, norm1.weight, norm1.variance_epsilon))
            out, _ = pool_attention(attn, rotate(heads(q, self.heads)), rotate(heads(k, self.kv_heads)),
                                    heads(v, self.kv_heads), None, scaling=attn.scaling, tandem_batch=batch)
            x = x + attn.o_proj(out.reshape(t, -1))
            gate, up = gate_up(_rms(x, norm2.weight, norm2.variance_epsilon))
            x = x + down(act(gate) * up)
            if taps:
                states.append(x)
        x = _rms(x, self.norm.weight, self.norm.variance_epsilon)
        if taps:
            states[-1] = x
        return self.lm_head(x[keep]), [states[i] for i in taps]
