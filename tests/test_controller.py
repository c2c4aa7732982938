"""The speculation controller speculates while that gives more tokens per second than plain decoding."""

import pytest

from draft_worker.controller import SpeculationController, controller_for, plain_instead
from tandem.speculation.survival import Survival

pytestmark = pytest.mark.unit

PLAIN_MS = 600.0         # one plain round, as the verify worker measured it


def started(*args, **kwargs) -> SpeculationController:
    """A controller past its opening round (always plain, see the test of it)."""
    c = SpeculationController(*args, **kwargs)
    assert c.choose(8) == 0 and c.plain_run() == 1
    c.observe(0, 1, 5.0)                 # the prefill's round: not timed as a plain round
    return c


def test_the_first_round_is_plain_and_does_not_count_as_plain_decoding():
    """The first token comes from the prefill pass, as without speculation; that round's seconds
    hold the prefill, so they must not make plain decoding look slow."""
    c = SpeculationController(PLAIN_MS)
    assert c.choose(8) == 0
    c.observe(0, 1, 5.0)
    assert c.plain.value == 1000 / PLAIN_MS
    assert c.choose(8) == 8


def run(c: SpeculationController, rounds: int, spec_round: tuple[int, float], k: int = 8) -> list[int]:
    """Plays `rounds` rounds: speculative ones give spec_round (tokens, seconds), plain ones 1 token
    in PLAIN_MS. Returns the k chosen each round."""
    chosen = []
    for _ in range(rounds):
        kk = c.choose(k)
        chosen.append(kk)
        c.observe(kk, *(spec_round if kk else (1, PLAIN_MS / 1000)))
    return chosen


def test_a_draft_that_pays_is_always_used():
    c = started(PLAIN_MS)
    assert run(c, 50, (4, 1.2)) == [8] * 50          # 3.3 tokens/s against 1.7


def test_a_draft_that_loses_falls_back_and_is_retried_ever_less_often():
    c = started(PLAIN_MS, backoff=4, max_backoff=64)
    chosen = run(c, 200, (1, 1.1))                     # 0.9 tokens/s against 1.7
    tries = [i for i, k in enumerate(chosen) if k]
    assert chosen.count(0) > 180
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:4] == [5, 9, 17, 33]                  # 4, 8, 16, 32 plain rounds in between
    assert max(gaps) == 65                             # capped


def test_a_draft_that_recovers_is_used_again():
    c = started(PLAIN_MS)
    run(c, 20, (1, 1.1))
    later = run(c, 60, (6, 1.2))
    assert later[-30:] == [8] * 30


def test_one_bad_round_among_good_ones_does_not_stop_speculation():
    c = started(PLAIN_MS)
    run(c, 10, (5, 1.2))
    c.observe(8, 1, 1.3)
    assert c.choose(8) == 8


def test_plain_instead_takes_the_proposals_positions_out_of_the_round_trip():
    assert plain_instead(3.0, 16, 0.04) == 3.0 - 16 * 0.04
    assert plain_instead(1.0, 16, 0.1) == 1.0 / 17      # never below an even share of the pass
    assert plain_instead(1.0, 4, 0.0) is None           # the worker sent no slope


def test_in_a_crowded_pass_short_proposals_still_beat_plain_rounds():
    """3 tokens a round in 3 s passes that others fill: plain rounds would wait for those passes too
    (2.8 s in place of 3 s), so the uncontended plain prior (0.6 s) must not send the session to
    plain rounds."""
    c = started(PLAIN_MS)
    chosen = []
    for _ in range(30):
        k = c.choose(8)
        chosen.append(k)
        if k:
            c.observe(k, 3, 3.0, plain_seconds=plain_instead(3.0, k, 0.025))
        else:
            c.observe(0, 1, 2.8)
    assert chosen[-20:] == [8] * 20
    without = run(started(PLAIN_MS), 30, (3, 3.0))     # 0.6 s plain rounds win
    assert without.count(0) > 20


def test_the_requested_k_is_never_exceeded_and_zero_stays_zero():
    c = started(PLAIN_MS)
    assert c.choose(3) == 3
    assert c.choose(0) == 0


def test_no_curve_no_controller():
    assert controller_for([]) is None
    c = controller_for([PLAIN_MS, PLAIN_MS * 1.01])
    c.choose(5)
    c.observe(0, 1, 1.0)
    assert c.choose(5) == 5


