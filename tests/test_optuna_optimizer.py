"""The Optuna tuner on a tiny image folder (CPU): objective, pruning, resume, OOM, plots."""
from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import sys
import time
from datetime import datetime, timedelta
from types import SimpleNamespace

import optuna
import pytest
import torch

import modules.storage
import optuna_optimizer
from conftest import make_folder
from modules.config import TrainConfig, UserError
from modules.dataset import index_dataset
from optuna_optimizer import OptunaTuner
from resolution_tuner import ResolutionTuner

BASE = TrainConfig(model="resnet18", weights="none", image_size=24, epochs=1, batch_size=8,
                   scheduler="none", device="cpu", progress=False, seed=0)
PARAMS = {"lr": 1e-3, "batch_size": 8, "optimizer": "adamw", "weight_decay": 1e-4}


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return index_dataset(make_folder(tmp_path_factory.mktemp("data"), n_train=8, n_test=2))


def tuner(index, tmp_path, **kwargs) -> OptunaTuner:
    kwargs = {"epochs": 2, "batch_sizes": (8, 16), "n_trials": 2, **kwargs}
    return OptunaTuner(index, BASE, output_dir=tmp_path / "hpo", **kwargs)


def fake_fit(index, config, on_epoch):
    """A stand-in for training: two epochs whose accuracy depends on lr (so params matter)."""
    acc = min(1.0, config.lr * 100)
    for epoch in (1, 2):
        on_epoch(epoch, {"val_acc": acc * epoch / 2})
    return SimpleNamespace(best_val_acc=acc, epochs_run=2, wall_s=0.01,
                           timing={"samples_per_s": 123.0})


def curves_by_lr(default, other):
    """A stand-in for training: per-epoch validation accuracies, one curve for the default lr
    and one for every other; the best of its curve is the trial's value."""
    def fit_(idx, config, on_epoch):
        accs = default if config.lr == BASE.lr else other
        for epoch, acc in enumerate(accs, 1):
            on_epoch(epoch, {"val_acc": acc})
        return SimpleNamespace(best_val_acc=max(accs), epochs_run=len(accs), wall_s=0.01,
                               timing={})
    return fit_


def with_val_images(t: OptunaTuner, n: int = 1000) -> OptunaTuner:
    """The tuner judging on n validation images, as many of each class (the fake trainings
    never read them)."""
    k = len(t.index.classes)
    t.index = SimpleNamespace(val=[(None, i % k) for i in range(n)], classes=t.index.classes)
    return t


def test_fixed_trial_suggests_and_trains_without_a_study(index, tmp_path):
    t = tuner(index, tmp_path)
    config = t.suggest(optuna.trial.FixedTrial(PARAMS))
    assert (config.lr, config.batch_size, config.epochs, config.optimizer,
            config.weight_decay) == (1e-3, 8, 2, "adamw", 1e-4)
    assert config.model == BASE.model and config.image_size == BASE.image_size
    assert BASE.cudnn_benchmark and not config.cudnn_benchmark  # a trial: TrainConfig.as_trial
    acc = t.objective(optuna.trial.FixedTrial(PARAMS))
    assert 0.0 <= acc <= 1.0


class PruneAfterFirstTrial(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return trial.number >= 1


def test_second_trial_pruned_and_counted(index, tmp_path, monkeypatch):
    t = tuner(index, tmp_path)
    monkeypatch.setattr(t, "_make_pruner", PruneAfterFirstTrial)
    summary = t.run()
    assert (summary["n_trials"], summary["n_complete"], summary["n_pruned"]) == (2, 1, 1)
    first, second = t.study.trials
    assert first.user_attrs["epochs_run"] == t.epochs == 2  # every trial: the same budget
    assert first.user_attrs["samples_per_s"] > 0 and first.user_attrs["wall_s"] > 0
    assert second.user_attrs["pruned_reason"] == "pruned after epoch 1"
    assert summary["best_value"] == first.value and summary["best_params"] == t.trained(first)
    assert set(first.params) == set(OptunaTuner.SEARCHED)  # what a resumed final run reads back


def test_resume_runs_the_trials_it_lacks_and_only_overwrite_starts_over(index, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    assert tuner(index, tmp_path, storage=storage).run()["n_trials"] == 2
    assert tuner(index, tmp_path, storage=storage, resume=True).run()["n_trials"] == 2
    resumed = tuner(index, tmp_path, storage=storage, resume=True, n_trials=3).run()
    assert resumed["n_trials"] == 3 and resumed["storage"] == storage
    with pytest.raises(UserError, match="batch sizes were"):  # a changed categorical space
        tuner(index, tmp_path, storage=storage, resume=True, batch_sizes=(8, 32)).run()
    # resumed on a GPU that holds less: the study keeps what it searched
    smaller = tuner(index, tmp_path, storage=storage, resume=True, max_batch_size=8)
    assert smaller.batch_sizes == (8,)
    assert smaller.run()["n_trials"] == 3 and smaller.batch_sizes == (8, 16)
    with pytest.raises(UserError, match=r"already exists.*resume=True from Python.*nothing "
                                        r"was deleted"):
        tuner(index, tmp_path, storage=storage, n_trials=1).run()
    assert tuner(index, tmp_path, storage=storage, resume=True, n_trials=4).run()["n_trials"] == 4
    assert tuner(index, tmp_path, storage=storage, n_trials=1,
                 overwrite=True).run()["n_trials"] == 1


@pytest.mark.parametrize("where", ["training", "keeping its weights", "a full disk"])
def test_an_interrupted_search_resumes_with_what_it_lacks_and_new_points(index, tmp_path,
                                                                          monkeypatch, where):
    """Run all again after a disconnect: the search ends with the trials it was asked for, and
    the new process's sampler does not draw the points the first one tried again. Ctrl-C after
    a trial's last epoch (saving its weights, seconds on Drive) left it FAIL, not queued again:
    --resume drew new parameters in its place. So did a full disk there, whose error advises
    the --resume."""
    stop = UserError("no space left on the device holding 'w.pt'; free some space, then "
                     "rerun (with --resume to continue)") if where == "a full disk" \
        else KeyboardInterrupt()
    calls = []

    def interrupted(idx, config, on_epoch):
        calls.append(config.lr)
        if len(calls) == 3 and where == "training":
            raise KeyboardInterrupt  # the session is cut off in its third trial
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", interrupted)
    keep, stopped = OptunaTuner._keep_weights, []

    def keep_weights(self, trial, result, curve):
        if len(calls) == 3 and where != "training" and not stopped:
            stopped.append(trial.number)  # once: the resume's trials keep theirs
            raise stop
        return keep(self, trial, result, curve)
    monkeypatch.setattr(OptunaTuner, "_keep_weights", keep_weights)
    with pytest.raises(type(stop)):
        tuner(index, tmp_path, n_trials=4).run()
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, n_trials=4, resume=True)
    summary = t.run()
    finished = [x for x in t.study.trials if x.state != optuna.trial.TrialState.FAIL]
    assert summary["n_complete"] == len(finished) == 4 and t.new_trials == 2
    # the cut-off trial is FAIL and its retry another trial: 4 ran, not 5
    assert (summary["n_trials"], summary["n_failed"]) == (4, 1)
    drawn = [x.params["lr"] for x in finished if not x.user_attrs.get("default")]
    assert len(set(drawn)) == len(drawn) == 3, drawn
    # the trial stopped by Ctrl-C (Optuna's FAIL) is trained again with its parameters, as
    # one cut off by a lost session is
    retried = [x for x in finished if x.user_attrs.get("retried_from") is not None]
    assert len(retried) == 1 and retried[0].params["lr"] == pytest.approx(calls[2])


def test_a_resume_without_a_count_keeps_the_study_s_and_retries_a_stopped_default(
        index, tmp_path, monkeypatch):
    calls = []

    def interrupted(idx, config, on_epoch):
        calls.append(config.lr)
        if len(calls) in (1, 4):
            raise KeyboardInterrupt  # the default trial, then a later one
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", interrupted)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            tuner(index, tmp_path, n_trials=5, resume=True, study_count=True).run()
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, n_trials=2, resume=True, study_count=True)  # a preset of 2
    summary = t.run()
    assert summary["n_complete"] + summary["n_pruned"] == 5
    assert summary["default_value"] is not None and t.study.user_attrs["n_trials"] == 5


@pytest.mark.parametrize("folder", ["run #2?x", "run%20b"])
def test_the_study_file_is_in_the_output_folder_whatever_its_name(index, tmp_path, folder):
    """'?' would start the URL's query and '%20' read as a space: the study went to another
    file or folder."""
    t = tuner(index, tmp_path / folder)
    assert (tmp_path / folder / "hpo" / "optuna.db").is_file()
    assert not (tmp_path / "run b").exists() and not (tmp_path / "run #2").exists()
    assert "optuna.db" in t.storage_url


def test_a_copy_of_the_study_cut_short_before_is_made_again(tmp_path):
    """--local-dir's copy of the study, when a disconnect left its temporary file half
    written: replaced, not opened ('file is not a database')."""
    import sqlite3
    from modules.storage import copy_sqlite
    source, target = tmp_path / "drive.db", tmp_path / "local" / "optuna.db"
    target.parent.mkdir()
    with sqlite3.connect(source) as db:
        db.execute("create table trials (n integer)")
        db.execute("insert into trials values (7)")
    db.close()
    (target.parent / ".optuna.db.tmp").write_bytes(b"half a copy" * 300)
    copy_sqlite(source, target)
    with sqlite3.connect(target) as db:
        assert db.execute("select n from trials").fetchall() == [(7,)]
    db.close()
    assert sorted(p.name for p in target.parent.iterdir()) == ["optuna.db"]
    source.write_bytes(b"not a database" * 300)
    with pytest.raises(UserError, match="cannot copy the Optuna study .* move it aside"):
        copy_sqlite(source, target)


def test_a_copy_of_the_study_onto_a_full_disk_is_not_called_damaged(tmp_path, monkeypatch):
    """A full disk under the copy (Drive's quota on the way out, the local disk on a new VM's
    restore) said "if it is damaged, move it aside": a study moved aside is searched again
    from its first trial. It says what is full, keeps both copies, and names --resume."""
    import sqlite3
    from modules import storage
    source, target = tmp_path / "local.db", tmp_path / "drive" / "optuna.db"
    target.parent.mkdir()
    for path, n in ((source, 8), (target, 7)):
        with sqlite3.connect(path) as db:
            db.execute("create table trials (n integer)")
            db.execute("insert into trials values (?)", (n,))
        db.close()
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode, full.sqlite_errorname = 13, "SQLITE_FULL"
    real = sqlite3.connect

    class Source:  # a real connection whose backup meets a full disk
        def __init__(self, path):
            self.db = real(path)

        def backup(self, target):
            raise full

        def close(self):
            self.db.close()
    monkeypatch.setattr(storage.sqlite3, "connect",
                        lambda path: Source(path) if str(path) == str(source) else real(path))
    with pytest.raises(UserError) as failed:
        storage.copy_sqlite(source, target)
    said = str(failed.value)
    assert "no space left on the device holding" in said and "--resume" in said
    assert "damaged" not in said and "move it aside" not in said
    monkeypatch.undo()
    assert sorted(p.name for p in target.parent.iterdir()) == ["optuna.db"]
    with sqlite3.connect(target) as db:  # the earlier copy, as it was
        assert db.execute("select n from trials").fetchall() == [(7,)]
    db.close()


