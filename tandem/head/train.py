"""python -m tandem.head.train: train a block-drafter head (tandem.head) for a target model.

Self-distillation, in three resumable stages under --out:
  1. responses  the target answers every prompt of tandem/head/prompts.jsonl greedily, and with
                --sampled-temperature also by drawing, with --followups also a second turn
                (data.jsonl; prompts already answered are skipped on a rerun);
  2. features   one teacher-forced pass of the target over each prompt + response gives the
                tapped layers' hidden states and its final hidden state (kept in memory);
  3. training   per sequence, `--anchors` random anchors, each a block of block_size positions
                attending to the context before it. The loss is DeepSpec's: ce_alpha x cross-
                entropy on the target's tokens + l1_alpha x L1 distance (twice the total
                variation) between the head's and the target's distributions + conf_alpha x binary
                cross-entropy of the confidence head against 1 - TV, each position weighted by
                exp(-j / gamma). AdamW, linear warm-up then cosine decay, gradients clipped.
Every --eval-every steps and at the end: held-out acceptance (greedy accepted length, per-position
acceptance, the confidence head's calibration) appended to log.jsonl, and state.pt written (head,
optimizer, step: --resume continues from it; --init starts from a head file instead of random
weights). After training, other held-out sequences fit the greedy calibration (a scale and offset of
the confidence logit per block position, BlockHead.acceptance). The result is head.safetensors
(tandem.head.checkpoint) with its sha256 printed.

Longer than 300 lines because the stages, the loss and the held-out evaluation are one program whose
parts share its data structures; the model itself is in tandem.head.model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.head import checkpoint
from tandem.head.model import BlockHead, HeadConfig, block_mask, state_indices


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem.head.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="preset, Hugging Face folder or .gguf")
    p.add_argument("--out", type=Path, required=True, help="run folder (data, log, state, head)")
    p.add_argument("--resume", action="store_true", help="continue from --out/state.pt")
    p.add_argument("--init", type=Path, help="start from this head file (its shape and draft vocabulary; a fresh "
                                             "optimizer) instead of a random head")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    # data
    p.add_argument("--max-prompts", type=int, default=0, help="use only the first N training prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="longest response generated per prompt")
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--followups", type=int, default=0,
                   help="second turns: a follow-up question after the greedy answer of the first N prompts")
    p.add_argument("--sampled-temperature", type=float, default=0.0,
                   help="also train on one answer per prompt sampled at this temperature (0: greedy answers only)")
    # head shape
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--taps", default="", help="comma-separated target layers to read (default: four spread)")
    p.add_argument("--mask-token-id", type=int, default=-1, help="-1: an unused vocabulary row or special token")
    p.add_argument("--draft-vocab", choices=["responses", "all"], default="responses",
                   help="the tokens the head drafts from: those of the training responses (and end of "
                        "sequence), or the whole vocabulary")
    # optimisation
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (sets the learning-rate schedule)")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--anchors", type=int, default=48, help="blocks per sequence per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=float, default=0.04, help="share of steps spent warming up")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=4.0, help="position weight exp(-j / gamma)")
    p.add_argument("--ce-alpha", type=float, default=0.1)
    p.add_argument("--l1-alpha", type=float, default=0.9)
    p.add_argument("--conf-alpha", type=float, default=1.0)
    p.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-sequences", type=int, default=48, help="held-out sequences evaluated, every family alike")
    p.add_argument("--calibration-sequences", type=int, default=48,
                   help="other held-out sequences that fit the greedy confidence per position (0: none)")
    return p.parse_args(argv)


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """A vocabulary row no chat uses: the first padding row past the tokenizer, or else its
    highest-numbered added token that is not one of its special tokens."""
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    special = set(tokenizer.all_special_ids)
    added = [i for i in tokenizer.added_tokens_decoder if i not in special]
    if not added:
        raise SystemExit("no unused token to mask with; pass --mask-token-id")
    return max(added)


# ---- stage 1: responses -------------------------------------------------------------------------

def generate_responses(lm, tokenizer, records: list[dict], path: Path, max_new: int, batch: int) -> list[dict]:
    """Each record with 'ids' (prompt + response token ids) and 'prompt_len': the target's answer,
    decoded by the serving engine (tandem.engine.modeling.CausalLM, batched), so the data is what
    the service's target says: greedy, or drawn at the record's 'temperature' with a generator
    seeded by its id (a rerun draws the same). Appended to `path` as made; records already there
    are read back instead."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["id"]] = row
    todo = [r for r in records if r["id"] not in done]
    eos = set(lm.eos_ids)
    with open(path, "a") as f, tqdm(total=len(records), initial=len(records) - len(todo), desc="responses",
                                    file=sys.stderr) as bar:
        for i in range(0, len(todo), batch):
            chunk = todo[i:i + batch]
            prompts = [tokenizer(tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
                                 add_special_tokens=False)["input_ids"] for r in chunk]
            caches = [lm.new_cache(len(p) + max_new + 1) for p in prompts]
            pickers = [_picker(r) for r in chunk]
            outs = [[pick(lm.forward(p, c, last=1)[0])] for p, c, pick in zip(prompts, caches, pickers)]
            active = [j for j, o in enumerate(outs) if o[-1] not in eos]
            while active:
                logits = lm.forward_batch([(caches[j], outs[j][-1:], 1) for j in active])
                for j, rows in zip(active, logits):
                    outs[j].append(pickers[j](rows[0]))
                active = [j for j in active if outs[j][-1] not in eos and len(outs[j]) < max_new]
            for r, p, o, c in zip(chunk, prompts, outs, caches):
                c.release()
                row = {"id": r["id"], "kind": r["kind"], "ids": p + o, "prompt_len": len(p)}
                done[r["id"]] = row
                f.write(json.dumps(row) + "\n")
            f.flush()
            bar.update(len(chunk))
    return [done[r["id"]] for r in records]


