"""The baseline learns real images nobody here drew: scikit-learn's handwritten digits
(UCI, 8x8 grayscale), written out as PNG class folders."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import pipeline

pytest.importorskip("sklearn.datasets")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from real_data import export_digits  # noqa: E402


def test_baseline_learns_handwritten_digits(tmp_path):
    data = export_digits(tmp_path / "digits", per_class=100)
    out = tmp_path / "out"
    assert pipeline.main(["--scenarios", "baseline", "--data-dir", str(data), "--epochs", "15", "--image-size", "32",
                          "--weights", "none", "--no-progress", "--output-dir", str(out)]) == 0
    row = json.loads((out / "results.json").read_text())[0]
    assert row["settings"]["model"] == "squeezenet1_1"
    assert row["test_acc"] > 0.3  # ten classes: chance is 0.1 (measured here: 0.41)