def test_a_study_of_other_data_is_refused(index, tmp_path, monkeypatch):
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.DEBUG)  # a library caller's own
    tuner(index, tmp_path, data_fingerprint="a", n_trials=1).run()
    with pytest.raises(UserError, match="searched other data"):
        tuner(index, tmp_path, data_fingerprint="b", resume=True, n_trials=1).run()
    assert optuna.logging.get_verbosity() == optuna.logging.DEBUG  # back, not ERROR
    optuna.logging.set_verbosity(level)
    # a library caller passes the index alone: its study is checked all the same (a study of
    # other data had answered "3 of its 3 trials done" and that data's best parameters)
    tuner(index, tmp_path / "lib", n_trials=1).run()
    other = index_dataset(make_folder(tmp_path / "other", n_train=6, n_test=2))
    with pytest.raises(UserError, match="searched other data"):
        tuner(other, tmp_path / "lib", resume=True, n_trials=1).run()


def test_a_study_an_older_version_recorded_for_this_data_goes_on(index, tmp_path, monkeypatch):
    """Before fingerprints named images by their place inside the data folder, they named the
    paths as listed: such a study, of these images at this place, is resumed, not refused."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    older = index._digest(("train", "val", "test"), str)
    assert older != index.fingerprint()
    tuner(index, tmp_path, data_fingerprint=older, n_trials=1).run()
    t = tuner(index, tmp_path, data_fingerprint=index.fingerprint(), resume=True, n_trials=2)
    t.run()
    assert len(t.study.trials) == 2 and t.study.user_attrs["data_fingerprint"] == older


def test_a_study_whose_trials_trained_otherwise_is_refused(index, tmp_path, monkeypatch):
    """Trials are compared with each other: a resumed study whose trials trained another size
    or other epochs is refused in one line, nothing deleted; so is one from before the study
    recorded that, whose finished trials trained other epochs."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    tuner(index, tmp_path, n_trials=1).run()
    for kwargs, message in (({"epochs": 3}, "epochs=2, this run's would train epochs=3"),
                            ({"base": dataclasses.replace(BASE, image_size=48)},
                             "image_size=24, this run's would train image_size=48 "
                             r"\(.*--search-size 24 for its size")):
        base = kwargs.pop("base", BASE)
        with pytest.raises(UserError, match=f"trained {message}.*nothing was deleted"):
            OptunaTuner(index, base, output_dir=tmp_path / "hpo", batch_sizes=(8, 16),
                        n_trials=2, resume=True, **{"epochs": 2, **kwargs}).run()
    # joined under torchrun with 2 processes: each trial's global batch twice the study's
    with monkeypatch.context() as m:
        m.setattr(optuna_optimizer.distributed, "world_size", lambda: 2)
        with pytest.raises(UserError, match="trained processes=1, this run's would train "
                                            "processes=2"):
            tuner(index, tmp_path, n_trials=2, resume=True).run()
    assert tuner(index, tmp_path, n_trials=2, resume=True).run()["n_complete"] == 2
    # a size the user did not choose (--search-size auto): the study's own is kept
    kept = OptunaTuner(index, dataclasses.replace(BASE, image_size=48), output_dir=tmp_path / "hpo",
                       batch_sizes=(8, 16), n_trials=3, resume=True, epochs=2,
                       keep_study_size=True)
    trained = []
    monkeypatch.setattr(optuna_optimizer, "fit", lambda idx, config, on_epoch:
                        trained.append(config.image_size) or fake_fit(idx, config, on_epoch))
    assert kept.run()["trial_size"] == 24 and trained == [24]
    with pytest.raises(UserError, match="would train image_size=48, epochs=3"):  # not only size
        OptunaTuner(index, dataclasses.replace(BASE, image_size=48), output_dir=tmp_path / "hpo",
                    batch_sizes=(8, 16), n_trials=4, resume=True, epochs=3,
                    keep_study_size=True).run()
    older = tuner(index, tmp_path / "older", n_trials=1)
    older.run()
    older.study.set_user_attr("trial_setup", None)  # as a study from before the record
    with pytest.raises(UserError, match="trained epochs=2, this run's would train epochs=4"):
        tuner(index, tmp_path / "older", n_trials=2, resume=True, epochs=4).run()


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # our study.ask() plays the dead run
def test_trial_of_a_killed_process_is_retried(index, tmp_path, monkeypatch):
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    monkeypatch.setattr(modules.storage, "HEARTBEAT_S", 1)
    monkeypatch.setattr(modules.storage, "GRACE_S", 1)
    t = tuner(index, tmp_path, n_trials=1)
    study = optuna.create_study(storage=t.storage, study_name=t.study_name, direction="maximize")
    dead = study.ask({"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    t.storage.record_heartbeat(dead._trial_id)  # then the process "dies": no more heartbeats
    time.sleep(2.2)  # SQLite timestamps have 1 s resolution; must exceed GRACE_S
    t = tuner(index, tmp_path, n_trials=2, resume=True)  # the default trial, then the retry
    t.run()
    failed = t.study.trials[0]
    retried = [x for x in t.study.trials if x.system_attrs.get("failed_trial") == failed.number]
    assert failed.state == optuna.trial.TrialState.FAIL
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.COMPLETE
    assert retried[0].params["lr"] == failed.params["lr"]
    # The dead trial "ran" until this session failed it: not time the search's budget spent.
    assert t.search_seconds() < 1.0


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # our study.ask() plays the dead run
def test_a_trial_killed_before_its_first_heartbeat_is_retried_too(index, tmp_path, monkeypatch):
    """Optuna only fails stale trials that have a heartbeat; a process killed between creating
    its trial and the first beat left that trial RUNNING for ever (a flaky real-kill test)."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    monkeypatch.setattr(modules.storage, "HEARTBEAT_S", 1)
    # A grace period no busy machine outlasts between asking `young` and the stale check; the
    # other two are backdated past it instead of slept for.
    monkeypatch.setattr(modules.storage, "GRACE_S", 60)
    t = tuner(index, tmp_path, n_trials=1)
    study = optuna.create_study(storage=t.storage, study_name=t.study_name, direction="maximize")
    lr = {"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    dead = study.ask(lr)  # killed before its first heartbeat: none recorded
    beating = study.ask(lr)
    with sqlite3.connect(t.storage_url.removeprefix("sqlite:///")) as db:
        db.execute("UPDATE trials SET datetime_start = ? WHERE trial_id IN (?, ?)",
                   ((datetime.now() - timedelta(seconds=120)).isoformat(" "),
                    dead._trial_id, beating._trial_id))  # both started before the grace period
    t.storage.record_heartbeat(beating._trial_id)  # but this one beats: alive
    young = study.ask(lr)  # just started, no heartbeat yet: alive as far as anyone knows
    t = tuner(index, tmp_path, n_trials=2, resume=True)  # the default trial, then the retry
    t.run()
    trials = {trial.number: trial for trial in t.study.trials}
    assert trials[dead.number].state == optuna.trial.TrialState.FAIL
    assert trials[young.number].state == trials[beating.number].state == \
        optuna.trial.TrialState.RUNNING
    retries = [x for x in t.study.trials if x.system_attrs.get("failed_trial") == dead.number]
    assert len(retries) == 1 and retries[0].state == optuna.trial.TrialState.COMPLETE
    assert retries[0].params["lr"] == trials[dead.number].params["lr"]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # our study.ask() plays the dead run
def test_a_study_of_its_own_retries_a_cut_off_trial_at_once(index, tmp_path, monkeypatch):
    """The pipeline's study of its own (the output dir locked): a trial RUNNING on resume was cut
    off with the last session, and is retried before the heartbeat's grace period is out,
    which a short resumed search could end before; the default trial keeps its mark."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, n_trials=1)
    study = optuna.create_study(storage=t.storage, study_name=t.study_name, direction="maximize")
    study.enqueue_trial(t.default_params(), user_attrs={"default": True})
    dead = study.ask(t.distributions())  # killed a second ago, its heartbeat fresh
    t.storage.record_heartbeat(dead._trial_id)
    t = tuner(index, tmp_path, n_trials=2, resume=True, sole_user=True)
    t.run()
    trials = t.study.trials
    assert trials[0].state == optuna.trial.TrialState.FAIL
    retried = [x for x in trials if x.system_attrs.get("failed_trial") == 0]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.COMPLETE
    assert retried[0].user_attrs.get("default") and retried[0].params == trials[0].params
    assert sum(x.user_attrs.get("default", False) for x in trials) == 2  # not queued a third time


def test_out_of_memory_is_a_pruned_trial(index, tmp_path, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(optuna_optimizer, "fit", oom)
    # The memory is handed back once no exception is being handled: inside the except block
    # its traceback would still hold the trial's tensors.
    handling = []
    monkeypatch.setattr(optuna_optimizer, "release",
                        lambda device: handling.append(sys.exc_info()[0]))
    t = tuner(index, tmp_path)
    summary = t.run()
    assert (summary["n_pruned"], summary["n_complete"], summary["best_value"]) == (2, 0, None)
    assert handling == [None, None]
    for trial in t.study.trials:
        assert trial.state == optuna.trial.TrialState.PRUNED
        assert trial.user_attrs["pruned_reason"] == \
            f"out of memory at batch_size={trial.params['batch_size']}"


def test_save_plots_writes_html_png_json(index, tmp_path, monkeypatch):
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, n_trials=3)
    summary = t.run()
    written = t.save_plots()
    names = {p.name for p in written}
    assert names == {"optuna_history.html", "optuna_importance.html", "optuna_history.png",
                     "optuna_importance.png", "best_params.json"}
    assert all(p.stat().st_size > 0 for p in written)
    assert (tmp_path / "hpo" / "optuna_history.png").read_bytes()[:4] == b"\x89PNG"
    # the page says what the values are, in %, as the PNG does ("Objective Value", 0.33)
    page = (tmp_path / "hpo" / "optuna_history.html").read_text()
    assert '"text":"validation accuracy"' in page and '"tickformat":".0%"' in page
    saved = json.loads((tmp_path / "hpo" / "best_params.json").read_text())
    assert saved["best_params"] == summary["best_params"] and saved["n_trials"] == 3
    # what the final run trains: the winner's, or the default configuration's own values
    assert saved["trained_params"] == (summary["chosen_params"] or {
        k: getattr(t.default_config(), k) for k in t.SEARCHED})
    assert saved["keeps_default"] == summary["keeps_default"] and saved["choice"]


def test_importances_that_cannot_be_computed_do_not_fail_the_search(index, tmp_path, monkeypatch,
                                                                    caplog):
    """Optuna 4's fANOVA raised on trials of one value (all at chance) and without
    scikit-learn: the search's other outputs are written, the chart named in one line."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, n_trials=3)
    t.run()
    (tmp_path / "hpo" / "optuna_importance.png").write_bytes(b"an earlier run's")

    def refuse(*_, **__):
        raise RuntimeError("Encountered zero total variance in all trees.")
    monkeypatch.setattr(optuna.importance, "get_param_importances", refuse)
    monkeypatch.setattr(optuna.visualization, "plot_param_importances", refuse)
    with caplog.at_level(logging.WARNING):
        names = {p.name for p in t.save_plots()}
    assert names == {"optuna_history.html", "optuna_history.png", "best_params.json"}
    assert "parameter importances not drawn: Encountered zero total variance" in caplog.text
    assert not (tmp_path / "hpo" / "optuna_importance.png").exists()


def test_save_plots_skips_importances_with_one_trial(index, tmp_path, monkeypatch):
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, n_trials=1)
    t.run()
    assert "optuna_importance.html" not in {p.name for p in t.save_plots()}


def test_max_batch_size_bounds_the_choices(index, tmp_path, monkeypatch):
    t = OptunaTuner(index, BASE, output_dir=tmp_path, max_batch_size=64)
    assert t.batch_sizes == (16, 32, 64)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    assert {t.suggest(study.ask()).batch_size for _ in range(30)} == {16, 32, 64}
    with pytest.raises(UserError, match="max_batch_size=8"):
        OptunaTuner(index, BASE, output_dir=tmp_path, max_batch_size=8)


@pytest.mark.parametrize("url", ["nosuchdb://nowhere/x", "sqlite:////nonexistent/dir/x.db"])
def test_bad_storage_url_is_a_one_line_user_error(index, tmp_path, url):
    with pytest.raises(UserError) as err:
        OptunaTuner(index, BASE, output_dir=tmp_path, storage=url)
    assert url in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, named", [({"n_trials": 0}, "n_trials=0"),
                                           ({"timeout_s": -1}, "timeout_s=-1"),
                                           ({"pruner": "bogus"}, "'bogus'"),
                                           ({"epochs": (1, 2)}, r"epochs=\(1, 2\)")])
def test_bad_arguments_are_user_errors(index, tmp_path, kwargs, named):
    with pytest.raises(UserError, match=named):
        OptunaTuner(index, BASE, output_dir=tmp_path, **kwargs)


def test_the_default_configuration_is_the_first_trial(index, tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(optuna_optimizer, "fit",
                        lambda idx, config, on_epoch: trained.append(config) or fake_fit(idx, config, on_epoch))
    base = BASE.__class__(**{**BASE.to_dict(), "weight_decay": 0.0})
    t = OptunaTuner(index, base, output_dir=tmp_path / "hpo", epochs=2, batch_sizes=(8, 16),
                    n_trials=2)
    t.run()
    first = t.study.trials[0]
    assert first.user_attrs["default"] is True and first.params == t.default_params()
    # trained exactly as the base configuration, weight decay 0 included (below the range)
    assert trained[0] == base.as_trial(epochs=2)
    # resumed: the default is not queued a second time
    t2 = OptunaTuner(index, base, output_dir=tmp_path / "hpo", epochs=2, batch_sizes=(8, 16),
                     n_trials=1, resume=True)
    t2.run()
    assert sum(bool(x.user_attrs.get("default")) for x in t2.study.trials) == 1


def test_a_trial_already_trained_with_the_default_settings_is_not_trained_again(
        index, tmp_path, monkeypatch):
    """The resolution scenario's trial at the size the search runs at trained exactly the
    default trial: the search takes its curve, value and weights, and trains only the others."""
    trained = []
    monkeypatch.setattr(optuna_optimizer, "fit",
                        lambda idx, config, on_epoch: trained.append(config) or fake_fit(idx, config, on_epoch))
    weights = tmp_path / "resolution-24px.weights.pt"
    weights.write_bytes(b"weights")
    probe = tuner(index, tmp_path / "probe")
    earlier = optuna_optimizer.EarlierTrial(
        config=dataclasses.replace(probe.default_config(), progress=True), val_curve=[0.2, 0.4],
        weights=weights, wall_s=3.0, samples_per_s=50.0, source="the 24 px trial")
    t = tuner(index, tmp_path, n_trials=3, earlier=earlier)
    summary = t.run()
    first = t.study.trials[0]
    assert first.user_attrs["default"] is True and first.user_attrs["reused_from"] == "the 24 px trial"
    assert first.value == 0.4 and first.intermediate_values == {1: 0.2, 2: 0.4}
    assert summary["n_trials"] == 3 and len(trained) == 2  # the default was not trained again
    assert all(config.lr != BASE.lr or config.batch_size != BASE.batch_size for config in trained)
    assert t.weights_for(None) == (weights, 2) and summary["default_reused_from"] == "the 24 px trial"
    # other speed knobs (the autotuner measured again at the search's size): the same learning
    faster = dataclasses.replace(earlier, config=dataclasses.replace(
        earlier.config, channels_last=True, optimizer_impl="fused"))
    trained.clear()
    t = tuner(index, tmp_path / "faster", n_trials=1, earlier=faster)
    t.run()
    assert t.study.trials[0].user_attrs["reused_from"] == "the 24 px trial" and not trained
    # another lr, or other epochs: not the default trial, so that one is trained
    for other in (dataclasses.replace(earlier, config=dataclasses.replace(earlier.config, lr=0.05)),
                  dataclasses.replace(earlier, val_curve=[0.4])):
        trained.clear()
        t = tuner(index, tmp_path / f"other{len(other.val_curve)}{other.config.lr}", earlier=other)
        t.run()
        assert "reused_from" not in t.study.trials[0].user_attrs
        assert trained[0] == t.default_config() and len(trained) == 2


@pytest.mark.parametrize("pruner", ["asha", "hyperband"])
def test_a_reused_default_trial_is_at_the_rung_the_others_are_judged_at(index, tmp_path,
                                                                         monkeypatch, pruner):
    """A default trial taken whole from the resolution scenario is compared at successive
    halving's first rung as a trained one is: a trial far behind it there is stopped."""
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.5, 0.9, 0.92], [0.3, 0.4, 0.45]))
    probe = tuner(index, tmp_path / "probe", epochs=3)
    earlier = optuna_optimizer.EarlierTrial(
        config=probe.default_config(), val_curve=[0.5, 0.9, 0.92], weights=None, wall_s=3.0,
        samples_per_s=50.0, source="the 24 px trial")
    t = with_val_images(tuner(index, tmp_path, epochs=3, n_trials=2, pruner=pruner,
                              earlier=earlier))
    t.run()
    default, other = t.study.trials
    assert default.user_attrs["reused_from"] == "the 24 px trial"
    assert default.system_attrs["completed_rung_0"] == 0.9  # first rung: epoch 2 of 3
    assert other.state == optuna.trial.TrialState.PRUNED


