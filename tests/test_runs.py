"""Several runs into one output folder: nothing of an earlier run is lost, and --resume
continues only a run on the same data."""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

import pipeline
import scenario
from conftest import COLOURS, make_folder, run_path, write_image
from modules.config import TrainConfig
from modules.dataset import index_dataset
from modules.models import build_model
from modules.results import keep_best_model
from modules.utility import load_model

RUN = ("--scenarios", "baseline", "--epochs", "1", "--image-size", "32", "--batch-size", "8",
       "--weights", "none", "--no-progress")


def rows(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())


def test_two_runs_on_two_datasets_keep_both_sets_of_rows_models_and_curves(tmp_path):
    first = make_folder(tmp_path / "shapes", n_train=8, n_test=3)
    second = make_folder(tmp_path / "colours", n_train=8, n_test=3, classes=("red", "blue"))
    out = tmp_path / "out"
    assert pipeline.main(["--data-dir", str(first), "--output-dir", str(out), *RUN]) == 0
    run_one = run_path(out).name
    assert pipeline.main(["--data-dir", str(second), "--output-dir", str(out), *RUN]) == 0
    run_two = run_path(out).name
    assert run_one != run_two
    assert [(r["dataset"], r["run_id"]) for r in rows(out)] == [("shapes", run_one),
                                                                ("colours", run_two)]
    assert (out / "shapes_model.pt").exists() and (out / "colours_model.pt").exists()
    for run_id in (run_one, run_two):  # each run's checkpoints and curves in their own folder
        assert (out / "checkpoints" / run_id / "baseline.pt").exists()
        assert list((out / "runs" / run_id / "baseline").glob("events.out.tfevents.*"))
    report = (out / "report.md").read_text()
    assert f"run {run_two}" in report and "## Other runs in this folder" in report
    assert f"- {run_one}: shapes, baseline" in report


def test_the_same_command_twice_keeps_the_first_runs_rows(tmp_path):
    data = make_folder(tmp_path / "d", n_train=8, n_test=3)
    argv = ["--data-dir", str(data), "--output-dir", str(tmp_path / "out"), *RUN]
    assert pipeline.main(argv) == 0 and pipeline.main(argv) == 0
    assert len({r["run_id"] for r in rows(tmp_path / "out")}) == 2


def test_resume_on_other_data_is_refused_in_one_line(tmp_path, capsys):
    synthetic_like = make_folder(tmp_path / "synthetic", n_train=8, n_test=3)
    other = make_folder(tmp_path / "intel", n_train=6, n_test=3)  # the same class names
    out = tmp_path / "out"
    assert pipeline.main(["--data-dir", str(synthetic_like), "--output-dir", str(out), *RUN]) == 0
    capsys.readouterr()
    assert pipeline.main(["--data-dir", str(other), "--output-dir", str(out), "--resume",
                          *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: cannot resume") and "'synthetic'" in err and "'intel'" in err
    assert [r["dataset"] for r in rows(out)] == ["synthetic"]  # nothing was touched


def test_resume_from_a_copy_of_the_data_continues_the_run(tmp_path):
    """The data folder copied elsewhere (to a faster disk, another machine) and given by a
    path of another form is the same data: --resume continues the run and its best model.
    So is a run recorded by an older version, whose fingerprint named the paths as listed."""
    data = make_folder(tmp_path / "d", n_train=8, n_test=3)
    out = tmp_path / "out"
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), *RUN]) == 0
    copy = Path(shutil.copytree(data, tmp_path / "fast disk" / "d"))
    latest = json.loads((out / "latest_run.json").read_text())
    assert pipeline.main(["--data-dir", str(copy), "--output-dir", str(out), "--resume",
                          *RUN]) == 0
    assert {r["run_id"] for r in rows(out)} == {latest["run_id"]}
    assert not list(out.glob("d_model.other-data-*.pt"))
    older = index_dataset(data, "d")._digest(("train", "val", "test"), str)
    (out / "latest_run.json").write_text(json.dumps({**latest, "data_fingerprint": older}))
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), "--resume",
                          *RUN]) == 0
    assert {r["run_id"] for r in rows(out)} == {latest["run_id"]}


