"""Two `pipeline.py --scenarios hpo` workers on one PostgreSQL study (CI starts the server and
sets HWTRAIN_TEST_POSTGRES_URL; elsewhere this skips)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_folder

URL = os.environ.get("HWTRAIN_TEST_POSTGRES_URL")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not URL, reason="no PostgreSQL server (set HWTRAIN_TEST_POSTGRES_URL)")
def test_two_workers_share_one_study(tmp_path):
    optuna = pytest.importorskip("optuna")
    try:
        optuna.delete_study(study_name="hpo", storage=URL)
    except KeyError:
        pass  # no study yet
    data = make_folder(tmp_path / "d", n_train=10, n_test=3)
    workers = [subprocess.Popen(
        [sys.executable, "pipeline.py", "--scenarios", "hpo", "--data-dir", str(data),
         "--storage", URL, "--resume", "--n-trials", "2", "--epochs", "2", "--image-size", "32",
         "--batch-size", "8", "--weights", "none", "--no-progress", "--seed", str(seed),
         "--output-dir", str(tmp_path / f"worker{seed}")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for seed in (1, 2)]
    for worker in workers:
        _, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name="hpo", storage=URL)
    trials = study.get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]  # every trial once
    finished = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert finished and study.best_value == max(t.value for t in finished)
    for seed in (1, 2):
        row = json.loads((tmp_path / f"worker{seed}" / "results.json").read_text())[0]
        assert row["scenario"] == "hpo" and "postgresql" in row["hpo"]["storage"]