def _picker(record: dict):
    """The record's rule for the next token from a row of logits: argmax, or a draw at its
    temperature from a generator seeded by its id."""
    temperature = record.get("temperature", 0.0)
    if not temperature:
        return lambda row: int(row.argmax())
    generator = torch.Generator().manual_seed(int(hashlib.sha256(record["id"].encode()).hexdigest()[:15], 16))
    return lambda row: int(torch.multinomial(torch.softmax(row.float() / temperature, -1), 1, generator=generator))


FOLLOWUPS = {"code": ["Add type hints and a docstring to it.", "Write a short test for it.",
                      "Can you make it shorter?", "Explain how it works, step by step."],
             "chat": ["Can you give an example?", "Summarize that in two sentences.",
                      "Explain it to a beginner.", "What are the drawbacks?"]}


def followup_records(records: list[dict], rows: list[dict], tokenizer, n: int) -> list[dict]:
    """Second turns for the first n records: the prompt, the target's (greedy) answer from `rows`
    and a follow-up question of the record's kind, picked by its id, so that the head also learns
    answers that follow a conversation."""
    out = []
    for r, row in list(zip(records, rows))[:n]:
        answer = tokenizer.decode(row["ids"][row["prompt_len"]:], skip_special_tokens=True)
        asks = FOLLOWUPS[r["kind"]]
        ask = asks[int(hashlib.sha256(r["id"].encode()).hexdigest(), 16) % len(asks)]
        out.append({**r, "id": r["id"] + "+followup", "messages": [*r["messages"], {"role": "assistant", "content": answer},
                                                                   {"role": "user", "content": ask}]})
    return out


def sampled_records(records: list[dict], temperature: float) -> list[dict]:
    """A copy of each record to be answered by a draw at `temperature` (none at 0)."""
    if not temperature:
        return []
    return [{**r, "id": f"{r['id']}@t{temperature:g}", "temperature": temperature} for r in records]


# ---- stage 2: features --------------------------------------------------------------------------

class Sequence:
    """One training sequence: ids, which positions are response, and the target's features."""

    def __init__(self, row: dict, features: torch.Tensor, final: torch.Tensor, lse: torch.Tensor | None = None) -> None:
        self.ids = torch.tensor(row["ids"])
        self.response = torch.arange(len(row["ids"])) >= row["prompt_len"]
        self.features, self.final = features, final           # [T, taps*H], [T, H] (float16)
        self.lse = lse          # [T] logsumexp of the target's logits over the whole vocabulary


