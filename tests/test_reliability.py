"""Faults tried on purpose: kill -9 mid-run then --resume, bad option values, bad input files."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

import pipeline
from conftest import COLOURS, make_folder, run_path, write_image
from modules.checkpoints import CHECKPOINT_FORMAT, check_resumable
from modules.config import TrainConfig, UserError
from modules.dataset import index_dataset

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 5
RUN = ["--scenarios", "baseline", "--epochs", str(EPOCHS), "--image-size", "64", "--batch-size",
       "4", "--weights", "none", "--no-progress"]


def command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "pipeline.py", "--data-dir", str(data), "--output-dir", str(out),
            *RUN, *extra]


def checkpoint_epoch(out: Path) -> int:
    try:
        return torch.load(run_path(out) / "baseline.pt", weights_only=True)["epoch"]
    except (OSError, RuntimeError, EOFError, KeyError):
        return 0


def run_to_end(data: Path, out: Path, *extra: str) -> dict:
    subprocess.run(command(data, out, *extra), cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    return json.loads((out / "results.json").read_text())[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("kill") / "colours", n_train=30, n_test=4)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> dict:
    return run_to_end(data, tmp_path_factory.mktemp("full") / "out")


def kill_9(data: Path, out: Path, log: Path, *extra: str, epochs: int | None = None,
           seconds: float | None = None) -> tuple[int, str]:
    """Starts a run and kills it with SIGKILL once its checkpoint holds `epochs` epochs (or
    after `seconds`); checks it died mid-way and left no results. Returns the epochs in the
    checkpoint it left (the last one is always readable) and its log."""
    with open(log, "w") as err:
        proc = subprocess.Popen(command(data, out, *extra), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err)
        deadline = time.monotonic() + 300
        seen, reached = None, checkpoint_epoch(out)
        while epochs is not None and reached < epochs and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
            # read again only when replaced: loading it every time took a core from the run
            try:
                stamp = os.stat(run_path(out) / "baseline.pt").st_mtime_ns
            except OSError:
                stamp = None
            if stamp != seen:
                seen, reached = stamp, checkpoint_epoch(out)
        if seconds is not None:
            time.sleep(seconds)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "results.json").exists()
    return checkpoint_epoch(out), log.read_text()


def test_kill_9_then_resume_ends_like_an_uninterrupted_run(data, uninterrupted, tmp_path):
    """One run killed three times, each time resumed with --resume: in start-up or the first
    epoch (nothing to resume from), after epoch 1, after epoch 3; the last resume runs to the
    end, which must be the uninterrupted run's, epoch for epoch. Each resume is the next run
    killed, so three kill points cost four starts rather than six."""
    out = tmp_path / "out"
    reached, _ = kill_9(data, out, tmp_path / "start-up.log", seconds=3)
    # killed before any checkpoint (or, on a fast machine, after a first one)
    after_1, log = kill_9(data, out, tmp_path / "epoch-1.log", "--resume", epochs=reached + 1)
    assert after_1 > reached
    if reached:
        assert f" after epoch {reached}\n" in log
    else:  # nothing to resume from: it starts from the beginning
        assert "resuming from" not in log
    after_3, log = kill_9(data, out, tmp_path / "epoch-3.log", "--resume",
                          epochs=min(after_1 + 2, EPOCHS - 1))
    assert after_3 > after_1 and f"baseline.pt after epoch {after_1}\n" in log
    resumed = run_to_end(data, out, "--resume")
    assert resumed["resumed_from_epoch"] == after_3
    assert [r["val_acc"] for r in resumed["history"]] == \
        [r["val_acc"] for r in uninterrupted["history"]]
    assert [r["train_loss"] for r in resumed["history"]] == \
        pytest.approx([r["train_loss"] for r in uninterrupted["history"]], rel=1e-6)
    assert resumed["test_acc"] == uninterrupted["test_acc"]


CHANGED = {"model": "resnet18", "image_size": 160, "batch_size": 64, "grad_accum_steps": 2,
           "optimizer": "sgd", "scheduler": "onecycle", "warmup_epochs": 1.0, "epochs": 11,
           "lr": 0.002, "seed": 7, "momentum": 0.5, "weight_decay": 1e-4, "max_grad_norm": 1.0}


@pytest.mark.parametrize("key", CHANGED)
def test_a_resume_refuses_each_changed_learning_setting(key, tmp_path):
    """Resumed with another --lr or --epochs, the checkpoint's scheduler state would override
    the new rate, or a cosine laid out for the old epochs run over the new ones, silently."""
    saved = TrainConfig()
    assert getattr(saved, key) != CHANGED[key]
    ckpt = {"format": CHECKPOINT_FORMAT, "config": saved.to_dict()}
    check_resumable(ckpt, saved, tmp_path / "c.pt")
    with pytest.raises(UserError, match=f"settings changed \\({key} "):
        check_resumable(ckpt, dataclasses.replace(saved, **{key: CHANGED[key]}), tmp_path / "c.pt")


NUMERIC = ["--epochs", "--image-size", "--batch-size", "--lr", "--grad-accum-steps",
           "--max-grad-norm", "--early-stopping", "--num-workers", "--seed", "--n-trials",
           "--time-budget", "--resolutions", "--momentum"]


@pytest.mark.parametrize("option", NUMERIC)
@pytest.mark.parametrize("value", ["0", "-1", "99999999999", "1e400", "abc", ""])
def test_every_numeric_option_is_used_or_refused_in_one_line(option, value, tmp_path):
    """0 and a huge number may be used; a negative, infinite, empty or non-numeric value
    never is (the try alone let a value the bounds check missed pass unseen)."""
    try:
        pipeline.parse_args([option, value, "--output-dir", str(tmp_path)])
    except UserError as err:
        assert "\n" not in str(err) and option.lstrip("-").replace("-", "_") in \
            str(err).replace("-", "_")
    else:
        assert value in ("0", "99999999999"), f"{option} {value!r} was accepted"


def test_zero_and_negative_sizes_are_refused(tmp_path):
    for option in ("--epochs", "--batch-size", "--image-size", "--lr"):
        for value in ("0", "-1"):
            with pytest.raises(UserError):
                pipeline.parse_args([option, value])


def test_a_diverging_lr_is_refused_or_stopped_clearly(tmp_path, capsys):
    data = make_folder(tmp_path / "d", n_train=8, n_test=2)
    assert pipeline.main(["--data-dir", str(data), *RUN, "--lr", "1e6",
                          "--output-dir", str(tmp_path / "o")]) == 2
    assert "argument --lr" in capsys.readouterr().err
    code = pipeline.main(["--data-dir", str(data), *RUN, "--lr", "10",
                          "--output-dir", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    if code != 0:  # stopped: the message says what diverged and what to lower
        assert "diverged" in err and "lower --lr" in err
    else:  # finished: no NaN is written as a score
        row = json.loads((tmp_path / "o2" / "results.json").read_text())[0]
        assert row["test_acc"] is None or 0 <= row["test_acc"] <= 1


def test_bad_input_matrix(tmp_path, monkeypatch):
    root = make_folder(tmp_path / "d", n_train=6, n_test=2)
    red = root / "train" / "red"
    jpeg_bytes = (red / "0.jpg").read_bytes()
    Image.open(red / "0.jpg").save(red / "really_png.jpg", format="PNG")  # wrong extension: used
    Image.new("RGB", (1, 1), (200, 40, 40)).save(red / "tiny.png")        # 1x1: used
    Image.new("RGB", (64, 64), (200, 40, 40)).save(red / "huge.png")      # over the bomb guard
    write_image(red / "cmyk.jpg", COLOURS["red"], mode="CMYK", fmt="JPEG")  # converted
    (red / "zero.jpg").write_bytes(b"")                                    # skipped
    (red / "half.jpg").write_bytes(jpeg_bytes[: len(jpeg_bytes) // 3])       # skipped
    (red / ".hidden.jpg").write_bytes(b"junk")                             # ignored
    for i in range(3):                                    # a class folder linked in: followed
        write_image(tmp_path / "elsewhere" / f"{i}.jpg", COLOURS["blue"])
    os.symlink(tmp_path / "elsewhere", root / "train" / "teal")
    for i in range(2):
        write_image(root / "test" / "teal" / f"{i}.jpg", COLOURS["blue"])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 = 4096 px > 2 x 1000
    index = index_dataset(root)
    used = {Path(p).name for p, _ in index.train + index.val}
    assert {"really_png.jpg", "tiny.png", "cmyk.jpg"} <= used
    assert dict((Path(p).name, r) for p, r in index.skipped) == {
        "huge.png": "too large (decompression bomb guard)", "zero.jpg": "empty file",
        "half.jpg": "truncated"}
    assert "teal" in index.classes


# ----------------------------------------------------------------------------- output faults

@pytest.fixture
def tiny_disk(tmp_path):
    """A real 400 KB filesystem (tmpfs): writes there hit ENOSPC like a full disk."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
                          capture_output=True)
    if proc.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root: " + proc.stderr.decode().strip()[:80])
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_clear_line_and_leaves_earlier_files_intact(data, tiny_disk):
    out = tiny_disk / "out"
    out.mkdir()
    earlier = '[{"scenario": "baseline", "dataset": "colours", "test_acc": 0.5}]'
    (out / "results.json").write_text(earlier)
    proc = subprocess.run(command(data, out), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no space left on the device holding ") and "--output-dir" in last
    assert (out / "results.json").read_text() == earlier          # untouched
    assert not list(out.rglob("*.tmp"))                            # no half-written temp files


def test_an_unreadable_image_is_skipped_and_counted(tmp_path):
    """chmod 000 stops everyone but root; as root the check runs with the nobody user's rights."""
    import tempfile
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="perm-"))
    try:
        os.chmod(root, 0o755)
        make_folder(root / "d", n_train=4, n_test=2)
        secret = root / "d" / "train" / "red" / "0.jpg"
        os.chmod(secret, 0)
        as_nobody = os.geteuid() == 0
        if as_nobody:
            os.seteuid(65534)
        try:
            index = index_dataset(root / "d")
        finally:
            if as_nobody:
                os.seteuid(0)
        assert [(Path(p).name, r) for p, r in index.skipped] == \
            [("0.jpg", "unreadable (permission denied)")]
        assert index.skipped_files == 1
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


