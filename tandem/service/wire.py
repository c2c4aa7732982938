"""Conversions between internal protobuf messages and plain Python values, kept at the edges."""

from __future__ import annotations

import math

import grpc
import numpy as np
import torch

from tandem.speculation.grammar import Guide
from tandem.speculation.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from tandem.speculation.sampling import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams
from tandem.v1 import internal_pb2 as pb

# Trailing metadata a draft worker adds when its verify stream broke: the gateway then blames the
# verify worker, not the draft worker, for the failure.
FAILED_HOP = "x-tandem-failed-hop"
FAILED_VERIFY = ((FAILED_HOP, "verify"),)

# A worker's deliberate answers (a bad request, no room, the deadline): they pass on to the client
# as they are and are no failure to log.
ANSWERS = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION})


def params_to_proto(p: SamplingParams) -> pb.WorkerSampling:
    return pb.WorkerSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                             max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens,
                             typical_p=p.typical_p, repetition_penalty=p.repetition_penalty,
                             presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                             length_start=p.length_start, length_decay=p.length_decay, resumed=p.resumed,
                             logprobs=p.logprobs, top_logprobs=p.top_logprobs, prompt_logprobs=p.prompt_logprobs,
                             guide=guide_to_proto(p.guide))


_GUIDE_KINDS = {pb.Guide.KIND_JSON: "json", pb.Guide.KIND_JSON_SCHEMA: "json_schema", pb.Guide.KIND_REGEX: "regex",
                pb.Guide.KIND_CHOICE: "choice", pb.Guide.KIND_GRAMMAR: "grammar"}


def guide_to_proto(g: Guide | None) -> pb.Guide | None:
    if g is None:
        return None
    kind = next(number for number, name in _GUIDE_KINDS.items() if name == g.kind)
    return pb.Guide(kind=kind, text=g.text, choices=g.choices)


def guide_from_proto(m: pb.Guide) -> Guide | None:
    """ValueError for a kind internal.proto does not define."""
    if m.kind == pb.Guide.KIND_UNSPECIFIED:
        return None
    if m.kind not in _GUIDE_KINDS:
        raise ValueError(f"sampling.guide.kind {m.kind} is not a known kind")
    return Guide(_GUIDE_KINDS[m.kind], m.text, tuple(m.choices))


def check_params(p: SamplingParams) -> SamplingParams:
    """p, or ValueError saying which field cannot work. The gateway validates what clients send;
    this guards a worker against a peer that did not."""
    if not math.isfinite(p.temperature) or not (p.temperature == 0 or p.temperature >= MIN_TEMPERATURE):
        raise ValueError(f"sampling.temperature must be 0 or at least {MIN_TEMPERATURE:g}, got {p.temperature}")
    if not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {p.top_p}")
    if not math.isfinite(p.typical_p) or not 0 < p.typical_p <= 1:
        raise ValueError(f"sampling.typical_p must be in (0, 1], got {p.typical_p}")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty < MIN_REPETITION_PENALTY:
        raise ValueError(f"sampling.repetition_penalty must be finite and at least {MIN_REPETITION_PENALTY:g}, "
                         f"got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(p, name)):
            raise ValueError(f"sampling.{name} must be finite, got {getattr(p, name)}")
    if not math.isfinite(p.length_decay) or p.length_decay <= 0:
        raise ValueError(f"sampling.length_decay must be finite and > 0, got {p.length_decay}")
    if p.max_new_tokens < 1:
        raise ValueError("sampling.max_new_tokens must be >= 1")
    if p.min_new_tokens > p.max_new_tokens:
        raise ValueError(f"sampling.min_new_tokens ({p.min_new_tokens}) exceeds max_new_tokens ({p.max_new_tokens})")
    if p.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"sampling.top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {p.top_logprobs}")
    if p.guide is not None and p.guide.kind == "choice" and not p.guide.choices:
        raise ValueError("sampling.guide.choices must not be empty")
    return p


def params_from_proto(m: pb.WorkerSampling) -> SamplingParams:
    """0 means "off" for the fields whose neutral value is 1."""
    return SamplingParams(temperature=float(m.temperature), top_k=int(m.top_k),
                          top_p=float(m.top_p) if m.top_p > 0 else 1.0, seed=int(m.seed),
                          max_new_tokens=int(m.max_new_tokens), min_new_tokens=int(m.min_new_tokens),
                          typical_p=float(m.typical_p) or 1.0,
                          repetition_penalty=float(m.repetition_penalty) or 1.0,
                          presence_penalty=float(m.presence_penalty), frequency_penalty=float(m.frequency_penalty),
                          length_start=int(m.length_start), length_decay=float(m.length_decay) or 1.0,
                          resumed=int(m.resumed), logprobs=bool(m.logprobs), top_logprobs=int(m.top_logprobs),
                          prompt_logprobs=bool(m.prompt_logprobs), guide=guide_from_proto(m.guide))


def logprobs_to_proto(reports: list[TokenLogprob]) -> list[pb.TokenScore]:
    return [pb.TokenScore(logprob=r.logprob, rank=r.rank, top_ids=[t for t, _ in r.top],
                            top_logprobs=[lp for _, lp in r.top]) for r in reports]


def logprobs_from_proto(token_ids, reports) -> list[TokenLogprob]:
    """The reports of a chunk, paired with its tokens (ValueError when the counts differ)."""
    if len(reports) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(reports)} logprob reports")
    return [TokenLogprob(int(t), r.logprob, r.rank, tuple(zip(r.top_ids, r.top_logprobs)))
            for t, r in zip(token_ids, reports)]


def support_to_proto(ids: torch.Tensor, probs: torch.Tensor) -> pb.DraftDistribution:
    """ids [m] int64, probs [m] float32 -> a sparse DraftDistribution."""
    return pb.DraftDistribution(token_ids=ids.tolist(),
                                probs=probs.to(torch.float32).numpy().astype("<f4").tobytes())


def dense_draft_probs(dists, k: int, vocab: int) -> torch.Tensor | None:
    """The sparse distributions of a Proposal -> q [k, V], or None when there are none.

    Raises ValueError on malformed input (wrong count, ids outside the vocabulary, bad probs)."""
    if len(dists) == 0:
        return None
    if len(dists) != k:
        raise ValueError(f"proposal has {k} tokens but {len(dists)} draft distributions")
    q = torch.zeros(k, vocab, dtype=torch.float32)
    for i, d in enumerate(dists):
        if len(d.probs) != 4 * len(d.token_ids):
            raise ValueError(f"draft distribution {i}: {len(d.token_ids)} ids but {len(d.probs)} prob bytes")
        ids = torch.tensor(list(d.token_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"draft distribution {i}: token id outside the vocabulary [0, {vocab})")
        probs = torch.from_numpy(np.frombuffer(d.probs, dtype="<f4").copy())
        if not torch.isfinite(probs).all() or (probs < 0).any():
            raise ValueError(f"draft distribution {i}: probabilities must be finite and >= 0")
        q[i, ids] = probs
    return q
