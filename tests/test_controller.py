"""The speculation controller picks k from measured costs and this session's acceptance."""

from draft_worker.controller import SpeculationController, controller_for

# A CPU-like curve: 1 position 400 ms, 2-3 slow, 4-8 about 800 ms (index i = i+1 positions).
CURVE = [400, 850, 1250, 790, 800, 820, 830, 800, 1000]


def test_a_good_draft_is_used_to_the_full():
    c = SpeculationController(CURVE, draft_ms=45)
    for _ in range(5):
        c.observe(7, 7)
    assert c.acceptance > 0.9
    assert c.choose(7) == 7
    assert c.choose(3) == 3     # never beyond what the request allows


def test_a_bad_draft_falls_back_to_plain_decoding_and_is_retried_later():
    c = SpeculationController(CURVE, draft_ms=0.0)
    for _ in range(4):
        c.observe(4, 0)
    assert c.acceptance < 0.3
    assert c.choose(7) == 0
    rounds = 0
    while c.choose(7) == 0:       # plain rounds observe nothing; the estimate drifts to the prior
        c.observe(0, 0)
        rounds += 1
    assert 1 < rounds < 40


def test_slow_shapes_are_avoided():
    c = SpeculationController(CURVE, draft_ms=0.0)
    c.observe(4, 1)               # middling acceptance: a short proposal would be best if costs were flat
    assert c.choose(2) in (0, 1)  # 3 positions cost 1250 ms here: worse than either
    assert c.choose(8) >= 3


def test_expected_tokens_matches_the_closed_form():
    c = SpeculationController(CURVE, draft_ms=0.0, prior=0.5, prior_weight=1.0)
    assert abs(c.expected_tokens(0) - 1.0) < 1e-9
    assert abs(c.expected_tokens(2) - 1.75) < 1e-9     # 1 + 0.5 + 0.25


def test_no_curve_no_controller():
    assert controller_for([], 45.0) is None
    assert controller_for(CURVE, None) is None
    assert 0 < controller_for(CURVE, 45.0).choose(20) < len(CURVE)      # capped by the curve
