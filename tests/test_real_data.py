"""The baseline learns real images nobody here drew: scikit-learn's handwritten digits
(UCI, 8x8 grayscale), written out as PNG class folders."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import pipeline

datasets = pytest.importorskip("sklearn.datasets")


def export_digits(root, per_class: int = 100):
    """Class folders of 32x32 grayscale PNGs, the first `per_class` digits of each class."""
    digits = datasets.load_digits()
    counts: dict[int, int] = {}
    for image, label in zip(digits.images, digits.target):
        if counts.get(label, 0) >= per_class:
            continue
        counts[label] = counts.get(label, 0) + 1
        pixels = (image * (255 / 16)).astype(np.uint8)  # the set stores 0..16
        path = root / str(label) / f"{counts[label]}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).resize((32, 32), Image.NEAREST).save(path)
    return root


def test_baseline_learns_handwritten_digits(tmp_path):
    data = export_digits(tmp_path / "digits")
    out = tmp_path / "out"
    assert pipeline.main(["--scenarios", "baseline", "--data-dir", str(data), "--epochs", "15", "--image-size", "32",
                          "--weights", "none", "--no-progress", "--output-dir", str(out)]) == 0
    row = json.loads((out / "results.json").read_text())[0]
    assert row["settings"]["model"] == "squeezenet1_1"
    assert row["test_acc"] > 0.3  # ten classes: chance is 0.1 (measured here: 0.41)