def test_a_moved_output_folder_resumes_the_hpo_final_run_from_its_kept_weights(tmp_path,
                                                                               capsys):
    """The checkpoint and the study record the trial weights by their path then; the output
    folder moved (Drive mounted elsewhere, a relative --output-dir from another directory)
    finds them in the run's folder where it is now, finished or not yet started."""
    data = make_folder(tmp_path / "d", n_train=8, n_test=3)
    hpo = ["--data-dir", str(data), "--scenarios", "hpo", "--n-trials", "1", "--no-autotune",
           *RUN[2:]]
    assert pipeline.main([*hpo, "--output-dir", str(tmp_path / "out")]) == 0
    moved = tmp_path / "moved"
    (tmp_path / "out").rename(moved)
    assert pipeline.main([*hpo, "--output-dir", str(moved), "--resume"]) == 0
    run_path(moved).joinpath("hpo.pt").unlink()  # as if stopped before the final run
    capsys.readouterr()
    assert pipeline.main([*hpo, "--output-dir", str(moved), "--resume"]) == 0
    assert "the final run starts from the weights of the default trial's best validation epoch" in \
        capsys.readouterr().err
    assert [r["scenario"] for r in rows(moved)] == ["hpo"]
    # copied, the original kept where it was recorded: the copy resumes from its own files
    assert pipeline.main([*hpo, "--output-dir", str(tmp_path / "original")]) == 0
    copy = Path(shutil.copytree(tmp_path / "original", tmp_path / "copy"))
    run_path(copy).joinpath("hpo.pt").unlink()
    assert pipeline.main([*hpo, "--output-dir", str(copy), "--resume"]) == 0
    start = Path(rows(copy)[-1]["warm_start"]["weights"])
    assert start.is_relative_to(copy) and start.exists()


def test_a_damaged_trial_weights_file_does_not_stop_resuming_a_final_run(tmp_path):
    """The final run's checkpoint holds the weights it goes on from: the trial's weights file
    it started from, truncated since, is not read (it stopped the resume of a finished run
    with "not a readable PyTorch file")."""
    data = make_folder(tmp_path / "d", n_train=8, n_test=3)
    out = tmp_path / "out"
    argv = ["--data-dir", str(data), "--scenarios", "resolution", "--resolutions", "32",
            "--no-autotune", "--output-dir", str(out), *RUN[2:]]
    assert pipeline.main(argv) == 0
    start = Path(rows(out)[-1]["warm_start"]["weights"])
    start.write_bytes(start.read_bytes()[:100])
    assert pipeline.main([*argv, "--resume"]) == 0
    assert rows(out)[-1]["history"] == rows(out)[0]["history"]


def test_a_kept_file_is_the_runs_own_copy_first(tmp_path):
    from modules.files import kept_file
    recorded = tmp_path / "out" / "checkpoints" / "run-1" / "w.pt"
    here = tmp_path / "copy" / "checkpoints" / "run-1" / "w.pt"
    recorded.parent.mkdir(parents=True), here.parent.mkdir(parents=True)
    recorded.write_text("the original folder's")
    assert kept_file(str(recorded), here.parent) == recorded  # moved away, or not copied
    here.write_text("this run's")
    assert kept_file(str(recorded), here.parent) == here
    assert kept_file(str(recorded), None) == recorded
    assert kept_file(str(tmp_path / "gone.pt"), here.parent) is None
    # a file of another folder by the name of one of the run's (a --weights baseline.pt)
    user = tmp_path / "mine" / "w.pt"
    user.parent.mkdir(), user.write_text("the user's")
    assert kept_file(str(user), here.parent) == user


def test_resume_with_another_seed_names_the_seed_to_pass(tmp_path, capsys):
    """Another --seed splits the same images otherwise: the two counts are equal, so the
    refusal says which seed the run was split with."""
    data = make_folder(tmp_path / "d", n_train=8, n_test=3, layout="class folders")
    out = tmp_path / "out"
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), *RUN]) == 0
    capsys.readouterr()
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), "--resume",
                          "--seed", "7", *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "split with --seed 42" in err and "--seed 7)" in err
    assert "pass --seed 42 to continue it, or drop --resume" in err
    write_image(data / "red" / "extra.jpg", COLOURS["red"])
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), "--resume",
                          "--seed", "7", *RUN]) == 2  # other images too: the seed is not enough
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--seed" not in err.split("):")[0] and "pass --seed" not in err