class Vocab:
    """The output layer's rows a head drafts from (all of them when ids is None): their weight,
    and each token's row (-1 for a token outside)."""

    def __init__(self, lm_head: torch.nn.Module, ids: torch.Tensor | None = None) -> None:
        weight = getattr(lm_head, "weight", None)      # a packed layer (tandem.engine.gemm) may keep none
        if ids is not None and weight is None:
            raise ValueError("a draft vocabulary needs the output layer's weight")
        self.module, self.ids = lm_head, ids
        self.weight = None if weight is None else weight.detach() if ids is None else weight.detach()[ids].contiguous()
        self.index = None
        if ids is not None:
            self.index = torch.full((weight.shape[0],), -1, dtype=torch.long)
            self.index[ids] = torch.arange(len(ids))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.module(hidden) if self.weight is None else hidden @ self.weight.to(hidden.device).T
        return out.float()

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens if self.index is None else self.index.to(tokens.device)[tokens]


def target_features(engine, row: dict, taps: list[int], chunk: int = 512) -> Sequence:
    """The tapped features and final hidden state of every position of row's ids, from one
    teacher-forced pass of the serving engine (the numbers the verify worker will hand the head)."""
    ids = row["ids"]
    cache = engine.new_cache(len(ids) + 1)
    hidden = engine.model.config.hidden_size
    states = state_indices(taps) + (engine.model.config.num_hidden_layers,)
    parts, lse = [], []
    for i in range(0, len(ids), chunk):
        logits, features = engine.forward(ids[i:i + chunk], cache, taps=states)
        parts.append(features)
        lse.append(torch.logsumexp(logits, -1))
    cache.release()
    f = torch.cat(parts).half()
    return Sequence(row, f[:, :-hidden], f[:, -hidden:], torch.cat(lse))


# ---- stage 3: the loss --------------------------------------------------------------------------

def block_outputs(head: BlockHead, embed, lm_head, seq: Sequence, anchors: torch.Tensor, device: str):
    """Teacher-forced outputs for blocks at `anchors`, over the rows of `lm_head` (a Vocab, or the
    output layer for all rows): draft logits [A, W, n] (Markov bias from the true previous
    tokens), the target's log-probabilities of those rows at the same predictions [A, W, n], labels
    [A, W] as rows (-1: a token outside them), valid [A, W] (inside the response, a contiguous
    prefix), confidence logits [A, W]."""
    vocab = lm_head if isinstance(lm_head, Vocab) else Vocab(lm_head)
    c = head.config
    W, T = c.block_size, len(seq.ids)
    ids = seq.ids.to(device)
    ctx = head.context(seq.features.to(device).float())
    kv = head.context_kv(ctx, torch.arange(T, device=device))
    offsets = torch.arange(W, device=device)
    block_ids = torch.full((len(anchors), W), c.mask_token_id, device=device)
    block_ids[:, 0] = ids[anchors]
    positions = (anchors[:, None] + offsets).reshape(-1)
    mask = block_mask(anchors.cpu(), T, W).to(device)
    hidden = head.backbone(embed(block_ids.reshape(-1)).float(), positions, kv, mask)      # [A*W, H]
    label_at = anchors[:, None] + 1 + offsets                                               # [A, W]
    inside = label_at < T
    safe = label_at.clamp(max=T - 1)
    valid = (inside & seq.response.to(device)[safe]).int().cumprod(-1).bool()
    tokens = ids[safe]
    prev = torch.cat([ids[anchors][:, None], tokens[:, :-1]], 1)                           # [A, W]
    logits = vocab.logits(hidden).view(len(anchors), W, -1)
    if head.markov_head is not None:
        w2 = head.markov_head.markov_w2.weight
        logits = logits + head.markov_head.markov_w1(prev) @ (w2 if vocab.ids is None else w2[vocab.ids]).T
    with torch.no_grad():
        target = vocab.logits(seq.final.to(device).float()[safe - 1])                      # [A, W, n]
        if vocab.ids is None:
            target = torch.log_softmax(target, -1)
        else:
            target = target - seq.lse.to(device)[safe - 1][..., None]
    conf = head.confidence_logits(hidden.view(len(anchors), W, -1), prev)
    return logits, target, vocab.rows(tokens), valid, conf