def test_alone_a_position_pays_for_its_own_share_of_the_pass():
    """With no price from the verify worker (a session alone in its passes) a position still costs
    the pass's marginal time: 5 ms a position against a 100 ms step is a twentieth of a token. A
    drafter whose proposals are almost never accepted then proposes nothing and stops hoping, where
    the same drafter under a flat curve (a GPU's) still sends every position."""
    steep = controller_for([100.0, 105.0, 110.0, 115.0, 120.0])
    flat = controller_for([100.0] * 5)
    assert steep.own_price == pytest.approx(0.05) and flat.own_price == 0
    for c in (steep, flat):
        c.choose(4)
        c.observe(0, 1, 0.1)                         # the opening round
        for _ in range(60):
            c.observe(4, 1, 0.1, accepted=0, price=0.0)
    assert steep.fit(4) == 0 and not steep.survival.hopeful(steep.position_price)
    assert flat.fit(4) == 4 and flat.survival.hopeful(flat.position_price)


def test_price_cuts_proposals_to_the_positions_that_pay_for_themselves():
    c = started(PLAIN_MS)
    for _ in range(20):          # accepted through position 1 always, through 2 half the time, never 3
        c.observe(4, 3, 0.5, accepted=1, price=0.0)
        c.observe(4, 4, 0.5, accepted=2, price=0.0)
    assert c.choose(4) == 4                   # no price: every position is worth trying
    c.observe(4, 3, 0.5, accepted=1, price=0.3)
    assert c.choose(4) == 2                   # position 2 (about 0.5) pays 0.3, position 3 (0) does not
    c.observe(4, 3, 0.5, accepted=1, price=0.9)
    assert c.choose(4) == 1                   # only the always-accepted first position still pays
    c.observe(4, 3, 0.5, accepted=1, price=1.0)
    assert c.choose(4) == 0                   # a saturated verify worker: decode plainly


def test_a_busy_worker_gets_no_probes_a_drafts_record_cannot_justify():
    """Trial rounds after a back-off probe with one position even when no position pays its price,
    so that a draft that got better is noticed; but not when the first position's acceptance,
    counting one more accepted proposal, stays under the price."""
    c = started(PLAIN_MS, backoff=2, max_backoff=8)
    for _ in range(5):                        # the first position accepted 60% of the time
        for accepted in (1, 0, 1, 0, 1):
            c.observe(1, 1 + accepted, 0.5, accepted=accepted, price=0.0)
    s = c.survival
    rate, hopeful = s.accepted[1] / s.reached[1], (s.accepted[1] + 1) / (s.reached[1] + 1)
    assert rate < hopeful < 0.9
    c.observe(0, 1, 0.5, price=(rate + hopeful) / 2)     # the first position does not pay, may yet
    chosen = [c.choose(4) for _ in range(6)]
    assert chosen == [0, 0, 0, 1, 0, 0]       # a back-off of 2 rounds, then the probe
    c.observe(1, 1, 0.5, accepted=0, price=0.9)
    chosen = []
    for _ in range(40):
        chosen.append(c.choose(4))
        c.observe(0, 1, 0.5, price=0.9)
    assert chosen == [0] * 40                 # 0.9: not even a probe, however long the wait


def test_after_a_spell_of_high_prices_speculation_is_back_within_a_short_plain_run():
    """No position pays a price of 1.0, so the controller decodes plainly; when the price falls it
    speculates again within one short plain run, however long the spell was (a price is sent with
    every verdict: there is nothing to wait out, unlike a draft that lost)."""
    c = started(PLAIN_MS, backoff=4, max_backoff=64)
    for _ in range(20):
        c.observe(2, 3, 0.5, accepted=2, price=0.0)          # a draft that is always accepted
    rounds, first = 0, None
    while first is None and rounds < 200:
        price = 1.0 if rounds < 40 else 0.2
        k = c.choose(2)
        if k:
            first = rounds if rounds >= 40 else None
            c.observe(k, k + 1, 0.5, accepted=k, price=price)
            rounds += 1
            continue
        for _ in range(c.plain_run()):
            c.observe(0, 1, 0.5, price=1.0 if rounds < 40 else 0.2)   # each verdict's price
            rounds += 1
    assert first is not None and first - 40 <= 5


