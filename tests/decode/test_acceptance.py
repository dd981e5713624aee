"""Confidence intervals of acceptance figures: one drafter's tau, and two drafters' ratio
on the same prompts, resampled together."""

from __future__ import annotations

import pytest

from eagletrain.decode.acceptance import paired_tau_ratio, tau_interval


def test_the_same_results_give_a_ratio_of_one_with_no_width():
    rows = [(128, 60), (128, 40), (128, 90), (128, 55)]
    assert paired_tau_ratio(rows, rows) == (1.0, 1.0, 1.0)


def test_pairing_separates_a_small_gain_that_separate_intervals_do_not():
    # prompts that differ widely in difficulty; the new drafter needs 5% fewer cycles on
    # every one of them
    base = [(128, c) for c in (30, 40, 50, 60, 70, 80, 90, 100, 110, 120) * 4]
    new = [(t, round(c * 0.95)) for t, c in base]
    ratio, low, high = paired_tau_ratio(base, new)
    assert ratio == pytest.approx(sum(c for _, c in base) / sum(c for _, c in new))
    assert 1.0 < low < ratio < high
    # the two drafters' own intervals overlap: alone they could not tell the gain
    _, base_high = tau_interval(base)
    new_low, _ = tau_interval(new)
    assert new_low < base_high


def test_a_gain_on_some_prompts_and_a_loss_on_others_leaves_one_inside():
    base = [(128, 64)] * 20
    new = [(128, 48)] * 10 + [(128, 85)] * 10  # about as many cycles in all
    _, low, high = paired_tau_ratio(base, new)
    assert low < 1.0 < high


def test_prompts_that_do_not_pair_are_refused():
    with pytest.raises(ValueError, match="differ in number"):
        paired_tau_ratio([(128, 60)], [(128, 60), (128, 50)])
