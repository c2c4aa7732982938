"""Loads a causal LM through one code path (presets, HF folders, GGUF) and runs it with a KV cache.

Longer than 300 lines because loading at each precision, the batched forward pass and the
start-up measurements of that pass share one model's state and are read together."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.engine import gemm, rowgemm
from tandem.engine.attention import ATTENTION, ForwardBatch
from tandem.engine.decoder import Decoder
from tandem.engine.kvpool import KVPool, SessionCache
from tandem.engine.vocab import trim_output
from tandem.speculation.tree import depths

log = logging.getLogger(__name__)


def resolve(spec: str) -> Path:
    """A preset name, a Hugging Face folder or a .gguf file -> a Hugging Face folder."""
    from tandem import presets  # imported lazily: resolving may download and convert
    return presets.resolve_model(spec)


DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")


def dtype_problem(dtype: str, device: str) -> str | None:
    """Why a model cannot run at `dtype` on `device` (None when it can)."""
    if dtype not in DTYPES:
        return f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}"
    if dtype in ("int8", "int4") and not device.startswith("cpu"):
        return f"dtype {dtype} runs on the CPU only (its kernels are); use bfloat16 on {device}"
    if dtype == "int4" and not rowgemm.int4():
        return "dtype int4 runs on Tandem's CPU kernel on AVX512-VNNI or AVX2 only (not built, or not this CPU); use int8"
    if dtype == "float16" and device.startswith("cpu"):
        return ("dtype float16 runs on a GPU only (the CPU has no float16 kernel here that keeps a row's "
                "result independent of its batch); use bfloat16 or int8 on the CPU")
    return None


def load_weights(path: Path, dtype: str, device: str, batch_invariant: bool = True, vocab: int = 0):
    """The model in `dtype` on `device`. int8 is every Linear layer's weights and inputs in int8,
    the rest in float32 (CPU only): with scales of their own rows when `batch_invariant`, so that
    like every precision here a row's result does not depend on the other rows of its pass, and
    where Tandem's int8 kernel runs (tandem.engine.rowgemm.int8), which is faster; else with a
    scale per call (tandem.engine.gemm). int4 is int8 with 4-bit weights in groups of 64 inputs
    (CPUs with AVX512-VNNI or AVX2; batch-invariant too), for drafts. vocab: a draft's output layer keeps that many (tandem.engine.vocab)."""
    if problem := dtype_problem(dtype, device):
        raise ValueError(problem)
    load_as = torch.float32 if dtype in ("int8", "int4") else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=load_as).to(device).eval()
    gemm.fuse_linears(model)
    if vocab:
        trim_output(model, vocab, [*AutoTokenizer.from_pretrained(path).all_special_ids,
                                   *eos_ids(model.generation_config, model.config)])
    if dtype in ("int8", "int4"):
        gemm.quantize_linears(model, per_row=batch_invariant or rowgemm.int8(), bits=int(dtype[3:]))
    return model