def dspark_loss(logits, target, labels, valid, conf, args) -> tuple[torch.Tensor, dict]:
    W = logits.shape[1]
    weights = valid.float() * torch.exp(-torch.arange(W, device=logits.device).float() / args.gamma)
    total = weights.sum().clamp_min(1e-6)
    # q lives on the rows only, so the L1 distance to the target's p over the whole vocabulary is
    # the rows' part plus p's mass outside them (nothing when the rows are all of it).
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-1).view_as(weights)
    q, p = torch.softmax(logits, -1), target.exp()
    l1 = (q - p).abs().sum(-1) + (1.0 - p.sum(-1)).clamp_min(0)
    accept = (1.0 - 0.5 * l1).clamp(0, 1).detach()
    loss = args.ce_alpha * (ce * weights).sum() / total + args.l1_alpha * (l1 * weights).sum() / total
    parts = {"ce": float((ce * weights).sum().detach() / total), "l1": float((l1 * weights).sum().detach() / total)}
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        loss = loss + args.conf_alpha * (bce * weights).sum() / total
        parts["conf"] = float((bce * weights).sum().detach() / total)
    return loss, parts


def _held_out_blocks(head, embed, lm_head, sequences: list[Sequence], device: str):
    """Every anchor's block of the sequences, teacher-forced, by chunks: (match [A, W], the target's
    greedy choice at each position; prefix [A, W], every position up to it matched; valid [A, W];
    confidence logits [A, W] or None), on the CPU."""
    for seq in sequences:
        cands = torch.nonzero(seq.response[1:]).flatten()
        for chunk in cands.split(128):
            logits, _, labels, valid, conf = block_outputs(head, embed, lm_head, seq, chunk.to(device), device)
            match = (logits.argmax(-1) == labels) & valid
            yield (match.cpu(), match.int().cumprod(-1).bool().cpu(), valid.cpu(),
                   None if conf is None else conf.float().cpu())


@torch.no_grad()
def evaluate(head, embed, lm_head, sequences: list[Sequence], device: str, bins: int = 10) -> dict:
    """Greedy acceptance on held-out sequences, every anchor: a block position is accepted when it
    and every position before it equal the sequence's token, the target's own greedy choice (the
    responses are its greedy output through the serving engine). Returns mean accepted length
    (tokens per round, the bonus token included), acceptance by position, and calibration of the
    predicted chance of reaching each position (cumulative product of the acceptance the head
    gives a greedy request, BlockHead.acceptance) against the share that reached it."""
    head.eval()
    W = head.config.block_size
    reach_counts = torch.zeros(W)
    pos_total = torch.zeros(W)
    cal_pred = torch.zeros(W, bins)
    cal_obs = torch.zeros(W, bins)
    cal_n = torch.zeros(W, bins)
    accepted_sum, blocks = 0.0, 0
    for _, prefix, valid, conf in _held_out_blocks(head, embed, lm_head, sequences, device):
        prefix = prefix.float()
        accepted_sum += float(prefix.sum())
        blocks += len(prefix)
        reach_counts += prefix.sum(0)
        pos_total += valid.float().sum(0)
        if conf is not None:
            pred = head.acceptance(conf, torch.arange(W), greedy=True).cumprod(-1)
            b = (pred * bins).long().clamp(0, bins - 1)
            for j in range(W):
                v = valid[:, j]
                cal_n[j].index_add_(0, b[v, j], torch.ones(int(v.sum())))
                cal_pred[j].index_add_(0, b[v, j], pred[v, j])
                cal_obs[j].index_add_(0, b[v, j], prefix[v, j])
    head.train()
    calibration = []
    for j in range(W):
        n = cal_n[j].sum()
        if n == 0:
            continue
        ece = float(((cal_pred[j] - cal_obs[j]).abs()).sum() / n)
        calibration.append({"position": j, "predicted": float(cal_pred[j].sum() / n),
                            "observed": float(cal_obs[j].sum() / n), "ece": ece})
    return {"mean_accepted_length": 1.0 + accepted_sum / max(blocks, 1),
            "reach_by_position": (reach_counts / pos_total.clamp_min(1)).tolist(),
            "calibration": calibration, "blocks": blocks}


