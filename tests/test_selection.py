"""How the tuners compare accuracies measured on one validation set."""
import pytest

from modules.selection import (accuracy_se, beats, chance_level, clearly_ahead, informative,
                              tie_margin)


def test_the_standard_error_is_binomial():
    assert accuracy_se(0.5, 100) == pytest.approx(0.05)
    assert accuracy_se(1.0, 100) == 0.0 and accuracy_se(1.5, 100) == 0.0


def test_a_difference_within_the_noise_is_a_tie_and_equal_scores_always_tie():
    assert tie_margin(0.5, 0.5, 100) == pytest.approx(0.0707, abs=1e-4)
    assert tie_margin(1.0, 1.0, 10**9) == 1e-9  # one image
    assert not beats(0.56, 0.5, 100) and beats(0.58, 0.5, 100)
    assert not beats(0.5, 0.5, 10**9)


def test_clearly_ahead_needs_a_leader_clear_of_chance_and_beyond_the_noise():
    # 10 classes on 1,000 images: chance 10%, two standard errors about 1.9 points
    assert not informative(0.11, 1000, 0.1) and informative(0.13, 1000, 0.1)
    assert not clearly_ahead(0.115, 0.05, 1000, 0.1)  # far ahead, but still at chance
    assert not clearly_ahead(0.41, 0.40, 1000, 0.1)   # clear of chance, within the noise
    assert clearly_ahead(0.50, 0.40, 1000, 0.1)


def test_chance_is_what_answering_the_most_common_class_scores():
    """On 400/20/20/20 images a model answering the first class scores 87%: against 1/4 it had
    left chance, and a size or trial still learning the small classes was judged behind it."""
    assert chance_level([0, 1, 2, 3] * 5, 4) == 0.25
    skewed = [0] * 80 + [1, 2, 3] * 4
    assert chance_level(skewed, 4) == pytest.approx(80 / 92)
    assert not informative(80 / 92, 92, chance_level(skewed, 4))
    assert not clearly_ahead(0.87, 0.78, 92, chance_level(skewed, 4))
    assert informative(80 / 92, 92, 0.25)  # as it was judged
    assert chance_level([], 5) == 0.2  # no validation labels: the classes' count


def test_a_one_image_gap_at_full_accuracy_ties_whatever_the_rounding():
    """At 100% both standard errors are under one image, so the one-image floor is the
    margin and the gap equals it: 1.0 - 0.99 rounded above it, 1.0 - 119/120 below."""
    from modules.selection import ties
    from resolution_tuner import ResolutionTrial, ResolutionTuner
    for n in (50, 100, 120, 300, 658, 1000):
        assert not beats(1.0, (n - 1) / n, n) and ties(1.0, (n - 1) / n, n), n
        assert beats(1.0, (n - 2) / n, n) or n < 10, n
        trials = [ResolutionTrial(64, (n - 1) / n, 1, 1, 1), ResolutionTrial(96, 1.0, 1, 1, 1)]
        assert ResolutionTuner.pick(trials, n, 64, 0.1) == 64, n  # a tie keeps the default


def test_an_accuracy_exactly_two_standard_errors_above_chance_has_not_left_it():
    """In whole images, 28 of 100 against chance 20% and 220 of 400 against 50% are exactly
    two standard errors above chance, as 60 of 100 against 50% is: none has left it, whichever
    way the floats of the difference round."""
    assert not informative(60 / 100, 100, 50 / 100)
    assert not informative(28 / 100, 100, 20 / 100)
    assert not informative(220 / 400, 400, 200 / 400)
    assert informative(29 / 100, 100, 20 / 100) and informative(221 / 400, 400, 200 / 400)
