"""How the tuners compare candidates measured on one validation set: the standard error of
an accuracy, and when two accuracies are too close to call; and the speed gain a measured
setting needs to be kept."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable


# The autotuner keeps a setting only when it is at least this much faster (timings wobble by
# a few percent), and the diagnosis does not advise one measured faster by less.
MIN_GAIN = 1.03


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


def chance_level(labels: Iterable[int], num_classes: int) -> float:
    """What a model that has learned nothing scores on images of these labels: it answers the
    most common class. 1 / num_classes on a balanced set; 87% on one of 400/20/20/20 images,
    where against 1/4 a model answering one class had "left chance" and could stop the sizes
    and trials that were learning the others."""
    counts = Counter(labels)
    return max(counts.values()) / sum(counts.values()) if counts else 1.0 / max(1, num_classes)


def validation_chance(index) -> float:
    """chance_level of an index's validation images (a DatasetIndex: its val and classes)."""
    return chance_level((label for _, label in index.val), len(index.classes))


def chance_words(chance: float) -> str:
    """How the log names chance, balanced or not: "chance (25.0%, ...)"."""
    return f"chance ({100 * chance:.1f}%, the most common class's share of validation)"


def informative(acc: float, n: int, chance: float) -> bool:
    """Whether an accuracy on n images is clear of chance (chance_level) by two standard
    errors: a short trial still at chance (a model from scratch that has not started to
    learn) ranks candidates by noise and by who leaves chance first, not by where they end.
    An accuracy exactly two standard errors above chance is not clear of it, however its
    floats round (28/100 - 20/100 = 0.08000000000000002 against 0.08; 60/100 - 50/100 reads
    below 0.1), as beats() ties a gap equal to its margin."""
    return acc - chance > 2 * accuracy_se(chance, n) + EPS


def clearly_ahead(leader: float, acc: float, n: int, chance: float) -> bool:
    """Whether a tuner may judge the candidate at `acc` behind `leader`: the leader is clear of
    chance and better by more than the noise. Before any candidate has left chance, short
    runs from scratch only show which one leaves it first."""
    return informative(leader, n, chance) and beats(leader, acc, n)
