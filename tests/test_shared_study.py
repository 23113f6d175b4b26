"""Two `pipeline.py --scenarios hpo` workers on one PostgreSQL study (CI starts the server and
sets HWTRAIN_TEST_POSTGRES_URL; elsewhere this skips)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_folder
from modules.config import UserError

URL = os.environ.get("HWTRAIN_TEST_POSTGRES_URL")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not URL, reason="no PostgreSQL server (set HWTRAIN_TEST_POSTGRES_URL)")
def test_two_workers_share_one_study(tmp_path):
    """Same command and --seed on both, one of them without --resume: neither deletes the
    study, and they do not repeat each other's trials."""
    optuna = pytest.importorskip("optuna")
    data = make_folder(tmp_path / "d", n_train=10, n_test=3)
    name = "hpo-d"  # the dataset in the name: another data set's workers get another study
    try:
        optuna.delete_study(study_name=name, storage=URL)
    except KeyError:
        pass  # no study yet
    workers = [subprocess.Popen(
        [sys.executable, "pipeline.py", "--scenarios", "hpo", "--data-dir", str(data),
         "--storage", URL, *resume, "--n-trials", "3", "--epochs", "2", "--image-size", "32",
         "--batch-size", "8", "--weights", "none", "--no-progress", "--seed", "1",
         "--output-dir", str(tmp_path / f"worker{i}")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i, resume in enumerate((["--resume"], []))]
    for worker in workers:
        _, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-2000:]
    study = optuna.load_study(study_name=name, storage=URL)
    trials = study.get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(6))  # every trial once, none deleted
    finished = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert finished and study.best_value == max(t.value for t in finished)
    sampled = [json.dumps(t.params, sort_keys=True) for t in trials
               if not t.user_attrs.get("default")]
    assert len(set(sampled)) == len(sampled)  # different seeds: no trial repeated
    for i in range(2):
        row = json.loads((tmp_path / f"worker{i}" / "results.json").read_text())[0]
        assert row["scenario"] == "hpo" and row["hpo"]["storage"].startswith("postgresql")
        assert "hwtrain" not in row["hpo"]["storage"]  # the user (and password) never shown


def test_workers_creating_one_storage_at_once_both_open_it(monkeypatch):
    """The first open of an empty database creates Optuna's tables: of two workers started
    together one failed on the other's table ("already exists", a duplicate key)."""
    import optuna
    import sqlalchemy

    from modules import storage
    calls = []

    class Racing:
        def __init__(self, url):
            calls.append(url)
            if len(calls) == 1:
                raise sqlalchemy.exc.OperationalError(
                    "CREATE TABLE alembic_version", {}, Exception("table alembic_version "
                                                                  "already exists"))
            self.engine = sqlalchemy.create_engine("sqlite://")
    monkeypatch.setattr(optuna.storages, "RDBStorage", Racing)
    monkeypatch.setattr(storage.time, "sleep", lambda s: None)
    storage.check_storage("sqlite:////tmp/shared.db")
    assert len(calls) == 2
    # another failure is not retried: it is the user's to fix, in one line
    calls.clear()

    class Refused:
        def __init__(self, url):
            calls.append(url)
            raise sqlalchemy.exc.OperationalError("connect", {}, Exception("password "
                                                                           "authentication failed"))
    monkeypatch.setattr(optuna.storages, "RDBStorage", Refused)
    with pytest.raises(UserError, match="cannot open Optuna storage"):
        storage.check_storage("postgresql://u:p@h/db")
    assert len(calls) == 1
