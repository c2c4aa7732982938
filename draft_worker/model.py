"""The draft model drafter: a causal LM sharing the target's vocabulary, behind the Drafter
protocol (draft_worker/drafters.py). A session's state keeps a KV cache of the draft model and
rolls it back to the longest prefix it shares with each new context; with a tree budget, a
proposal also drafts branches at the draft's second choices in the same forward passes, each on a
cache of its own (a line), and the next proposal takes as its own whichever line the verdict
followed furthest.

Longer than 300 lines because the drafter, a session's lines and a proposal's rows keep one rule
for what each cache holds, and are read together.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

import torch

from draft_worker.drafters import Draft, DraftState
from tandem.engine import vocab
from tandem.engine.batcher import Step
from tandem.engine.kvpool import KVPoolFull, SessionCache, common_prefix, copy_longest_prefix, kv_need, proposal_room
from tandem.engine.lru import KeptCaches
from tandem.engine.modeling import CausalLM
from tandem.service import metrics
from tandem.speculation import tree
from tandem.speculation.drafting import Drawn, RowDrafter, second_choices
from tandem.speculation.grammar import Matcher
from tandem.speculation.ngram import lookup
from tandem.speculation.sampling import SamplingParams, make_generator
from tandem.speculation.tree import TreeBudget


class ModelDrafter:
    """A causal LM sharing the target's vocabulary. `confidence`: stop a proposal after a token the
    draft itself gives less probability than this, since the tokens after it are likely wasted.

    Like the verify worker, a new session copies the KV of the longest prompt prefix (`MIN_SHARED`
    tokens or more) that a live session or a recently finished one holds instead of computing it;
    finished sessions' caches are kept for that, least recently used first out, up to `keep_share`
    of the KV pool."""

    name = "model"
    uses_model = True
    MIN_SHARED = 16
    LOOKUP_NGRAM = 2
    LOOKUP_WINDOW = 4096   # a lookup searches the line's last tokens only, so a step's search stays far
                           # shorter than the step (docs/benchmarks.md, the code's rules)

    def __init__(self, model: CausalLM, confidence: float = 0.0, keep_share: float = 0.25,
                 lookup_tokens: int = 0) -> None:
        self.model = model
        self.confidence, self.lookup_tokens = confidence, lookup_tokens
        self.keep_tokens = int(keep_share * model.pool.slots)
        self._live: weakref.WeakSet[_ModelDraftState] = weakref.WeakSet()
        self._kept: KeptCaches[tuple[list[int], SessionCache]] = KeptCaches(lambda kept: kept[1])
        self._lock = threading.Lock()           # start() runs on the event loop, the rest on the inference thread

    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int,
              room: int = proposal_room(), grammar: Matcher | None = None) -> DraftState:
        """room: beyond the prompt and output, what the verify worker's largest proposal takes."""
        while True:
            try:
                state = _ModelDraftState(self, params, eos_ids, prompt_len, room, grammar)
                break
            except KVPoolFull:
                if not self._drop_kept():
                    raise
        self._live.add(state)
        return state

    def keep(self, cached: list[int], cache: SessionCache) -> None:
        """A finished session's cache, kept to lend its prefix to later sessions."""
        if len(cached) < self.MIN_SHARED or self.keep_tokens <= 0:
            cache.release()
            return
        with self._lock:
            self._kept.put(id(cache), (cached, cache))
            self._kept.trim(self.keep_tokens)

    def share(self, state: _ModelDraftState, context: list[int]) -> None:
        """Fills an empty cache with the longest prefix of context (all but its last token) that
        another live or kept cache holds. On the inference thread, between passes."""
        want = context[:len(context) - 1]
        with self._lock:
            donors = [(s.cached, s.cache) for s in list(self._live)] + self._kept.values()
            if copy_longest_prefix(state.cache, want, donors, self.MIN_SHARED):
                state.cached = want[:state.cache.length]

    def _drop_kept(self) -> bool:
        with self._lock:
            return self._kept.evict_oldest()


