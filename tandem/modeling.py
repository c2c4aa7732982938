"""Loads a causal LM through one code path (presets, HF folders, GGUF) and runs it with a KV cache."""

from __future__ import annotations

import logging
import time
import warnings
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


DTYPES = ("float32", "bfloat16", "float16", "int8")


def load_weights(path: Path, dtype: str, device: str):
    """The model in `dtype` on `device`. int8 is dynamic quantization of every Linear layer (int8
    weights, activations quantized per call): CPU only, about 3x faster per decode step than float32
    here, and meant for drafts, whose precision never changes the output (the target decides)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "int8" and not device.startswith("cpu"):
        raise ValueError("dtype int8 (dynamic quantization) runs on the CPU only; use bfloat16 on "
                         f"{device}")
    load_as = torch.float32 if dtype == "int8" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=load_as).to(device).eval()
    if dtype == "int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch.ao's deprecation notice; the kernels are current
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model


class CausalLM:
    """A transformers causal LM in inference mode on one device."""

    def __init__(self, spec: str, device: str = "cpu", threads: int | None = None,
                 dtype: str = "float32") -> None:
        if threads:
            torch.set_num_threads(threads)
        self.path = resolve(spec)
        start = time.monotonic()
        self.model = load_weights(self.path, dtype, device)
        self.device = device
        self.dtype = dtype
        # n new tokens are fed as padded_length[n] (>= n) when that shape is measurably faster
        self.padded_length: dict[int, int] = {}
        self.forward_ms: list[float] = []         # [i]: one forward pass of i+1 new tokens, padded as above
        config = self.model.config
        self.name = spec
        self.vocab_size: int = config.vocab_size
        self.max_context: int = context_length(config)
        self.eos_ids: list[int] = _eos_ids(self.model)
        log.info("loaded %s (%s) from %s in %.1fs (vocab %d, context %d, eos %s)", spec, dtype, self.path,
                 time.monotonic() - start, self.vocab_size, self.max_context, self.eos_ids)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: SessionCache, last: int | None = None) -> torch.Tensor:
        """Feeds token_ids after the cached ones; returns the logits of the last `last` of them (all
        when None) as [last, V] on the CPU, float32. Asking only for what is used skips most of the
        output layer on a prefill, which is a large share of its cost with a 150k vocabulary.

        When a longer input runs faster (see `calibrate`), the ids are padded at the end with copies
        of the last one: causal attention keeps the real positions' logits unaffected, and the padded
        positions are cropped from the cache before returning."""
        n = len(token_ids)
        padded = self.padded_length.get(n, n)
        keep = n if last is None else min(last, n)
        ids = torch.tensor([token_ids + token_ids[-1:] * (padded - n)], dtype=torch.long,
                           device=self.device)                                     # [1, padded]
        out = self.model(input_ids=ids, cache=cache.kv, use_cache=True, logits_to_keep=keep + padded - n)
        cache.length += padded
        cache.crop(cache.length - (padded - n))
        return out.logits[0, :keep].float().cpu()

    def calibrate(self, max_new: int, last: int | None = None, context: int = 64, repeats: int = 3,
                  gain: float = 0.85) -> None:
        """Measures one forward pass of n = 1..max_new new tokens and pads n to the shortest longer
        length that takes at most `gain` of n's time. On some CPUs a few lengths (2, 3, 7 here) are
        far slower than longer ones; on a GPU the curve is flat and nothing gets padded. The lengths
        are measured in turn, `repeats` times, keeping each one's fastest run, so that a burst of
        load from elsewhere cannot make one length look slow. `last`: as the caller will pass it to
        forward (None for every position's logits, as in verification; 1 for drafting)."""
        cache = SessionCache()
        self.padded_length = {}
        self.forward([0] * min(context, self.max_context - max_new - 1), cache, last=1)
        base = cache.length
        times: dict[int, float] = {}
        for n in [1, 2] + [n for _ in range(repeats) for n in range(1, max_new + 1)]:   # warm-up first
            start = time.perf_counter()
            self.forward([0] * n, cache, last)
            times[n] = min(times.get(n, float("inf")), time.perf_counter() - start)
            cache.crop(base)
        for n in range(1, max_new + 1):
            best = min(range(n, max_new + 1), key=lambda m: times[m])
            if times[best] <= gain * times[n]:
                self.padded_length[n] = best
        self.forward_ms = [1000 * times[self.padded_length.get(n, n)] for n in range(1, max_new + 1)]
        log.info("forward ms by new tokens: %s; padded: %s",
                 {n: round(1000 * t, 1) for n, t in times.items()}, self.padded_length or "none")


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