def test_a_draft_never_measured_is_probed_not_sent_whole_into_a_busy_worker():
    """Positions not seen yet count as accepted half the time, the next ones as the first's rate
    to the power j: under a low price a new session proposes a few, under a high one it backs off
    and then probes one position; once the first position is known to hold (0.94), the next are
    tried while 0.94^j pays."""
    c = started(PLAIN_MS, backoff=2)
    c.observe(0, 1, 0.5, price=0.2)
    assert c.choose(8) == 2                    # 0.5 and 0.25 pay 0.2, 0.125 does not
    c = started(PLAIN_MS, backoff=2)
    c.observe(0, 1, 0.5, price=0.8)
    assert [c.choose(8) for _ in range(4)] == [0, 0, 0, 1]
    for _ in range(10):
        c.observe(1, 2, 0.5, accepted=1, price=0.8)
    assert c.survival.worth(8, 0.8) == 3       # 0.94, 0.89, 0.84 pay 0.8; 0.80 does not
    assert c.survival.worth(8, 0.0) == 8       # no price: all


def test_each_kind_of_proposal_is_cut_by_its_own_acceptance():
    """The n-gram drafter names a proposal's kind (its match length): after a 3-token match the
    proposals are accepted, after a 1-token match not; under a price the first go whole and the
    second not at all, and a later session starts from what earlier ones measured."""
    from draft_worker.drafters import NgramDrafter
    assert NgramDrafter().propose([5, 6, 7, 8, 5, 6, 7], 2).kind == 3
    assert NgramDrafter().propose([5, 6, 7, 8, 9, 7], 2).kind == 1
    prior: dict = {}
    c = started(PLAIN_MS, prior=prior)
    for _ in range(20):
        for kind, accepted in ((3, 4), (1, 0)):
            assert c.fit(4, kind) == 4            # no price: every position is worth trying
            c.observe(4, accepted + 1, 0.5, accepted=accepted, price=0.0)
    c.observe(0, 1, 0.5, price=0.5)
    assert c.fit(4, 3) == 4 and c.fit(4, 1) == 0
    assert c.choose(4) == 4                       # the best kind's worth: the draft is cut after
    later = started(PLAIN_MS, prior=prior)
    later.observe(0, 1, 0.5, price=0.5)
    assert later.fit(4, 3) == 4 and later.fit(4, 1) == 0