def test_the_resolution_trial_is_the_default_trial_with_early_stopping_too(index, tmp_path):
    """Trials never stop early (TrainConfig.as_trial), so a user's --early-stopping leaves the
    resolution scenario's trial at the kept size reusable as the search's default trial."""
    base = dataclasses.replace(BASE, early_stopping_patience=2)
    resolution = ResolutionTuner(index, base, [base.image_size], epochs=2)
    search = OptunaTuner(index, base, output_dir=tmp_path / "hpo", epochs=2, batch_sizes=(8, 16))
    assert resolution.trial_config(base.image_size).run_settings() == \
        search.default_config().run_settings()


@pytest.mark.parametrize("gain, keeps", [(0.01, True), (0.2, False)])
def test_the_winner_is_trained_only_when_it_beats_the_default(index, tmp_path, monkeypatch,
                                                               gain, keeps):
    """1,000 validation images: one standard error of a difference near 50% is ~2.2 points."""
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.5], [0.5 + gain]))
    summary = with_val_images(tuner(index, tmp_path, n_trials=3, pruner="median")).run()
    assert summary["default_value"] == 0.5 and summary["keeps_default"] is keeps
    assert summary["n_val"] == 1000 and summary["best_value_se"] > 0
    if keeps:
        assert summary["chosen_params"] is None and "keeping the default" in summary["choice"]
    else:
        assert summary["chosen_params"] == summary["best_params"]
        assert summary["chosen_params"]["lr"] != BASE.lr and "beats the default" in summary["choice"]


def test_the_default_and_the_best_trial_keep_their_weights(index, tmp_path, monkeypatch):
    """The final run continues from the trial of the configuration it trains: the default's
    and the best so far are kept, a best that is overtaken is deleted."""
    accs = iter([0.5, 0.6, 0.55, 0.7, 0.65])  # trials 1 and 3 each become the best

    def fit_(idx, config, on_epoch):
        acc = next(accs)
        on_epoch(1, {"val_acc": acc})
        model = torch.nn.Linear(1, 1)
        torch.nn.init.constant_(model.weight, acc)
        return SimpleNamespace(best_val_acc=acc, epochs_run=1, wall_s=0.01, timing={}, model=model)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    t = tuner(index, tmp_path, n_trials=5, pruner="none", weights_dir=tmp_path / "w")
    t.run()
    kept = sorted(p.name for p in (tmp_path / "w").iterdir())
    assert kept == ["hpo-trial-0.weights.pt", "hpo-trial-3.weights.pt"]
    path, epochs = t.weights_for(None)
    assert path.name == "hpo-trial-0.weights.pt" and epochs == 1
    assert torch.load(path)["state_dict"]["weight"].item() == pytest.approx(0.5)
    trials = t.study.trials
    path, _ = t.weights_for(trials[3].params)
    assert torch.load(path)["state_dict"]["weight"].item() == pytest.approx(0.7)
    assert t.weights_for(trials[1].params) == (None, 0)  # overtaken by trial 3: deleted
    assert t.weights_for(trials[2].params) == (None, 0)  # never the best: never kept


def test_a_new_best_deletes_no_other_workers_weights(index, tmp_path, monkeypatch):
    """On a study two workers share, each keeps its trials' weights in its own folder; a best
    found by one must not delete the file the other may be continuing from."""
    accs = iter([0.5, 0.6, 0.7, 0.65])  # worker A: trials 0, 1 (its best); B: 2 (new best), 3

    def fit_(idx, config, on_epoch):
        acc = next(accs)
        on_epoch(1, {"val_acc": acc})
        return SimpleNamespace(best_val_acc=acc, epochs_run=1, wall_s=0.01, timing={},
                               model=torch.nn.Linear(1, 1))
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    a = tuner(index, tmp_path / "a", storage=storage, pruner="none", weights_dir=tmp_path / "a")
    a.run()
    b = tuner(index, tmp_path / "b", storage=storage, pruner="none", weights_dir=tmp_path / "b",
              resume=True, n_trials=4)
    b.run()
    assert (tmp_path / "a" / "hpo-trial-1.weights.pt").exists()
    assert (tmp_path / "b" / "hpo-trial-2.weights.pt").exists()