def _keep(out: Path, test_acc: float, scenario: str, data: str = "same data",
          classes=("a", "b"), val_acc: float | None = None, data_path: str = "streaming",
          images: str | None = None) -> dict:
    """keep_best_model of a model validated on `data` (a fingerprint of its split), of
    `images` (the split's images however validation holds them out; default: `data`'s)."""
    model = build_model("squeezenet1_1", len(classes), "none")
    row = {"scenario": scenario, "run_id": scenario, "test_acc": test_acc,
           "val_acc": test_acc if val_acc is None else val_acc,
           "per_class_test_acc": dict.fromkeys(classes, test_acc), "data_fingerprint": data,
           "confusion_matrix": [[1, 0], [0, 1]], "settings": {"data_path": data_path}}
    keep_best_model(SimpleNamespace(model=model),
                    TrainConfig(model="squeezenet1_1", image_size=32),
                    SimpleNamespace(name="d", classes=list(classes), train=[],
                                    same_data=lambda recorded: recorded == data,
                                    images_fingerprint=lambda: images or data), row, out)
    return load_model(out / "d_model.pt").meta["extra"]


def test_a_better_model_is_never_replaced_by_a_worse_one(tmp_path, caplog):
    assert _keep(tmp_path, 0.91, "full")["test_acc"] == 0.91
    with caplog.at_level("INFO"):  # not left to the tests run before it
        assert _keep(tmp_path, 0.30, "rerun")["scenario"] == "full"  # the same scenario too
    assert "is not better" in caplog.text
    assert _keep(tmp_path, 0.95, "better")["scenario"] == "better"
    # chosen by validation accuracy: the test set stays held out
    assert _keep(tmp_path, 0.99, "luckier on test", val_acc=0.90)["scenario"] == "better"
    assert _keep(tmp_path, 0.90, "better on val", val_acc=0.97)["scenario"] == "better on val"


def test_a_model_of_other_data_under_the_same_name_is_kept_aside(tmp_path, caplog):
    """Two folders named alike (projA/images, projB/images) write d_model.pt into one output
    dir: the second's model is not judged by the first's test accuracy, nor lost to it."""
    assert _keep(tmp_path, 0.95, "cats", data="A")["scenario"] == "cats"
    assert _keep(tmp_path, 0.40, "fruit", data="B", classes=("x", "y", "z"))["scenario"] == "fruit"
    (aside,) = tmp_path.glob("d_model.other-data-*.pt")
    assert load_model(aside).meta["extra"]["scenario"] == "cats"
    assert "trained on other data named 'd'" in caplog.text


def test_a_model_validated_on_another_split_or_of_unknown_data_is_kept_aside(tmp_path, caplog):
    """Another --seed holds out other validation images of the same folder: the model it saved
    was said to be of "other data". A file of a version that recorded no data was judged as
    this data's, by a validation accuracy on other images (100% on 12, which no run beat)."""
    with caplog.at_level("WARNING"):
        assert _keep(tmp_path, 0.95, "seed 42", data="A", images="X")["scenario"] == "seed 42"
        assert _keep(tmp_path, 0.40, "seed 1", data="B", images="X")["scenario"] == "seed 1"
    assert "was validated on another split of the same images (run seed 42): another " \
        "--seed splits them otherwise" in caplog.text
    assert "other data" not in caplog.text
    assert _keep(tmp_path, 0.30, "seed 42 again", data="A", images="X")["scenario"] == "seed 42"
    old = build_model("squeezenet1_1", 2, "none")
    from modules.utility import save_model
    save_model(old, tmp_path / "d_model.pt", arch="squeezenet1_1", class_names=["a", "b"],
               image_size=32, extra={"scenario": "older", "val_acc": 1.0, "test_acc": 1.0})
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert _keep(tmp_path, 0.5, "now", data="A", images="X")["scenario"] == "now"
    assert "was saved by an earlier version, which did not record its data (run None); " \
        "kept it as" in caplog.text


def test_an_unreadable_model_file_is_kept_aside_not_overwritten(tmp_path):
    (tmp_path / "d_model.pt").write_bytes(b"not a model")
    assert _keep(tmp_path, 0.5, "new")["scenario"] == "new"
    (aside,) = tmp_path.glob("d_model.unreadable-*.pt")
    assert aside.read_bytes() == b"not a model"