@torch.no_grad()
def fit_greedy_calibration(head, embed, lm_head, sequences: list[Sequence], device: str,
                           least: int = 200) -> torch.Tensor | None:
    """Per block position j, the scale and offset of the confidence logit that best predict
    (logistic regression) whether a greedy request accepts j, over the held-out blocks that reached
    j: the greedy reading of the head's confidence (BlockHead.acceptance). A position with fewer
    than `least` such blocks takes the previous position's fit. None without a confidence head."""
    W = head.config.block_size
    logits: list[list[torch.Tensor]] = [[] for _ in range(W)]
    labels: list[list[torch.Tensor]] = [[] for _ in range(W)]
    for match, prefix, valid, conf in _held_out_blocks(head, embed, lm_head, sequences, device):
        if conf is None:
            return None
        reached = torch.cat([valid[:, :1], prefix[:, :-1] & valid[:, 1:]], 1)
        for j in range(W):
            logits[j].append(conf[reached[:, j], j])
            labels[j].append(match[reached[:, j], j].float())
    fit = torch.tensor([[1.0, 0.0]] * W)
    for j in range(W):
        x, y = torch.cat(logits[j]), torch.cat(labels[j])
        if len(x) < least:
            fit[j] = fit[j - 1] if j else fit[j]
            continue
        params = torch.tensor([1.0, 0.0], requires_grad=True)
        optimizer = torch.optim.LBFGS([params], max_iter=100)

        def loss():
            optimizer.zero_grad()
            out = F.binary_cross_entropy_with_logits(x * params[0] + params[1], y)
            out.backward()
            return out
        with torch.enable_grad():
            optimizer.step(loss)
        fit[j] = params.detach()
    return fit


def portable(argv: list[str]) -> list[str]:
    """The command line as recorded in the head file: the run folder and the starting head by
    their names only (the starting head's sha256 is recorded beside it)."""
    out = list(argv)
    for i, arg in enumerate(out):
        for flag in ("--out", "--init"):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = Path(out[i + 1]).name
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}={Path(arg[len(flag) + 1:]).name}"
    return out