class _ModelDraftState:
    inline = False

    def __init__(self, drafter: ModelDrafter, params: SamplingParams, eos_ids: list[int], prompt_len: int,
                 room: int, grammar: Matcher | None = None):
        self.drafter, self.model = drafter, drafter.model
        self.grammar = grammar
        self.params, self.eos_ids, self.prompt_len = params, eos_ids, prompt_len
        self.confidence = drafter.confidence
        # what the target reserves too; it grows if a turn needs more (a pipelined proposal)
        self.cache = self.model.new_cache(kv_need(prompt_len, params.max_new_tokens, room, self.model.max_context))
        self.cached: list[int] = []              # token ids whose KV is in self.cache
        self.lines: list[_Line] = []             # the caches of earlier proposals' branches
        self.generator = make_generator(params.seed, stream=1)

    def propose(self, context: list[int], k: int, budget: TreeBudget | None = None, steps: int = 0) -> Draft:
        """k tokens (fewer after an end-of-sequence or an unconfident one, or when `steps` forward
        passes are done), one forward pass each unless a lookup's tokens are agreed with; with a
        budget, a tree: branches drafted in the same passes (see _Proposal)."""
        if not self.cached and k > 0:
            self.drafter.share(self, context)
        proposal = self._begin(context, k, budget, steps)
        while rows := proposal.rows():
            for row, logits in zip(rows, self.model.forward_batch([(r.line.cache, *r.input()) for r in rows])):
                row.take(logits)
        return proposal.draft()

    async def propose_batched(self, batcher, context: list[int], k: int, budget: TreeBudget | None = None,
                              steps: int = 0) -> Draft:
        """As propose, each step going through `batcher` so that it shares a forward pass with the
        other sessions' steps."""
        if not self.cached and k > 0:
            await batcher.between_passes(self.drafter.share, self, context)
        proposal = self._begin(context, k, budget, steps)
        while rows := proposal.rows():
            await asyncio.gather(*(batcher.forward(Step(r.line.cache, *r.input(), r.take, returns=True)) for r in rows))
        for line in [self, *self.lines]:
            batcher.leave(line.cache)              # nothing more until the verdict comes back
        return proposal.draft()

    def _begin(self, context: list[int], k: int, budget: TreeBudget | None, steps: int = 0) -> _Proposal:
        """Takes as its own the line (this state's, or a branch's of an earlier proposal) that
        shares the longest prefix with context, and rolls it back to that prefix."""
        if k <= 0:
            return _Proposal(self, context, 0, [], None, steps)
        best = max(self.lines, key=lambda line: common_prefix(line.cached, context), default=None)
        if best is not None and common_prefix(best.cached, context) > common_prefix(self.cached, context):
            self.cache, self.cached, best.cache, best.cached = best.cache, best.cached, self.cache, self.cached
        feed = self._fit(self, context)
        vocab.see(self.model.model, feed)         # a trimmed output layer scores them from now on
        return _Proposal(self, context, k, feed, budget if self.params.greedy and self.grammar is None else None, steps)

    @staticmethod
    def _fit(line, context: list[int]) -> list[int]:
        """Rolls a line back to the longest prefix it shares with context; returns the rest to feed
        (at least one token, to get logits)."""
        keep = min(common_prefix(line.cached, context), len(context) - 1)
        line.cache.crop(keep)
        line.cached = line.cached[:keep]
        return context[keep:]

    def branch_line(self, context: list[int]) -> tuple[_Line, list[int]] | None:
        """A line to draft a branch after `context` on, and what it must be fed: an earlier
        branch's cache, or a new one; either takes this state's prefix where it shares more.
        None when the pool has no room. On the inference thread, between passes."""
        line = next((line for line in self.lines if line.free), None)
        if line is None:
            try:
                line = _Line(self.model.new_cache(self.cache.capacity))
            except KVPoolFull:
                return None
            self.lines.append(line)
        line.free = False
        shared = min(common_prefix(self.cached, context), self.cache.length, len(context) - 1)
        if shared > common_prefix(line.cached, context) + self.drafter.MIN_SHARED:
            line.cache.copy_prefix(self.cache, shared)
            line.cached = context[:shared]
        return line, self._fit(line, context)

    def kv_bytes(self) -> int:
        return self.cache.nbytes() + sum(line.cache.nbytes() for line in self.lines)

    def close(self) -> None:
        self.drafter._live.discard(self)
        cached, self.cached = self.cached, []
        self.drafter.keep(cached, self.cache)
        for line in self.lines:
            line.cache.release()
        self.lines = []


class _Line:
    """A KV cache of the draft model and the token ids whose KV it holds."""

    def __init__(self, cache: SessionCache) -> None:
        self.cache, self.cached, self.free = cache, [], True


class _Row:
    """One line of a proposal being drafted: `take` turns each step's logits into tokens (through
    the request's pipeline and guide, tandem.speculation.drafting) and sets what to feed next
    (nothing when the line is complete). Runs on the inference thread."""

    def __init__(self, proposal: _Proposal, line, context: list[int], feed: list[int], most: int,
                 reach: float = 1.0) -> None:
        st = proposal.state
        self.proposal, self.line, self.feed, self.most, self.reach = proposal, line, feed, most, reach
        self.rows = RowDrafter(context, st.prompt_len, st.params, st.eos_ids, st.grammar, st.generator, want_prob=True)
        self.drawn: list[Drawn] = []
        self.seed: list[int] = []
        self.steps = 0

    def input(self) -> tuple[list[int], int]:
        """The next step's tokens and the logits rows it keeps: the feed, then the seed (what a
        prompt lookup says this line drafts next; the main line of a chain only), a row each."""
        st, self.seed = self.proposal.state, []
        room = min(st.drafter.lookup_tokens, self.most - len(self.rows.tokens) - 1,
                   st.model.max_context - self.line.cache.length - len(self.feed))
        if room > 0 and self is self.proposal.main and self.proposal.budget is None:
            recent = [*self.proposal.context[-st.drafter.LOOKUP_WINDOW:], *self.rows.tokens]
            self.seed = lookup(recent, room, min_ngram=st.drafter.LOOKUP_NGRAM)[0]
        return self.feed + self.seed, 1 + len(self.seed)

    def take(self, logits: torch.Tensor) -> None:
        """Row i of logits follows the feed and the seed's first i tokens: it is drawn from while
        every draw before it equalled the seed; the seed's tokens after the last row drawn from
        leave the cache."""
        st = self.proposal.state
        seed, self.seed = self.seed, []
        self.line.cached.extend(self.feed)
        before = len(self.line.cached)
        for i, row in enumerate(logits.reshape(-1, logits.shape[-1])):
            if i:
                self.line.cached.append(seed[i - 1])
            drawn = self.rows.take(row)
            if drawn is not None:
                self.drawn.append(drawn)
            self.feed = [] if (drawn is None or len(self.rows.tokens) >= self.most or drawn.token in st.eos_ids
                               or drawn.prob < st.confidence) else [drawn.token]
            if drawn is not None:
                self.proposal.grown(self, drawn)
            if not self.feed or i >= len(seed) or drawn.token != seed[i]:
                break
        if seed:
            agreed = len(self.line.cached) - before
            metrics.LOOKUP.labels("agreed").inc(agreed)
            metrics.LOOKUP.labels("void").inc(len(seed) - agreed)
            self.line.cache.crop(len(self.line.cached))
        self.steps += 1
        if self.steps == self.proposal.steps:
            self.feed = []


