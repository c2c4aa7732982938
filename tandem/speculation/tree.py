"""Token trees: a proposal whose tokens each name their parent, so that one verify pass checks
alternatives where a chain would check one candidate per position.

A tree of k proposed tokens is `parents`: parents[j] is the index of token j's parent among the
proposed tokens, or -1 when token j follows the last committed token (the root). Parents come
first (parents[j] < j), so every prefix of a tree is a tree, and siblings carry distinct tokens.
A chain is the tree [-1, 0, 1, ..., k - 2].

Fed to the target, the root and the k tokens take k + 1 positions of the session's KV run in
proposal order; each attends the committed positions and its own ancestors, at the position its
depth gives it. The verdict walks from the root: while the target's token after a node is one of
its children, that child is accepted; the first token that is none is the target's own. Greedy,
this is exactly the target alone's output (every accepted token is the target's argmax after
its ancestors, which are the committed output), so a tree is lossless by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.speculation.survival import position_ms


@dataclass(frozen=True)
class TreeBudget:
    """How large a tree a drafter may propose: `nodes` tokens in all, at most `branches` lines off
    its main one, and only nodes the drafter itself thinks likelier than `at_least` to be on the
    target's path (what a position in the pass costs, in tokens; see for_round)."""
    nodes: int
    branches: int = 2
    at_least: float = 0.05

    AT_LEAST = 0.05      # the floor where a position costs less

    @classmethod
    def for_round(cls, k: int, max_proposal: int, context_left: int, branches: int, price: float,
                  forward_ms: Sequence[float] = (), tokens_per_second: float = 0.0) -> TreeBudget:
        """A round's budget: as many nodes as a pass may verify (the request's k, 0 for the verify
        worker's most) and the context window holds. A node must be likelier to be taken than its
        position costs: under load, the verify worker's price (the other sessions' tokens it
        delays); alone, the seconds a position adds to the pass (the slope of forward_ms, the
        verify worker's pass time by length) times the tokens per second the session gets (the
        tokens that time would have given). Where a pass costs the same for any length (a GPU),
        trees widen; where each position costs (a CPU), only likely nodes go."""
        return cls(min(k or max_proposal, max_proposal, context_left - 1), branches,
                   cls.floor(price, forward_ms, tokens_per_second))

    @classmethod
    def floor(cls, price: float, forward_ms: Sequence[float] = (), tokens_per_second: float = 0.0) -> float:
        """How likely a node must be to be taken to pay for its position (see for_round)."""
        return max(cls.AT_LEAST, price, position_ms(forward_ms) / 1000 * tokens_per_second)


def chain(k: int) -> list[int]:
    """The parents of a chain of k tokens."""
    return list(range(-1, k - 1))


def problem(tokens: Sequence[int], parents: Sequence[int]) -> str | None:
    """Why `parents` is not a tree over `tokens` (None when it is)."""
    if len(parents) != len(tokens):
        return f"a tree proposal needs one parent per token: {len(parents)} parents for {len(tokens)} tokens"
    children: dict[tuple[int, int], int] = {}
    for j, (token, parent) in enumerate(zip(tokens, parents)):
        if not -1 <= parent < j:
            return f"token {j}'s parent is {parent}; it must be -1 (the last committed token) or an earlier index"
        twin = children.setdefault((parent, token), j)
        if twin != j:
            return f"tokens {twin} and {j} are siblings with the same id {token}"
    return None


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's depth: 1 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def fed(parents: Sequence[int]) -> list[int]:
    """The tree over the fed positions (the root first, then the proposed tokens): index i + 1 is
    proposed token i, whose parent moves up one; the root has none (-1)."""
    return [-1, *(p + 1 for p in parents)]


def ancestors_mask(fed_parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: position a may attend position b (b is a itself or one of its ancestors)."""
    n = len(fed_parents)
    mask = torch.eye(n, dtype=torch.bool)
    for a, p in enumerate(fed_parents):
        if p >= 0:
            mask[a] |= mask[p]
    return mask


def paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path, as proposed indices (the empty path when there are no tokens)."""
    has_child = {p for p in parents}
    leaves = [j for j in range(len(parents)) if j not in has_child]
    out = []
    for leaf in leaves:
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out or [[]]


def rows_by_path(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int],
                 process_path: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """The fed rows [n, V] of a tree (row 0: after the root; row j + 1: after token j, n <= k + 1)
    processed as chains: each root-to-leaf path's rows go through process_path(rows, path tokens),
    as a chain's would, so that a node's row sees the history of its own ancestors only (penalties,
    min_new_tokens by depth, the guide's state). A node on several paths comes out the same on each."""
    n = logits.shape[0]
    every = paths(list(parents)[:n - 1])
    if len(every) == 1 and every[0] == list(range(n - 1)):         # a chain: its rows in order
        return process_path(logits, [tokens[j] for j in every[0]])
    out = logits.float().clone()
    for path in every:
        rows = [0, *(j + 1 for j in path)]
        out[rows] = process_path(logits[rows], [tokens[j] for j in path]).float()
    return out


def walk(tokens: Sequence[int], parents: Sequence[int], choice: Sequence[int]) -> tuple[list[int], int]:
    """The greedy verdict on a tree: choice[i] is the target's token at fed row i (row 0 after the
    root, row j + 1 after token j). Returns the accepted path (proposed indices) and the target's
    token after it."""
    children: dict[tuple[int, int], int] = {(p, t): j for j, (t, p) in enumerate(zip(tokens, parents))}
    path, node = [], -1
    while True:
        token = int(choice[node + 1])
        child = children.get((node, token))
        if child is None or child + 1 >= len(choice):      # a node beyond the rows was not fed
            return path, token
        path.append(child)
        node = child