# ----------------------------------------------------------------------------- a killed study

def _study_states(db: Path) -> list[tuple[int, str]]:
    import sqlite3
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT number, state FROM trials ORDER BY number").fetchall()
    except sqlite3.Error:
        return []


def test_kill_9_mid_study_then_resume_loses_no_trial_and_counts_none_twice(data, tmp_path):
    import optuna
    out = tmp_path / "out"
    grace_s = 2  # the shortest grace period modules/storage.py takes
    env = {**os.environ, "HWTRAIN_TRIAL_GRACE_S": str(grace_s)}
    # trials of 2 epochs (short_budget); the final run, after the search, 3
    hpo = [sys.executable, "pipeline.py", "--data-dir", str(data), "--output-dir", str(out),
           "--scenarios", "hpo", "--epochs", "3", "--image-size", "32", "--batch-size", "4",
           "--weights", "none", "--no-progress", "--no-autotune"]
    child = subprocess.Popen(hpo + ["--n-trials", "4"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    try:  # kill while a trial is running, after at least one finished
        while time.time() < deadline:
            states = _study_states(out / "optuna.db")
            if any(s != "RUNNING" for _, s in states) and states and states[-1][1] == "RUNNING":
                break
            assert child.poll() is None, "the study ended before it could be killed"
            time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        child.wait(timeout=60)
    before = _study_states(out / "optuna.db")
    killed = [n for n, s in before if s == "RUNNING"]
    assert len(killed) == 1
    # past the grace period: the killed trial's heartbeat has gone stale
    time.sleep(max(0.0, killed_at + grace_s + 1.5 - time.monotonic()))
    subprocess.run(hpo + ["--n-trials", "4", "--resume"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    study = optuna.load_study(study_name=optuna.get_all_study_names(
        f"sqlite:///{out / 'optuna.db'}")[0], storage=f"sqlite:///{out / 'optuna.db'}")
    trials = {t.number: t for t in study.trials}
    assert len(trials) == len(study.trials)                      # no number twice
    assert trials[killed[0]].state == optuna.trial.TrialState.FAIL
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == killed[0]]
    assert len(retries) == 1                                     # retried once, same params
    # the killed trial may have died before suggesting every parameter; those it had, the
    # retry repeats
    assert trials[killed[0]].params.items() <= retries[0].params.items()
    done = [t for t in study.trials if t.state.is_finished() and t.state.name != "FAIL"]
    finished_before = [n for n, s in before if s in ("COMPLETE", "PRUNED")]
    assert {n for n in finished_before} <= {t.number for t in done}  # none lost
    assert len(done) == 4                                        # the four asked for


def test_a_read_only_filesystem_is_one_clear_line(data, tmp_path, capsys):
    """Root ignores chmod, so a real read-only mount stands in for a read-only folder. The
    command line's main() in this process: it fails before any training, and a second Python
    process importing torch would take longer than the test itself."""
    mount = tmp_path / "ro"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                          capture_output=True)
    if proc.returncode != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        code = pipeline.main(command(data, mount / "out")[2:])  # an exception would fail here
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: cannot write to --output-dir {str(mount / 'out')!r} (Read-only file system).")


# ------------------------------------------------------------------- a new user's mistakes

def test_mistakes_in_paths_and_lists_are_refused_before_any_work(tmp_path):
    data = make_folder(tmp_path / "d", n_train=4, n_test=2)
    (tmp_path / "afile").write_text("")
    refused = {
        ("--data-dir", str(data), "--output-dir", str(data / "red" / "out")): "inside --data-dir",
        ("--data-dir", str(data), "--output-dir", str(data)): "inside --data-dir",
        ("--data-dir", str(data), "--local-dir", str(data / "local")): "--local-dir .* is "
                                                                        "inside --data-dir",
        ("--output-dir", ""): "--output-dir is empty",
        ("--local-dir", str(tmp_path / "afile")): "is a file, not a folder",
        ("--resolutions", "8,64"): "--resolutions: 8 px is refused",
        ("--resolutions", "100000"): "--resolutions: 100000 px is refused",
    }
    for argv, says in refused.items():
        with pytest.raises(UserError, match=says):
            pipeline.parse_args(list(argv))
    with pytest.raises(UserError, match="names a scenario twice"):
        pipeline.parse_args(["--scenarios", "baseline,baseline"])
    assert not (data / "red" / "out").exists()
    home = Path.home()
    weights = home / ".hwtrain-test-weights.pt"
    from modules.models import build_model
    torch.save(build_model("squeezenet1_1", 2).state_dict(), weights)  # fits: the head aside
    try:
        assert pipeline.parse_args(["--weights", "~/" + weights.name]).weights == str(weights)
    finally:
        weights.unlink()


def test_a_wrong_storage_is_refused_before_any_training(tmp_path, capsys):
    from modules.storage import check_storage
    for url in ("sqlite://", "sqlite:///:memory:"):
        with pytest.raises(UserError, match="in-memory SQLite"):
            check_storage(url)
    data = make_folder(tmp_path / "d", n_train=4, n_test=2)
    code = pipeline.main(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"), *RUN,
                          "--scenarios", "baseline,hpo",
                          "--storage", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}"])
    assert code == 2 and "cannot open Optuna storage" in capsys.readouterr().err
    assert not (tmp_path / "o" / "results.json").exists()  # the baseline did not train
    # a damaged study database says so and what to do, not only SQLite's words
    damaged = tmp_path / "study.db"
    damaged.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 20)
    with pytest.raises(UserError, match=r"not a database\): the file is damaged; move it away"):
        check_storage(f"sqlite:///{damaged}")


def test_train_and_test_folders_are_found_whatever_their_case(tmp_path):
    root = make_folder(tmp_path / "d", n_train=4, n_test=2)
    (root / "train").rename(root / "Train")
    (root / "test").rename(root / "TEST")
    index = index_dataset(root)
    assert index.layout == "train/test" and index.classes == ["blue", "green", "red"]


def test_names_that_are_not_utf8_train_and_print(tmp_path):
    """Folders unzipped from an archive made on Windows: a class and a file whose names are
    not UTF-8."""
    root = make_folder(tmp_path / "d", n_train=6, n_test=2)
    for split in ("train", "test"):
        os.rename(os.fsencode(root / split / "red"), os.fsencode(root / split) + b"/r\xe9d")
    os.rename(os.fsencode(root / "train" / "blue" / "0.jpg"),
              os.fsencode(root / "train" / "blue") + b"/b\xff.jpg")
    # a file that is not an image, skipped and listed: its name failed the list's write
    with open(os.fsencode(root / "train" / "green") + b"/br\xe9ken.jpg", "wb") as f:
        f.write(b"not a jpeg")
    out = tmp_path / "out"
    assert pipeline.main(["--data-dir", str(root), "--output-dir", str(out), "--quick",
                          "--epochs", "1", "--image-size", "32", "--resolutions", "24",
                          "--n-trials", "1", "--weights", "none", "--no-progress"]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline", "resolution", "hpo"]
    assert set(rows[0]["per_class_test_acc"]) == {"blue", "green", "r\\xe9d"}
    assert rows[0]["skipped_files"] == 1
    listed = (run_path(out, "runs") / "skipped_files.txt").read_text(encoding="utf-8")
    assert listed.startswith(f"train{os.sep}green{os.sep}br\\xe9ken.jpg\t")


def test_a_damaged_results_file_is_kept_aside_not_overwritten(tmp_path):
    from modules.results import merge_results
    path = tmp_path / "results.json"
    path.write_text('[{"scenario": "baseline", "run_id": "a"},]')  # a stray comma
    row = {"scenario": "baseline", "run_id": "b"}
    assert merge_results(path, [row]) == [row]
    (aside,) = tmp_path.glob("results.unreadable-*.json")
    assert aside.read_text() == '[{"scenario": "baseline", "run_id": "a"},]'
    # an entry that is not a row: the report failed on it in every later run (KeyError:
    # 'scenario'), or a next write dropped it
    for text in ('[{"a": 1}]', '[5, {"scenario": "baseline", "run_id": "a"}]'):
        path.write_text(text)
        assert merge_results(path, [row]) == [row]
        assert text in [p.read_text() for p in tmp_path.glob("results.unreadable-*.json")]


def test_resume_finds_the_interrupted_run_past_a_mistake_and_a_lost_record(tmp_path):
    """The newest run is what --resume continues, even one stopped before it checkpointed;
    a run refused after it started (an option checked once the run runs) is not; and a lost
    or damaged latest_run.json loses nothing."""
    from modules.results import RUN_FILE, forget_refused_run, latest_run
    out = tmp_path / "out"
    for run_id, started, progress in (("20261127-100000", "2026-11-27T10:00:00Z", True),
                                      ("20261127-110000", "2026-11-27T11:00:00Z", False)):
        folder = out / "checkpoints" / run_id
        folder.mkdir(parents=True)
        record = json.dumps({"run_id": run_id, "started": started})
        (folder / "run.json").write_text(record)
        (out / RUN_FILE).write_text(record)
        if progress:
            (folder / "baseline.pt").write_bytes(b"a checkpoint")
    assert latest_run(out)["run_id"] == "20261127-110000"  # interrupted in its first epoch
    forget_refused_run(out, "20261127-110000")  # no: it was refused
    assert latest_run(out)["run_id"] == "20261127-100000"
    assert json.loads((out / RUN_FILE).read_text())["run_id"] == "20261127-100000"
    (out / RUN_FILE).write_text("{damaged")
    assert latest_run(out)["run_id"] == "20261127-100000"
    (out / RUN_FILE).unlink()
    assert latest_run(out)["run_id"] == "20261127-100000"
    forget_refused_run(out, "20261127-100000")  # it has a checkpoint: kept
    assert latest_run(out)["run_id"] == "20261127-100000"


def test_a_resume_after_toggling_quick_names_quick(tmp_path):
    """--quick takes a subset of the data, so the data check refused the resume, blaming
    "other images or another --seed's split": the likely slip is RESUME ticked after QUICK
    was changed."""
    from types import SimpleNamespace

    from modules.config import UserError
    from modules.results import start_run
    out = tmp_path / "out"
    full = SimpleNamespace(name="synthetic", n_images=lambda: 104, fingerprint=lambda: "full",
                           same_data=lambda recorded: recorded == "full")
    subset = SimpleNamespace(name="synthetic", n_images=lambda: 44,
                             fingerprint=lambda: "quick",
                             same_data=lambda recorded: recorded == "quick")
    start_run(out, full, resume=False, command="", seed=42, quick=False)
    with pytest.raises(UserError, match="was started without --quick, which trains on all of "
                                        "the data; drop --quick to continue it"):
        start_run(out, subset, resume=True, command="", seed=42, quick=True)
    start_run(out, subset, resume=False, command="", seed=42, quick=True)
    with pytest.raises(UserError, match="started with --quick, which takes a subset of the "
                                        "data; add --quick"):
        start_run(out, full, resume=True, command="", seed=42, quick=False)


def test_a_resume_with_other_learning_options_is_refused_at_the_start(tmp_path):
    """Interrupted while the resolution tuner trained its sizes and resumed with --epochs 24
    for 30, the run trained every size again under 24 without a word (its journal keyed by
    the settings), the row then mixing two runs' seconds; only a final run's checkpoint
    refused other options."""
    from types import SimpleNamespace

    from modules.config import UserError
    from modules.results import start_run
    from scenario import learning_options
    out = tmp_path / "out"
    data = SimpleNamespace(name="synthetic", n_images=lambda: 104, fingerprint=lambda: "f",
                           same_data=lambda recorded: recorded == "f")
    given = dict.fromkeys(("model", "epochs", "image_size", "batch_size", "lr", "scheduler",
                           "momentum", "grad_accum_steps", "max_grad_norm", "resolutions",
                           "search_size"))
    settings = learning_options(SimpleNamespace(**{**given, "model": "squeezenet1_1",
                                                   "epochs": 30, "resolutions": [24, 32],
                                                   "search_size": "auto"}))
    run = start_run(out, data, resume=False, command="python pipeline.py --epochs 30",
                    seed=42, quick=False, settings=settings)
    with pytest.raises(UserError, match=r"started with other options \(--epochs 30 -> 24, "
                                        r"--lr not given -> 0.01\): give the options it was "
                                        r"started with \(python pipeline.py --epochs 30\)"):
        start_run(out, data, resume=True, command="", seed=42, quick=False,
                  settings={**settings, "epochs": 24, "lr": 0.01})
    with pytest.raises(UserError, match=r"--resolutions 24,32 -> 24"):
        start_run(out, data, resume=True, command="", seed=42, quick=False,
                  settings={**settings, "resolutions": [24]})
    assert start_run(out, data, resume=True, command="", seed=42, quick=False,
                     settings=dict(settings)) == run
    # a run recorded by a version without them is resumed as before
    assert start_run(out, data, resume=True, command="", seed=42, quick=False) == run


def test_resume_names_checkpoints_of_a_version_before_run_ids(tmp_path, caplog):
    """checkpoints/baseline.pt, written before runs had ids: --resume said "no earlier run"
    beside an interrupted one it cannot continue."""
    from types import SimpleNamespace

    from modules.results import start_run
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "baseline.pt").write_bytes(b"")
    index = SimpleNamespace(name="d", n_images=lambda: 10, fingerprint=lambda: "f",
                            same_data=lambda recorded: recorded == "f")
    with caplog.at_level("INFO"):
        start_run(out, index, resume=True, command="", seed=42, quick=False)
    assert "--resume: no run this version can continue (checkpoints/baseline.pt: an earlier " \
        "version's, whose runs had no ids)" in caplog.text


def two_runs(out: Path):
    """Run records of an older run A (20261127-100000) and a newer run B (-110000) in `out`,
    neither with progress, B named newest; returns an index of their data."""
    from types import SimpleNamespace
    from modules.results import RUN_FILE
    for run_id, started in (("20261127-100000", "2026-11-27T10:00:00Z"),
                            ("20261127-110000", "2026-11-27T11:00:00Z")):
        folder = out / "checkpoints" / run_id
        folder.mkdir(parents=True)
        record = json.dumps({"run_id": run_id, "started": started, "data_fingerprint": "fp"})
        (folder / "run.json").write_text(record)
        (out / RUN_FILE).write_text(record)
    return SimpleNamespace(name="d", n_images=lambda: 9, fingerprint=lambda: "fp",
                           same_data=lambda recorded: recorded == "fp")


def test_resume_continues_the_run_with_progress_past_a_newer_empty_one(tmp_path, caplog):
    """Run A was interrupted with checkpoints; run B, started without --resume by mistake,
    was stopped before its first checkpoint. --resume continues A (B left nothing to
    continue) and latest_run.json names A again; with no run that has progress, the newest."""
    from modules.results import RUN_FILE, latest_run, start_run
    out = tmp_path / "out"
    index = two_runs(out)
    resume = dict(index=index, resume=True, command="python pipeline.py --resume")
    assert start_run(out, **resume) == "20261127-110000"  # neither has progress: the newest
    (out / "checkpoints" / "20261127-100000" / "baseline.pt").write_bytes(b"a checkpoint")
    assert latest_run(out)["run_id"] == "20261127-110000"
    with caplog.at_level("INFO"):
        assert start_run(out, **resume) == "20261127-100000"
    assert "the newer run 20261127-110000 left nothing to continue" in caplog.text
    assert json.loads((out / RUN_FILE).read_text())["run_id"] == "20261127-100000"
    assert start_run(out, **resume) == "20261127-100000"
    assert start_run(out, index=index, resume=False, command="") not in (
        "20261127-100000", "20261127-110000")


def test_a_new_run_beside_an_interrupted_one_says_resume_would_continue_it(tmp_path, caplog):
    """After a disconnect, Run all without RESUME trained everything again without a word:
    a new run beside an unfinished one with progress says --resume would continue it. A run
    that finished, or one of a version that did not mark finished runs but has a row for each
    of its scenarios, or one stopped before its first checkpoint, is not named."""
    from modules.results import mark_finished, start_run

    def named(case: str, progress: bool = True, rows: tuple = (), finished: bool = False):
        out = tmp_path / case
        index = two_runs(out)
        newest = out / "checkpoints" / "20261127-110000"
        record = {**json.loads((newest / "run.json").read_text()),
                  "scenarios": ["baseline", "hpo"]}
        for path in (newest / "run.json", out / "latest_run.json"):
            path.write_text(json.dumps(record))
        if progress:
            (newest / "baseline.pt").write_bytes(b"a checkpoint")
        (out / "results.json").write_text(json.dumps(
            [{"scenario": s, "run_id": "20261127-110000"} for s in rows]))
        if finished:
            mark_finished(out, "20261127-110000")
        caplog.clear()
        with caplog.at_level("INFO"):
            start_run(out, index=index, resume=False, command="python pipeline.py")
        return caplog.text
    said = named("interrupted")
    assert ("the newest run in" in said and "(20261127-110000) did not finish; --resume "
            "continues it" in said and "nothing is deleted" in said)
    assert "did not finish" in named("one row", rows=("baseline",))
    assert "did not finish" not in named("no progress", progress=False)
    assert "did not finish" not in named("finished", finished=True)
    # a version that did not mark finished runs: each of its scenarios has its row
    assert "did not finish" not in named("older version", rows=("baseline", "hpo"))


def test_resume_continues_an_interrupted_run_past_a_newer_finished_one(tmp_path, caplog):
    """Run A was interrupted; run B, newer, finished (its rows, its checkpoints). --resume
    continued B, which has nothing left, and A could never be continued. A on other data
    is passed over for an unfinished run on this data."""
    from modules.results import mark_finished, start_run
    out = tmp_path / "out"
    index = two_runs(out)
    resume = dict(index=index, resume=True, command="python pipeline.py --resume")
    for run_id in ("20261127-100000", "20261127-110000"):
        (out / "checkpoints" / run_id / "baseline.pt").write_bytes(b"a checkpoint")
    mark_finished(out, "20261127-110000")
    with caplog.at_level("INFO"):
        assert start_run(out, **resume) == "20261127-100000"
    assert "the newer run 20261127-110000 left nothing to continue" in caplog.text
    # both unfinished: the newest on this data, before a newer one on other data
    record = out / "checkpoints" / "20261127-110000" / "run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "finished": False,
                                  "data_fingerprint": "other"}))
    assert start_run(out, **resume) == "20261127-100000"