class _Proposal:
    """One proposal being drafted: the main line, a token a step, and with a budget (greedy, no
    guide) its branches, drafted in the same passes, a row each: after each token the main line
    draws, a branch opens with the draft's second choice there when the draft's own estimate that
    the target takes it (the chance of reaching the position times the second choice's
    probability) beats the budget's floor, while branches and nodes are left; a branch grows like
    the main line, while its estimate still beats the floor, never deeper than k."""

    def __init__(self, state: _ModelDraftState, context: list[int], k: int, feed: list[int],
                 budget: TreeBudget | None, steps: int = 0) -> None:
        self.state, self.context, self.k, self.budget, self.steps = state, context, k, budget, steps
        self.main = _Row(self, state, context, feed, k)
        self.branches: list[tuple[int, _Row]] = []       # (where it forks off the main line, its row)
        for line in state.lines:
            line.free = True

    def rows(self) -> list[_Row]:
        return [r for r in (self.main, *(b for _, b in self.branches)) if r.feed]

    def nodes(self) -> int:
        return len(self.main.drawn) + sum(len(b.drawn) for _, b in self.branches)

    def grown(self, row: _Row, drawn: Drawn) -> None:
        budget = self.budget
        if budget is None:
            return
        if row is not self.main:              # a token the floor or the budget has no room for is dropped
            row.reach *= drawn.prob
            if row.reach < budget.at_least or self.nodes() > budget.nodes:
                row.drawn.pop()
                row.feed = []
            elif self.nodes() == budget.nodes:
                row.feed = []
            return
        at = len(self.main.drawn) - 1
        if (drawn.alt < 0 or len(self.branches) >= budget.branches or self.nodes() >= budget.nodes
                or self.main.reach * drawn.alt_prob < budget.at_least):
            self.main.reach *= drawn.prob
            return
        fork = [*self.context, *self.main.rows.tokens[:at], drawn.alt]
        got = self.state.branch_line(fork)
        if got is not None:
            line, feed = got
            branch = _Row(self, line, fork, feed, self.k - at - 1, self.main.reach * drawn.alt_prob)
            branch.drawn.append(Drawn(drawn.alt, drawn.alt_prob))
            if branch.most <= 0 or branch.reach * self.state.confidence < budget.at_least:
                branch.feed = []               # the second choice alone, nothing drafted after it
            self.branches.append((at, branch))
        self.main.reach *= drawn.prob

    def draft(self) -> Draft:
        """The main line, then each branch, then the second choices at the main line's other
        positions as leaves, where the draft's estimate that the target takes them beats the floor
        (a leaf costs the pass one position and the draft nothing: on a hit, the target's token
        after it comes too); cut to the budget's nodes, the leaves and the last branches first."""
        main, budget = self.main, self.budget
        for row in (main, *(b for _, b in self.branches)):
            row.rows.finish()
        drawn, parents = list(main.drawn), tree.chain(len(main.drawn))
        for at, b in self.branches:
            parents += [at - 1, *range(len(drawn), len(drawn) + len(b.drawn) - 1)]
            drawn += b.drawn
        if budget is not None:
            taken = {at for at, _ in self.branches}
            leaves = [(v, at) for v, at in second_choices(main.drawn) if at not in taken and v >= budget.at_least]
            for _, at in sorted(leaves, key=lambda leaf: -leaf[0])[:max(0, budget.nodes - len(drawn))]:
                drawn.append(Drawn(main.drawn[at].alt, main.drawn[at].alt_prob))
                parents.append(at - 1)
        if len(drawn) == len(main.drawn):
            return Draft(main.rows.tokens, main.rows.support, drawn=main.drawn if self.state.params.greedy else None)
        n = budget.nodes
        return Draft([d.token for d in drawn[:n]], None, drawn=drawn[:n], parents=parents[:n])