def test_the_default_continues_from_a_longer_earlier_trial_of_the_same_settings(
        index, tmp_path, monkeypatch):
    """The resolution trial at a size other than the default trains more epochs than the
    search's trials, so it is not the default trial; when the search keeps the default, the
    final run continues from it if it validated at least as well as the default trial."""
    def fit_(idx, config, on_epoch):
        for epoch in (1, 2):
            on_epoch(epoch, {"val_acc": 0.2 * epoch})
        model = torch.nn.Linear(1, 1)
        return SimpleNamespace(best_val_acc=0.4, epochs_run=2, wall_s=0.01, timing={}, model=model)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    longer = tmp_path / "resolution-24px.weights.pt"
    longer.write_bytes(b"weights")
    probe = tuner(index, tmp_path / "probe")
    for curve, continues in (([0.1, 0.3, 0.5], True), ([0.1, 0.2, 0.3], False)):
        earlier = optuna_optimizer.EarlierTrial(  # other speed knobs: the same learning
            config=probe.default_config().as_trial(epochs=3, dropout_impl="bytemask",
                                                   channels_last=True),
            val_curve=curve, weights=longer,
            wall_s=3.0, samples_per_s=50.0, source="the 24 px trial")
        out = tmp_path / str(continues)
        t = tuner(index, out, n_trials=1, earlier=earlier, weights_dir=out / "w")
        t.run()
        assert "reused_from" not in t.study.trials[0].user_attrs  # 3 epochs against 2
        weights, epochs, source = t.start_for(None)
        curve = t.curve_for(None)  # the start trial's epochs, when it trained in this study
        if continues:
            assert (weights, epochs, source) == (longer, 3, "the 24 px trial")
            assert curve == []  # its time was spent in the resolution scenario
        else:
            assert (weights.name, epochs, source) == ("hpo-trial-0.weights.pt", 2,
                                                      "the default trial")
            assert [acc for _, acc in curve] == [0.2, 0.4]
            assert curve[0][0] <= curve[1][0] <= time.time()
            t.worker = "a later session"  # this run resumed (after Stop): still its trial
            assert [acc for _, acc in t.curve_for(None)] == [0.2, 0.4]
            t.run_name = "another run"  # a shared study's trial trained elsewhere
            assert t.curve_for(None) == []
    other = dataclasses.replace(earlier, val_curve=[0.1, 0.3, 0.5],
                                config=dataclasses.replace(earlier.config, lr=0.05))
    t = tuner(index, tmp_path / "other", n_trials=1, earlier=other)
    t.run()
    assert t.start_for(None)[2] == "the default trial"  # other settings: never


def test_trials_at_a_smaller_size_than_the_final_run(index, tmp_path, monkeypatch):
    """Trials train at a cheaper size (BASE's 24 px) for a final run at 32 px: the earlier
    trial, at 32 px, is not the default trial, but a kept default continues from it (the same
    start at the final run's size); the chosen trial's epoch seconds are scaled to 32 px by
    what the default configuration took per epoch at each size, else by their pixels."""
    monkeypatch.setattr(optuna_optimizer, "fit", lambda idx, config, on_epoch: SimpleNamespace(
        **vars(fake_fit(idx, config, on_epoch)), model=torch.nn.Linear(1, 1)))
    weights = tmp_path / "resolution-32px.weights.pt"
    weights.write_bytes(b"weights")
    probe = tuner(index, tmp_path / "probe")
    earlier = optuna_optimizer.EarlierTrial(
        config=dataclasses.replace(probe.default_config(), image_size=32), val_curve=[0.2, 0.4],
        weights=weights, wall_s=3.0, samples_per_s=50.0, source="the 32 px trial")
    t = tuner(index, tmp_path / "a", n_trials=1, earlier=earlier, final_size=32,
              weights_dir=tmp_path / "a" / "w")
    summary = t.run()
    assert "reused_from" not in t.study.trials[0].user_attrs  # it trained at another size
    assert summary["trial_size"] == 24 and t.study.user_attrs["trial_setup"]["image_size"] == 24
    assert t.start_for(None) == (weights, 2, "the 32 px trial")
    here = t.epoch_seconds(None)  # the default trial's, at 24 px
    assert here == pytest.approx(0.01 / 2)
    assert t.final_epoch_seconds(None) == pytest.approx(3.0 / 2)  # 1.5 s an epoch at 32 px
    assert summary["chosen_epoch_s"] == pytest.approx(3.0 / 2)
    # without the earlier trial: by pixels; trials at the final run's size: as measured
    t = tuner(index, tmp_path / "b", n_trials=1, final_size=32, weights_dir=tmp_path / "b" / "w")
    t.run()
    assert t.final_epoch_seconds(None) == pytest.approx(here * (32 / 24) ** 2)
    assert t.start_for(None)[2] == "the default trial"
    t = tuner(index, tmp_path / "c", n_trials=1)
    t.run()
    assert t.final_epoch_seconds(None) == t.epoch_seconds(None)
    # an earlier trial of other learning settings at 32 px is never the start
    other = dataclasses.replace(earlier, config=dataclasses.replace(earlier.config, lr=0.05))
    t = tuner(index, tmp_path / "d", n_trials=1, earlier=other, final_size=32,
              weights_dir=tmp_path / "d" / "w")
    t.run()
    assert t.start_for(None)[2] == "the default trial"


def test_asha_prunes_on_equal_epochs(index, tmp_path, monkeypatch):
    """Successive halving compares trials at the same epoch: a trial worse than the default at
    the first rung (epoch 2 of 3) stops there."""
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.61, 0.62, 0.63], [0.21, 0.22, 0.23]))
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=3))
    t.run()
    default, *others = t.study.trials
    assert default.state == optuna.trial.TrialState.COMPLETE
    for trial in others:
        assert trial.state == optuna.trial.TrialState.PRUNED and max(trial.intermediate_values) == 2


def test_the_first_rung_is_at_two_thirds_of_a_trial(index, tmp_path, monkeypatch):
    """Four epochs per trial: trials are first compared after epoch 3. On digits, trials
    stopped after epoch 2 at chance would have ended at 44-52% (the best 61%), and the sampler,
    told their region was poor, never found plain TPE's best."""
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.61, 0.62, 0.63, 0.64], [0.21, 0.22, 0.23, 0.24]))
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=4))
    t.run()
    assert t.first_rung() == 3
    for trial in t.study.trials[1:]:
        assert trial.state == optuna.trial.TrialState.PRUNED and max(trial.intermediate_values) == 3
    assert [optuna_optimizer.first_rung(e) for e in (1, 2, 3, 4, 6, 12)] == [1, 2, 2, 3, 4, 8]
    # A 2-epoch trial would be judged at its end: nothing saved, a finished trial thrown away
    # (and told to the sampler as poor). Such trials all finish.
    short = with_val_images(tuner(index, tmp_path / "short", n_trials=3, epochs=2))
    short.run()
    assert [trial.state for trial in short.study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    # what the measuring budget counts a trial as, at the least: a trial that has left chance
    # can be stopped after epoch 1 (below)
    assert [OptunaTuner.shortest_trial(p, 4) for p in ("asha", "hyperband", "median", "none")] \
        == [1, 1, 2, 4]
    assert [OptunaTuner.shortest_trial(p, 1) for p in ("asha", "median", "none")] == [1, 1, 1]
    assert [optuna_optimizer.early_rungs(e) for e in (1, 2, 4, 7, 16)] == \
        [[], [1], [1], [1, 3], [1, 3, 9]]


def test_a_trial_that_has_left_chance_can_be_stopped_before_the_first_rung(index, tmp_path,
                                                                           monkeypatch):
    """From pretrained weights every curve leaves chance in the first epoch: a trial clearly
    behind there is stopped after epoch 1, not 3 (replayed on five studies from stand-in
    weights, 0.44-0.84x of plain TPE's epochs where the first rung alone gave 0.78-0.86x, the
    best trial never stopped). Three classes, 1,000 validation images: chance 33%. A trial
    still at chance after epoch 1 waits for the first rung, as from scratch: it may leave
    chance late and lead. So does one within the noise of the leader."""
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.70, 0.72, 0.74, 0.75], [0.45, 0.47, 0.50, 0.52]))
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=4))
    t.run()
    for trial in t.study.trials[1:]:
        assert trial.state == optuna.trial.TrialState.PRUNED and max(trial.intermediate_values) == 1
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.70, 0.72, 0.74, 0.75], [0.34, 0.47, 0.50, 0.52]))
    t = with_val_images(tuner(index, tmp_path / "at_chance", n_trials=3, epochs=4))
    t.run()
    for trial in t.study.trials[1:]:  # at chance after epoch 1: judged at the first rung
        assert trial.state == optuna.trial.TrialState.PRUNED and max(trial.intermediate_values) == 3
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.70, 0.72, 0.74, 0.75], [0.69, 0.72, 0.74, 0.76]))
    t = with_val_images(tuner(index, tmp_path / "close", n_trials=3, epochs=4))
    t.run()
    assert [trial.state for trial in t.study.trials] == [optuna.trial.TrialState.COMPLETE] * 3


def test_a_trial_cut_off_with_its_session_is_no_yardstick(index, tmp_path):
    """A trial cut off with its session (FAIL) is retried with the same parameters: its
    values and its retry's would count one configuration twice. Three classes, 1,000
    validation images: the retry at 60% against the default's 62% is within the noise, and
    goes on; against its own earlier attempt's 75% it was stopped."""
    t = tuner(index, tmp_path)
    study = optuna.create_study(direction="maximize")
    made = lambda state, acc, **kw: optuna.trial.create_trial(  # noqa: E731
        state=state, params=PARAMS, distributions=t.distributions(),
        intermediate_values={1: acc}, **kw)
    study.add_trial(made(optuna.trial.TrialState.COMPLETE, 0.62, value=0.62,
                         user_attrs={"default": True}))
    study.add_trial(made(optuna.trial.TrialState.FAIL, 0.75))
    pruner = optuna_optimizer._BeyondNoise(optuna.pruners.NopPruner(), n_val=1000,
                                           chance=1 / 3, epochs=4, early=[1])
    retry = made(optuna.trial.TrialState.COMPLETE, 0.60, value=0.60)
    assert not pruner.prune(study, retry)
    # the same 75% completed by another configuration is a yardstick: the 60% is stopped
    other = optuna.create_study(direction="maximize")
    for trial in study.trials[:1] + [made(optuna.trial.TrialState.COMPLETE, 0.75, value=0.75)]:
        other.add_trial(trial)
    assert pruner.prune(other, retry)