def test_a_typo_after_an_interrupted_run_does_not_take_over_resume(tmp_path, capsys):
    data = make_folder(tmp_path / "d", n_train=4, n_test=2)
    out = tmp_path / "o"
    argv = ["--data-dir", str(data), "--output-dir", str(out), *RUN, "--epochs", "1"]
    assert pipeline.main(argv) == 0
    first = json.loads((out / "results.json").read_text())[-1]["run_id"]
    assert pipeline.main(argv + ["--scenarios", "resolution", "--amp", "fp16"]) == 2  # no GPU
    capsys.readouterr()
    assert pipeline.main(argv + ["--resume"]) == 0
    assert f"resuming run {first}" in capsys.readouterr().err


def test_a_folder_the_run_cannot_write_is_one_line(tmp_path, monkeypatch, capsys):
    """A read-only checkpoints/ inside a writable output dir (root ignores modes, so the
    refusal is played); any other OSError is a bug and keeps its traceback."""

    import scenario
    data = make_folder(tmp_path / "d", n_train=4, n_test=2)
    denied = PermissionError(errno.EACCES, "Permission denied",
                             str(tmp_path / "o" / "checkpoints"))
    monkeypatch.setattr(scenario, "start_run", lambda *a, **k: (_ for _ in ()).throw(denied))
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"), *RUN]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: cannot write {str(tmp_path / 'o' / 'checkpoints')!r} (Permission denied); fix its "
        "permissions or pass another --output-dir, then rerun (with --resume to continue; what "
        "was written before stays intact).")
    # The same words as a write that modules.files catches itself, also when the OSError
    # names no file.
    monkeypatch.setattr(scenario, "start_run", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    assert pipeline.main(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"), *RUN]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: no space left on the device holding the output folder; free some space")
    # A forbidden or read-only folder is said so even where the disk reports no free space
    # (read-only filesystems often do): the free-space guess is for errors without an errno.
    from modules import files
    monkeypatch.setattr(files, "disk_full", lambda folder: True)
    for code in (errno.EACCES, errno.EROFS):
        said = str(files.write_error(tmp_path / "x", OSError(code, os.strerror(code))))
        assert said.startswith(f"cannot write {str(tmp_path / 'x')!r} ({os.strerror(code)})")
    assert str(files.write_error(tmp_path / "x", RuntimeError("file write failed"))).startswith(
        "no space left")
    monkeypatch.setattr(scenario, "start_run", lambda *a, **k: (_ for _ in ()).throw(
        OSError(errno.EBADF, "Bad file descriptor")))
    with pytest.raises(OSError, match="Bad file descriptor"):
        pipeline.main(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"), *RUN])


def test_a_disk_filled_by_a_large_checkpoint_is_one_line(tmp_path, monkeypatch):
    """torch.save wraps the full disk's OSError in a RuntimeError ("unexpected pos"); once its
    partial file is removed the disk has room again, so the free space alone would not say."""

    from modules import files
    from modules.config import UserError
    path = tmp_path / "baseline.pt"
    files.atomic_torch_save({"epoch": 1}, path)

    def full(payload, f):
        f.write(b"part of a checkpoint")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            # as torch.save raises it: the OSError only as the context
            raise RuntimeError("[enforce fail at inline_container.cc:672] . "  # noqa: B904
                               "unexpected pos 704 vs 598")
    monkeypatch.setattr(files.torch, "save", full)
    monkeypatch.setattr(files, "disk_full", lambda folder: False)
    with pytest.raises(UserError, match="^no space left on the device holding"):
        files.atomic_torch_save({"epoch": 2}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["baseline.pt"]
    assert files.read_torch_file(path, "checkpoint") == {"epoch": 1}


def test_a_failed_write_names_the_option_of_the_folder_it_was_in(tmp_path):
    """A full --local-dir is not fixed by another --output-dir; a file outside both (a
    download cache) names neither."""

    import scenario
    from modules import files
    out = scenario.prepare_output_dir(str(tmp_path / "out"))
    local = scenario.prepare_output_dir(str(tmp_path / "out" / "local"), "--local-dir")
    full = OSError(errno.ENOSPC, "No space left on device")
    assert "pass --local-dir on another disk" in str(files.write_error(local / "cache.npy", full))
    assert "pass --output-dir on another disk" in str(files.write_error(out / "results.json", full))
    said = str(files.write_error(tmp_path / "elsewhere" / "weights.pth", full))
    assert said.startswith("no space left on the device holding") and "pass --" not in said
    denied = OSError(errno.EACCES, "Permission denied")
    assert str(files.write_error(tmp_path / "elsewhere", denied, in_run=True)).startswith(
        f"cannot write {str(tmp_path / 'elsewhere')!r} (Permission denied); fix its permissions, "
        "then rerun")
    # a library call's (save_model to a file of the user's): no run to resume
    assert str(files.write_error(tmp_path / "elsewhere", denied)).endswith(
        "fix its permissions, then try again.")
    assert "then rerun (with --resume" in str(files.write_error(out / "results.json", denied))
    assert "pass a writable --local-dir" in str(files.write_error(
        local / "x", OSError(errno.EIO, "Input/output error")))


def test_a_second_run_into_a_folder_in_use_stops_in_one_line(tmp_path):
    """Two --resume of one interrupted run would train the same thing twice, side by side."""
    from modules.files import folder_lock
    with folder_lock(tmp_path):
        other = subprocess.run(
            [sys.executable, "-c", "import sys; sys.path.insert(0, '.')\n"
             "from modules.files import folder_lock\n"
             f"with folder_lock({str(tmp_path)!r}): pass"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert other.returncode != 0 and "another run is writing to" in other.stderr
        assert f"pid {os.getpid()}" in other.stderr
    with folder_lock(tmp_path):  # released at the end: the next run goes ahead
        pass
    # A process forked during the run (a DataLoader worker kept alive by a failed notebook
    # cell's traceback) does not keep the folder locked once the run is over.
    import multiprocessing
    import time as time_
    with folder_lock(tmp_path):
        worker = multiprocessing.get_context("fork").Process(target=time_.sleep, args=(60,))
        worker.start()
    try:
        again = subprocess.run(
            [sys.executable, "-c", "import sys; sys.path.insert(0, '.')\n"
             "from modules.files import folder_lock\n"
             f"with folder_lock({str(tmp_path)!r}): pass"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr
    finally:
        worker.kill()


def test_a_run_into_a_folder_in_use_is_refused_before_it_reads_or_makes_data(tmp_path):
    """The lock was taken once the data was loaded: a second run generated the synthetic set
    (143 s on a loaded machine) into the output dir before its refusal, and that copy then
    took the place of the first run's --local-dir copy when it resumed."""
    from modules.files import folder_lock, refuse_if_in_use
    out, local = tmp_path / "out", tmp_path / "local"
    out.mkdir()
    with folder_lock(out):
        other = subprocess.run(
            [sys.executable, "pipeline.py", "--quick", "--scenarios", "baseline", "--output-dir",
             str(out), "--local-dir", str(local), "--no-progress"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "error: another run is writing to" in other.stderr
    assert "Traceback" not in other.stderr
    assert not (out / "data").exists() and not (local / "data").exists()
    refuse_if_in_use(out)  # free: the probe goes ahead, and holds nothing after it
    with folder_lock(out):
        pass
    refuse_if_in_use(tmp_path / "never used")  # no lock file: nothing to probe, none made
    assert not (tmp_path / "never used").exists()


def test_windows_locks_the_folder_with_msvcrt(tmp_path, monkeypatch):
    """Without fcntl (Windows) the folder went unlocked: a second run trained beside the
    first, and killed writes' leftovers were never swept. msvcrt's locks, emulated here as
    Windows keeps them (per open file, a byte range, refused to any other holder), guard it;
    the locked byte lies past the holder's line, which the refusal reads."""
    from modules import files
    held: dict[tuple[int, int], int] = {}  # (file, offset) -> the descriptor holding it

    class FakeMsvcrt:
        LK_NBLCK, LK_UNLCK = 2, 0

        @staticmethod
        def locking(fd, mode, nbytes):
            key = (os.fstat(fd).st_ino, os.lseek(fd, 0, os.SEEK_CUR))
            if mode == FakeMsvcrt.LK_UNLCK:
                assert held.pop(key) == fd
            elif held.setdefault(key, fd) != fd:
                raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(files, "fcntl", None)
    monkeypatch.setattr(files, "msvcrt", FakeMsvcrt)
    leftover = tmp_path / ".results.json.deadbeef.tmp"
    leftover.write_bytes(b"a killed write's")
    os.utime(leftover, (time.time() - 3600,) * 2)
    with files.folder_lock(tmp_path):
        assert list(held) == [((tmp_path / ".lock").stat().st_ino, files.WINDOWS_LOCK_OFFSET)]
        assert not leftover.exists()
        with pytest.raises(UserError, match=f"another run is writing to .*pid {os.getpid()}"):
            with files.folder_lock(tmp_path):
                pass
    assert not held
    with files.folder_lock(tmp_path):  # released: the next run goes ahead
        pass


def test_writes_a_kill_cut_short_are_swept_when_the_folder_is_next_locked(tmp_path):
    """A kill -9 during a checkpoint's save leaves its temporary file, a checkpoint's size, that
    no except block removed; a resumed run sharing a checkpoint it shared before (a hard link
    renamed onto a link of the same file) left its temporary link."""
    from modules.files import folder_lock, share_file
    run = tmp_path / "checkpoints" / "r1"
    run.mkdir(parents=True)
    (run / "resolution.pt").write_bytes(b"weights")
    for _ in range(2):
        share_file(run / "resolution.pt", run / "hpo.pt")
    assert sorted(p.name for p in run.iterdir()) == ["hpo.pt", "resolution.pt"]
    stale = [run / ".hpo.pt.0a1b2c3d.tmp", tmp_path / ".results.json.deadbeef.tmp",
             run / ".hpo.pt.ce6b6a91.link"]
    kept = [run / ".hpo.pt.0123abcd.tmp",           # young: a live writer's, maybe
            tmp_path / ".notes.tmp",                # not a name of ours
            tmp_path / "data" / ".x.png.0a1b2c3d.tmp"]  # the generated data is not swept
    for path in stale + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
    hour_ago = time.time() - 3600
    for path in stale + kept[1:]:
        os.utime(path, (hour_ago, hour_ago))
    with folder_lock(tmp_path):
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in kept)
    assert (run / "hpo.pt").read_bytes() == b"weights"


def test_a_class_named_train_is_a_class(tmp_path):
    root = make_folder(tmp_path / "d", layout="class folders", n_train=3, n_test=2,
                       classes=("red", "green", "blue"))
    (root / "green").rename(root / "Train")
    index = index_dataset(root)
    assert index.layout == "class folders" and "Train" in index.classes


def test_a_test_folder_alone_is_named_as_the_problem(tmp_path):
    root = make_folder(tmp_path / "d", n_train=2, n_test=2)
    import shutil
    shutil.rmtree(root / "train")
    with pytest.raises(UserError, match="has test/ but no train/ folder"):
        index_dataset(root)


def _started_loading_torch(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if "libtorch" in Path(f"/proc/{pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)
    pytest.fail("torch did not start loading")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_ctrl_c_while_torch_loads_ends_without_a_traceback(tmp_path):
    """Loading torch takes seconds (its library is mapped first, the rest of the imports
    follow), and a Ctrl-C then printed an import traceback."""
    proc = subprocess.Popen([sys.executable, "pipeline.py", "--quick", "--output-dir",
                             str(tmp_path / "out")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    _started_loading_torch(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        err = proc.communicate(timeout=30)[1]
        last = "interrupted before the run started."
    except subprocess.TimeoutExpired:
        # Once in CI the Ctrl-C was lost while torch's libraries loaded and the run went on
        # (the next test's cause, most likely): a second one, as a user would press, ends it.
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
        last = "interrupted"  # before the run started, or with the resume hint
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(last)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_an_ignored_ctrl_c_stays_ignored(tmp_path):
    """A run started with SIGINT ignored (a background job of a script) is not stopped by it,
    neither while torch loads nor once the run has started."""
    data = make_folder(tmp_path / "data")  # epochs enough to outlast the test
    proc = subprocess.Popen([sys.executable, "pipeline.py", "--data-dir", str(data),
                             "--scenarios", "baseline", "--epochs", "500", "--image-size", "32",
                             "--weights", "none", "--no-progress", "--output-dir",
                             str(tmp_path / "out")], cwd=ROOT, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        _started_loading_torch(proc.pid)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 120
        while not (tmp_path / "out" / "latest_run.json").exists() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # the run has started: main() ran
        time.sleep(1)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_while_an_import_s_weakref_callback_runs_still_ends_the_run():
    """The handler's SystemExit, raised while a weakref callback of the imports ran, was
    dropped by Python ("Exception ignored") and the imports went on to the run."""
    hook = (
        "import runpy, signal, sys, weakref\n"
        "class Drop:\n"
        "    def find_spec(self, *a):\n"
        "        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:\n"
        "            sys.meta_path.remove(self)\n"
        "            holder = type('H', (), {})()\n"
        "            ref = weakref.ref(holder, lambda _: signal.raise_signal(signal.SIGINT))\n"
        "            del holder\n"
        "sys.meta_path.insert(0, Drop())\n"
        "sys.argv = ['pipeline.py', '--help']\n"
        "runpy.run_path('pipeline.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", hook], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130, done.stdout[-300:] + done.stderr
    assert "interrupted before the run started." in done.stderr and "usage:" not in done.stdout



def test_resume_does_not_replay_a_finished_run_past_the_newer_one(tmp_path):
    """Run A finished; run B was cut off before its first checkpoint (a Colab disconnect in
    its first epoch). --resume continues B, not A, which has nothing left to train."""
    from modules.results import mark_finished, start_run
    out = tmp_path / "out"
    index = two_runs(out)
    (out / "checkpoints" / "20261127-100000" / "baseline.pt").write_bytes(b"a checkpoint")
    mark_finished(out, "20261127-100000")
    assert start_run(out, index=index, resume=True, command="") == "20261127-110000"
    # unfinished, A would be continued (the test above)
    record = out / "checkpoints" / "20261127-100000" / "run.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "finished": False}))
    assert start_run(out, index=index, resume=True, command="") == "20261127-100000"


def test_a_folder_without_locks_runs_unguarded_with_no_lock_error_in_its_tracebacks(
        tmp_path, monkeypatch):
    """On a filesystem without record locks (some network drives) the run went on inside the
    lock's except block: every error of the run then read "No locks available ... During
    handling of the above exception", and killed writes' leftovers were never swept."""
    import fcntl

    from modules.files import folder_lock

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    stale = tmp_path / ".results.json.deadbeef.tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600,) * 2)
    with pytest.raises(ValueError) as raised:
        with folder_lock(tmp_path):
            assert not stale.exists()
            raise ValueError("the run's own error")
    assert raised.value.__context__ is None



def test_a_chart_or_report_that_fills_the_disk_leaves_the_earlier_one(tmp_path, monkeypatch):
    """Charts, report.md and the plotly pages were written in place: a full disk left a
    truncated PNG where the previous run's was, under a message saying it stayed intact."""

    from modules import files
    from modules.config import UserError
    from modules.report import plot_comparison, write_html
    histories = {"baseline": [{"epoch": 1, "train_loss": 1.0, "val_loss": 1.1,
                               "train_acc": 0.5, "val_acc": 0.4}]}
    paths = {p.name: p for p in plot_comparison(histories, tmp_path)}
    before = {name: p.read_bytes() for name, p in paths.items()}

    def full(self, target, **kwargs):
        target.write(b"\x89PNG half a chart")
        raise OSError(errno.ENOSPC, "No space left on device")
    from matplotlib.figure import Figure
    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(UserError, match="^no space left on the device holding "):
        plot_comparison(histories, tmp_path)
    real = files._atomic_write

    def html_full(path, write):  # the page's own write fails
        if path.suffix == ".html":
            raise files.write_error(path, OSError(errno.ENOSPC, "No space left on device"))
        real(path, write)
    monkeypatch.setattr(files, "_atomic_write", html_full)
    import plotly.graph_objects as go
    with pytest.raises(UserError, match="^no space left"):
        write_html(go.Figure(), paths["training_comparison.html"])
    assert {name: p.read_bytes() for name, p in paths.items()} == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_clock_or_refusal_record_that_cannot_be_written_is_no_traceback(data, tmp_path,
                                                                          caplog, capsys):
    """The tuning clock's thread caught OSError only; writers raise UserError for a full or
    read-only disk, so the thread died with a traceback on stderr. And a refused run whose
    record could not be undone said that instead of why it was refused."""

    import scenario
    from modules import clock, files
    from modules.config import UserError
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(clock, "write_json", lambda path, data: (_ for _ in ()).throw(
            files.write_error(path, OSError(errno.ENOSPC, "No space left on device"))))
        with caplog.at_level("INFO", logger="scenario"):
            clock.write_clock(tmp_path / "hpo.clock.json", 12.0)
    assert "could not write" in caplog.text and "no space left" in caplog.text
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scenario, "_run_scenarios", lambda *a, **k: (_ for _ in ()).throw(
            UserError("the weights file is a JPEG")))
        mp.setattr(scenario, "forget_refused_run", lambda *a, **k: (_ for _ in ()).throw(
            files.write_error(tmp_path / "o" / "run.json", OSError(errno.EROFS, "Read-only"))))
        assert pipeline.main(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"),
                              *RUN]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: the weights file is a JPEG"


def test_a_finished_run_is_not_resumed_into_scenarios_it_did_not_have(tmp_path):
    """A finished baseline,resolution run resumed with the default three scenarios trained hpo
    into it, where the README says a finished run resumed trains nothing. An unfinished run
    given more scenarios takes them, and keeps them on its next resume."""
    from types import SimpleNamespace

    from modules.config import UserError
    from modules.results import mark_finished, start_run
    out = tmp_path / "out"
    index = SimpleNamespace(name="d", n_images=lambda: 9, fingerprint=lambda: "fp",
                            same_data=lambda recorded: recorded == "fp")
    run = start_run(out, index, resume=False, command="", scenarios=["baseline", "resolution"])
    mark_finished(out, run)
    with pytest.raises(UserError, match=rf"^cannot resume: run {run} in .* finished with "
                                        r"baseline, resolution; hpo would be trained into it: "
                                        r"drop --resume and run only hpo \(--scenarios hpo\)"):
        start_run(out, index, resume=True, command="",
                  scenarios=["baseline", "resolution", "hpo"])
    for scenarios in (["baseline", "resolution"], ["resolution"]):  # nothing to train
        assert start_run(out, index, resume=True, command="", scenarios=scenarios) == run
    unfinished = start_run(out, index, resume=False, command="", scenarios=["baseline"])
    (out / "checkpoints" / unfinished / "baseline.pt").write_bytes(b"a checkpoint")
    assert start_run(out, index, resume=True, command="",
                     scenarios=["baseline", "hpo"]) == unfinished
    mark_finished(out, unfinished)
    assert start_run(out, index, resume=True, command="",
                     scenarios=["baseline", "hpo"]) == unfinished


def _eio(path=None):
    return OSError(errno.EIO, "Input/output error", None if path is None else str(path))


def test_an_image_the_drive_failed_to_read_is_read_again_not_skipped(tmp_path, monkeypatch):
    """One read error of a network drive (a Google Drive mount's) during indexing was taken
    for an undecodable image: skipped, it left the data set one image short, and a --resume
    of that run was then refused as 'other images'. It is read again; a drive that keeps
    failing stops the run in one line, with nothing skipped."""
    from modules import dataset
    from modules.files import ReadFailed
    root = make_folder(tmp_path / "d", layout="class folders", n_train=6, n_test=2)
    opened = Image.open
    failing = {str(next(root.rglob("*.jpg"))): 1}

    def drive(path, *a, **k):
        if failing.get(str(path), 0) > 0:
            failing[str(path)] -= 1
            raise _eio(path)
        return opened(path, *a, **k)
    monkeypatch.setattr(dataset.Image, "open", drive)
    index = index_dataset(root, "d")
    assert not index.skipped and index.n_images() == 24
    failing = {path: 2 for path in failing}  # it keeps failing
    with pytest.raises(ReadFailed, match=r"could not read or write '.*' \(Input/output error\)"
                                         r": the disk or network drive failed; check it, then "
                                         r"rerun with --resume"):
        index_dataset(root, "d")


def test_a_resume_that_cannot_read_its_run_files_stops_rather_than_redo(tmp_path):
    """A resume that met a read error on its tuning clock, its resolution trials' journal or
    results.json went on as if the file were missing: its tuning seconds dropped from the row,
    every size trained again, a finished row's figures replaced. A file that is missing still
    reads as none."""
    from unittest import mock
    from modules import clock, results
    from modules.files import ReadFailed
    from resolution_tuner import ResolutionTuner
    for read, path, missing in (
            (clock.read_kept, tmp_path / "clock.json", (0.0, [], [])),
            (results.earlier_rows, tmp_path / "results.json", [])):
        assert read(path) == missing
        path.write_text("{}")
        with mock.patch.object(Path, "read_text", side_effect=_eio(path)), \
                mock.patch.object(Path, "read_bytes", side_effect=_eio(path)), \
                pytest.raises(ReadFailed, match="Input/output error"):
            read(path)
        path.unlink()
    tuner = ResolutionTuner.__new__(ResolutionTuner)
    tuner.journal = tmp_path / "resolution.tuning.json"
    tuner.journal.write_text("{}")
    with mock.patch.object(Path, "read_text", side_effect=_eio(tuner.journal)), \
            pytest.raises(ReadFailed, match="resolution.tuning.json"):
        tuner._journaled()


def test_an_io_error_outside_the_atomic_writers_is_one_line(capsys):
    """A report copied, results.json read, TensorBoard's event file written: an I/O error
    there ended the run with a traceback; like a full disk, it is one line."""
    from modules.files import user_error
    said = user_error(_eio("/out/runs/r/report/report.md"))
    assert said.startswith("could not read or write '/out/runs/r/report/report.md' (Input/"
                           "output error): the disk or network drive failed")
    assert "--resume" in said and "\n" not in said
    assert user_error(OSError(errno.EIO, "Input/output error")).startswith(
        "could not read or write a file of the run")



def test_a_file_the_run_may_not_read_is_not_called_unwritable(tmp_path, monkeypatch):
    """A results.json another user left (a Docker run's, root's) that the run may not read was
    said to be one it 'cannot write', with a fix for a folder."""
    from modules.files import user_error
    kept = tmp_path / "results.json"
    kept.write_text("[]")
    refused = PermissionError(errno.EACCES, "Permission denied", str(kept))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert user_error(refused) == (
        f"cannot read {str(kept)!r} (Permission denied): fix its permissions (a file another "
        "user made?), then rerun with --resume to continue (what was written before stays "
        "intact).")
    monkeypatch.undo()  # a file it may read: the write was refused
    assert user_error(refused).startswith(f"cannot write {str(kept)!r} (Permission denied)")


def test_the_run_s_copy_of_its_report_is_whole_or_absent(tmp_path, monkeypatch):
    """runs/<run>/report/ got a plain copy: a disk that filled mid-copy left half a report.md
    there. It is a copy, not a link: an editor that saves in place (Jupyter's, vim's) would
    change the run's own copy with the top-level file."""
    import shutil

    from modules.config import UserError
    from modules.report import write_report
    out, copy_to = tmp_path / "out", tmp_path / "out" / "runs" / "r" / "report"
    out.mkdir()

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    def half(source, target, *args, **kwargs):
        target.write(b"# half a report")
        raise OSError(errno.ENOSPC, "No space left on device")
    write_report([], out, copy_to=copy_to)
    with open(out / "report.md", "a") as saved_in_place:
        saved_in_place.write("edited")
    assert "edited" not in (copy_to / "report.md").read_text()
    (copy_to / "report.md").unlink()
    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(shutil, "copyfileobj", half)
    monkeypatch.setattr(shutil, "_fastcopy_sendfile", half, raising=False)
    with pytest.raises(UserError, match="^no space left on the device holding "):
        write_report([], out, copy_to=copy_to)
    assert (out / "report.md").is_file()
    assert [p.name for p in copy_to.iterdir()] == []