def lr_at(step: int, args) -> float:
    warm = max(1, int(args.warmup * args.steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    progress = (step - warm) / max(1, args.steps - warm)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from tandem.presets import resolve_model
    path = resolve_model(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    from tandem.engine.modeling import CausalLM
    # The serving engine answers the prompts and gives the features; a plain copy of the target
    # gives the frozen embedding and output layer the loss differentiates through.
    engine = CausalLM(args.target, device=args.device, kv_tokens=args.gen_batch * (args.max_new_tokens + 512))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    model.requires_grad_(False)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    args.out.mkdir(parents=True, exist_ok=True)

    state_file = args.out / "state.pt"
    state = torch.load(state_file, weights_only=False) if args.resume and state_file.exists() else None
    start = checkpoint.load(args.init)[0] if args.init and state is None else None
    if state is not None:
        config = HeadConfig.from_dict(state["config"])
    elif start is not None:
        config = start.config
    else:
        taps = [int(t) for t in args.taps.split(",")] if args.taps else None
        mask = args.mask_token_id if args.mask_token_id >= 0 else default_mask_token(tokenizer, model.config.vocab_size)
        config = HeadConfig.for_target(model.config, layers=args.layers, block_size=args.block_size,
                                       markov_rank=args.markov_rank, taps=taps, mask_token_id=mask)
    head = BlockHead(config).to(args.device)
    optimizer = torch.optim.AdamW([p for p in head.parameters()], lr=args.lr, weight_decay=0.0)
    step = 0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        torch.set_rng_state(state["rng"])
        random.setstate(state["py_rng"])
    elif start is not None:
        head.load_state_dict(start.state_dict())

    from tandem.head import prompts
    train_prompts = prompts.load("train")
    if args.max_prompts:
        train_prompts = train_prompts[:args.max_prompts]
    heldout = prompts.load("heldout")
    heldout_prompts = prompts.stratified(heldout, args.eval_sequences)
    calibration_prompts = prompts.stratified(heldout, args.calibration_sequences, skip=args.eval_sequences)
    data = args.out / "data.jsonl"
    rows = generate_responses(engine, tokenizer, train_prompts + heldout_prompts + calibration_prompts, data,
                              args.max_new_tokens, args.gen_batch)
    train_rows, held_rows = rows[:len(train_prompts)], rows[len(train_prompts):len(train_prompts) + len(heldout_prompts)]
    calibration_rows = rows[len(train_prompts) + len(heldout_prompts):]
    more = (sampled_records(train_prompts, args.sampled_temperature)
            + followup_records(train_prompts, train_rows, tokenizer, args.followups))
    train_rows += generate_responses(engine, tokenizer, more, data, args.max_new_tokens, args.gen_batch)
    train_rows = [r for r in train_rows if len(r["ids"]) - r["prompt_len"] >= 2]
    if state is not None and state.get("draft_vocab") is not None:
        head.draft_vocab = state["draft_vocab"]
    elif start is not None:
        head.draft_vocab = start.draft_vocab
    elif args.draft_vocab == "responses":
        seen = {t for r in train_rows for t in r["ids"][r["prompt_len"]:]} | set(engine.eos_ids)
        head.draft_vocab = torch.tensor(sorted(seen))
    rows_out = Vocab(lm_head, head.draft_vocab)
    held = [target_features(engine, r, config.target_layer_ids)
            for r in tqdm(held_rows, desc="held-out features", file=sys.stderr)]
    cache: dict[int, Sequence] = {}

    def sequence(i: int) -> Sequence:
        if i not in cache:
            cache[i] = target_features(engine, train_rows[i], config.target_layer_ids)
        return cache[i]

    log_file = open(args.out / "log.jsonl", "a")

    def checkpoint_now(evaluated: dict | None) -> None:
        if evaluated is not None:
            log_file.write(json.dumps({"step": step, "eval": evaluated}) + "\n")
            log_file.flush()
        torch.save({"config": config.to_dict(), "head": head.state_dict(), "draft_vocab": head.draft_vocab,
                    "optimizer": optimizer.state_dict(),
                    "step": step, "rng": torch.get_rng_state(), "py_rng": random.getstate()}, state_file)

    if start is not None and step == 0:      # where the run starts from, on the same held-out set
        evaluated = evaluate(head, embed, rows_out, held, args.device)
        tqdm.write(f"start: held-out mean accepted length {evaluated['mean_accepted_length']:.3f}", file=sys.stderr)
        log_file.write(json.dumps({"step": 0, "eval": evaluated}) + "\n")
    started = time.monotonic()
    order: list[int] = []
    head.train()
    bar = tqdm(total=args.steps, initial=step, desc="training", file=sys.stderr)
    while step < args.steps:
        if args.minutes and time.monotonic() - started > 60 * args.minutes:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        optimizer.zero_grad()
        parts_sum: dict[str, float] = {}
        for _ in range(args.batch):
            if not order:
                order = list(range(len(train_rows)))
                random.shuffle(order)
            seq = sequence(order.pop())
            cands = torch.nonzero(seq.response[1:]).flatten()
            pick = cands[torch.randperm(len(cands))[:args.anchors]].sort().values.to(args.device)
            loss, parts = dspark_loss(*block_outputs(head, embed, rows_out, seq, pick, args.device), args)
            (loss / args.batch).backward()
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v / args.batch
        torch.nn.utils.clip_grad_norm_(head.parameters(), args.clip)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in parts_sum.items()})
        log_file.write(json.dumps({"step": step, "lr": lr_at(step - 1, args), **parts_sum,
                                   "seconds": round(time.monotonic() - started, 1)}) + "\n")
        if step % args.eval_every == 0:
            evaluated = evaluate(head, embed, rows_out, held, args.device)
            tqdm.write(f"step {step}: held-out mean accepted length {evaluated['mean_accepted_length']:.3f}",
                       file=sys.stderr)
            checkpoint_now(evaluated)
    bar.close()
    evaluated = evaluate(head, embed, rows_out, held, args.device)
    checkpoint_now(evaluated)
    if calibration_rows:
        fitted = [target_features(engine, r, config.target_layer_ids)
                  for r in tqdm(calibration_rows, desc="calibration features", file=sys.stderr)]
        head.greedy_calibration = fit_greedy_calibration(head, embed, rows_out, fitted, args.device)
        evaluated = evaluate(head, embed, rows_out, held, args.device)
        log_file.write(json.dumps({"step": step, "greedy_calibration": head.greedy_calibration.tolist(),
                                   "eval": evaluated}) + "\n")
    trained = {"command": "python -m tandem.head.train " + " ".join(portable(argv if argv is not None else sys.argv[1:])),
               "steps": step, "train_sequences": len(train_rows),
               "train_tokens": sum(len(r["ids"]) - r["prompt_len"] for r in train_rows),
               "sampled_sequences": sum(1 for r in train_rows if "@t" in r["id"]),
               "second_turns": sum(1 for r in train_rows if r["id"].endswith("+followup")),
               **({"init_sha256": checkpoint.sha256(args.init)} if args.init else {}),
               "heldout_mean_accepted_length": evaluated["mean_accepted_length"]}
    digest = checkpoint.save(head.cpu(), args.out / "head.safetensors", target=args.target, trained=trained)
    print(json.dumps({"head": str(args.out / "head.safetensors"), "sha256": digest, **trained,
                      "eval": evaluated}, indent=1))


if __name__ == "__main__":
    main()