@pytest.mark.parametrize("pruner", ["asha", "hyperband"])
def test_a_trial_cut_off_with_its_session_is_not_ranked_at_the_rung(index, tmp_path, pruner):
    """Successive halving ranked a retry against its own cut-off attempt (FAIL), whose rung
    value it had recorded: the retry at 70% after epoch 3 of 4, second of six at the rung, was
    stopped as third of seven behind the attempt's 75%. Three classes, 1,000 validation
    images: 80% beats 70% beyond the noise."""
    t = with_val_images(tuner(index, tmp_path, epochs=4, pruner=pruner))
    study = optuna.create_study(direction="maximize", pruner=t._make_pruner())

    def add(state, acc, lr, **kw):
        study.add_trial(optuna.trial.create_trial(
            state=state, params={**PARAMS, "lr": lr}, distributions=t.distributions(),
            intermediate_values={1: acc, 2: acc, 3: acc},
            system_attrs={"completed_rung_0": acc}, **kw))
    add(optuna.trial.TrialState.COMPLETE, 0.80, 1e-3, value=0.80, user_attrs={"default": True})
    for acc, lr in ((0.50, 2e-3), (0.45, 3e-3), (0.40, 4e-3), (0.35, 5e-3)):
        add(optuna.trial.TrialState.PRUNED, acc, lr, value=acc)
    add(optuna.trial.TrialState.FAIL, 0.75, 7e-3)
    retry = study.ask({k: v for k, v in t.distributions().items()})
    for epoch in (1, 2, 3):
        retry.report(0.70, epoch)
        assert not retry.should_prune(), epoch
    assert study.trials[-1].system_attrs["completed_rung_0"] == 0.70  # its rung recorded
    # the same 70% third of eight at the rung, behind 80% and 72%: stopped
    add(optuna.trial.TrialState.PRUNED, 0.72, 8e-3, value=0.72)
    late = study.ask({k: v for k, v in t.distributions().items()})
    for epoch in (1, 2, 3):
        late.report(0.70, epoch)
    assert late.should_prune()


def test_the_default_stays_only_while_no_trial_has_left_chance(index, tmp_path, monkeypatch):
    """Three classes, 1,000 validation images: chance is 33%, two standard errors 3 points.
    Trials all at chance rank nothing: the default stays. A trial that has left chance where
    the default has not is ahead at equal epochs, and is chosen."""
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.34], [0.35]))
    summary = with_val_images(tuner(index, tmp_path, n_trials=3, pruner="median")).run()
    assert summary["keeps_default"] and "no trial has left chance" in summary["choice"]
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.34], [0.6]))
    summary = with_val_images(tuner(index, tmp_path / "learning", n_trials=3,
                                    pruner="median")).run()
    assert not summary["keeps_default"] and "beats the default (34.0%)" in summary["choice"]


def test_on_imbalanced_data_the_search_judges_chance_by_the_largest_class(index, tmp_path,
                                                                           monkeypatch):
    """800 of 1,000 validation images in one class: trials at 80% answer that class and have
    not left chance, where against 1/3 the search's 'best' would replace the default."""
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.34], [0.80]))
    t = tuner(index, tmp_path, n_trials=3, pruner="median")
    t.index = SimpleNamespace(val=[(None, 0)] * 800 + [(None, 1 + i % 2) for i in range(200)],
                              classes=t.index.classes)
    assert t.chance() == pytest.approx(0.8)
    summary = t.run()
    assert summary["keeps_default"] and "no trial has left chance (80.0%" in summary["choice"]


def test_no_trial_is_pruned_while_every_trial_is_still_at_chance(index, tmp_path, monkeypatch):
    """Three classes, 1,000 validation images: chance 33%, two standard errors 3 points. At
    the first rung (epoch 2 of 3) everyone is at chance (the default by luck a little higher):
    nobody is pruned, and the default, leaving chance in its last epoch, is not the only one
    to finish. Once the default has left chance at the rung, a trial still there is pruned."""
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.35, 0.35, 0.6], [0.33, 0.33, 0.33]))
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=3))
    t.run()
    assert [trial.state for trial in t.study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.35, 0.6, 0.6], [0.33, 0.33, 0.33]))
    t = with_val_images(tuner(index, tmp_path / "left", n_trials=3, epochs=3))
    t.run()
    for trial in t.study.trials[1:]:
        assert trial.state == optuna.trial.TrialState.PRUNED
        assert max(trial.intermediate_values) == 2