class CausalLM:
    """A transformers causal LM in inference mode on one device, with the KV pool of its sessions.

    `kv_tokens`: the pool's size in token positions, all sessions together, allocated up front;
    `kv_bytes`, when given, sizes it in bytes instead. `batch_invariant`: a token's logits are the
    same whichever other tokens share its pass (tandem.engine.attention; the linear layers are so
    at every precision, tandem.engine.gemm), as a target's must be for speculation to be lossless;
    a draft runs faster without, and with an output layer of `vocab` tokens (`load_weights`).
    `lean`: run covered architectures through tandem.engine.decoder (the same numbers, faster)."""

    def __init__(self, spec: str, device: str = "cpu", threads: int | None = None,
                 dtype: str = "float32", kv_tokens: int = 16384, kv_bytes: int = 0,
                 packed_gemm: bool = True, batch_invariant: bool = True, vocab: int = 0,
                 lean: bool = True) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.path = resolve(spec)
        start = time.monotonic()
        self.model = load_weights(self.path, dtype, device, batch_invariant, vocab)
        self.model.set_attn_implementation(ATTENTION)
        # float32 and bfloat16 on the CPU only: int8 has its own kernels, and GPUs do not need it
        self.packed = packed_gemm and gemm.available() and gemm.pack_linears(self.model, batch_invariant) > 0
        self.pool = KVPool.for_model(self.model, kv_tokens, kv_bytes)
        # transformers' forward, or the same operations without its modules' calls where covered
        # (built on the layers as packed or quantized above)
        self.decoder = Decoder.of(self.model) if lean else None
        self.device, self.dtype, self.batch_invariant = device, dtype, batch_invariant
        self.rows_alike = batch_invariant and gemm.rows_computed_alone(self.model)
        # n new tokens are fed as padded_length[n] (>= n) when that shape is measurably faster
        self.padded_length: dict[int, int] = {}
        self.forward_ms: list[float] = []         # [i]: one forward pass of i+1 new tokens, padded as above
        self.pass_ms: list[tuple[int, float]] = []  # (S, ms): a pass of S sessions feeding a token each
        config = self.model.config
        self.name = spec
        self.vocab_size: int = config.vocab_size
        self.max_context: int = context_length(config)
        self.eos_ids: list[int] = eos_ids(self.model.generation_config, self.model.config)
        log.info("loaded %s (%s%s) from %s in %.1fs (vocab %d, context %d, eos %s, KV pool %d tokens, %.0f MiB)",
                 spec, dtype, ", packed GEMM" if self.packed else "", self.path, time.monotonic() - start,
                 self.vocab_size, self.max_context, self.eos_ids, self.pool.slots, self.pool.nbytes / 2**20)

    @property
    def invariant(self) -> bool:
        """Whether a token's logits are the same whichever tokens share its pass: asked for, every
        Linear layer on one of tandem.engine.gemm's CPU kernels (packed, or int8 per row), and those
        found at start to compute a row alike in calls of any size on this CPU."""
        return (self.batch_invariant and self.device.startswith("cpu") and (self.packed or self.dtype in ("int8", "int4"))
                and self.rows_alike)

    @property
    def numerics(self) -> str:
        """What decides its numbers beside the weights: invariant models of equal numerics give equal logits."""
        if not self.device.startswith("cpu"):
            linear = f"{self.device} (CUDA {torch.version.cuda})"
        elif self.dtype == "int4":
            linear = f"tandem int4 in groups of {rowgemm.GROUP}, output layer int8"
        elif self.dtype != "int8":
            linear = f"tandem {rowgemm.isa()}" if self.packed and gemm.own_kernel(getattr(torch, self.dtype)) else "onednn"
        else:
            linear = (f"tandem int8 {rowgemm.int8_isa()}" if rowgemm.int8()
                      else f"onednn int8, {gemm.int8_weight_bits()}-bit weights")
        return (f"{self.dtype}, linear {linear}, torch {torch.__version__} "
                f"{torch.backends.cpu.get_cpu_capability()}{'' if self.invariant else ', not batch-invariant'}")

    def new_cache(self, capacity: int = 64) -> SessionCache:
        """A session's cache with room for `capacity` positions (it grows when fed more).
        Raises KVPoolFull."""
        return SessionCache(self.pool, min(capacity, self.max_context))

    def check_feed(self, cache: SessionCache, token_ids: list[int], extra: int = 0) -> None:
        """Raises ValueError unless token_ids (plus `extra` padding) can follow cache's positions."""
        if not token_ids or cache.length + len(token_ids) + extra > self.max_context:
            raise ValueError(f"cannot feed {len(token_ids)} tokens after {cache.length} cached ones "
                             f"(context {self.max_context})")

    def forward(self, token_ids: list[int], cache: SessionCache, last: int | None = None,
                taps: tuple[int, ...] = ()):
        """Feeds token_ids after the cached ones; returns the logits of the last `last` of them (all
        when None) as [last, V] on the CPU, float32. Asking only for what is used skips most of the
        output layer on a prefill, which is a large share of its cost with a 150k vocabulary.
        With `taps`, returns (logits, features) as forward_batch does."""
        return self.forward_batch([(cache, token_ids, last)], taps)[0]

    @torch.inference_mode()
    def forward_batch(self, items: list[tuple], taps: tuple[int, ...] = ()) -> list:
        """One forward pass over the new tokens of many sessions: (cache, token_ids, last) each, as
        in `forward`, or (cache, token_ids, last, tree) where the new tokens are a token tree
        (tandem.speculation.tree: tree[i] the index of token i's parent among them, -1 for the
        first): each attends its ancestors only, at the position its depth gives it, and every
        one takes a KV slot of its own in order. Returns each item's logits. A session may appear
        once per batch.

        taps: indices into the model's hidden states (0 the embeddings, i + 1 the output of layer
        i, num_hidden_layers the final normed state); then each item's result is (logits,
        features [len(token_ids), len(taps) * hidden]) with those states concatenated, float32,
        for every token fed (a trained head reads them, tandem.head).

        When a longer input runs faster (see `calibrate`), the batch is padded at the end with
        copies of the last token, appended to the last session: causal attention keeps the real
        positions unaffected, and the padded positions are dropped from the cache afterwards."""
        items = [(*item, None)[:4] for item in items]
        total = sum(len(item[1]) for item in items)
        pad = self.padded_length.get(total, total) - total
        last_cache = items[-1][0]
        if pad and (items[-1][3] is not None or last_cache.length + len(items[-1][1]) + pad
                    > min(last_cache.capacity, self.max_context)):
            pad = 0                          # never run past the session's run or the context window
        ids: list[int] = []
        positions: list[int] = []
        keep: list[int] = []
        parts: list[tuple[int, int, int]] = []
        for i, (cache, token_ids, last, tree) in enumerate(items):
            n = len(token_ids) + (pad if i == len(items) - 1 else 0)
            self.check_feed(cache, token_ids, n - len(token_ids))
            cache.reserve(cache.length + n)
            kept = len(token_ids) if last is None else min(last, len(token_ids))
            keep.extend(range(len(ids) + len(token_ids) - kept, len(ids) + len(token_ids)))
            ids.extend(token_ids + token_ids[-1:] * (n - len(token_ids)))
            if tree is None:
                positions.extend(range(cache.length, cache.length + n))
            else:
                positions.extend(cache.length - 1 + d for d in depths(tree))
            parts.append((cache.start, cache.length, n, cache.prefix_key(), tree))
        batch = ForwardBatch.build(self.pool, parts, self.batch_invariant)
        ids_t, positions_t = torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
        keep_t = torch.tensor(keep, device=self.device)
        if self.decoder is not None:
            logits, states = self.decoder(ids_t, positions_t, keep_t, batch, taps)
        else:
            out = self.model(input_ids=ids_t[None], position_ids=positions_t[None], use_cache=False,
                             logits_to_keep=keep_t, tandem_batch=batch, output_hidden_states=bool(taps))
            logits, states = out.logits[0], [out.hidden_states[t][0] for t in taps]
        logits = logits.float().cpu()
        features = torch.cat(states, -1).float().cpu() if taps else None
        results, at, fed = [], 0, 0
        for cache, token_ids, last, _ in items:
            kept = len(token_ids) if last is None else min(last, len(token_ids))
            rows = logits[at:at + kept]
            results.append(rows if features is None else (rows, features[fed:fed + len(token_ids)]))
            at += kept
            fed += len(token_ids)                    # padding follows the last item only
            cache.length += len(token_ids)           # padded positions are never counted
        return results

    def calibrate(self, max_new: int, last: int | None = None, context: int = 64, repeats: int = 3,
                  gain: float = 0.85) -> None:
        """Measures one forward pass of n = 1..max_new new tokens and pads n to the shortest longer
        length that takes at most `gain` of n's time. On some CPUs, with some kernels, a few lengths
        are far slower than longer ones (see docs/benchmarks.md, "Measurements behind the code's
        rules"); on a GPU the curve is flat and nothing gets padded. The lengths are measured in
        turn, `repeats` times, keeping each one's fastest run, so that a burst of load from
        elsewhere cannot make one length look slow. `last`: as the caller will pass it to
        forward (None for every position's logits, as in verification; 1 for drafting)."""
        context = min(context, self.max_context - max_new - 1)
        cache = self.new_cache(context + max_new)
        self.padded_length = {}
        self.forward([0] * context, cache, last=1)
        base = cache.length
        times: dict[int, float] = {}
        for n in [1, 2] + [n for _ in range(repeats) for n in range(1, max_new + 1)]:   # warm-up first
            start = time.perf_counter()
            self.forward([0] * n, cache, last)
            times[n] = min(times.get(n, float("inf")), time.perf_counter() - start)
            cache.crop(base)
        cache.release()
        for n in range(1, max_new + 1):
            best = min(range(n, max_new + 1), key=lambda m: times[m])
            if times[best] <= gain * times[n]:
                self.padded_length[n] = best
        self.forward_ms = [1000 * times[self.padded_length.get(n, n)] for n in range(1, max_new + 1)]
        log.info("forward ms by new tokens: %s; padded: %s",
                 {n: round(1000 * t, 1) for n, t in times.items()}, self.padded_length or "none")

    def pass_seconds(self, n: int) -> float:
        """One forward pass of n new tokens alone, as calibrated (padded as it would be); beyond the
        lengths measured, the longest one's. Needs `calibrate` first."""
        return self.forward_ms[min(n, len(self.forward_ms)) - 1] / 1000

    def calibrate_passes(self, max_sessions: int, context: int = 64, repeats: int = 3,
                         budget_s: float = 6.0) -> None:
        """Measures a batched pass of S sessions feeding one token each, S = 1, 2, 4, ... up to
        max_sessions, into `pass_ms` [(S, ms)]: what a pass costs by its size, which one session's
        longer inputs (`calibrate`) do not tell. On a CPU the curve bends: up to a few dozen
        positions a pass costs about the same however many (reading the weights takes the time),
        beyond that each position adds its arithmetic. The sizes are measured in turn, `repeats`
        times, keeping each one's fastest run, so that a burst of load from elsewhere during one
        size cannot make it look dearer than it is (both measured in docs/benchmarks.md,
        "Measurements behind the code's rules"); sizes stop where the pool has no room or the first
        turn took its share of `budget_s`."""
        context = min(context, self.max_context - 2)
        sessions = min(max_sessions, self.pool.free_slots() // (2 * (context + 2)))
        self.pass_ms = []
        if sessions < 4:
            return
        donor = self.new_cache(context + 1)
        self.forward([1] * context, donor, last=1)
        caches = []
        for _ in range(sessions):
            cache = self.new_cache(context + 2)
            cache.copy_prefix(donor, context)
            caches.append(cache)

        def one_pass(size: int) -> float:
            start = time.perf_counter()
            self.forward_batch([(c, [1], None) for c in caches[:size]])
            took = time.perf_counter() - start
            for c in caches[:size]:
                c.crop(context)
            return took

        one_pass(2)                                                          # warm-up
        best: dict[int, float] = {}
        spent, size = 0.0, 1
        while size <= sessions and spent < budget_s / repeats:
            best[size] = one_pass(size)
            spent, size = spent + best[size], size * 2
        for _ in range(repeats - 1):
            for size in best:
                best[size] = min(best[size], one_pass(size))
        for c in (donor, *caches):
            c.release()
        self.pass_ms = [(size, 1000 * seconds) for size, seconds in best.items()]
        log.info("forward ms by sessions in a pass: %s", {s: round(ms, 1) for s, ms in self.pass_ms})


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


def eos_ids(generation_config, config) -> list[int]:
    """The end-of-sequence ids: the generation config's, else (where it names none) the model config's."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = getattr(config, "eos_token_id", None) if ids is None else ids
    return [] if ids is None else [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
