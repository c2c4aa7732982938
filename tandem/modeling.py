"""Loads a causal LM through one code path (presets, HF folders, GGUF) and runs it with a KV cache."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

log = logging.getLogger(__name__)


def resolve(spec: str) -> Path:
    """A preset name, a Hugging Face folder or a .gguf file -> a Hugging Face folder."""
    from tandem import presets  # imported lazily: resolving may download and convert
    return presets.resolve_model(spec)


class SessionCache:
    """The KV cache of one session on one model.

    `length` tokens have keys/values in the cache. Rolling back is `crop`, which keeps a view of
    the leading positions: no copy of the cache is made.
    """

    def __init__(self) -> None:
        self.kv = DynamicCache()
        self.length = 0

    def crop(self, length: int) -> None:
        if length < self.length:
            self.kv.crop(length - self.length)
            self.length = length

    def nbytes(self) -> int:
        total = 0
        for layer in self.kv.layers:
            if getattr(layer, "is_initialized", False):
                total += layer.keys.nbytes + layer.values.nbytes
        return total


class CausalLM:
    """A transformers causal LM in inference mode on one device."""

    def __init__(self, spec: str, device: str = "cpu", threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.path = resolve(spec)
        start = time.monotonic()
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).to(device).eval()
        self.device = device
        config = self.model.config
        self.name = spec
        self.vocab_size: int = config.vocab_size
        self.max_context: int = context_length(config)
        self.eos_ids: list[int] = _eos_ids(self.model)
        log.info("loaded %s from %s in %.1fs (vocab %d, context %d, eos %s)", spec, self.path,
                 time.monotonic() - start, self.vocab_size, self.max_context, self.eos_ids)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: SessionCache) -> torch.Tensor:
        """Feeds token_ids after the cached ones; returns logits [n, V] on the CPU (float32)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)    # [1, n]
        out = self.model(input_ids=ids, cache=cache.kv, use_cache=True)
        cache.length += len(token_ids)
        return out.logits[0].float().cpu()


def context_length(config) -> int:
    return int(getattr(config, "max_position_embeddings", 2048))


def load_tokenizer(spec: str):
    return AutoTokenizer.from_pretrained(resolve(spec))


def vocab_mismatch(target: str, draft: str) -> str | None:
    """Why a draft model cannot serve a target (None when it can): same vocabulary, token for token."""
    t_cfg, d_cfg = AutoConfig.from_pretrained(resolve(target)), AutoConfig.from_pretrained(resolve(draft))
    t_tok, d_tok = load_tokenizer(target), load_tokenizer(draft)
    if t_tok.get_vocab() != d_tok.get_vocab():
        return (f"draft model {draft!r} has a different vocabulary from target {target!r} "
                f"({len(d_tok)} vs {len(t_tok)} tokens); pick a draft from the same model family")
    if t_cfg.vocab_size != d_cfg.vocab_size:
        return (f"draft model {draft!r} has vocab_size {d_cfg.vocab_size}, target {target!r} has "
                f"{t_cfg.vocab_size}; logits would not line up")
    return None


def _eos_ids(model) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = model.config.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