def test_a_trial_behind_by_less_than_the_noise_is_not_pruned(index, tmp_path, monkeypatch):
    """Successive halving keeps only the top trial of a small rung, however close the next.
    200 validation images: one standard error of the difference near 50% is 5 points, so a
    trial 3 points behind the default at the first rung (epoch 2 of 3) trains on (and here ends
    ahead), while one 20 points behind stops there."""
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.50, 0.52, 0.53],
                                                              [0.47, 0.49, 0.70]))
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=3), n=200)
    t.run()
    assert [trial.state for trial in t.study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    monkeypatch.setattr(optuna_optimizer, "fit", curves_by_lr([0.50, 0.52, 0.53],
                                                              [0.30, 0.32, 0.70]))
    t = with_val_images(tuner(index, tmp_path / "far", n_trials=3, epochs=3), n=200)
    t.run()
    for trial in t.study.trials[1:]:
        assert trial.state == optuna.trial.TrialState.PRUNED
        assert max(trial.intermediate_values) == 2


def test_local_dir_keeps_the_study_local_and_copies_it_to_the_output_dir(index, tmp_path,
                                                                          monkeypatch):
    """An output dir on a network drive (Colab's Google Drive) holds a copy after every trial;
    a new machine (an empty local dir) continues from that copy."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t = tuner(index, tmp_path, local_dir=tmp_path / "local")
    assert t.storage_url.startswith(f"sqlite:///{tmp_path / 'local'}")
    t.run()
    copy = tmp_path / "hpo" / "optuna.db"
    stored = optuna.load_study(study_name="hpo", storage=f"sqlite:///{copy}")
    assert len(stored.trials) == 2
    del stored
    again = tuner(index, tmp_path, local_dir=tmp_path / "new-machine", resume=True, n_trials=3)
    again.run()
    assert len(again.study.trials) == 3
    assert len(optuna.load_study(study_name="hpo", storage=f"sqlite:///{copy}").trials) == 3


def test_local_dir_copies_a_trial_to_the_output_dir_as_it_starts(index, tmp_path, monkeypatch):
    """The copy was refreshed only after a trial ended: a session lost mid-trial (a new Colab
    VM, its local dir gone) left no RUNNING trial in it to retry on resume."""
    copy = tmp_path / "hpo" / "optuna.db"
    seen = []

    def looking(idx, config, on_epoch):
        stored = optuna.load_study(study_name="hpo", storage=f"sqlite:///{copy}")
        seen.append(stored.trials[-1].state)
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", looking)
    tuner(index, tmp_path, local_dir=tmp_path / "local", n_trials=2).run()
    assert seen == [optuna.trial.TrialState.RUNNING] * 2

    def stopped(idx, config, on_epoch):
        raise KeyboardInterrupt  # Stop pressed mid-trial
    monkeypatch.setattr(optuna_optimizer, "fit", stopped)
    with pytest.raises(KeyboardInterrupt):
        tuner(index, tmp_path, local_dir=tmp_path / "local", n_trials=3, resume=True).run()
    stored = optuna.load_study(study_name="hpo", storage=f"sqlite:///{copy}")
    assert [t.state.name for t in stored.trials][2:] == ["FAIL", "WAITING"]  # none RUNNING


def test_a_smaller_batch_must_beat_the_default_within_the_default_trials_steps(index, tmp_path):
    """Batch 4 takes twice the optimizer steps of the default's batch 8 per epoch: over 4-epoch
    trials it is judged after epoch 2. Leading only at epochs 3-4 keeps the default; leading by
    epoch 2 wins. A larger batch (fewer steps) is judged over all its epochs. 1,000 validation
    images: one standard error of a difference near 50% is ~2.2 points."""
    t = with_val_images(tuner(index, tmp_path, epochs=4, batch_sizes=(4, 8, 16)))
    default_curve = [0.3, 0.4, 0.45, 0.5]

    def study_with(batch, curve):
        t.study = optuna.create_study(direction="maximize")
        for params, accs, attrs in ((t.default_params(), default_curve, {"default": True}),
                                    ({**PARAMS, "batch_size": batch}, curve, {})):
            t.study.add_trial(optuna.trial.create_trial(
                params=params, distributions=t.distributions(), value=max(accs),
                user_attrs=attrs, intermediate_values=dict(enumerate(accs, start=1))))
        return t.choice()

    assert t.default_params()["batch_size"] == 8
    params, why = study_with(4, [0.35, 0.45, 0.6, 0.7])
    assert params is None and "45.0% after epoch 2" in why and "keeping the default" in why
    params, why = study_with(4, [0.45, 0.6, 0.65, 0.7])
    assert params["batch_size"] == 4 and "60.0% after epoch 2" in why and "beats" in why
    params, why = study_with(16, [0.2, 0.3, 0.5, 0.6])
    assert params["batch_size"] == 16 and "after epoch" not in why


def test_a_trial_whose_first_epoch_outsteps_the_default_trial_does_not_win(index, tmp_path):
    """Batch 2 beside the default's 8 over 3-epoch trials: its first epoch alone takes 4/3 of
    the default trial's optimizer steps, so no epoch of it can be judged within them. It does
    not win however far ahead it ends; the best trial that can be judged still does."""
    t = with_val_images(tuner(index, tmp_path, epochs=3, batch_sizes=(2, 8, 16)))
    t.batch_sizes = (2, 8, 16)  # a study of a version that still searched batch 2
    assert t.default_params()["batch_size"] == 8
    t.study = optuna.create_study(direction="maximize")
    for params, accs, attrs in ((t.default_params(), [0.3, 0.4, 0.45], {"default": True}),
                                ({**PARAMS, "batch_size": 2}, [0.7, 0.8, 0.9], {}),
                                ({**PARAMS, "batch_size": 16}, [0.4, 0.5, 0.6], {})):
        t.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=t.distributions(), value=max(accs),
            user_attrs=attrs, intermediate_values=dict(enumerate(accs, start=1))))
    params, why = t.choice()
    assert params["batch_size"] == 16 and "trial 2, 60.0%" in why and "beats" in why
    assert t.within_default_steps(t.study.trials[1], t.study.trials[0])[1] == 0


def test_a_trials_steps_are_counted_as_the_trainer_takes_them(tmp_path, monkeypatch):
    """Steps are counted as the trainer takes them, per process under torchrun and per
    grad_accum_steps batches. 100 images, 4 epochs: batch 64 takes 4 steps in all, and batch
    16's first epoch alone 6, where the batch ratio said one epoch's would be 4: left out of the
    search. A short last batch dropped each epoch is within STEP_SLACK: over 1,200 images the
    default's batch 32 takes 37 steps an epoch, batch 16 75, and batch 16 is judged after half
    the epochs (12-epoch trials: 450 steps to 444; 4-epoch ones: 150 to 148), not fewer."""
    def at(n_train, batch, epochs, **changes):
        index = SimpleNamespace(train=[None] * n_train, val=[], classes=["a", "b", "c"])
        base = dataclasses.replace(BASE, batch_size=batch, **changes)
        return OptunaTuner(index, base, output_dir=tmp_path / f"{n_train}-{batch}-{changes}",
                           epochs=epochs, batch_sizes=(16, 32, 64))

    t = at(1200, 32, 12)
    assert t._judged_at(16, {e: e / 100 for e in range(1, 13)}, 0.12) == (0.06, 6)
    assert at(1200, 32, 4)._judged_at(16, {1: 0.1, 2: 0.2, 3: 0.3}, 0.4) == (0.2, 2)
    assert at(1200, 32, 12, grad_accum_steps=2)._judged_at(16, {6: 0.5}, 0.6) == (0.5, 6)
    t = at(100, 64, 4)
    assert t.unjudged == {16} and t.batch_sizes == (32, 64)
    assert t._judged_at(32, {1: 0.5, 2: 0.6}, 0.6) == (0.5, 1)
    monkeypatch.setattr(optuna_optimizer.distributed, "world_size", lambda: 2)
    t = at(100, 64, 4)  # 50 images a process: one step an epoch at either batch
    assert not t.unjudged and t._judged_at(32, {1: 0.5, 2: 0.6}, 0.6) == (0.6, 4)


def test_the_trials_are_ranked_within_the_default_trials_steps(index, tmp_path):
    """The search's best is the trial ahead within the default trial's optimizer steps, not
    the one ahead at its last epoch: batch 4 ends highest by its extra steps (45% after epoch
    2), and ranked by that alone it hid a batch-8 trial 20 points ahead of the default."""
    t = with_val_images(tuner(index, tmp_path, epochs=4, batch_sizes=(4, 8, 16)))
    t.study = optuna.create_study(direction="maximize")
    for params, accs, attrs in ((t.default_params(), [0.3, 0.4, 0.45, 0.5], {"default": True}),
                                ({**PARAMS, "batch_size": 4}, [0.35, 0.45, 0.6, 0.9], {}),
                                ({**PARAMS, "lr": 3e-3, "batch_size": 8}, [0.4, 0.5, 0.6, 0.7],
                                 {})):
        t.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=t.distributions(), value=max(accs),
            user_attrs=attrs, intermediate_values=dict(enumerate(accs, start=1))))
    params, why = t.choice()
    assert params is not None and params["batch_size"] == 8 and "trial 2, 70.0%" in why, why


def test_the_chosen_trial_keeps_its_weights(index, tmp_path, monkeypatch):
    """A trial that ends highest but cannot be judged within the default's steps (batch 2
    beside 8 over 3 epochs) is never chosen: it must not delete the weights of the trial that
    is (batch 16), or the final run would start from scratch."""
    curves = {8: [0.3, 0.4, 0.45], 16: [0.4, 0.5, 0.6], 2: [0.7, 0.8, 0.9]}

    def fit_(idx, config, on_epoch):
        accs = curves[config.batch_size]
        for epoch, acc in enumerate(accs, start=1):
            on_epoch(epoch, {"val_acc": acc})
        return SimpleNamespace(best_val_acc=max(accs), epochs_run=3, wall_s=0.01, timing={},
                               model=torch.nn.Linear(1, 1))
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    t = with_val_images(tuner(index, tmp_path, n_trials=1, epochs=3, batch_sizes=(2, 8, 16),
                              pruner="none", weights_dir=tmp_path / "w", storage=storage))
    t.batch_sizes = (2, 8, 16)  # a study of a version that still searched batch 2
    t.run()
    study = optuna.load_study(study_name="hpo", storage=storage)
    study.enqueue_trial({**PARAMS, "batch_size": 16})
    study.enqueue_trial({**PARAMS, "batch_size": 2})
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=3, batch_sizes=(2, 8, 16),
                              pruner="none", weights_dir=tmp_path / "w", storage=storage,
                              resume=True))
    summary = t.run()
    assert summary["chosen_params"]["batch_size"] == 16, summary["choice"]
    # the study keeps batch 2 among its choices (Optuna's rule), but a trial drawn at it is
    # stopped before it trains: it could never be judged against the default
    drawn = t.study.trials[2]
    assert drawn.state == optuna.trial.TrialState.PRUNED and not drawn.intermediate_values
    assert drawn.user_attrs["pruned_reason"].startswith("batch 2 not trained")
    # ... and not counted: another trial is drawn in its place, and trained
    trained = [x for x in t.study.trials if not x.user_attrs.get("untrained")]
    assert len(trained) == 3 and summary["n_trials"] == 3
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == \
        ["hpo-trial-0.weights.pt", "hpo-trial-1.weights.pt"]
    assert t.weights_for(summary["chosen_params"])[0].name == "hpo-trial-1.weights.pt"


def test_the_default_trial_is_judged_whatever_batch_it_is_recorded_at(index, tmp_path):
    """A default batch between the search's choices is recorded at the nearest (4 for 8): over
    1-epoch trials its own ratio read 0 epochs within its steps, the default left the
    comparison, and a batch-2 trial won on its whole value, "after epoch 0"."""
    t = with_val_images(tuner(index, tmp_path, epochs=1, batch_sizes=(2, 4)))
    assert t.default_params()["batch_size"] == 4 and t.base.batch_size == 8
    t.study = optuna.create_study(direction="maximize")
    for params, acc, attrs in ((t.default_params(), 0.45, {"default": True}),
                               ({**PARAMS, "batch_size": 2}, 0.9, {})):
        t.study.add_trial(optuna.trial.create_trial(
            params=params, distributions=t.distributions(), value=acc, user_attrs=attrs,
            intermediate_values={1: acc}))
    params, why = t.choice()
    assert params is None and "keeping the default" in why and "epoch 0" not in why


def test_a_batch_that_could_never_be_judged_is_not_searched(index, tmp_path):
    """Over 3-epoch trials, batch 2's first epoch takes more optimizer steps than the default
    batch 8's whole trial: choice() could never pick it, yet it was drawn, and at equal epochs
    its extra steps set the bar that pruned the others."""
    assert tuner(index, tmp_path, epochs=3, batch_sizes=(2, 4, 8, 16)).batch_sizes == (4, 8, 16)
    # none left: the choices as they were (the default's own is judged whatever its batch)
    assert tuner(index, tmp_path, epochs=1, batch_sizes=(2, 4)).batch_sizes == (2, 4)


def test_a_default_with_no_rival_is_not_said_to_beat_itself(index, tmp_path):
    """Every other trial pruned: "the search's best (trial 0) does not beat the default"
    named the default as the search's best."""
    t = with_val_images(tuner(index, tmp_path))
    t.study = optuna.create_study(direction="maximize")
    t.study.add_trial(optuna.trial.create_trial(
        params=t.default_params(), distributions=t.distributions(), value=0.9,
        user_attrs={"default": True}, intermediate_values={1: 0.8, 2: 0.9}))
    t.study.add_trial(optuna.trial.create_trial(
        params={**PARAMS, "batch_size": 16}, distributions=t.distributions(),
        state=optuna.trial.TrialState.PRUNED, intermediate_values={1: 0.2}))
    params, why = t.choice()
    assert params is None and why == ("no trial but the default's completed within its "
                                      "optimizer steps, to compare with it (90.0%): keeping "
                                      "the default")


def test_a_default_that_diverged_gives_way_to_the_search_s_best(index, tmp_path, monkeypatch):
    """The default configuration's trial diverged: its final run would diverge too and end the
    scenario with nothing. The search's best completed trial is trained instead, and why is
    said."""
    from modules.trainer import DivergedError

    def fit_(idx, config, on_epoch):
        if config.lr == BASE.lr:
            raise DivergedError("training diverged: the loss was NaN/inf in 3 batches")
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    summary = tuner(index, tmp_path, n_trials=3).run()
    assert summary["chosen_params"] is not None and summary["chosen_params"]["lr"] != BASE.lr
    assert "the default configuration's trial failed (training diverged" in summary["choice"]
    # nothing else completed either: said, as its final run may fail the same way
    monkeypatch.setattr(optuna_optimizer, "fit", lambda *a, **k: (_ for _ in ()).throw(
        DivergedError("training diverged: the loss was NaN/inf in 3 batches")))
    summary = tuner(index, tmp_path / "all", n_trials=2).run()
    assert summary["chosen_params"] is None and summary["choice"].startswith(
        "no trial completed: keeping the default configuration, whose trial failed (training "
        "diverged")


def test_a_study_given_by_storage_is_joined_whatever_the_database(index, tmp_path, monkeypatch):
    """--storage sqlite:///... names a study other runs search too, as a PostgreSQL URL does:
    a second run joins it and runs its own trials, where it used to stop with "already exists"
    after the baseline and resolution scenarios had trained."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    first = tuner(index, tmp_path / "a", storage=storage, shared=True).run()
    second = tuner(index, tmp_path / "b", storage=storage, shared=True, seed=7).run()
    assert (first["n_trials"], second["n_trials"]) == (2, 4)
    with pytest.raises(UserError, match="refusing to delete the shared study"):
        tuner(index, tmp_path / "c", storage=storage, shared=True, overwrite=True).run()


def test_a_search_the_time_budget_ended_says_so(index, tmp_path, monkeypatch, caplog):
    def slow_fit(*args, **kwargs):
        time.sleep(0.3)  # past the budget: no second trial starts
        return fake_fit(*args, **kwargs)
    monkeypatch.setattr(optuna_optimizer, "fit", slow_fit)
    with caplog.at_level("INFO"):
        assert tuner(index, tmp_path, n_trials=3, timeout_s=0.1).run()["n_complete"] == 1
    assert "the time budget (0 s) ended the search after 1 of the 3 trials" in caplog.text


def test_the_time_budget_is_the_searchs_in_all_over_resumed_sessions(index, tmp_path,
                                                                       monkeypatch, caplog):
    """A resumed search spends only what its earlier sessions left of the budget: a session
    ended by Ctrl-C must not start the whole budget again."""
    def slow_fit(*args, **kwargs):
        time.sleep(0.3)
        return fake_fit(*args, **kwargs)
    monkeypatch.setattr(optuna_optimizer, "fit", slow_fit)
    first = tuner(index, tmp_path, n_trials=2).run()
    assert first["n_trials"] == 2 and first["search_s"] >= 0.6 and first["time_budget_s"] is None
    with caplog.at_level("INFO"):
        spent = tuner(index, tmp_path, n_trials=4, timeout_s=0.5, resume=True)
        assert spent.run()["n_trials"] == 2 and spent.time_left() < 0
    assert "its time budget (0 s) was spent by the trials already run: none added" in caplog.text
    # With room left it runs on, and stops starting trials once the room is spent.
    more = tuner(index, tmp_path, n_trials=6, timeout_s=first["search_s"] + 0.1, resume=True)
    grown = more.run()
    assert grown["n_trials"] == 3 and grown["time_budget_s"] == first["search_s"] + 0.1
    assert grown["search_s"] >= 0.9


def test_the_time_budget_counts_trial_seconds_in_every_session(index, tmp_path, monkeypatch):
    """Trials of 0.8 s, 1.6 s apart (the gap: saving, logging), and a budget of 3 s: by the
    trials' own seconds, the measure a resumed session reads, the fourth trial is the last.
    Optuna's wall-clock timeout stopped after two, and a resumed search then found time left
    and ran two more: an interrupted run searched more than an uninterrupted one. The trials'
    seconds are counted as 0.8 each (search_seconds, which sums their durations, is tested
    above): timed for real, a loaded machine's overhead pushed three trials past 2.4 s."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    monkeypatch.setattr(OptunaTuner, "_log_trial", lambda self, study, trial: time.sleep(1.6))
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    monkeypatch.setattr(OptunaTuner, "search_seconds", lambda self: 0.8 * sum(
        t.state in done for t in self.study.trials))
    first = tuner(index, tmp_path, n_trials=10, timeout_s=3.0).run()
    assert first["n_trials"] == 4
    again = tuner(index, tmp_path, n_trials=10, timeout_s=3.0, resume=True, study_count=True)
    assert again.run()["n_trials"] == 4


