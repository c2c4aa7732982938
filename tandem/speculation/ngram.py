"""Prompt lookup (n-gram drafting): the rule both the draft pool's n-gram drafter and the verify
worker's head use. The context's last n tokens (n = max_ngram down to min_ngram) are looked up at
their latest earlier occurrence, and what followed it is proposed."""

from __future__ import annotations


def lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier occurrence of the longest matching suffix,
    the suffix's length n); ([], 0) when nothing matches."""
    if k <= 0:
        return [], 0
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = context[n_ctx - n:]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + k]
                if follow:
                    return follow, n
    return [], 0


def lookup_tree(context: list[int], k: int, nodes: int, branches: int, at_least: float = 0.0,
                max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], list[int] | None, int]:
    """As lookup, and where other earlier occurrences of the same suffix were followed otherwise,
    their continuations merged in as up to `branches` branches (latest occurrence first; a token
    tree, tandem/speculation/tree.py), `nodes` tokens in all, each at most k deep. A branch is
    taken where the share of the occurrences seen that follow it beats `at_least`.
    Returns (tokens, parents or None for a chain, the suffix's length n)."""
    line, n = lookup(context, min(k, nodes), max_ngram, min_ngram)
    if not line or branches <= 0:
        return line, None, n
    tail, n_ctx = context[len(context) - n:], len(context)
    follows = [context[s + n:s + n + k] for s in range(n_ctx - n - 1, -1, -1) if context[s:s + n] == tail]
    follows = [f for f in follows if f]
    tokens, parents = list(line), list(range(-1, len(line) - 1))
    children = {(p, t): j for j, (t, p) in enumerate(zip(tokens, parents))}
    added = 0
    for follow in follows[1:]:
        node, depth = -1, 0
        while depth < len(follow) and (node, follow[depth]) in children:
            node, depth = children[(node, follow[depth])], depth + 1
        if depth == len(follow):
            continue
        share = sum(f[:depth + 1] == follow[:depth + 1] for f in follows) / sum(f[:depth] == follow[:depth] for f in follows)
        if share <= at_least:
            continue
        for t in follow[depth:depth + nodes - len(tokens)]:
            children[(node, t)] = len(tokens)
            tokens.append(t)
            parents.append(node)
            node = len(tokens) - 1
        added += 1
        if added >= branches or len(tokens) >= nodes:
            break
    return tokens, parents if added else None, n
