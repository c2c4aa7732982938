"""Validated generation requests: the one shape both public faces are converted into."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tandem.cluster.registry import DRAFT_POOL_METHODS, VERIFY_METHODS
from tandem.speculation.grammar import Guide
from tandem.speculation.logprobs import MAX_TOP_LOGPROBS
from tandem.speculation.sampling import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams

DRAFT_METHODS = (*DRAFT_POOL_METHODS, *VERIFY_METHODS)
SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Speculation knobs as call metadata, for faces whose wire format has no field for them.
MD_METHOD = "x-tandem-draft-method"
MD_K = "x-tandem-num-speculative-tokens"
MD_SESSION = "x-tandem-session-id"


class InvalidRequest(ValueError):
    """A request that can never succeed; the message says which field and why."""


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 2048
    default_max_new_tokens: int = 128
    tgis_default_max_new_tokens: int = 20     # what TGIS's proto documents for max_new_tokens = 0
    max_repetition_penalty: float = 10.0
    max_length_decay: float = 10.0
    max_stop_sequences: int = 6
    max_stop_sequence_chars: int = 240
    max_speculative_tokens: int = 16
    default_speculative_tokens: int = 16
    default_draft_method: str = "model"
    max_prompt_chars: int = 1_000_000
    max_prompt_tokens: int = 0          # 0 = the model's context window
    max_guide_chars: int = 65536        # a JSON Schema, regex or grammar; a choice's strings together


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop_sequences: list[str] = field(default_factory=list)
    include_stop_sequence: bool = False
    # Token ids that end the output once min_new_tokens are out (the token itself is output).
    stop_token_ids: frozenset[int] = frozenset()
    method: str = "model"          # model | ngram | none
    k: int = 4                     # speculative tokens per round
    session_id: str = ""
    continuation_ids: list[int] | None = None   # the input as a later turn of a session (None: prompt_ids)
    token_details: bool = False    # report each generated token (id, text; logprobs when params ask)
    prompt_details: bool = False   # report each prompt token (id, text; logprobs when params ask)


def check_sampling(limits: Limits, *, temperature: float, top_k: int, top_p: float, seed: int | None,
                   max_new_tokens: int, min_new_tokens: int, stop_sequences: list[str],
                   default_max_new_tokens: int | None = None) -> SamplingParams:
    """Validates sampling fields; 0 for max_new_tokens and top_p means 'use the default'."""
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise InvalidRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature}")
    if top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = disabled), got {top_k}")
    if top_p == 0:
        top_p = 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens == 0:
        max_new_tokens = default_max_new_tokens or limits.default_max_new_tokens
    if not 1 <= max_new_tokens <= limits.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {max_new_tokens}")
    if min_new_tokens < 0 or min_new_tokens > max_new_tokens:
        raise InvalidRequest(f"min_new_tokens must be between 0 and max_new_tokens ({max_new_tokens}), "
                             f"got {min_new_tokens}")
    if len(stop_sequences) > limits.max_stop_sequences:
        raise InvalidRequest(f"at most {limits.max_stop_sequences} stop sequences are allowed, "
                             f"got {len(stop_sequences)}")
    for i, s in enumerate(stop_sequences):
        if not s:
            raise InvalidRequest(f"stop_sequences[{i}] is empty")
        if len(s) > limits.max_stop_sequence_chars:
            raise InvalidRequest(f"stop_sequences[{i}] is {len(s)} characters; the limit is "
                                 f"{limits.max_stop_sequence_chars}")
    if seed is None:
        import secrets
        seed = secrets.randbits(63)
    if seed < 0 or seed >= 2**63:
        raise InvalidRequest(f"seed must be in [0, 2^63), got {seed}")
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                          seed=int(seed), max_new_tokens=int(max_new_tokens),
                          min_new_tokens=int(min_new_tokens))


def check_processing(limits: Limits, params: SamplingParams, *, typical_p: float = 0.0,
                     repetition_penalty: float = 0.0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, length_penalty: tuple[int, float] | None = None,
                     where: Callable[[str], str] = lambda name: name) -> SamplingParams:
    """Validates the penalties and typical-p; 0 for typical_p and repetition_penalty means 'off'.
    length_penalty: (start_index, decay_factor), transformers' exponential decay length penalty.
    where: a field's name as the face's clients know it (its path in their request)."""
    def finite(name: str, value: float) -> float:
        if not math.isfinite(value):
            raise InvalidRequest(f"{where(name)} must be a finite number, got {value}")
        return value

    typical_p = finite("typical_p", typical_p) or 1.0
    if not 0 < typical_p <= 1:
        raise InvalidRequest(f"{where('typical_p')} must be in (0, 1] (0 = off), got {typical_p}")
    repetition_penalty = finite("repetition_penalty", repetition_penalty) or 1.0
    if not MIN_REPETITION_PENALTY <= repetition_penalty <= limits.max_repetition_penalty:
        raise InvalidRequest(f"{where('repetition_penalty')} must be between {MIN_REPETITION_PENALTY:g} and "
                             f"{limits.max_repetition_penalty:g} (0 or 1 = off), got {repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not -2 <= finite(name, value) <= 2:
            raise InvalidRequest(f"{where(name)} must be between -2 and 2, got {value}")
    start, decay = length_penalty or (0, 1.0)
    if not 1 <= finite("length_penalty.decay_factor", decay) <= limits.max_length_decay:
        raise InvalidRequest(f"{where('length_penalty.decay_factor')} must be between 1 and "
                             f"{limits.max_length_decay:g}, got {decay}")
    if start < 0:
        raise InvalidRequest(f"{where('length_penalty.start_index')} must be >= 0, got {start}")
    return replace(params, typical_p=float(typical_p), repetition_penalty=float(repetition_penalty),
                   presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                   length_start=int(start), length_decay=float(decay))


def check_reports(params: SamplingParams, *, logprobs: bool, top_logprobs: int, prompt_logprobs: bool,
                  field: str = "top_logprobs") -> SamplingParams:
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{field} must be between 0 and {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    return replace(params, logprobs=bool(logprobs), top_logprobs=int(top_logprobs),
                   prompt_logprobs=bool(prompt_logprobs))


def truncate(ids: list[int], keep: int, max_context: int) -> list[int]:
    """The last `keep` tokens (TGIS's truncate_input_tokens; 0 = all). More than the context
    window can hold is an error, as in TGIS; more than the prompt has keeps it whole."""
    if keep < 0 or keep >= max_context:
        raise InvalidRequest(f"truncate_input_tokens must be below the model's context of {max_context} "
                             f"tokens, got {keep}")
    return ids[-keep:] if 0 < keep < len(ids) else ids


def check_speculation(limits: Limits, method: str, k: int) -> tuple[str, int]:
    method = method or limits.default_draft_method
    if method not in DRAFT_METHODS:
        raise InvalidRequest(f"unknown draft method {method!r}; use one of {', '.join(DRAFT_METHODS)}")
    if k == 0:
        k = limits.default_speculative_tokens
    if not 1 <= k <= limits.max_speculative_tokens:
        raise InvalidRequest(f"num_speculative_tokens must be between 1 and "
                             f"{limits.max_speculative_tokens}, got {k}")
    return method, k


def speculation_metadata(limits: Limits, metadata, batch_size: int = 1) -> tuple[str, int, str]:
    """(method, k, session id) from a call's x-tandem-* metadata (gRPC's (key, value) pairs), for
    the faces whose wire format has no place for them (TGIS, vLLM's engine protocol)."""
    md = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    raw_k = md.get(MD_K, "").strip()
    try:
        k = int(raw_k) if raw_k else 0
    except ValueError:
        raise InvalidRequest(f"{MD_K} must be an integer, got {raw_k!r}") from None
    method, k = check_speculation(limits, md.get(MD_METHOD, "").strip(), k)
    session_id = check_session_id(md.get(MD_SESSION, ""))
    # One session id on several concurrent generations would make them indistinguishable.
    if session_id and batch_size > 1:
        raise InvalidRequest(f"{MD_SESSION} names one generation; this batch has {batch_size} requests")
    return method, k, session_id


def check_session_id(session_id: str) -> str:
    if session_id and not SESSION_ID.match(session_id):
        raise InvalidRequest("session_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return session_id


def check_guide(limits: Limits, params: SamplingParams, kind: str | None, *, text: str = "",
                choices: list[str] = (), where: Callable[[str], str] = lambda name: name) -> SamplingParams:
    """Validates structured output. kind: json | json_schema | regex | choice | grammar, or None
    (unconstrained); text: the schema, regex or grammar; choices: a choice's strings. Whether the
    guide compiles is the verify worker's to say (INVALID_ARGUMENT with the library's message)."""
    if kind is None:
        return params
    guide = Guide(kind, text, tuple(choices))
    if guide.size() > limits.max_guide_chars:
        raise InvalidRequest(f"{where(kind)} is {guide.size()} characters; the limit is {limits.max_guide_chars}")
    if kind in ("json_schema", "regex", "grammar") and not text.strip():
        raise InvalidRequest(f"{where(kind)} must not be empty")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:        # nested past the parser's depth: RecursionError
            raise InvalidRequest(f"{where(kind)} is not JSON: {e or 'nested too deep'}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"{where(kind)} must be a JSON object (a schema), got {type(schema).__name__}")
    if kind == "choice":
        if not choices:
            raise InvalidRequest(f"{where(kind)} must hold at least one string")
        for i, c in enumerate(choices):
            if not c:
                raise InvalidRequest(f"{where(kind)}[{i}] is empty")
    return replace(params, guide=guide)


def check_guided(limits: Limits, params: SamplingParams, m, kind: str | None,
                 where: Callable[[str], str]) -> SamplingParams:
    """check_guide for a face's guided oneof `m` whose `kind` is set: json_schema, regex and
    grammar are strings, choice a message with `choices` (both faces spell them so)."""
    text = getattr(m, kind) if kind in ("json_schema", "regex", "grammar") else ""
    choices = list(m.choice.choices) if kind == "choice" else []
    return check_guide(limits, params, kind, text=text, choices=choices, where=where)
