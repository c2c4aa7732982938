"""The verification function alone: hand-computed cases, then the distribution it produces."""

import pytest
import torch

from tandem.speculation import tree
from tandem.speculation.tree import walk
from tandem.speculation.verification import verify_sampled

pytestmark = pytest.mark.unit


def chain(k):
    return tree.chain(k)


def test_greedy_chain_all_accepted_takes_bonus():
    assert walk([1, 2, 3], chain(3), [1, 2, 3, 4]) == ([0, 1, 2], 4)


def test_greedy_chain_first_mismatch_gives_corrected_token():
    assert walk([1, 2, 3], chain(3), [1, 0, 3, 4]) == ([0], 0)


def test_greedy_no_proposal_is_plain_decoding():
    assert walk([], [], [2]) == ([], 2)


# A tree: root -> 1 (node 0) -> 2 (node 1) -> 3 (node 2); root -> 7 (node 3) -> 8 (node 4); node 0 -> 5 (node 5)
TOKENS, PARENTS = [1, 2, 3, 7, 8, 5], [-1, 0, 1, -1, 3, 0]


def test_greedy_tree_follows_the_sibling_the_target_chose():
    # rows: after root, after each node 0..5
    assert walk(TOKENS, PARENTS, [7, 0, 0, 0, 8, 9, 0]) == ([3, 4], 9)
    assert walk(TOKENS, PARENTS, [1, 5, 0, 0, 0, 0, 6]) == ([0, 5], 6)
    assert walk(TOKENS, PARENTS, [1, 2, 3, 4, 0, 0, 0]) == ([0, 1, 2], 4)
    assert walk(TOKENS, PARENTS, [4, 2, 3, 4, 0, 0, 0]) == ([], 4)


def test_greedy_tree_cut_by_the_batcher_ignores_nodes_not_fed():
    # only the root and nodes 0..3 were fed: node 4 (token 8 after node 3) has no row
    assert walk(TOKENS, PARENTS, [7, 0, 0, 0, 8]) == ([3], 8)


def test_tree_shape_rules():
    assert tree.problem(TOKENS, PARENTS) is None
    assert "same id" in tree.problem([1, 1], [-1, -1])
    assert "earlier index" in tree.problem([1, 2], [-1, 1])
    assert "one parent per token" in tree.problem([1, 2], [-1])
    assert tree.depths(PARENTS) == [1, 2, 3, 1, 2, 2]
    assert sorted(tree.paths(PARENTS)) == [[0, 1, 2], [0, 5], [3, 4]]
    mask = tree.ancestors_mask(tree.fed(PARENTS))
    assert mask[5].tolist() == [True, False, False, False, True, True, False]     # node 4: root, node 3, itself
    assert mask[6].tolist() == [True, True, False, False, False, False, True]     # node 5: root, node 0, itself


def test_tree_rows_are_processed_along_their_own_path():
    """A node's row sees its ancestors' tokens only: a 'penalty' that marks each token of the path
    shows which history each row got."""
    logits = torch.zeros(len(TOKENS) + 1, 10)

    def mark(rows, path):
        out = rows.clone()
        for i in range(rows.shape[0]):
            out[i, path[:i]] = -1.0
        return out
    out = tree.rows_by_path(logits, TOKENS, PARENTS, mark)
    seen = [set((out[r] < 0).nonzero().flatten().tolist()) for r in range(len(TOKENS) + 1)]
    assert seen == [set(), {1}, {1, 2}, {1, 2, 3}, {7}, {7, 8}, {1, 5}]


def test_sampled_acceptance_threshold_is_p_over_q():
    # p(x=1) = 0.3, q(x=1) = 0.6: accept iff u < 0.5
    p = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.4, 0.6, 0.0]])
    g = torch.Generator().manual_seed(0)
    accept = verify_sampled(torch.tensor([1]), q, p, torch.tensor([0.49]), g)
    assert (accept.accepted, accept.next_token) == (1, 2)      # bonus from p[1], a point mass on 2
    reject = verify_sampled(torch.tensor([1]), q, p, torch.tensor([0.51]), g)
    # residual max(0, p - q) = [0.3, 0, 0]: the corrected token must be 0
    assert (reject.accepted, reject.next_token) == (0, 0)


def test_sampled_always_accepts_when_p_exceeds_q():
    p = torch.tensor([[0.1, 0.9], [0.5, 0.5]])
    q = torch.tensor([[0.5, 0.5]])
    out = verify_sampled(torch.tensor([1]), q, p, torch.tensor([0.999]), torch.Generator().manual_seed(0))
    assert out.accepted == 1


def test_sampled_never_accepts_a_token_the_target_forbids():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0]])
    out = verify_sampled(torch.tensor([1]), q, p, torch.tensor([0.0]), torch.Generator().manual_seed(0))
    assert (out.accepted, out.next_token) == (0, 0)


def test_deterministic_proposal_rejection_excludes_the_proposed_token():
    # q one-hot on token 2 (n-gram drafting): accept with probability p(2) = 0.25
    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert verify_sampled(torch.tensor([2]), None, p, torch.tensor([0.2]), g).accepted == 1
    rejected = [verify_sampled(torch.tensor([2]), None, p, torch.tensor([0.3]), g).next_token for _ in range(200)]
    assert set(rejected) == {0, 1}


def _first_token_histogram(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int) -> torch.Tensor:
    """Draws n single-token speculations (k=1) and counts the first output token."""
    g = torch.Generator().manual_seed(seed)
    vocab = p.shape[1]
    counts = torch.zeros(vocab)
    for _ in range(n):
        if q is None:
            proposed = torch.tensor([int(torch.randint(vocab, (1,), generator=g))])
        else:
            proposed = torch.multinomial(q[0], 1, generator=g)
        out = verify_sampled(proposed, q, p, torch.rand(1, generator=g), g)
        counts[int(proposed[0]) if out.accepted else out.next_token] += 1
    return counts


def test_output_distribution_matches_target():
    """The first output token is distributed as p, whatever q is. Chi-square against p with
    20000 draws: the threshold is the 99.9% quantile for 5 degrees of freedom (20.5)."""
    p = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05], [1 / 6] * 6])
    for q in (torch.tensor([[0.30, 0.10, 0.20, 0.10, 0.10, 0.20]]),
              torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]),
              p[:1].clone()):
        n = 20000
        counts = _first_token_histogram(p, q, n, seed=1)
        expected = p[0] * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (q, counts, chi2)


def test_distribution_check_detects_a_biased_rule():
    """The chi-square check above would catch a wrong rule: accepting whatever q proposes."""
    p = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.15, 0.05])
    q = torch.tensor([0.30, 0.10, 0.20, 0.10, 0.10, 0.20])
    n = 20000
    counts = torch.bincount(torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(1)),
                            minlength=6).float()
    chi2 = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert chi2 > 20.5