def test_token_price_is_marginal_pass_time_times_output_per_pass_second():
    from verify_worker.price import TokenPrice
    price = TokenPrice(decay=1.0)
    assert price.value == 0.0
    out = busy = 0.0
    for tokens, prefill in zip((1, 8, 16, 32, 64) * 4, (0, 0, 256, 0, 100, 0, 0)  * 3):
        seconds = 0.05 + 0.002 * tokens + 0.0005 * prefill
        price.observe_output(tokens // 2)                      # given out by the pass before
        price.observe_pass(tokens, prefill, seconds, tokens)
        out, busy = out + tokens // 2, busy + seconds
    assert abs(price.position_seconds(1, 1) - 0.002) < 1e-4    # prefill's cheaper tokens kept apart
    assert abs(price.rate - out / busy) < 1e-9                 # per second of passes, idle time aside
    # the last pass held 64 sessions, whose plain decoding would give more than the measured rate
    assert price.value == pytest.approx(0.002 * max(out / busy, 64 / (0.05 + 0.002 * 64)) * 63 / 64, rel=0.05)


def test_token_price_is_at_least_what_plain_decoding_of_the_sessions_would_give():
    """Passes full of rejected positions give out few tokens per second; the price must not fall
    with that rate: plain decoding of the same sessions (S tokens per pass of S positions) is the
    floor."""
    from verify_worker.price import TokenPrice
    price = TokenPrice(decay=1.0)
    for sessions, tokens in [(40, 400), (40, 160), (48, 480), (44, 300)] * 3:
        seconds = 0.04 + 0.0015 * tokens
        price.observe_output(sessions)                         # one token per session: all rejected
        price.observe_pass(tokens, 0, seconds, sessions)
    plain = 44 / (0.04 + 0.0015 * 44)                          # the last pass's sessions, plainly
    assert price.rate < plain
    assert price.value == pytest.approx(min(1.0, 0.0015 * plain) * 43 / 44, rel=0.01)


# SmolLM2-135M on this machine: a pass of S sessions feeding one token each, ms
CURVE = [(1, 50.0), (2, 50.0), (4, 53.0), (8, 60.0), (16, 86.0), (32, 111.0), (64, 205.0), (128, 305.0)]


def test_with_a_calibrated_curve_a_position_costs_what_it_adds_to_a_pass_of_that_size():
    """On a CPU the pass time bends: a line through passes of 16 to 64 positions would price a
    position in a pass of 64 at 2.5 ms, the curve at 1.6 ms (205 -> 305 ms for 64 more, and on at
    that slope). A position's seconds are the mean over 4 more per session; the price is that times
    the plain rate, S / T(S). Passes running slower than at start-up scale the seconds, not the price."""
    from verify_worker.price import TokenPrice
    price = TokenPrice(curve=CURVE)
    beyond = (305 - 205) / 64 / 1000                                         # s per position past 128
    assert price.position_seconds(64, 64) == pytest.approx(beyond)
    assert price.for_batch(64) == pytest.approx(beyond * 64 / 0.205 * 63 / 64)
    assert price.for_batch(64, 192) == pytest.approx(price.for_batch(64))    # 64 proposing 2 each
    assert price.for_batch(64, 20) == price.for_batch(64)       # a pass of fewer: priced as 64 plain
    at_80 = 0.205 + 16 * beyond                                              # 16 sessions + 4 each
    assert price.for_batch(16) == pytest.approx((at_80 - 0.086) / 64 * 16 / 0.086 * 15 / 16)
    assert price.for_batch(4) < 0.2 and price.for_batch(1) == 0.0           # small passes cheap; alone free
    for _ in range(20):
        price.observe_output(64)
        price.observe_pass(64, 0, 1.5 * 0.205, 64)
    assert price.position_seconds(64, 64) == pytest.approx(1.5 * beyond, rel=1e-6)
    assert price.for_batch(64) == pytest.approx(beyond * 64 / 0.205 * 63 / 64, rel=1e-6)
    # an n-gram proposal after a 3-token match (84% accepted at its first position) pays in a pass of 64
    measured = Survival(decay=1.0)
    for accepted, proposals in ((0, 16), (1, 12), (2, 11), (3, 61)):
        for _ in range(proposals):
            measured.add(3, accepted)
    assert measured.worth(3, price.for_batch(64)) == 3
    assert TokenPrice(curve=[]).curve is None


def test_a_pass_at_the_calibrated_speed_is_read_off_the_curve_between_and_beyond_its_sizes():
    """What the verify worker counts as a pass's calibrated seconds (tandem_verify_pass_seconds_total,
    against the measured ones: how much slower passes run than at start-up)."""
    from verify_worker.price import TokenPrice
    price = TokenPrice(curve=CURVE)
    (s0, ms0), (s1, ms1) = CURVE[3:5]
    middle = (s0 + s1) / 2
    assert price.calibrated_seconds(middle) == pytest.approx((ms0 + ms1) / 2 / 1000)
    assert price.calibrated_seconds(128 + 64) == pytest.approx(0.405)     # on at the last slope: 205 -> 305
    for _ in range(5):
        price.observe_pass(64, 0, 3 * 0.205, 64)        # slower passes do not move the curve itself
    assert price.calibrated_seconds(64) == pytest.approx(0.205)
    assert TokenPrice().calibrated_seconds(8) is None
    # one session's pass: that length's own calibration (beyond the lengths measured, the longest's)
    lengths = [0.010, 0.012, 0.014]
    alone = TokenPrice(curve=CURVE, alone=lambda n: lengths[min(n, len(lengths)) - 1])
    assert alone.calibrated_seconds(2, sessions=1) == pytest.approx(0.012)
    assert alone.calibrated_seconds(9, sessions=1) == pytest.approx(0.014)
    assert alone.calibrated_seconds(2, sessions=2) == pytest.approx(0.050)     # two sessions: the curve


def test_a_verdicts_price_takes_the_plain_rate_of_its_own_pass_size():
    """After many passes of 2 sessions, a pass of 64: its price is the slope times what plain
    decoding of 64 sessions gives per second, not of the recent passes' 2."""
    from verify_worker.price import TokenPrice
    price = TokenPrice()
    for sessions in (2, 3) * 10 + (64,):
        price.observe_output(sessions)
        price.observe_pass(sessions, 0, 0.05 + 0.004 * sessions, sessions)
    plain_64 = 64 / (0.05 + 0.004 * 64)
    assert price.for_batch(64) == pytest.approx(0.004 * plain_64 * 63 / 64, rel=0.02)
    assert price.for_batch(64) > 2 * price.for_batch(2)      # 2 sessions: a plain rate of 2


def test_plain_rounds_planned_after_a_back_off_are_asked_for_as_one_run():
    c = started(PLAIN_MS, backoff=4)
    assert c.choose(8) == 8
    c.observe(8, 1, 1.1)                      # lost against plain: back off for 4 rounds
    assert c.choose(8) == 0
    assert c.plain_run() == 4                 # this round and the 3 planned after it
    for _ in range(4):
        c.observe(0, 1, PLAIN_MS / 1000)
    assert c.choose(8) == 8                   # then the trial round
    assert c.choose(0) == 0 and c.plain_run() == 1
