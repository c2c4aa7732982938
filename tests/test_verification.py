"""The verification function alone: hand-computed cases, then the distribution it produces."""

import pytest
import torch

from tandem.speculation.verification import verify_greedy, verify_sampled

pytestmark = pytest.mark.unit


def logits_for(choices: list[int], vocab: int = 5) -> torch.Tensor:
    """[n, vocab] logits whose argmax at row i is choices[i]."""
    x = torch.zeros(len(choices), vocab)
    x[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return x


def test_greedy_all_accepted_takes_bonus():
    out = verify_greedy(torch.tensor([1, 2, 3]), logits_for([1, 2, 3, 4]))
    assert (out.accepted, out.next_token) == (3, 4)


def test_greedy_first_mismatch_gives_corrected_token():
    out = verify_greedy(torch.tensor([1, 2, 3]), logits_for([1, 0, 3, 4]))
    assert (out.accepted, out.next_token) == (1, 0)


def test_greedy_no_proposal_is_plain_decoding():
    out = verify_greedy(torch.tensor([], dtype=torch.long), logits_for([2]))
    assert (out.accepted, out.next_token) == (0, 2)


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