def test_worker_seeds_differ_by_process_unless_given(monkeypatch):
    args = pipeline.parse_args(["--storage", "postgresql://h/db", "--seed", "7"])
    first = scenario.worker_seed(args)
    monkeypatch.setattr(scenario.os, "getpid", lambda: 123456)
    assert scenario.worker_seed(args) != first
    args.worker_seed = 5
    assert scenario.worker_seed(args) == 5
    assert torch.tensor(first).dtype == torch.int64  # a plain int Optuna accepts


def test_a_quick_run_sets_the_best_model_aside_and_the_next_full_run_brings_it_back(tmp_path):
    """--quick trains on a subset of the same folder (other data to the model file): its
    model takes the name, the full-data best is kept aside by its data, and a later full run
    that does not beat that best brings it back. Two set aside in one second both stay."""
    assert _keep(tmp_path, 0.90, "full", data="full")["scenario"] == "full"
    assert _keep(tmp_path, 0.40, "quick", data="subset")["scenario"] == "quick"
    assert _keep(tmp_path, 0.50, "full again", data="full")["scenario"] == "full"
    assert _keep(tmp_path, 0.95, "better", data="full")["scenario"] == "better"
    kept = {load_model(f).meta["extra"]["scenario"] for f in tmp_path.glob("d_model*.pt")}
    assert kept == {"better", "quick"}  # the worse full-data run was never saved over a better
    assert _keep(tmp_path, 0.30, "quick again", data="subset")["scenario"] == "quick"
    from modules.results import set_aside
    first, second = tmp_path / "x.pt", tmp_path / "x.lab.pt"
    second.write_text("set aside before, in the same second")
    first.write_text("a")
    assert set_aside(first, "lab") == tmp_path / "x.lab-2.pt"
    assert second.read_text() == "set aside before, in the same second"


def test_a_model_file_that_cannot_be_read_now_stays_and_is_not_replaced(tmp_path, monkeypatch):
    """An I/O error reading the best model (a network drive's hiccup) is not damage: it stays
    where it is, and a worse model does not take its name."""
    assert _keep(tmp_path, 0.90, "best")["scenario"] == "best"
    import modules.files as files
    real_load = files.torch.load
    failing = iter([OSError(5, "Input/output error")])

    def flaky(*a, **k):
        error = next(failing, None)
        if error is not None:
            raise error
        return real_load(*a, **k)
    monkeypatch.setattr(files.torch, "load", flaky)
    assert _keep(tmp_path, 0.10, "worse")["scenario"] == "best"
    assert not list(tmp_path.glob("d_model.unreadable-*.pt"))


def test_a_model_of_the_decoded_cache_was_tested_on_full_decodes_and_says_so(tmp_path):
    assert _keep(tmp_path, 0.5, "baseline")["decode"] == "full"
    assert _keep(tmp_path, 0.9, "resolution", data_path="decoded cache")["decode"] == "full"


def test_a_resume_across_copies_now_left_out_names_them(tmp_path, capsys, monkeypatch):
    """A run started by a version that trained on copies of held-out images cannot resume
    once they are left out: the refusal said "other images or another --seed's split" of the
    same folder and seed."""
    from modules import dataset
    data = make_folder(tmp_path / "d", n_train=8, n_test=3)
    for c in ("red", "green"):
        (data / "train" / c / "copy.jpg").write_bytes((data / "test" / c / "0.jpg").read_bytes())
    out = tmp_path / "out"
    with monkeypatch.context() as older:
        older.setattr(dataset, "leave_out_copies", lambda index: index)
        assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), *RUN]) == 0
    capsys.readouterr()
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(out), "--resume",
                          *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "(or the 2 copies of held-out images now left out, which versions before be37e88 " \
        "trained on)" in err


def test_a_run_says_what_it_keeps_on_disk(tmp_path):
    """A run's checkpoints are several times its model (the best epoch's weights and the
    optimizer's state beside the last weights): 0.7 GB a run for resnet18, and nothing said
    it, on a 15 GB Drive that ten runs fill."""
    from modules.results import footprint
    for kind, size in (("checkpoints", 12 * 2**20), ("runs", 300 * 2**10)):
        (tmp_path / kind / "r1" / "deep").mkdir(parents=True)
        (tmp_path / kind / "r1" / "deep" / "f").write_bytes(b"x" * size)
    (tmp_path / "checkpoints" / "r2").mkdir()
    (tmp_path / "checkpoints" / "r2" / "other run").write_bytes(b"x" * 2**20)
    assert footprint(tmp_path, "r1") == "checkpoints/r1 12 MiB, runs/r1 0.3 MiB"