def test_a_resumed_search_keeps_the_budget_it_was_started_with(index, tmp_path, monkeypatch):
    """Started with --n-trials 6 (no time budget) and cut off after 3 trials, a plain --resume
    (the count from the study, the pipeline's automatic budget offered) runs all 6: the
    automatic budget, which the first session never had, had ended it after 3."""
    calls = []

    def fit_(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        time.sleep(0.2)
        return fake_fit(*args, **kwargs)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    with pytest.raises(KeyboardInterrupt):
        tuner(index, tmp_path, n_trials=6).run()
    resumed = tuner(index, tmp_path, n_trials=20, timeout_s=0.5, auto_budget=True,
                    study_count=True, resume=True)
    summary = resumed.run()
    assert summary["n_trials"] == 6 and summary["time_budget_s"] is None
    # A budget the user gives on the resume (--time-budget) is kept.
    given = tuner(index, tmp_path, n_trials=20, timeout_s=0.1, study_count=True, resume=True)
    given.run()
    assert given.timeout_s == 0.1


def test_a_shared_studys_time_budget_is_this_sessions(index, tmp_path):
    """On a shared study the trials are every worker's: each worker's budget is its own."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    tuner(index, tmp_path / "a", storage=storage, shared=True).run()
    joined = tuner(index, tmp_path / "b", storage=storage, shared=True, timeout_s=30.0)
    joined.run()
    assert joined.time_left() == 30.0


def test_successive_halving_ranks_every_trial_at_the_rungs_own_epoch():
    """Two trials still at chance at the first rung (epoch 4 of 6), leaving it at epoch 5:
    their rung value is their epoch-4 accuracy, not a later one. A later trial second of six
    there, in the top third, goes on."""
    from types import SimpleNamespace
    t = OptunaTuner.__new__(OptunaTuner)
    t.index = SimpleNamespace(val=[(None, i % 10) for i in range(1000)],
                              classes=list(range(10)))  # chance 10%
    t.epochs, t.pruner = 6, "asha"
    assert t.first_rung() == 4
    study = optuna.create_study(direction="maximize", pruner=t._make_pruner())

    def run(curve):
        trial = study.ask()
        for epoch, acc in enumerate(curve, 1):
            trial.report(acc, epoch)
            if trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                return epoch
        study.tell(trial, max(curve))
        return None
    for curve in ([.10, .10, .10, .10, .90, .92], [.10, .10, .10, .10, .90, .92],
                  [.10, .10, .10, .80, .85, .86], [.10, .10, .10, .30, .35, .36],
                  [.10, .10, .10, .30, .35, .36]):
        run(curve)
    assert run([.10, .10, .10, .60, .70, .75]) is None  # second of six at epoch 4
    assert {t.system_attrs.get("completed_rung_0") for t in study.trials[:2]} == {0.10}


def test_the_median_pruner_judges_no_trial_at_its_first_epoch(index, tmp_path, monkeypatch):
    """MEDIAN_WARMUP epochs unjudged, as shortest_trial counts them: Optuna judges from the
    step equal to n_warmup_steps, and epochs are reported from 1."""
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.70, 0.72, 0.74, 0.75], [0.20, 0.47, 0.50, 0.52]))
    t = with_val_images(tuner(index, tmp_path, n_trials=3, epochs=4, pruner="median"))
    t.run()
    stopped = [max(trial.intermediate_values) for trial in t.study.trials
               if trial.state == optuna.trial.TrialState.PRUNED]
    assert stopped and min(stopped) == OptunaTuner.shortest_trial("median", 4) == 2


def test_a_growth_cut_short_is_finished_by_the_next_resume(index, tmp_path, monkeypatch):
    """`--resume --n-trials 4` after a finished 2-trial study, interrupted after one new
    trial: the study is recorded as asked for 4 with 3 done. The next resume, with the same
    count or none of its own, runs the one it lacks; then none more."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    tuner(index, tmp_path, n_trials=2).run()
    calls = []

    def interrupted(idx, config, on_epoch):
        calls.append(config.lr)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tuner(index, tmp_path, n_trials=4, resume=True).run(ended=True)
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    plain = tuner(index, tmp_path, n_trials=99, resume=True, study_count=True)  # no --n-trials
    plain.run(ended=True)
    done = [t for t in plain.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert plain.new_trials == 1 and len(done) == 4
    again = tuner(index, tmp_path, n_trials=4, resume=True)
    again.run(ended=True)
    assert again.new_trials == 0


def test_a_pruned_default_trial_stands_and_is_not_queued_again(index, tmp_path, monkeypatch):
    """A default configuration that diverged is a result (it diverges again): a resumed or
    grown study does not train it again, nor leave a waiting copy when it runs nothing."""
    from modules.trainer import DivergedError
    trained = []

    def fit_(idx, config, on_epoch):
        trained.append(config.lr)
        if config.lr == BASE.lr:
            raise DivergedError("loss is nan at epoch 1")
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    tuner(index, tmp_path, n_trials=3).run()
    assert trained.count(BASE.lr) == 1
    grown = tuner(index, tmp_path, n_trials=5, resume=True)
    grown.run(ended=True)
    assert trained.count(BASE.lr) == 1 and len(grown.study.trials) == 5
    same = tuner(index, tmp_path, n_trials=5, resume=True)
    same.run(ended=True)
    assert len(same.study.trials) == 5
    assert not [t for t in same.study.trials if t.state == optuna.trial.TrialState.WAITING]


def test_workers_starting_together_on_a_new_shared_study_queue_one_default(index, tmp_path,
                                                                          monkeypatch):
    """Two workers of a job array: the one whose create_study made the study queues the
    default configuration; one that joined it still empty (its creator about to queue it)
    does not queue a second. A worker joining a study with trials and no default queues it."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    joiner = tuner(index, tmp_path / "b", storage=storage, shared=True)
    optuna.create_study(storage=storage, study_name=joiner.study_name, direction="maximize")
    joiner.run()  # the study was created a moment before by the other worker, still empty
    assert not [t for t in joiner.study.trials if t.user_attrs.get("default")]
    late = tuner(index, tmp_path / "c", storage=storage, shared=True)
    late.run()
    assert len([t for t in late.study.trials if t.user_attrs.get("default")]) == 1
    creator = tuner(index, tmp_path / "a", storage=f"sqlite:///{tmp_path / 'other.db'}",
                    shared=True)
    creator.run()
    assert creator.study.trials[0].user_attrs.get("default")


def test_a_resumed_worker_on_a_shared_study_counts_its_own_trials(index, tmp_path, monkeypatch):
    """Each worker runs its n_trials on a shared study, over its sessions: resumed, it runs
    only what it lacks; grown with --n-trials N after its final run started, it grows its own
    trials to N, whatever the other workers added."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"

    def worker(run, **kw):
        return tuner(index, tmp_path / run, storage=storage, shared=True, run_name=run, **kw)
    first = worker("first", n_trials=3)
    first.run()
    again = worker("first", n_trials=3, resume=True)
    again.run()
    assert again.new_trials == 0
    worker("second", n_trials=3, seed=7).run()
    grown = worker("first", n_trials=5, resume=True)
    grown.run(ended=True)
    assert grown.new_trials == 2 and len(grown.study.trials) == 8
    same = worker("first", n_trials=99, resume=True, study_count=True)  # no --n-trials
    same.run(ended=True)
    assert same.new_trials == 0


def test_a_search_its_time_budget_ended_is_not_resumed_once_its_final_run_started(
        index, tmp_path, monkeypatch):
    """Without --n-trials the search stops at the baseline's time, short of the preset count
    it records: once its final run has started, a plain --resume adds no trial (it could only
    change the best under the final run); an explicit --n-trials grows it."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    first = tuner(index, tmp_path, n_trials=3)
    first.run()
    first.study.set_user_attr("n_trials", 20)  # the preset it was asked for, 3 trained in time
    plain = tuner(index, tmp_path, n_trials=20, resume=True, study_count=True)
    plain.run(ended=True)
    assert plain.new_trials == 0
    grown = tuner(index, tmp_path, n_trials=4, resume=True)
    grown.run(ended=True)
    assert grown.new_trials == 1


def test_the_same_command_resumed_again_does_not_grow_a_search_its_budget_ended(
        index, tmp_path, monkeypatch):
    """`--n-trials 5 --time-budget S` ran 2 trials in S, then its final run started: resuming
    that command after a crash in the final run added trials each time (5 is above 2), and
    could set the finished final run aside. Only an --n-trials above the one given grows it."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    first = tuner(index, tmp_path, n_trials=2)
    first.run()
    first.study.set_user_attr("n_trials:given", 5)  # asked for 5, the budget ended it at 2
    first.study.set_user_attr("n_trials", 5)
    again = tuner(index, tmp_path, n_trials=5, resume=True)
    again.run(ended=True)
    assert again.new_trials == 0
    grown = tuner(index, tmp_path, n_trials=6, resume=True)
    grown.run(ended=True)
    assert grown.new_trials == 4 and len(grown.study.trials) == 6


def test_workers_of_a_shared_study_do_not_draw_each_others_trials(index, tmp_path, monkeypatch):
    """The sampler's seed was worker seed + trials in the study: worker 3 joining at 6 trials
    drew exactly what worker 5 joining at 4 had drawn."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"

    def worker(run, seed, n):
        w = tuner(index, tmp_path / run, storage=storage, shared=True, run_name=run, seed=seed,
                  n_trials=n)
        w.run()
        return w
    worker("w0", 0, 4)
    worker("w5", 5, 2)
    study = worker("w3", 3, 2).study
    drawn = [json.dumps(t.params, sort_keys=True) for t in study.trials
             if not t.user_attrs.get("default")]
    assert len(drawn) == 7 and len(set(drawn)) == 7, drawn


def test_a_worker_with_another_default_is_refused_by_a_shared_study(index, tmp_path,
                                                                   monkeypatch):
    """The default trial, which any worker may pop and train with its own --lr, is recorded
    with the creator's: a worker with another default would compare against a trial that
    trained neither, and is refused in one line."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    tuner(index, tmp_path / "a", storage=storage, shared=True, run_name="a").run()
    other = tuner(index, tmp_path / "b", storage=storage, shared=True, run_name="b")
    other.base = dataclasses.replace(other.base, lr=3e-3)
    with pytest.raises(UserError, match=r"its trials trained default_lr=0.001, this run's "
                                        r"would train default_lr=0.003"):
        other.run()


def test_the_default_trial_is_never_pruned_on_a_shared_study(index, tmp_path, monkeypatch):
    """A faster worker's trial, ahead at the first rung, stopped the default trial there;
    choice() then found no completed default and every worker kept the default configuration,
    however far the other trial ended above it."""
    monkeypatch.setattr(optuna_optimizer, "fit",
                        curves_by_lr([0.21, 0.22, 0.23], [0.61, 0.62, 0.63]))
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    worker = with_val_images(tuner(index, tmp_path / "a", storage=storage, shared=True,
                                   n_trials=2, epochs=3))
    study = optuna.create_study(storage=storage, study_name=worker.study_name,
                                direction="maximize")
    ahead = {**worker.default_params(), "lr": 5e-3}
    study.add_trial(optuna.trial.create_trial(  # the other worker's, finished first
        params=ahead, distributions=worker.distributions(), value=0.63,
        intermediate_values={1: 0.61, 2: 0.62, 3: 0.63},
        system_attrs={"completed_rung_0": 0.62}))
    worker.run()
    default = next(t for t in worker.study.trials if t.user_attrs.get("default"))
    assert default.state == optuna.trial.TrialState.COMPLETE
    summary = worker.summary()
    assert not summary["keeps_default"] and summary["chosen_params"]["lr"] == 5e-3


def test_the_default_trial_trains_the_default_configuration_itself(index, tmp_path,
                                                                    monkeypatch):
    """--lr 0.05 and --batch-size 8 lie outside the searched ranges: the default trial trained
    lr 0.01 and batch 16, while "keeping the default" trained 0.05 and 8, from that trial's
    weights; best_params.json named values never trained."""
    trained = []

    def fit_(idx, config, on_epoch):
        trained.append((config.lr, config.batch_size, config.weight_decay))
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    base = dataclasses.replace(BASE, lr=0.05, batch_size=8, weight_decay=0.0)
    t = OptunaTuner(index, base, output_dir=tmp_path / "hpo", epochs=2, batch_sizes=(16, 32),
                    n_trials=1)
    t.run()
    assert trained == [(0.05, 8, 0.0)]
    assert t.study.trials[0].params["lr"] == OptunaTuner.LR_RANGE[1]  # the study's point
    saved = json.loads((tmp_path / "hpo" / "best_params.json").read_text()) \
        if t.save_plots() else None
    assert saved["trained_params"] == {"lr": 0.05, "batch_size": 8, "optimizer": base.optimizer,
                                       "weight_decay": 0.0}
    # the study's best is the default trial: named by what it trained, not the study's point
    assert saved["best_params"] == saved["trained_params"]


def test_a_shared_study_of_another_model_or_start_is_refused(index, tmp_path, monkeypatch):
    """A worker with --model resnet18 joined a squeezenet study: its trial was ranked against
    theirs, and a squeezenet worker that then picked it failed after its whole search on
    weights of another architecture."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    tuner(index, tmp_path / "a", storage=storage, shared=True).run()
    for change, said in (({"model": "squeezenet1_1"}, "model=resnet18"),
                         ({"weights": "imagenet"}, "weights=none"),
                         ({"scheduler": "cosine"}, "scheduler=none")):
        other = OptunaTuner(index, dataclasses.replace(BASE, **change),
                            output_dir=tmp_path / "b" / "hpo", epochs=2, batch_sizes=(8, 16),
                            n_trials=2, storage=storage, shared=True)
        with pytest.raises(UserError, match=said):
            other.run()
    # the same setup joins
    tuner(index, tmp_path / "c", storage=storage, shared=True, seed=5).run()


def test_a_retried_trial_is_judged_at_the_rungs_it_had_passed_before_the_kill():
    """Optuna's retry copied the cut-off trial's successive-halving rungs: the retry, clearly
    behind at the first rung, was not pruned there, where a fresh trial of the same curve
    was."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = modules.storage.retry_callback()
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL, params={"lr": 1e-3},
        distributions={"lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)},
        system_attrs={"completed_rung_0": 0.66}, intermediate_values={1: 0.35, 2: 0.51}))
    retry(study, study.trials[0])
    again = study.trials[1]
    assert again.state == optuna.trial.TrialState.WAITING and again.params == {"lr": 1e-3}
    assert again.system_attrs["failed_trial"] == 0
    assert not [k for k in again.system_attrs if k.startswith("completed_rung_")]
    assert study.trials[0].system_attrs["completed_rung_0"] == 0.66  # the original as it was


def test_a_database_locked_mid_search_is_one_line_and_the_search_resumes(index, tmp_path,
                                                                        monkeypatch):
    """Another process holding SQLite's lock past the wait (the sqlite3 shell, a stuck
    worker) failed the search with pages of chained tracebacks. It is one line that says to
    resume, and the resumed search keeps the finished trial and completes."""
    monkeypatch.setattr(modules.storage, "SQLITE_WAIT_S", 0.2)
    t = tuner(index, tmp_path, n_trials=3)
    database = t.storage_url.removeprefix("sqlite:///")
    holder = []

    def fit_(idx, config, on_epoch):
        if len(holder) == 0 and config.lr != BASE.lr:  # trial 1: another process locks it
            holder.append(sqlite3.connect(database, isolation_level=None))
            holder[0].execute("BEGIN EXCLUSIVE")
        return fake_fit(idx, config, on_epoch)
    monkeypatch.setattr(optuna_optimizer, "fit", fit_)
    with pytest.raises(UserError, match=r"the study's storage .* failed \(.*database is locked"
                                        r".*rerun with --resume to continue"):
        t.run()
    holder[0].execute("ROLLBACK")
    holder[0].close()
    resumed = tuner(index, tmp_path, n_trials=3, resume=True)
    summary = resumed.run()
    assert summary["n_complete"] == 3 and resumed.study.trials[0].user_attrs["default"]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed")
def test_a_worker_waits_for_the_default_trial_another_is_training(index, tmp_path,
                                                                   monkeypatch, caplog):
    """On a shared study, a worker whose trials ended while another still trained the
    default trial found no default to compare with: it kept the default, untrained, whatever
    its own trials reached. It now waits for that trial, unless its worker went silent."""
    t = tuner(index, tmp_path, storage=f"sqlite:///{tmp_path / 'shared.db'}", shared=True)
    t.study = optuna.create_study(storage=t.storage, study_name="s", direction="maximize")
    other = t.study.ask(t.distributions())  # another worker's, RUNNING
    other.set_user_attr("default", True)
    slept = []

    def sleep(seconds):  # meanwhile the other worker ends its trial
        slept.append(seconds)
        t.study.tell(other, 0.5)
    monkeypatch.setattr(optuna_optimizer.time, "sleep", sleep)
    with caplog.at_level("INFO", logger="optuna_optimizer"):
        t._await_default()
    assert len(slept) == 1 and t._default_trial().number == other.number
    assert f"waiting for trial {other.number}, the default configuration" in caplog.text
    # a default trial whose worker went silent is not waited for: it is trained here
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    t.study = optuna.create_study(storage=t.storage, study_name="s2", direction="maximize")
    silent = t.study.ask(t.distributions())
    silent.set_user_attr("default", True)
    monkeypatch.setattr(t.storage, "_get_stale_trial_ids", lambda study_id: [silent._trial_id])
    t._await_default()
    assert len(slept) == 1 and t._default_trial().system_attrs["failed_trial"] == silent.number


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # our study.ask() plays the dead run
def test_a_default_trial_whose_worker_died_is_trained_by_the_worker_waiting_for_it(
        index, tmp_path, monkeypatch):
    """A worker killed while it trained the default trial, restarted (or joined by another)
    before the heartbeat's grace period: its trials started while the dead one still looked
    alive, so none retried it, and after waiting out the grace period it kept the default
    untrained ("no completed trial to compare with"), the dead trial left RUNNING."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    monkeypatch.setattr(modules.storage, "HEARTBEAT_S", 1)
    monkeypatch.setattr(modules.storage, "GRACE_S", 3)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    dead_worker = tuner(index, tmp_path / "a", storage=url, shared=True)
    study = optuna.create_study(storage=dead_worker.storage, study_name=dead_worker.study_name,
                                direction="maximize")
    study.set_user_attr("data_fingerprint", dead_worker.data_fingerprint)
    study.enqueue_trial(dead_worker.default_params(), user_attrs={"default": True})
    dead = study.ask()  # the default trial, RUNNING, then its worker is killed
    dead_worker.storage.record_heartbeat(dead._trial_id)
    t = tuner(index, tmp_path / "b", storage=url, shared=True, n_trials=1)
    summary = t.run()
    default = [x for x in t.study.trials if x.user_attrs.get("default")]
    assert [x.state for x in default] == [optuna.trial.TrialState.FAIL,
                                          optuna.trial.TrialState.COMPLETE]
    assert summary["default_value"] is not None
    assert "no completed trial" not in summary["choice"]


def test_a_study_resumed_with_other_accumulation_is_refused(index, tmp_path, monkeypatch):
    """A searched batch is a micro-batch: trials of batch 16 with 4x accumulation took an
    effective batch of 64 and a quarter of the optimizer steps of batch 16 before, under the
    same parameter, and choice() judged every trial by this session's accumulation."""
    monkeypatch.setattr(optuna_optimizer, "fit", fake_fit)
    tuner(index, tmp_path).run()
    other = OptunaTuner(index, dataclasses.replace(BASE, grad_accum_steps=4),
                        output_dir=tmp_path / "hpo", epochs=2, batch_sizes=(8, 16), n_trials=3,
                        resume=True)
    with pytest.raises(UserError, match="grad_accum_steps=1.*grad_accum_steps=4"):
        other.run()


def test_a_local_dir_beside_a_storage_url_is_said_to_keep_no_study():
    """--local-dir with --storage: the study is written to that database directly, a SQLite
    file on Drive included, and --local-dir was silently not used for it."""
    from modules.storage import local_dir_unused
    said = local_dir_unused("sqlite:////content/drive/MyDrive/s.db", "/root/.cache/local")
    assert "'sqlite:////content/drive/MyDrive/s.db'" in said and "unsafe" in said
    said = local_dir_unused("postgresql://u:secret@host/db", "/root/.cache/local")
    assert "secret" not in said and "postgresql://host/db" in said and "unsafe" not in said
    assert local_dir_unused(None, "/x") is None and local_dir_unused("sqlite:////a.db", None) is None
