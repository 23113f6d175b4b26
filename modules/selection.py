"""How the tuners compare candidates measured on one validation set: the standard error of
an accuracy, and when two accuracies are too close to call."""
from __future__ import annotations

import math


def accuracy_se(acc: float, n: int) -> float:
    """Standard error of an accuracy measured on n images (binomial)."""
    acc = min(1.0, max(0.0, acc))
    return math.sqrt(acc * (1 - acc) / max(1, n))


def tie_margin(a: float, b: float, n: int) -> float:
    """One standard error of the difference of two accuracies on n images each: a difference
    within it is noise. At least one image, so that equal scores always tie."""
    return max(math.hypot(accuracy_se(a, n), accuracy_se(b, n)), 1.0 / max(1, n))


# Accuracies are image counts over n: a gap that equals the margin in images (one image, at
# 100%) must tie whichever way its floats round (1.0 - 0.99 = 0.010000000000000009).
EPS = 1e-9


def beats(challenger: float, incumbent: float, n: int) -> bool:
    """Whether `challenger` is better than `incumbent` by more than the noise."""
    return challenger - incumbent > tie_margin(challenger, incumbent, n) + EPS


def ties(a: float, b: float, n: int) -> bool:
    """Whether two accuracies are within the noise of each other."""
    return abs(a - b) <= tie_margin(a, b, n) + EPS


def informative(acc: float, n: int, num_classes: int) -> bool:
    """Whether an accuracy on n images is clear of chance (1 / num_classes) by two standard
    errors: a short trial still at chance (a model from scratch that has not started to
    learn) ranks candidates by noise and by who leaves chance first, not by where they end."""
    chance = 1.0 / max(1, num_classes)
    return acc - chance > 2 * accuracy_se(chance, n)


def clearly_ahead(leader: float, acc: float, n: int, num_classes: int) -> bool:
    """Whether a tuner may judge the candidate at `acc` behind `leader`: the leader is clear of
    chance and better by more than the noise. Before any candidate has left chance, short
    runs from scratch only show which one leaves it first."""
    return informative(leader, n, num_classes) and beats(leader, acc, n)
