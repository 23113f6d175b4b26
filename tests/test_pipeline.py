"""The command end to end: options, outputs, clear errors, resume."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipeline
import scenario
import resolution_tuner
from conftest import COLOURS, Recorded, make_folder, record_tuner, run_path, write_image
from modules import final_runs, hostmem, report
from modules.clock import read_kept, ticking, write_clock
from modules.config import UserError
from modules.results import MACHINE_FIGURES, STEP_FIGURES
from modules.utility import load_model, predict, results_table

ROOT = Path(__file__).resolve().parents[1]
ROW_FIELDS = {"scenario", "train_acc", "train_loss", "test_acc", "best_resolution", "epochs",
              "avg_step_ms", "samples_per_s", "gpu_util_pct", "cpu_util_pct", "cpu_exec_us",
              "peak_mem_mb", "data_wait_frac", "wall_s", "diagnosis", "skipped_files", "settings"}


def run_main(*argv: str) -> int:
    """The command; one scenario unless the test names them (the tuners have their own tests)."""
    if "--scenarios" not in argv and "--quick" not in argv:
        argv = ("--scenarios", "baseline", *argv)
    return pipeline.main(list(argv))


def run_stopped_after_a_checkpoint(monkeypatch, *argv: str) -> int:
    """run_main(*argv), stopped (Ctrl-C) right after it writes its first checkpoint."""
    from modules import checkpoints
    real = checkpoints.CheckpointSaver.save

    def save_then_stop(self, *a, **k):
        real(self, *a, **k)
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(checkpoints.CheckpointSaver, "save", save_then_stop)
        return run_main(*argv)


def small_hpo(data: Path, out: Path, *more: str) -> tuple[str, ...]:
    """The hpo scenario alone on the `small` folder, quickly: 32 px, 2 epochs, no autotune."""
    return ("--data-dir", str(data), "--scenarios", "hpo", "--image-size", "32", "--epochs",
            "2", "--weights", "none", "--no-progress", "--no-autotune", "--output-dir", str(out),
            *more)


@pytest.fixture
def small(tmp_path):
    data = make_folder(tmp_path / "colours", n_train=16, n_test=6)
    (data / "train" / "red" / "broken.jpg").write_bytes(b"")
    (data / "train" / "red" / "Thumbs.db").write_bytes(b"\0")
    return data


def test_baseline_end_to_end_on_a_folder(small, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--epochs", "3", "--image-size", "32",
                    "--batch-size", "8", "--weights", "none", "--no-progress",
                    "--output-dir", str(out)) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline"]
    row = rows[0]
    assert ROW_FIELDS <= set(row)
    assert row["skipped_files"] == 1 and row["ignored_files"] == 1
    assert row["best_resolution"] == 32 and row["epochs"] == 3
    assert row["gpu_util_pct"] is None and 0 < row["cpu_util_pct"] <= 100
    assert row["settings"]["batch_size"] == 8 and row["settings"]["amp"] == "off"
    assert 0 <= row["test_acc"] <= 1 and len(row["history"]) == 3
    for name in ("training_loss_comparison.png", "training_accuracy_comparison.png",
                 "training_comparison.html", "colours_model.pt", "latest_run.json"):
        assert (out / name).exists(), name
    assert (run_path(out) / "baseline.pt").exists()
    # what --resume continues: this run's options, not the Python process's (pytest's here,
    # a notebook kernel's launcher when main() is called from a cell)
    command = json.loads((out / "latest_run.json").read_text())["command"]
    assert command.startswith("python pipeline.py --scenarios baseline --data-dir ") and \
        "--epochs 3" in command
    assert (run_path(out, "runs") / "baseline" / "config.json").exists()
    assert list((run_path(out, "runs") / "baseline").glob("events.out.tfevents.*"))
    # the log again, with each line's wall-clock time: where the run's time went
    logged = (run_path(out, "runs") / "run.log").read_text().splitlines()
    # the data's lines first: read before the log could be opened, they were missing from it
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} info modules.dataset: data: "
                    r"colours: 3 classes, .*, 1 skipped, 1 other files ignored in ", logged[0])
    assert logged[1].endswith("skipped 1 undecodable image file(s): listed in skipped_files.txt")
    # and where the weights started: a random start was said before the log was opened
    assert logged[2].endswith("start weights: none")
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} info scenario: run ", logged[3])
    (listed,) = (run_path(out, "runs") / "skipped_files.txt").read_text().splitlines()
    assert listed.startswith(f"train{os.sep}") and "\t" in listed  # inside the data folder
    assert any("epoch 3/3" in line for line in logged)
    model = load_model(out / "colours_model.pt")
    assert model.meta["class_names"] == ["blue", "green", "red"]
    assert predict(model, [small / "test" / "red" / "0.jpg"])[0]["label"] in model.meta["class_names"]
    assert "| baseline |" in capsys.readouterr().out


def test_run_log_says_how_a_session_ended(small, tmp_path, monkeypatch, capsys):
    """The console's last line (an interrupt, a refusal, a crash) is printed after run.log
    closes: the log of a session that ended so stopped mid-epoch, without a word why."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--epochs", "2", "--image-size", "32", "--weights",
            "none", "--no-progress", "--output-dir", str(out))
    assert run_stopped_after_a_checkpoint(monkeypatch, *argv) == 130
    log_file = run_path(out, "runs") / "run.log"
    assert log_file.read_text().splitlines()[-1].endswith(
        "error pipeline: interrupted (Ctrl-C or Stop): --resume continues the run from its "
        "checkpoints")

    def diverged(*args, **kwargs):
        raise UserError("training diverged: lower --lr.")
    monkeypatch.setattr(scenario, "train", diverged)
    assert run_main(*argv, "--resume") == 2
    assert log_file.read_text().splitlines()[-1].endswith(
        "error pipeline: stopped: training diverged: lower --lr.")

    # the console's one line: a full disk's, a DataLoader worker's error without its traceback
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(out / "x.pt"))
    monkeypatch.setattr(scenario, "train", full)
    assert run_main(*argv, "--resume") == 2
    assert "error pipeline: stopped: no space left on the device holding " in \
        log_file.read_text().splitlines()[-1]

    def in_worker(*args, **kwargs):
        raise UserError("Caught UserError in DataLoader worker process 0.\nOriginal Traceback "
                        "(most recent call last):\n  File \"x.py\", line 1\n"
                        "modules.config.UserError: image 'a.jpg' became unreadable")
    monkeypatch.setattr(scenario, "train", in_worker)
    assert run_main(*argv, "--resume") == 2
    assert log_file.read_text().splitlines()[-1].endswith(
        "error pipeline: stopped: image 'a.jpg' became unreadable")

    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(scenario, "train", bug)
    with pytest.raises(ZeroDivisionError):
        run_main(*argv, "--resume")
    assert log_file.read_text().splitlines()[-1].endswith(
        "stopped by an error (ZeroDivisionError: division by zero); the console has its "
        "traceback")


def test_resume_after_a_finished_run_trains_nothing_more(small, tmp_path):
    args = ["--data-dir", str(small), "--epochs", "2", "--image-size", "32", "--weights", "none",
            "--no-progress", "--output-dir", str(tmp_path / "out")]
    assert run_main(*args) == 0
    first = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert run_main(*args, "--resume") == 0
    again = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    # it resumed nothing: it evaluated the finished run
    assert again["resumed_from_epoch"] is None and again["history"] == first["history"]
    assert again["test_acc"] == first["test_acc"]
    # the figures of the run that trained it stay, not those of a process that only evaluated
    for key in STEP_FIGURES + MACHINE_FIGURES:
        assert again[key] == first[key], key
    assert again["diagnosis"] == first["diagnosis"]
    assert again["wall_s"] >= first["history"][-1]["elapsed_s"]
    # a checkpoint from before checkpoints carried the step timing: results.json's row has it
    ckpt_path = run_path(tmp_path / "out") / "baseline.pt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    del ckpt["timing"]
    torch.save(ckpt, ckpt_path)
    assert run_main(*args, "--resume") == 0
    old = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    for key in STEP_FIGURES + MACHINE_FIGURES:
        assert old[key] == first[key], key


def test_resume_after_a_finished_run_keeps_each_rows_timeline(small, tmp_path):
    """Only evaluated, the resumed process would time its own preparation (a decode the tuning
    had done) and lose the start trial's epochs: the row would reach the baseline's accuracy
    later than the run that trained it did."""
    out = tmp_path / "out"
    args = ["--data-dir", str(small), "--scenarios", "baseline,resolution", "--resolutions",
            "24,32", "--image-size", "32", "--epochs", "2", "--weights", "none",
            "--no-progress", "--output-dir", str(out)]
    assert run_main(*args) == 0
    first = json.loads((out / "results.json").read_text())[-1]
    assert first["scenario"] == "resolution" and first["warm_start"]["curve"]
    assert run_main(*args, "--resume") == 0
    again = json.loads((out / "results.json").read_text())[-1]
    assert again["resumed_from_epoch"] is None
    for key in ("prepare_s", "wall_s", "time_to_best_s", "warm_start", "baseline_acc_reached_in"):
        assert again[key] == first[key], key
    # the resumed session's own seconds in the tuning code (reading its journal) count
    assert again["tuning_s"] >= first["tuning_s"]
    assert again["total_s"] - first["total_s"] == pytest.approx(
        again["tuning_s"] - first["tuning_s"])
    # the output dir copied elsewhere, by a version whose clock did not record its sessions
    # (which place the trial's epochs anew): the row records the start weights where they were
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    (clock,) = run_path(moved).glob("resolution.clock.json")
    clock.write_text(json.dumps({"tuning_s": json.loads(clock.read_text())["tuning_s"]}))
    assert run_main(*args[:-1], str(moved), "--resume") == 0
    there = json.loads((moved / "results.json").read_text())[-1]
    for key in ("time_to_baseline_acc_s", "baseline_acc_reached_in"):
        assert there[key] == again[key], key
    assert there["warm_start"]["curve"] == again["warm_start"]["curve"]


def test_a_row_on_the_decoded_cache_records_the_workers_it_ran(small, tmp_path):
    """--num-workers applies to streamed images: the tuned scenarios' cache started none, and
    their rows said 2 beside "decoded cache"."""
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--scenarios", "resolution", "--resolutions",
                    "32", "--image-size", "32", "--epochs", "1", "--weights", "none",
                    "--no-progress", "--no-autotune", "--num-workers", "2",
                    "--output-dir", str(out)) == 0
    settings = json.loads((out / "results.json").read_text())[-1]["settings"]
    assert settings["data_path"] == "decoded cache" and settings["num_workers"] == 0


def test_the_final_run_holds_only_its_own_sizes_cache(small, tmp_path):
    """The other candidate sizes' decoded images stayed in memory through the final run and
    counted in its peak memory (4.8 GB for Intel's train split at the GPU sizes)."""
    from modules import fastdata
    fastdata.clear_cache()
    assert run_main("--data-dir", str(small), "--scenarios", "resolution", "--resolutions",
                    "24,32", "--image-size", "32", "--epochs", "2", "--weights", "none",
                    "--no-progress", "--output-dir", str(tmp_path / "out")) == 0
    row = json.loads((tmp_path / "out" / "results.json").read_text())[-1]
    assert {size for _, size in fastdata._MEMO} == {row["best_resolution"]}
    fastdata.keep_sizes({48, 64})  # sizes not named go, the last one too
    assert not fastdata._MEMO


def test_each_finished_scenario_is_in_results_json_before_the_next_one_runs(small, tmp_path,
                                                                            monkeypatch):
    seen = []

    def crash(*_, **__):
        # a lost VM would end the process here: the finished scenario's report is written
        seen.append((out / "report.md").read_text())
        raise pipeline.UserError("simulated crash in the second scenario")
    monkeypatch.setattr(scenario, "tune_resolution", crash)
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--scenarios", "baseline,resolution", "--epochs",
                    "1", "--image-size", "32", "--weights", "none", "--no-progress",
                    "--output-dir", str(out)) == 2
    rows = json.loads((out / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline"] and rows[0]["samples_per_s"] > 0
    # the finished scenario's report and charts are written all the same, marked incomplete
    report = (out / "report.md").read_text()
    assert f"run {rows[0]['run_id']}" in report
    assert "**Incomplete run:** resolution did not finish" in report
    assert "**Incomplete run:** resolution did not finish" in seen[0]
    assert (out / "training_accuracy_comparison.png").exists()
    # the run's own copy, which the next run does not write over
    kept = out / "runs" / rows[0]["run_id"] / "report"
    assert (kept / "report.md").read_text() == report
    assert (kept / "training_accuracy_comparison.png").exists()
    assert not (kept / "resolution_tradeoff.png").exists()
    # the interactive chart too (the next run wrote over it), its script the output folder's
    page = (kept / "training_comparison.html").read_text()
    assert 'src="../../../plotly.min.js"' in page and (out / "plotly.min.js").is_file()
    assert page.replace("../../../", "") == (out / "training_comparison.html").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-0.1"], "argument --lr: must be > 0.0"),
    (["--lr", "abc"], "argument --lr: expected a number"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["--epochs", "1e9"], "argument --epochs: expected an integer"),
    (["--seed", str(2**64)], "argument --seed: must be >= 0 and <= 4294967295"),
    (["--data-dir", ""], "--data-dir is empty; name a folder"),
    (["--model", "resnet18", "--image-size", "32", "--batch-size", "1"],
     "batch_size 1 cannot train resnet18 at 32 px"),
    (["--image-size", "16"], "image_size 16 is too small for squeezenet1_1: its layers need at least 17"),
    (["--model", "resnet999"], "argument --model: invalid choice"),
    (["--data-dir", "/no/such/folder"], "--data-dir '/no/such/folder' does not exist"),
    (["--weights", "/no/such.pt"], "--weights must be none, imagenet or an existing file"),
    (["--scenarios", "baseline,magic"], "unknown scenario magic"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--early-stopping", "200000"], "argument --early-stopping: must be >= 1 and <= 100000"),
    # argparse takes "-1e-3" for an option: the value's own check was never reached
    (["--lr", "-1e-3"], "expected one argument (a value starting with '-' is written "
                        "--lr=-1e-3)"),
    (["--lr=-1e-3"], "argument --lr: must be > 0.0"),
    (["--weights", ""], "--weights must be none, imagenet or an existing file, but got ''."),
])
def test_bad_options_end_in_one_line(argv, message, capsys, tmp_path):
    assert run_main(*argv, "--output-dir", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()  # refused before any work


def test_mistakes_found_in_files_and_devices_are_refused_before_a_run_starts(tmp_path, capsys):
    """A --weights file that is not PyTorch's or fits nothing, and fp16 on a CPU, used to be
    found once the run had started: each try left a run folder behind."""
    notes = tmp_path / "weights.txt"
    notes.write_text("not weights")
    other = tmp_path / "other.pt"
    torch.save({"encoder.w": torch.zeros(3)}, other)
    whole = tmp_path / "whole.pt"  # torch.save(model): pickled code, not loaded
    torch.save(torch.nn.Linear(2, 2), whole)
    cases = [(["--weights", str(notes)], "is not a readable PyTorch file (UnpicklingError)"),
             (["--weights", str(whole)], "(UnpicklingError: it holds pickled Python objects, "
              "which are not run for safety; a whole model saved with torch.save(model)? save "
              "model.state_dict() instead)"),
             (["--weights", str(other)], "no tensor in"),
             (["--amp", "fp16", "--device", "cpu"], "--amp fp16 needs a CUDA GPU")]
    for argv, message in cases:
        assert run_main(*argv, "--output-dir", str(tmp_path / "o")) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err
        assert not (tmp_path / "o").exists()


def test_good_files_and_the_notebooks_defaults_pass_the_early_checks(tmp_path, caplog):
    """The checks before a run refuse only mistakes: this tool's own 2-class model file is a
    usable --weights for any class count, and the notebook's defaults warn of nothing."""
    from modules.models import build_model
    saved = tmp_path / "two_classes.pt"
    torch.save(build_model("squeezenet1_1", 2, "none").state_dict(), saved)
    with caplog.at_level(logging.WARNING):
        assert pipeline.parse_args(["--weights", str(saved)]).weights == str(saved)
        pipeline.options(scenarios=["baseline"], pruner="asha", n_trials=None, time_budget=None,
                         resolutions="", storage="", worker_seed=None, amp="fp16" if
                         torch.cuda.is_available() else "")
    assert not caplog.records


def test_a_data_folder_behind_a_locked_one_is_a_read_error_in_one_line(monkeypatch, capsys):
    """Path.is_dir raises PermissionError for a folder whose parent cannot be entered (as
    root, permissions cannot be tested for real): main() read it as a failed write."""
    real = pipeline.Path.is_dir

    def is_dir(self):
        if "locked" in str(self):
            raise PermissionError(13, "Permission denied")
        return real(self)
    monkeypatch.setattr(pipeline.Path, "is_dir", is_dir)
    assert run_main("--data-dir", "/srv/locked/images") == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: cannot read --data-dir '/srv/locked/images' (Permission " \
        "denied)."


def test_options_no_scenario_reads_are_named(caplog):
    with caplog.at_level(logging.WARNING):
        pipeline.parse_args(["--scenarios", "baseline", "--n-trials", "8", "--pruner", "none",
                             "--resolutions", "32,48"])
    said = [r.getMessage() for r in caplog.records]
    assert "--n-trials does nothing here: only the hpo scenario uses it, and this run's " \
        "scenarios are baseline" in said
    assert any(m.startswith("--pruner does nothing") for m in said)
    assert any(m.startswith("--resolutions does nothing") for m in said) and len(said) == 3
    caplog.clear()
    pipeline.parse_args(["--scenarios", "baseline,resolution", "--resolutions", "32,48"])
    assert not caplog.records
    pipeline.parse_args(["--scenarios", "hpo", "--worker-seed", "7"])  # no shared study
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "--worker-seed does nothing here: it seed"]
    caplog.clear()
    pipeline.parse_args(["--scenarios", "baseline", "--worker-seed", "7"])  # said once, not twice
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "--worker-seed does nothing here: only th"]
    caplog.clear()  # SGD's momentum: baseline and resolution train with Adam
    pipeline.parse_args(["--scenarios", "baseline,resolution", "--momentum", "0.5"])
    assert [r.getMessage()[:50] for r in caplog.records] == [
        "--momentum does nothing here: only the hpo scenari"]


def test_options_no_scenario_reads_are_named_once_under_torchrun(caplog, monkeypatch):
    """torchrun starts a process per rank, each parsing the same options: rank 0 says it."""
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING):
        pipeline.parse_args(["--scenarios", "baseline", "--n-trials", "8"])
    assert not caplog.records
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING):
        pipeline.parse_args(["--scenarios", "baseline", "--n-trials", "8"])
    assert len(caplog.records) == 1


@pytest.mark.parametrize("raised, said", [
    (RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback "
                  "...\nRuntimeError: unable to allocate shared memory(shm) for file "
                  "</torch_1>: No space left on device (28)"), "--num-workers 0, or give "
     "/dev/shm more space; then rerun with --resume"),
    (RuntimeError("Too many open files. Communication with the workers is no longer "
                  "possible."), "ulimit -n 4096, or pass --num-workers 0"),
    (OSError(24, "Too many open files"), "ulimit -n 4096"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                  "memory: you tried to allocate 1572864 bytes"), "lower --batch-size"),
    (RuntimeError("can't start new thread"), "ulimit -u"),
])
def test_a_limit_of_the_machine_is_one_line_saying_what_to_change(monkeypatch, capsys, raised,
                                                                   said):
    """A container's 64 MB /dev/shm with workers, ulimit -n 32, ulimit -v 4 GB, ulimit -u:
    each ended the run with a traceback (an out-of-memory in the loader, outside the training
    step's recovery); a limit of the machine is not a bug of ours."""
    def run(args):
        raise raised
    monkeypatch.setattr(pipeline, "run", run)
    assert pipeline.main(["--output-dir", "/tmp/unused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_an_output_dir_whose_name_is_not_utf8_is_refused_in_one_line(tmp_path, capsys):
    """A Latin-1 byte in --output-dir (an old NAS or USB stick) crashed the first scenario in
    TensorBoard's writer with a UnicodeEncodeError; --data-dir takes such a name."""
    import os
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out-\xe9")
    assert pipeline.main(["--output-dir", out, "--scenarios", "baseline"]) == 2
    err = capsys.readouterr().err
    assert "out-\\xe9' has a name that is not UTF-8" in err and err.count("\n") == 1


def test_a_reader_gone_from_the_pipe_stops_nothing():
    """`pipeline.py | head -1`: the finished run's table print raised BrokenPipeError, with a
    traceback, before the run was marked finished; with progress bars, `2>&1 | head -3`
    killed the training at its first bar."""
    import os
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    os.close(read)  # the reader is gone
    safe = pipeline.ReaderSafe(stream)
    for _ in range(3):
        safe.write("x" * 100_000)
        safe.flush()
    stream.close()  # its descriptor writes to the null device: nothing left to fail


def test_a_write_the_process_s_limits_refuse_names_the_limit_not_the_folder(tmp_path):
    """ulimit -n 8 and ulimit -f: "pass a writable --output-dir", of a writable folder."""
    import errno
    from modules.files import write_error
    assert "the open-file limit is too low" in str(
        write_error(tmp_path / "f.png", OSError(errno.EMFILE, "Too many open files")))
    assert "file-size limit (ulimit -f) or the file system allows (FAT32: 4 GB)" in str(
        write_error(tmp_path / "m.pt", OSError(errno.EFBIG, "File too large")))


def test_user_errors_in_a_real_process_have_no_traceback(tmp_path):
    empty = tmp_path / "empty"
    (empty / "train" / "a").mkdir(parents=True)
    (empty / "test" / "a").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "pipeline.py", "--data-dir", str(empty),
                           "--output-dir", str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == \
        "error: class 'a' in the train split has no usable images."


def test_a_user_error_raised_in_a_dataloader_worker_is_its_own_line():
    """An image that became unreadable is found in a DataLoader worker: torch re-raises it in
    the main process with the worker's traceback inside the message."""
    from torch.utils.data import DataLoader, Dataset

    class Unreadable(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            raise pipeline.UserError("image 'a.jpg' became unreadable during training")
    with pytest.raises(pipeline.UserError) as err:
        next(iter(DataLoader(Unreadable(), num_workers=1)))
    assert "Original Traceback" in str(err.value)
    assert pipeline.user_error(err.value) == "image 'a.jpg' became unreadable during training"
    assert pipeline.user_error(pipeline.UserError("plain")) == "plain"


def test_unwritable_output_dir_is_one_clear_line(small, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert run_main("--data-dir", str(small), "--output-dir", str(blocker / "out")) == 2
    assert "cannot write to --output-dir" in capsys.readouterr().err
    assert run_main("--data-dir", str(small), "--output-dir", str(blocker)) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    # a file where a folder of the output is to be: a traceback (NotADirectoryError) before
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("x")
    assert run_main("--data-dir", str(small), "--image-size", "32", "--epochs", "1",
                    "--weights", "none", "--no-progress", "--output-dir", str(out)) == 2
    assert "a file stands where a folder of that path is to be" in capsys.readouterr().err
    # and a folder where a file of the output is to be: results.json ended the run after
    # training with a traceback (IsADirectoryError), its row lost
    (out / "checkpoints").unlink()
    for name in ("results.json", "report.md", "latest_run.json"):
        (out / name).mkdir()
        assert run_main("--data-dir", str(small), "--image-size", "32", "--epochs", "1",
                        "--weights", "none", "--no-progress", "--scenarios", "baseline",
                        "--output-dir", str(out)) == 2
        assert f"{name}' is a folder where this run writes a file" in capsys.readouterr().err
        (out / name).rmdir()


def test_paths_the_system_cannot_follow_or_hold_are_one_line(small, tmp_path, capsys):
    """An output folder that is a link to itself, or whose name is longer than a file system
    holds, and an empty --storage: each one line, where they were tracebacks (RuntimeError,
    ENAMETOOLONG) or a silently "shared" study in the run's own database."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert run_main("--data-dir", str(small), "--output-dir", str(loop)) == 2
    assert "cannot follow --output-dir" in capsys.readouterr().err
    assert run_main("--data-dir", str(small), "--output-dir", str(tmp_path / ("a" * 300))) == 2
    assert "cannot write to --output-dir" in capsys.readouterr().err  # nothing to resume
    assert run_main("--data-dir", str(small), "--scenarios", "hpo", "--storage", " ") == 2
    assert "--storage is empty" in capsys.readouterr().err


def test_a_start_file_this_run_may_replace_is_refused(small, tmp_path, capsys):
    """--weights naming the output's best model (or a checkpoint) would be read again after
    the baseline replaced it: the later scenarios would start from the baseline's result."""
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--image-size", "32", "--epochs", "1",
                    "--weights", "none", "--no-progress", "--output-dir", str(out)) == 0
    saved = out / "colours_model.pt"
    assert saved.exists()
    assert run_main("--data-dir", str(small), "--weights", str(saved),
                    "--output-dir", str(out)) == 2
    assert "is a file this run may replace" in capsys.readouterr().err
    aside = out / "colours_model.other-data-0123456789.pt"  # a run may move it back
    aside.write_bytes(saved.read_bytes())
    assert run_main("--data-dir", str(small), "--weights", str(aside),
                    "--output-dir", str(out)) == 2
    assert "is a file this run may replace" in capsys.readouterr().err
    copy = tmp_path / "start.pt"
    copy.write_bytes(saved.read_bytes())
    assert run_main("--data-dir", str(small), "--image-size", "32", "--epochs", "1",
                    "--weights", str(copy), "--no-progress", "--output-dir", str(out)) == 0


def test_no_workers_asked_for_is_no_workers_on_any_cpu(monkeypatch):
    """The tuned scenarios keep their workers alive between epochs on a CPU of more than two
    cores; --num-workers 0 asks for none, and nothing is left to keep alive."""
    monkeypatch.setattr(scenario, "usable_cpus", lambda: 8)
    args = pipeline.parse_args(["--num-workers", "0", "--device", "cpu"])
    for name in pipeline.SCENARIOS:
        config = pipeline.scenario_config(name, args, torch.device("cpu"))
        assert (config.num_workers, config.persistent_workers) == (0, False)
    tuned = pipeline.scenario_config("hpo", pipeline.parse_args([]), torch.device("cpu"))
    assert tuned.num_workers == 4 and tuned.persistent_workers


def test_under_torchrun_rank_0_downloads_the_intel_set_before_the_others_read_it(
        tmp_path, monkeypatch):
    """kagglehub has no lock: processes downloading into one cache at once remove each other's
    archive."""
    said = []
    monkeypatch.setattr(scenario.distributed, "world_size", lambda: 2)
    monkeypatch.setattr(scenario.distributed, "same_on_every_rank", lambda value: True)
    monkeypatch.setattr(scenario, "on_main", lambda action: said.append("rank 0 first") or
                        action())
    monkeypatch.setattr(scenario, "resolve_source", lambda *a: said.append("download") or (
        make_folder(tmp_path / "intel"), "intel"))
    scenario.load_data(pipeline.parse_args(["--dataset", "intel"]), tmp_path / "out")
    # (the first: rank 0 checks that no other run holds the output dir)
    assert said == ["rank 0 first", "rank 0 first", "download", "download"]


def test_quick_is_the_small_cpu_preset():
    """What --quick means on a CPU; the end-to-end test below runs it on less data and fewer
    epochs, and benchmarks/scenarios.py measures what the preset itself reaches."""
    args = pipeline.parse_args(["--quick"])
    cpu = torch.device("cpu")
    for name in pipeline.SCENARIOS:
        config = pipeline.scenario_config(name, args, cpu)
        assert (config.epochs, config.image_size) == (12, 64), name
    assert scenario.tuned_resolutions(args, cpu, 64) == [48, 64, 96]
    assert scenario.trial_count(args) == 4 and scenario.trial_count(pipeline.parse_args([])) == 20
    assert scenario.QUICK_PER_CLASS == {"train": 200, "val": 60, "test": 200}
    assert scenario.QUICK_SYNTHETIC_PER_CLASS == (260, 200)  # generated: train + val, test


def test_quick_keeps_validation_and_test_large_enough_with_few_classes(tmp_path):
    """Two classes get the six-class preset's 360 validation and 1,200 test images in all
    (as many as the folder has), not 120 and 400: 120 validation images cannot tell 5 points."""
    assert scenario.quick_per_class(2) == {"train": 200, "val": 180, "test": 600}
    assert scenario.quick_per_class(4) == {"train": 200, "val": 90, "test": 300}
    assert scenario.quick_per_class(6) == scenario.quick_per_class(10) == scenario.QUICK_PER_CLASS
    from PIL import Image
    for split, n in (("train", 400), ("test", 700)):
        for label in ("ok", "cracked"):
            folder = tmp_path / "data" / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                # 16 bytes of its own: a copy of another split's image would be left out
                Image.frombytes("L", (4, 4), hashlib.md5(f"{split}{label}{i}".encode())
                                .digest()).save(folder / f"{i}.png")
    out = tmp_path / "out"
    args = pipeline.parse_args(["--quick", "--data-dir", str(tmp_path / "data"), "--output-dir", str(out)])
    index = scenario.load_data(args, out)
    # validation: 25% of 400 held out of each class's train/ (a small set), all of it kept
    assert (len(index.train), len(index.val), len(index.test)) == (400, 200, 1200)


def test_quick_run_does_all_three_scenarios_on_synthetic_data(tmp_path, monkeypatch):
    """The whole --quick path on generated data: smaller and shorter than the preset
    (test_quick_is_the_small_cpu_preset) so that it takes seconds, every part still run."""
    monkeypatch.setattr(scenario, "QUICK_PER_CLASS", {"train": 16, "val": 6, "test": 6})
    monkeypatch.setattr(scenario, "QUICK_SYNTHETIC_PER_CLASS", (22, 6))
    out = tmp_path / "out"
    # --epochs: the tuned final runs keep them instead of filling the baseline's time
    # (fill_time has its own test).
    assert run_main("--quick", "--epochs", "3", "--n-trials", "2", "--weights", "none",
                    "--no-progress", "--output-dir", str(out)) == 0
    rows = {r["scenario"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(rows) == ["baseline", "resolution", "hpo"]
    assert all(r["dataset"] == "synthetic" for r in rows.values())
    assert rows["baseline"]["best_resolution"] == 64
    # the preset's per-class split of the generated set, six classes
    assert (rows["baseline"]["n_val"], rows["baseline"]["n_test"]) == (36, 36)
    trials = rows["resolution"]["resolution_trials"]
    assert [t["image_size"] for t in trials] == [48, 64, 96]
    assert rows["resolution"]["best_resolution"] in (48, 64, 96)
    assert rows["hpo"]["best_resolution"] == rows["resolution"]["best_resolution"]
    assert rows["hpo"]["hpo"]["n_trials"] == 2
    # the search's winner when it beat the default trial, else the default (resolution's lr)
    search = rows["hpo"]["hpo"]
    chosen = search["chosen_params"] or {"lr": rows["resolution"]["settings"]["lr"]}
    assert rows["hpo"]["settings"]["lr"] == chosen["lr"]
    assert search["keeps_default"] is (search["chosen_params"] is None)
    for name in ("synthetic_model.pt", "optuna.db", "resolution_tradeoff.png", "report.md",
                 "training_accuracy_comparison.png"):
        assert (out / name).exists(), name
    # the baseline keeps the per-sample data path; the optimized scenarios are autotuned
    assert rows["baseline"]["settings"]["data_path"] == "per-sample PIL decode"
    assert "autotune" not in rows["baseline"]
    for name in ("resolution", "hpo"):
        row = rows[name]
        assert row["settings"]["data_path"] == "decoded cache"
        knobs = row["autotune"]["knobs"]
        for knob in ("cpu_threads", "cpu_allocator", "channels_last", "amp", "optimizer_impl",
                     "compile", "num_workers", "batch_size"):
            assert knobs[knob]["reason"], (name, knob)
        assert row["settings"]["amp"] == knobs["amp"]["choice"]
        assert row["settings"]["channels_last"] == knobs["channels_last"]["choice"]
    report = (out / "report.md").read_text()
    assert "`amp` = " in report
    # the tuners' charts are shown in the report, as the scenarios' are (and copied beside it)
    for chart in ("resolution_tradeoff.png", "optuna_history.png"):
        assert f"![{chart}]({chart})" in report, chart
    # each tuned final run continued from its chosen trial's weights, classifier included
    size = rows["resolution"]["best_resolution"]
    assert rows["resolution"]["warm_start"]["from"] == f"the {size} px trial"
    # (a kept default continues from the resolution trial when that trained it longer)
    assert rows["hpo"]["warm_start"]["from"] in (
        "the default trial", "the chosen trial", f"the resolution scenario's {size} px trial")
    assert all(t["val_curve"] and max(t["val_curve"]) == t["val_acc"] for t in trials)
    # the search's default trial at the picked size is the resolution trial, not trained again
    # (below the baseline's 64 px, the search's trials train the compute sizes were compared at)
    if size <= 64:
        assert search["default_reused_from"] == f"the resolution scenario's {size} px trial"
        picked = next(t for t in trials if t["image_size"] == size)
        assert search["trial_epochs"] == len(picked["val_curve"]) == (4 if size == 48 else 2)
    for name in ("resolution", "hpo"):
        weights = Path(rows[name]["warm_start"]["weights"])
        assert weights.parent == run_path(out) and rows[name]["settings"]["weights"] == str(weights)
        # continued weights, a fresh optimizer: the rate ramps up over its first epoch
        assert rows[name]["settings"]["warmup_epochs"] == 1
    assert rows["baseline"]["settings"]["warmup_epochs"] == 0
    # the start trial's epochs, in seconds since its scenario started, for time to accuracy
    picked = next(t for t in trials if t["image_size"] == size)
    curve = rows["resolution"]["warm_start"]["curve"]
    assert [p["val_acc"] for p in curve] == picked["val_curve"]
    elapsed = [p["elapsed_s"] for p in curve]
    assert 0 < elapsed[0] and elapsed == sorted(elapsed)
    assert elapsed[-1] <= rows["resolution"]["tuning_s"]
    hpo_curve = rows["hpo"]["warm_start"]["curve"]
    assert [p["elapsed_s"] for p in hpo_curve] == sorted(p["elapsed_s"] for p in hpo_curve)
    if search["default_reused_from"] and rows["hpo"]["warm_start"]["from"] != "the chosen trial":
        # trained in the resolution scenario, counted in this row first: its epochs end where
        # its seconds counted do (left out, the row reached the baseline's accuracy only in
        # its final run, though its model was the same)
        assert [p["val_acc"] for p in hpo_curve] == picked["val_curve"]
        # (after the rest of that scenario's tuning, where the row took its model)
        assert hpo_curve[-1]["elapsed_s"] == pytest.approx(
            rows["hpo"]["hpo"]["default_reused_s"]
            + rows["hpo"]["hpo"].get("resolution_tuning_s", 0.0))
    else:
        assert hpo_curve


def test_hpo_takes_the_resolution_final_when_it_would_train_the_same(small, tmp_path, monkeypatch,
                                                                     capsys):
    """One search trial, the default: it is the resolution scenario's trial, so the kept default
    continues from the same weights for the same epochs as the resolution scenario's final run.
    That run's model and figures are taken, not trained a second time, and trained a second
    time they are the same."""
    def scenarios(out, *more):
        assert run_main("--data-dir", str(small), "--scenarios", "resolution,hpo",
                        "--resolutions", "32", "--image-size", "32", "--n-trials", "1",
                        "--epochs", "2", "--weights", "none", "--no-progress",
                        "--output-dir", str(out), *more) == 0
        return {r["scenario"]: r for r in json.loads((out / "results.json").read_text())}

    filled = {}
    real_fill = scenario.fill_time

    def fill(config, name, args, output_dir, index, tuned, tuning_s, *more):
        filled[name] = tuning_s
        return real_fill(config, name, args, output_dir, index, tuned, tuning_s, *more)
    monkeypatch.setattr(scenario, "fill_time", fill)
    rows = scenarios(tmp_path / "once")
    monkeypatch.setattr(scenario, "fill_time", real_fill)
    resolution, hpo = rows["resolution"], rows["hpo"]
    assert hpo["hpo"]["keeps_default"] and hpo["final_from"] == "resolution"
    # The same model never reads faster in the hpo row: it took the resolution scenario's
    # model, which came of all of that scenario's tuning (the speed knobs measured, the sizes
    # compared), counted first, then its own search. Its search took less here than that
    # tuning did beyond the trial it reused, and the row read 0.22x where the other read 0.25x.
    taken = hpo["hpo"]["resolution_tuning_s"]
    assert taken == pytest.approx(resolution["tuning_s"] - hpo["hpo"]["default_reused_s"])
    assert hpo["tuning_s"] >= resolution["tuning_s"] and hpo["total_s"] >= resolution["total_s"]
    assert hpo["warm_start"]["curve"][-1]["elapsed_s"] == pytest.approx(resolution["tuning_s"])
    # --match-time's fill counted the tuning its row counts, the reused trial included (80% of
    # the baseline's time, "tuning included", was overrun by that trial's seconds)
    assert filled["hpo"] == pytest.approx(hpo["tuning_s"] - taken)
    clock = scenario.checkpoint_file(tmp_path / "once", "hpo", scenario.CLOCK_SUFFIX,
                                     hpo["run_id"])
    assert hpo["history"] == resolution["history"] and hpo["test_acc"] == resolution["test_acc"]
    assert hpo["total_s"] == pytest.approx(hpo["tuning_s"] + resolution["prepare_s"]
                                           + resolution["wall_s"])
    # the trial it continues from trained in the resolution scenario: counted here too, as the
    # final run is (the same model must not read faster in the hpo row)
    picked = resolution["resolution_trials"][0]
    assert hpo["hpo"]["default_reused_s"] == pytest.approx(picked["wall_s"])
    assert hpo["tuning_s"] > hpo["hpo"]["default_reused_s"] > 0
    for row in rows.values():  # the final run's preparation (the decode, the model) counts
        assert row["total_s"] >= row["tuning_s"] + row["wall_s"] and row["prepare_s"] >= 0
    assert hpo["warm_start"]["weights"] == resolution["warm_start"]["weights"]
    assert list((run_path(tmp_path / "once", "runs") / "hpo").iterdir())  # its scalars
    told = (tmp_path / "once" / "report.md").read_text()
    assert "trained once" in told and "the speed settings below are those this scenario's " \
        "search and own runs trained with; the figures above are that run's" in told
    # the autotuner's figures are for a size: the hpo scenario's, where it measured again
    assert f"Autotune at {hpo['autotune']['image_size']} px (" in told
    # its checkpoint is the resolution final's: --resume finds both finished, trains nothing
    checkpoints = run_path(tmp_path / "once")
    assert (checkpoints / "hpo.pt").read_bytes() == (checkpoints / "resolution.pt").read_bytes()
    capsys.readouterr()
    again = scenarios(tmp_path / "once", "--resume")
    # finished: this session resumed nothing, only evaluated
    assert again["hpo"]["resumed_from_epoch"] is None and again["hpo"]["epochs"] == 2
    said = capsys.readouterr().err  # not "had started ...: resuming it", with nothing to resume
    assert "hpo: the final run had finished (" in said and "resuming it" not in said
    assert again["hpo"]["tuning_s"] == pytest.approx(hpo["tuning_s"])  # nothing added twice
    assert scenarios(tmp_path / "once", "--resume")["hpo"]["tuning_s"] == \
        pytest.approx(hpo["tuning_s"])
    # its clock, read back from the row, is its own time: a grown study adds to that
    own = hpo["tuning_s"] - taken - hpo["hpo"]["default_reused_s"]
    assert read_kept(clock).seconds == pytest.approx(own)
    assert again["hpo"]["history"] == hpo["history"] and again["hpo"]["final_from"] == "resolution"
    # ... and its start trial's epochs, trained in the resolution scenario's session, stay: the
    # curve the time to the baseline's accuracy is read off
    assert hpo["warm_start"]["curve"] and again["hpo"]["warm_start"] == hpo["warm_start"]

    monkeypatch.setattr(scenario, "final_to_reuse", lambda *_: None)
    twice = scenarios(tmp_path / "twice")["hpo"]
    assert "final_from" not in twice and (run_path(tmp_path / "twice") / "hpo.pt").exists()
    assert twice["test_acc"] == hpo["test_acc"]
    assert [h["val_acc"] for h in twice["history"]] == [h["val_acc"] for h in hpo["history"]]
    # trained again and validated lower (as for other time-matched epochs): the resolution
    # final run is kept, the own run's scalars set aside in TensorBoard
    real = final_runs.default_if_better
    monkeypatch.setattr(scenario, "default_if_better",
                        lambda row, same: real({**row, "val_acc": row["val_acc"] - 0.5}, same))
    both = scenarios(tmp_path / "lower")
    lower = both["hpo"]
    assert lower["final_from"] == "resolution" and lower["default_final"]["epochs"] == 2
    assert lower["history"] == both["resolution"]["history"]
    # resumed, it finds both final runs finished: its own (which gave way) read back, nothing
    # added to its seconds (each resume added its own)
    assert lower["tuning_s"] == pytest.approx(
        lower["default_final"]["tuning_s"] + lower["default_final"]["wall_s"]
        + lower["default_final"]["prepare_s"] + lower["hpo"]["resolution_tuning_s"])
    assert lower["total_s"] >= both["resolution"]["total_s"]
    for _ in range(2):
        again = scenarios(tmp_path / "lower", "--resume")["hpo"]
        assert again["tuning_s"] == pytest.approx(lower["tuning_s"])
        assert again["default_final"]["wall_s"] == lower["default_final"]["wall_s"]
        assert read_kept(scenario.checkpoint_file(
            tmp_path / "lower", "hpo", scenario.CLOCK_SUFFIX, lower["run_id"])).seconds == \
            pytest.approx(lower["default_final"]["tuning_s"] - lower["hpo"]["default_reused_s"])
    runs = run_path(tmp_path / "lower", "runs")
    assert [p.name[:12] for p in runs.glob("hpo.*")] == ["hpo.default-"]
    assert "kept the default configuration" in (tmp_path / "lower" / "report.md").read_text()


def test_only_the_same_learning_takes_the_resolution_final():
    from modules.config import TrainConfig
    resolution = TrainConfig(weights="trial.pt", epochs=12, image_size=48)
    tuned = {"final": {"scenario": "resolution", "config": resolution, "row": {}}}
    # other speed knobs (measured at another size): the same learning
    faster = dataclasses.replace(resolution, dropout_impl="bytemask", cpu_threads=1)
    assert final_runs.final_to_reuse("hpo", faster, tuned) is tuned["final"]
    for other in ({"epochs": 13}, {"lr": 2e-3}, {"weights": "other.pt"}, {"batch_size": 16}):
        assert final_runs.final_to_reuse("hpo", dataclasses.replace(resolution, **other),
                                         tuned) is None, other
    assert final_runs.final_to_reuse("resolution", resolution, tuned) is None
    assert final_runs.final_to_reuse("hpo", resolution, {}) is None


REGIONS = ("data_wait", "h2d", "forward", "backward", "optimizer_step")


def test_profiled_run_writes_traces_report_and_every_figure(small, tmp_path):
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--epochs", "2", "--image-size", "32",
                    "--batch-size", "4", "--weights", "none", "--no-progress", "--profile",
                    "--output-dir", str(out)) == 0
    traces = list((run_path(out, "profiler") / "baseline").glob("*.pt.trace.json"))
    assert traces and (run_path(out, "profiler") / "baseline" / "key_averages.txt").exists()
    text = traces[0].read_text()
    assert all(f'"{region}"' in text for region in REGIONS)
    # recorded after the steps the step timing leaves out as unrepresentative (0-2)
    steps = {int(n) for n in re.findall(r'"ProfilerStep#(\d+)"', text)}
    assert steps and min(steps) == scenario.TIMING_WARMUP_STEPS, steps
    row = json.loads((out / "results.json").read_text())[0]
    for key in ("gpu_util_pct", "cpu_util_pct", "cpu_exec_us", "avg_step_ms", "samples_per_s",
                "peak_mem_mb", "data_wait_frac", "wall_s", "time_to_best_s", "energy_j"):
        assert key in row, key
    assert row["peak_mem_mb"] > 0 and row["cpu_exec_us"] > 0 and row["avg_step_ms"] > 0
    assert row["diagnosis"]["bottleneck"] in ("input-bound", "compute-bound", "overhead-bound")
    assert row["diagnosis"]["recommendations"]
    report = (out / "report.md").read_text()
    assert "## Diagnosis" in report and "step_time_breakdown.png" in report
    assert (out / "step_time_breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_large_jpegs_for_a_tiny_input_are_diagnosed_input_bound(tmp_path):
    data = tmp_path / "big"
    for c in COLOURS:  # decoding, not generating, is what is timed: one image per class, copied
        first = write_image(data / "train" / c / "0.jpg", COLOURS[c], size=1400)
        for split, n in (("train", 10), ("test", 2)):
            for i in range(n):
                if not (data / split / c / f"{i}.jpg").exists():
                    (data / split / c).mkdir(parents=True, exist_ok=True)
                    # bytes after the JPEG's end: the same image, not a copy left out
                    (data / split / c / f"{i}.jpg").write_bytes(
                        first.read_bytes() + f"{split}{i}".encode())
    out = tmp_path / "out"
    assert run_main("--data-dir", str(data), "--epochs", "1", "--image-size", "24",
                    "--batch-size", "4", "--weights", "none", "--no-progress",
                    "--output-dir", str(out)) == 0
    row = json.loads((out / "results.json").read_text())[0]
    assert row["data_wait_frac"] > 0.5
    assert row["diagnosis"]["bottleneck"] == "input-bound"


def test_tensorboard_profiler_plugin_reads_the_trace(small, tmp_path):
    tb_data = pytest.importorskip("torch_tb_profiler.profiler.data")
    from torch_tb_profiler.profiler.run_generator import RunGenerator
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--epochs", "1", "--image-size", "32",
                    "--batch-size", "4", "--weights", "none", "--no-progress", "--profile",
                    "--output-dir", str(out)) == 0
    trace = next((run_path(out, "profiler") / "baseline").glob("*.pt.trace.json"))
    data = tb_data.RunProfileData.parse("worker0", None, str(trace), str(tmp_path / "cache"))
    data.process()
    views = [v.display_name for v in RunGenerator("worker0", None, data).generate_run_profile().views]
    assert {"Overview", "Operator", "Trace"} <= set(views)


def test_no_autotune_and_user_knobs_skip_the_measurements(small, tmp_path):
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--scenarios", "resolution", "--resolutions", "32",
                    "--image-size", "32", "--epochs", "2", "--batch-size", "4", "--weights", "none",
                    "--no-progress", "--no-autotune", "--output-dir", str(out)) == 0
    row = json.loads((out / "results.json").read_text())[0]
    assert "autotune" not in row and row["settings"]["data_path"] == "decoded cache"
    out2 = tmp_path / "out2"
    assert run_main("--data-dir", str(small), "--scenarios", "resolution", "--resolutions", "32",
                    "--image-size", "32", "--epochs", "2", "--batch-size", "4", "--weights", "none",
                    "--no-progress", "--amp", "off", "--cpu-allocator", "retain",
                    "--dropout-impl", "bytemask",
                    "--output-dir", str(out2)) == 0
    row = json.loads((out2 / "results.json").read_text())[0]
    for knob in ("amp", "batch_size", "cpu_allocator", "dropout_impl"):
        assert row["autotune"]["knobs"][knob]["reason"] == "set by the user", knob
    assert row["settings"]["amp"] == "off" and row["settings"]["cpu_allocator"] == "retain"
    assert row["settings"]["dropout_impl"] == "bytemask"
    hostmem.apply("system")


def test_streaming_fallback_measures_loader_workers(small, tmp_path, monkeypatch):
    """When the decoded images would not fit, batches stream from disk and the autotuner
    times real DataLoaders to pick how many decoding workers keep up with the model."""
    from modules import fastdata
    monkeypatch.setattr(fastdata, "CACHE_RAM_FRACTION", 1e-12)
    # a budget that holds the worker measurement: a 2-epoch run's 10% does not (it is then
    # "not measured", tests/test_autotune.py), and 10x that was spent by the knobs' races
    # on a busy machine
    monkeypatch.setattr(scenario, "MEASURE_SHARE", 1000.0)
    out = tmp_path / "out"
    assert run_main("--data-dir", str(small), "--scenarios", "resolution", "--resolutions", "32",
                    "--image-size", "32", "--epochs", "2", "--weights", "none", "--no-progress",
                    "--output-dir", str(out)) == 0
    row = json.loads((out / "results.json").read_text())[0]
    assert row["settings"]["data_path"] == "per-sample PIL decode"
    workers = row["autotune"]["knobs"]["num_workers"]
    assert "0" in workers["img_s"]
    assert len(workers["img_s"]) >= (2 if (os.cpu_count() or 1) >= 2 else 1)  # 0 and 2 timed
    assert workers["choice"] == row["settings"]["num_workers"]
    assert "workers deliver" in workers["reason"]


def test_the_knobs_the_user_set_are_kept_zero_workers_too():
    """`--num-workers 0` read as unset (0 == False) and was measured and replaced."""
    assert "num_workers" in scenario.user_knobs(pipeline.parse_args(["--num-workers", "0"]))
    assert scenario.user_knobs(pipeline.parse_args(["--compile", "--amp", "off"])) == \
        {"compile", "amp"}
    assert not scenario.user_knobs(pipeline.parse_args([]))


def test_the_tuned_scenarios_on_switches_can_be_turned_off():
    """channels_last (and pin_memory on a GPU) start on for the tuned scenarios: a plain
    --channels-last flag could only turn them on, so --no-autotune always ran them NHWC, and
    the notebook's False was dropped."""
    cpu, gpu = scenario.torch.device("cpu"), scenario.torch.device("cuda")
    off = pipeline.parse_args(["--no-channels-last", "--no-pin-memory", "--no-compile"])
    assert scenario.user_knobs(off) == {"channels_last", "compile"}
    assert scenario.scenario_config("resolution", off, cpu).channels_last is False
    assert scenario.scenario_config("resolution", off, gpu).pin_memory is False
    unset = pipeline.parse_args([])
    assert scenario.scenario_config("resolution", unset, cpu).channels_last is True
    assert scenario.scenario_config("resolution", unset, gpu).pin_memory is True
    assert scenario.scenario_config("baseline", unset, cpu).channels_last is False
    # the notebook's three-way fields: "" leaves the scenario's own, "on" / "off" set it
    assert pipeline.options(channels_last="").channels_last is None
    assert pipeline.options(channels_last="off", compile="on").channels_last is False
    assert pipeline.options(channels_last="off", compile="on").compile is True
    assert "--no-channels-last" in pipeline.options(channels_last="off").command


def test_a_scenario_without_a_thread_count_gets_the_processs_own():
    """The threads tuned for the resolution scenario stayed for a baseline run after it (or a
    notebook's next run)."""
    from modules.config import TrainConfig
    from modules.device import STARTUP_THREADS, apply_process_settings
    apply_process_settings(TrainConfig(cpu_threads=1, device="cpu"), torch.device("cpu"))
    assert torch.get_num_threads() == 1
    apply_process_settings(TrainConfig(device="cpu"), torch.device("cpu"))
    assert torch.get_num_threads() == STARTUP_THREADS


def test_fit_from_a_script_keeps_the_callers_thread_count(small):
    """A library caller's torch.set_num_threads(1) after import was overridden by fit, with
    the count at import, and the process left at it after."""
    from modules.config import TrainConfig
    from modules.dataset import index_dataset
    from modules.device import STARTUP_THREADS
    from modules.trainer import fit
    seen = []
    mine = max(1, STARTUP_THREADS - 1) if STARTUP_THREADS > 1 else 2
    torch.set_num_threads(mine)
    try:
        fit(index_dataset(small), TrainConfig(device="cpu", epochs=1, image_size=32,
                                              weights="none", progress=False),
            on_epoch=lambda *_: seen.append(torch.get_num_threads()))
        assert seen == [mine] and torch.get_num_threads() == mine
        fit(index_dataset(small), TrainConfig(device="cpu", epochs=1, image_size=32,
                                              weights="none", progress=False, cpu_threads=1))
        assert torch.get_num_threads() == mine  # a count of its own, for its own training
    finally:
        torch.set_num_threads(STARTUP_THREADS)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one
def test_a_ctrl_c_python_drops_still_stops_the_run(small, tmp_path, monkeypatch, capsys):
    """Stop pressed while a weakref callback ran (after an epoch, say): Python dropped the
    KeyboardInterrupt and the run trained on to its end. It stops at the next batch, with
    the resume hint."""
    import signal
    import weakref
    from modules import trainer
    logged = trainer._log_epoch

    def log_epoch(row, *rest):
        logged(row, *rest)
        if row["epoch"] == 1:
            holder = type("Holder", (), {})()
            ref = weakref.ref(holder, lambda _: signal.raise_signal(signal.SIGINT))  # noqa: F841
            del holder
    monkeypatch.setattr(trainer, "_log_epoch", log_epoch)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert run_main("--data-dir", str(small), "--epochs", "3", "--image-size", "32",
                        "--weights", "none", "--no-progress",
                        "--output-dir", str(tmp_path / "out")) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "rerun the same command with --resume" in capsys.readouterr().err


def test_a_run_leaves_the_process_settings_as_it_found_them(small, tmp_path, monkeypatch):
    """From a notebook, the user's next cell ran with the run's thread count and allocator (a
    scenario's tuned ones, or the process's count at import), not those it had set; and the
    baseline trained with the count at import, not the one the user set in a cell before."""
    from modules.device import STARTUP_THREADS
    allocator = hostmem.candidates()[-1]  # "retain" where glibc offers it
    torch.set_num_threads(STARTUP_THREADS + 1)
    mine, trained = torch.get_num_threads(), []
    apply = scenario.apply_process_settings
    monkeypatch.setattr(scenario, "apply_process_settings", lambda *a: apply(*a) or
                        trained.append(torch.get_num_threads()))
    try:
        assert run_main("--data-dir", str(small), "--epochs", "1", "--image-size", "32",
                        "--cpu-allocator", allocator, "--weights", "none", "--no-progress",
                        "--output-dir", str(tmp_path / "out")) == 0
        assert torch.get_num_threads() == mine and hostmem.current() == "system"
        assert trained == [mine]  # the baseline's
        # the notebook estimates the run first: its speed probe applies the scenario's count
        args = pipeline.parse_args(["--data-dir", str(small), "--epochs", "1",
                                    "--image-size", "32", "--output-dir", str(tmp_path / "e")])
        scenario.estimate(args, scenario.load_data(args, tmp_path / "e"))
        assert torch.get_num_threads() == mine
    finally:
        torch.set_num_threads(STARTUP_THREADS)


def test_resume_keeps_the_autotuned_settings_instead_of_measuring_again(small, tmp_path,
                                                                           monkeypatch):
    """A fresh measurement can differ by noise (another optimizer kernel, an AMP dtype, on a GPU
    another batch); a resumed run continues with the settings it started with."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "resolution", "--resolutions", "32",
            "--image-size", "32", "--epochs", "2", "--weights", "none", "--no-progress",
            "--output-dir", str(out))
    assert run_main(*argv) == 0
    first = json.loads((out / "results.json").read_text())[-1]
    saved = run_path(out) / "resolution.autotune.json"
    assert json.loads(saved.read_text())["report"]["knobs"] == first["autotune"]["knobs"]
    assert (out / "autotune_cache.json").exists()  # beside results.json, for every later run

    real_autotune = scenario.autotune

    def measure_again(*_, **__):
        raise AssertionError("--resume measured the knobs again")

    def tune_again(*_, **__):
        raise AssertionError("--resume trained a tuned resolution again")
    monkeypatch.setattr(scenario, "autotune", measure_again)
    monkeypatch.setattr(resolution_tuner, "fit", tune_again)
    assert run_main(*argv, "--resume") == 0
    resumed = json.loads((out / "results.json").read_text())[-1]
    assert resumed["autotune"]["knobs"] == first["autotune"]["knobs"]
    # measured by this run, in its first session: not reused from another's
    assert resumed["autotune"]["resumed_from"] == str(saved)
    assert resumed["autotune"].get("reused_from") == first["autotune"].get("reused_from")
    for knob in ("amp", "channels_last", "optimizer_impl", "cpu_threads", "cpu_allocator",
                 "batch_size"):
        assert resumed["settings"][knob] == first["settings"][knob], knob
    assert "in an earlier session of this run" in (out / "report.md").read_text()
    assert "reused from" not in (out / "report.md").read_text()
    # resumed on another machine (another GPU in Colab's next session), or by a version that
    # names machines otherwise: a finished scenario trains nothing more, its settings stand
    # and no measuring is added to its time
    record = json.loads(saved.read_text())
    saved.write_text(json.dumps(dict(record, machine="another machine")))
    assert run_main(*argv, "--resume") == 0
    again = json.loads((out / "results.json").read_text())[-1]
    assert again["tuning_s"] == resumed["tuning_s"] and again["settings"] == resumed["settings"]
    # unfinished (stopped before its row was written): measured again, the batch kept,
    # since the checkpoint resumes only with it
    (out / "results.json").write_text("[]")
    measured = []

    def measure_keeping(config, *a, fixed=frozenset(), **k):
        measured.append((config.batch_size, "batch_size" in fixed))
        return real_autotune(config, *a, fixed=fixed, **k)
    monkeypatch.setattr(scenario, "autotune", measure_keeping)
    assert run_main(*argv, "--resume") == 0
    assert measured == [(first["settings"]["batch_size"], True)]
    assert json.loads(saved.read_text())["start"] == record["start"]


def test_resume_after_the_search_finished_does_not_extend_the_study(small, tmp_path,
                                                                      monkeypatch, capsys):
    """After a crash in the hpo scenario's final run, more trials could only change its best
    parameters (and the final checkpoint would then refuse to resume)."""
    out = tmp_path / "out"
    argv = small_hpo(small, out)
    assert run_main(*argv, "--n-trials", "2") == 0
    first = json.loads((out / "results.json").read_text())[-1]
    assert first["hpo"]["default_value"] is not None and first["hpo"]["n_trials"] == 2

    # another worker sharing the study finishes a better trial meanwhile
    import optuna
    storage = f"sqlite:///{out / 'optuna.db'}"
    (name,) = optuna.get_all_study_names(storage)
    assert name == f"hpo-colours-{run_path(out).name}"  # the dataset and the run in its name
    study = optuna.load_study(study_name=name, storage=storage)
    done = study.best_trial
    study.add_trial(optuna.trial.create_trial(
        params={**done.params, "lr": done.params["lr"] * 0.5}, distributions=done.distributions,
        value=2.0))

    def search_again(*_, **__):
        raise AssertionError("--resume ran another trial")
    monkeypatch.setattr(scenario.OptunaTuner, "objective", search_again)
    capsys.readouterr()
    assert run_main(*argv, "--resume") == 0  # the final run continues with what it started with
    # the study's count, 2, not the preset's 20, which the line alone would say; a fresh
    # study in a resumed session (none before) was said to keep a count it never had
    assert "; a study resumed keeps the count it was started with" in capsys.readouterr().err
    resumed = json.loads((out / "results.json").read_text())[-1]
    assert resumed["hpo"]["n_trials"] == first["hpo"]["n_trials"] + 1 == 3
    assert resumed["settings"]["lr"] == first["settings"]["lr"]
    assert resumed["resumed_from_epoch"] is None and resumed["test_acc"] == first["test_acc"]

    # while the search itself was interrupted (no final checkpoint yet), --resume runs the
    # trials it lacks up to --n-trials: none here (it has 3), one more for 4
    final = run_path(out) / "hpo.pt"
    final.unlink()
    assert run_main(*argv, "--resume", "--n-trials", "2") == 0
    assert json.loads((out / "results.json").read_text())[-1]["hpo"]["n_trials"] == 3
    final.unlink()
    monkeypatch.undo()
    assert run_main(*argv, "--resume", "--n-trials", "4") == 0
    assert json.loads((out / "results.json").read_text())[-1]["hpo"]["n_trials"] == 4


def test_resume_with_more_trials_grows_a_finished_study(small, tmp_path, monkeypatch):
    """`--resume --n-trials N` after a finished hpo scenario, N more than its trials: the
    study grows to N; the final run is trained again only when the choice changed (the
    earlier one kept aside). The same command resumed again adds nothing."""
    out = tmp_path / "out"
    argv = small_hpo(small, out)
    assert run_main(*argv, "--n-trials", "2") == 0
    first = json.loads((out / "results.json").read_text())[-1]

    # one more trial that cannot beat the default: the finished final run is not trained again
    def no_better(self, trial):
        self.suggest(trial)
        return -1.0
    monkeypatch.setattr(scenario.OptunaTuner, "objective", no_better)
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (
        None, "keeping the default") if first["hpo"]["keeps_default"] else (
        first["hpo"]["chosen_params"], "unchanged"))
    assert run_main(*argv, "--resume", "--n-trials", "2") == 0  # the command run again
    again = json.loads((out / "results.json").read_text())[-1]
    assert again["hpo"]["n_trials"] == 2 and again["test_acc"] == first["test_acc"]
    assert run_main(*argv, "--resume", "--n-trials", "3") == 0
    grown = json.loads((out / "results.json").read_text())[-1]
    assert grown["hpo"]["n_trials"] == 3
    assert grown["resumed_from_epoch"] is None and grown["test_acc"] == first["test_acc"]
    # the start it continued from stays on record, with its trial's epochs as the session
    # that trained them timed them (keep_timeline)
    assert grown["settings"]["weights"] == first["settings"]["weights"] != "none"
    assert grown["warm_start"] == first["warm_start"]

    # one more trial that wins: trained again from the start, the earlier final run kept aside
    better = {"lr": 0.005, "batch_size": 16, "optimizer": "sgd", "weight_decay": 1e-4}
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (better, "a new winner"))
    assert run_main(*argv, "--resume", "--n-trials", "4") == 0
    changed = json.loads((out / "results.json").read_text())[-1]
    assert changed["hpo"]["n_trials"] == 4
    if "grown_final" in changed:  # it validated below the earlier final run, which stays
        assert changed["grown_final"]["settings"]["lr"] == 0.005
        assert changed["settings"]["lr"] == grown["settings"]["lr"]
        assert changed["test_acc"] == grown["test_acc"]
        assert list(run_path(out).glob("hpo.grown-*.pt"))
        return
    assert changed["resumed_from_epoch"] is None
    assert (changed["settings"]["lr"], changed["settings"]["optimizer"]) == (0.005, "sgd")
    aside = list(run_path(out).glob("hpo.before-*.pt"))
    assert aside
    # the final run set aside counts as tuning, and the row still says what it was
    replaced = changed["replaced_final"]
    assert replaced["checkpoint"] == str(aside[0]) and replaced["finished"]
    assert (replaced["val_acc"], replaced["test_acc"]) == (grown["val_acc"], grown["test_acc"])
    assert replaced["seconds"] == pytest.approx(grown["total_s"] - grown["tuning_s"])
    assert changed["tuning_s"] >= grown["tuning_s"] + replaced["seconds"]
    assert "trained again after the study grew" in (out / "report.md").read_text()
    assert run_main(*argv, "--resume", "--n-trials", "4") == 0  # nothing left: it stays
    assert json.loads((out / "results.json").read_text())[-1]["replaced_final"] == replaced


def test_a_saved_autotune_is_reused_only_for_the_same_start(tmp_path):
    start = scenario.TrainConfig(image_size=32, device="cpu")
    tuned = scenario.dataclasses.replace(start, amp="bf16", channels_last=True)
    path = tmp_path / "resolution.autotune.json"
    assert scenario._saved_autotune(path, start) is None  # nothing saved
    path.write_text(json.dumps({"start": start.to_dict(), "config": tuned.to_dict(),
                                "report": {"knobs": {}}}))
    config, report, here = scenario._saved_autotune(path, start)
    assert config == tuned and report["resumed_from"] == str(path)
    assert here  # a file from before machines were recorded: taken as this machine's
    path.write_text(json.dumps({"start": start.to_dict(), "config": tuned.to_dict(),
                                "report": {"knobs": {}}, "machine": "another machine"}))
    assert scenario._saved_autotune(path, start)[2] is False
    other = scenario.dataclasses.replace(start, lr=0.002)  # the user changed an option
    assert scenario._saved_autotune(path, other) is None
    # progress bars change nothing measured: resuming with --no-progress reuses the choice
    quiet, _, _ = scenario._saved_autotune(path, scenario.dataclasses.replace(start, progress=False))
    assert quiet == scenario.dataclasses.replace(tuned, progress=False)
    path.write_text("{not json")  # torn or edited: measured again, no traceback
    assert scenario._saved_autotune(path, start) is None
    path.write_text(json.dumps({"start": start.to_dict(), "config": {"amp": "fp8"},
                                "report": {}}))  # a value this version rejects
    assert scenario._saved_autotune(path, start) is None


def _ns(**kw):
    from types import SimpleNamespace
    return SimpleNamespace(**{"epochs": None, "match_time": True, "resume": False,
                              "run_id": None, **kw})


def test_a_winner_whose_final_run_validates_below_the_defaults_gives_way_to_it(tmp_path):
    """The search's winner led on short trials; trained in full it validated below the default
    configuration's final run (the resolution scenario's, from the same default trial): the hpo
    row takes that model, as when the default is kept, and keeps the winner's figures."""
    def hpo_row(val_acc, keeps_default=False, reused="the resolution scenario's 48 px trial"):
        return {"scenario": "hpo", "run_id": "r", "val_acc": val_acc, "test_acc": 0.90,
                "wall_s": 30.0, "tuning_s": 24.0, "total_s": 54.0, "epochs": 21,
                "settings": {"lr": 1e-4}, "start_weights": "none",
                "hpo": {"keeps_default": keeps_default, "default_reused_from": reused}}
    resolution = {"scenario": "resolution", "run_id": "r", "val_acc": 0.972, "test_acc": 0.953,
                  "wall_s": 25.0, "tuning_s": 23.0, "total_s": 48.0, "settings": {"lr": 1e-3}}
    same = {"scenario": "resolution", "row": resolution}
    lower = hpo_row(0.928)
    kept = final_runs.default_if_better(lower, same)
    assert (kept["scenario"], kept["final_from"], kept["test_acc"]) == ("hpo", "resolution", 0.953)
    assert kept["winner_final"]["val_acc"] == 0.928 and kept["winner_final"]["test_acc"] == 0.90
    # its own final run counted, and the resolution scenario's tuning, whose model it took
    assert (kept["tuning_s"], kept["total_s"]) == (77.0, 102.0)
    assert kept["hpo"] == {**lower["hpo"], "resolution_tuning_s": 23.0}
    assert resolution["scenario"] == "resolution" and "resolution_tuning_s" not in lower["hpo"]
    # the report says the winner was trained and lost, not that the run was reused
    told = " ".join(report.versus_baseline_lines([{**resolution, "scenario": "baseline"}, kept]))
    assert "winner was trained in full and validated at 92.8% (test 90.0%)" in told
    assert "trained once" not in told
    unknown = {**kept, "winner_final": {**kept["winner_final"], "test_acc": None}}
    assert "validated below the resolution" in report.final_from_text(unknown)  # not "0.0%"
    for row in (hpo_row(0.98), hpo_row(0.972), hpo_row(0.98, keeps_default=True),
                hpo_row(0.9, reused=None)):  # higher, a tie, kept default higher, another default
        assert final_runs.default_if_better(row, same) is row
    assert final_runs.default_if_better(lower, None) is lower  # no resolution scenario in this run
    # `--resume --scenarios hpo`: the resolution final run of this run, from results.json
    from types import SimpleNamespace
    earlier = {**resolution, "dataset": "d", "warm_start": {"curve": [{"elapsed_s": 1.0}]}}
    (tmp_path / "results.json").write_text(json.dumps([earlier]))
    found = final_runs.resolution_final_row(tmp_path, SimpleNamespace(name="d"), "r")
    assert found["row"]["test_acc"] == 0.953 and final_runs.resolution_final_row(
        tmp_path, SimpleNamespace(name="d"), "another run") is None
    assert "warm_start" not in final_runs.default_if_better(lower, found)


def test_a_kept_default_trained_again_gives_way_to_the_resolution_final_run():
    """The search kept the default, but time-matching gave its final run other epochs than
    the resolution scenario's final run of that configuration, from the same trial: two runs
    of one configuration, and the row keeps the better validated, saying which it trained."""
    trial = "checkpoints/r/resolution-64px-73e2ff43b3.weights.pt"
    resolution = {"scenario": "resolution", "run_id": "r", "val_acc": 0.497, "test_acc": 0.478,
                  "wall_s": 25.0, "tuning_s": 23.0, "total_s": 48.0, "epochs": 12,
                  "settings": {"lr": 1e-3, "epochs": 12, "weights": trial}}
    own = {"scenario": "hpo", "run_id": "r", "val_acc": 0.458, "test_acc": 0.430, "epochs": 13,
           "wall_s": 27.0, "tuning_s": 30.0, "total_s": 57.0, "start_weights": "none",
           "settings": {"lr": 1e-3, "epochs": 13, "weights": trial},
           "hpo": {"keeps_default": True, "default_reused_from": "the 64 px trial"}}
    kept = final_runs.default_if_better(own, {"scenario": "resolution", "row": resolution})
    assert (kept["final_from"], kept["test_acc"], kept["epochs"]) == ("resolution", 0.478, 12)
    assert "winner_final" not in kept and kept["default_final"]["epochs"] == 13
    # trained from another start (a shared study's default trial, another worker's): not the
    # same configuration's other run
    elsewhere = {**own, "settings": {**own["settings"], "weights": "another worker's.pt"}}
    assert final_runs.default_if_better(elsewhere, {"scenario": "resolution",
                                                    "row": resolution}) is elsewhere
    # its own final run counted, and the resolution scenario's tuning, whose model it took
    assert (kept["tuning_s"], kept["total_s"]) == (80.0, 105.0)
    told = report.final_from_text(kept, detail=True)
    assert "kept the default configuration, trained it in full for 13 epochs, and it validated " \
        "at 45.8% (test 43.0%), below the resolution scenario's final run of that " \
        "configuration (12 epochs)" in told and "winner" not in told


def test_a_tuned_final_run_fills_the_baselines_time_with_epochs(tmp_path, caplog):
    config = scenario.TrainConfig(epochs=10, device="cpu")
    index = type("Index", (), {"name": "d"})()
    tuned = {"baseline_total_s": 100.0}

    def fill(args=None, **kw):
        return scenario.fill_time(config, "hpo", _ns(**(args or {})), tmp_path, index,
                                  kw.get("tuned", tuned), kw.get("tuning_s", 20.0),
                                  kw.get("epoch_s", 2.0))
    # 80% of 100 s, less 20 s of tuning, leaves 60 s: 30 epochs of 2 s, within 3x the 10
    with caplog.at_level(logging.INFO, logger="scenario"):
        assert fill().epochs == 30
        assert fill(epoch_s=1.0).epochs == 30        # 60 would exceed 3x: capped
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("hpo: 30 epochs instead of 10: they fit in 80% of the baseline's "
                              "100 s with 20 s of tuning in this scenario, at 2.0 s per epoch")
    # the cap, not the time, set the count: a reader's sum of the figures gives 60
    assert said[1].startswith("hpo: 30 epochs instead of 10: the most allowed (3x); 60 would "
                              "fit in 80% of the baseline's 100 s")
    assert fill(tuning_s=70.0).epochs == 10      # no time left: never fewer than its own
    assert fill(args={"epochs": 10}).epochs == 10 and fill(args={"match_time": False}).epochs == 10
    assert fill(epoch_s=None).epochs == 10 and fill(tuned={}).epochs == 10  # nothing to go by


def test_another_size_trains_the_epochs_that_cost_what_the_defaults_do(tmp_path):
    """The resolution tuner compares sizes at equal compute, so a final run at another size
    than the baseline's trains the epochs that cost what the baseline's do: 48 px for 64 px's
    10 is about 18 (x (64 / 48)^2), 96 px about 4, and time-matching fills from there, up to
    3x that."""
    index = type("Index", (), {"name": "d"})()
    small = scenario.TrainConfig(epochs=10, image_size=48, device="cpu")

    def fill(config=small, args=None, **kw):
        return scenario.fill_time(config, "resolution", _ns(**(args or {})), tmp_path, index,
                                  kw.get("tuned", {"baseline_total_s": 100.0}),
                                  kw.get("tuning_s", 70.0), kw.get("epoch_s", 1.0), 64).epochs
    assert fill() == 18                            # no time left: the default's compute
    assert fill(tuned={}) == 18 and fill(epoch_s=None) == 18  # nothing to time by
    assert fill(tuning_s=0.0) == 54                # 80 epochs fit: capped at 3x its 18
    larger = scenario.TrainConfig(epochs=10, image_size=96, device="cpu")
    assert fill(larger, tuning_s=78.0) == 4          # 10 x (64 / 96)^2: the compute compared
    assert fill(larger) == 10                        # time-matching fills what 10 s allow
    assert fill(args={"epochs": 10}) == 10
    # --no-match-time: no fill, but the compute the sizes were compared at (it trained the
    # default's 10 epochs at 48 px: 0.56x the compute; at 96 px 2.25x)
    assert fill(args={"match_time": False}, tuning_s=0.0) == 18
    assert fill(larger, args={"match_time": False}, tuning_s=0.0) == 4


def test_a_resumed_final_run_keeps_its_checkpoints_epochs_and_warm_up(tmp_path):
    """A final run started by a version without the warm-up resumes without one (the
    checkpoint would refuse another), one started with it keeps it; --epochs aside."""
    index = type("Index", (), {"name": "d"})()
    config = scenario.TrainConfig(epochs=10, device="cpu", warmup_epochs=1.0)
    ckpt = scenario.checkpoint_file(tmp_path, "resolution", run_id="r1")
    ckpt.parent.mkdir(parents=True)
    older = {k: v for k, v in dataclasses.replace(config, epochs=21).to_dict().items()
             if k != "warmup_epochs"}
    torch.save({"config": older}, ckpt)

    def fill(**args):
        return scenario.fill_time(config, "resolution", _ns(resume=True, run_id="r1", **args),
                                  tmp_path, index, {"baseline_total_s": 100.0}, 10.0, 1.0)
    assert (fill().epochs, fill().warmup_epochs) == (21, 0.0)
    assert (fill(epochs=10).epochs, fill(epochs=10).warmup_epochs) == (10, 0.0)
    assert fill(match_time=False).epochs == 21  # what it started with, as the checkpoint has
    torch.save({"config": {**older, "warmup_epochs": 1.0}}, ckpt)
    assert fill().warmup_epochs == 1.0


def test_the_search_trains_trials_a_third_of_the_final_runs_compute():
    """At a size below the baseline's, the final run trains the baseline's compute (above), so
    the search's trials train the epochs that cost a third of it: as many as the resolution
    tuner's trial at that size, which is then the search's default trial as it is."""
    from resolution_tuner import ResolutionTuner
    config = scenario.TrainConfig(epochs=12, image_size=48, device="cpu")
    assert scenario.search_epochs(config) == 4                   # no default size: a third
    assert scenario.search_epochs(config, 48) == 4
    assert scenario.search_epochs(config, 64) == 7               # 4 x (64 / 48)^2
    assert scenario.search_epochs(dataclasses.replace(config, image_size=96), 64) == 2  # larger
    from types import SimpleNamespace
    tuner = ResolutionTuner(SimpleNamespace(val=[], classes=[0, 1]),
                            dataclasses.replace(config, image_size=64),
                            (48, 96), epochs=scenario.short_budget(config))
    assert tuner.epochs_for(48) == scenario.search_epochs(config, 64)
    assert tuner.epochs_for(96) == scenario.search_epochs(
        dataclasses.replace(config, image_size=96), 64)


def test_each_row_is_compared_with_the_baseline():
    hist = lambda *accs: [{"epoch": i + 1, "val_acc": a, "elapsed_s": 10.0 * (i + 1)}  # noqa: E731
                          for i, a in enumerate(accs)]
    # total_s, preparing and decoding the data included, against wall_s, training alone
    base = {"scenario": "baseline", "val_acc": 0.6, "test_acc": 0.55, "total_s": 100.0,
            "wall_s": 80.0, "tuning_s": 0.0, "history": hist(0.3, 0.6)}
    fast = {"scenario": "resolution", "test_acc": 0.6, "total_s": 50.0, "wall_s": 30.0,
            "tuning_s": 5.0, "history": hist(0.5, 0.65, 0.7)}
    slow = {"scenario": "hpo", "test_acc": 0.5, "total_s": 150.0, "wall_s": 90.0,
            "tuning_s": 30.0, "history": hist(0.4, 0.5)}
    scenario.compare_to_baseline([base, fast, slow], base)
    assert base["time_to_baseline_acc_s"] == 20.0 and base["test_acc_vs_baseline"] == 0.0
    assert fast["time_to_baseline_acc_s"] == 25.0  # tuning included: 5 + 20
    assert fast["test_acc_vs_baseline"] == pytest.approx(5.0) and fast["total_vs_baseline"] == 0.5
    assert slow["time_to_baseline_acc_s"] is None and slow["total_vs_baseline"] == 1.5
    assert "+5.0 points against the baseline, 50 s in all (0.50x the baseline's)" in \
        report.versus_baseline_lines([fast])[0]
    # the baseline compared with is named when it is another run's
    base["run_id"], fast["run_id"] = "run-1", "run-2"
    scenario.compare_to_baseline([fast], base)
    assert fast["baseline_run_id"] == "run-1"
    assert "points against the baseline of run run-1" in report.versus_baseline_lines([fast])[0]
    # ... in report.md and the printed table too, whose "vs Baseline" columns do not say
    assert "Compared with the baseline of run run-1: another run" in report.render_report(
        [fast], [])
    fast["run_id"] = "run-1"
    assert "baseline of run" not in report.versus_baseline_lines([fast])[0]
    assert "baseline of run" not in report.render_report([fast], [])
    # no baseline anywhere: said, rather than the comparison left silently empty
    alone = {k: v for k, v in slow.items() if k not in ("test_acc_vs_baseline",
                                                         "total_vs_baseline")}
    assert report.versus_baseline_lines([alone])[-1].startswith("no baseline to compare with")
    assert len(report.versus_baseline_lines([base, fast])) == 2
    # compared, and never reached: the table says so, where "n/a" would say not measured
    table = results_table([base, fast, slow])
    assert table.loc["hpo", "To Baseline Val Acc (s)"] == "never"
    assert table.loc["resolution", "To Baseline Val Acc (s)"] == "25.0"
    # The epochs of the trial a final run continued from are the final model's first: its
    # curve (seconds since the scenario started) counts, before the final run's own.
    trial = lambda *points: {"curve": [{"elapsed_s": t, "val_acc": a} for t, a in points]}  # noqa: E731
    fast["warm_start"] = trial((2.0, 0.3), (4.0, 0.62))
    slow["warm_start"] = trial((12.0, 0.45))  # never reached: the final run's history decides
    scenario.compare_to_baseline([fast, slow], base)
    assert fast["time_to_baseline_acc_s"] == 4.0 and slow["time_to_baseline_acc_s"] is None
    fast["warm_start"] = trial((2.0, 0.3))  # the trial short of it: the final run's epochs
    scenario.compare_to_baseline([fast], base)
    assert fast["time_to_baseline_acc_s"] == 25.0 and fast["baseline_acc_reached_in"] == "final run"
    fast["warm_start"] = trial((2.0, 0.3), (4.0, 0.62))
    scenario.compare_to_baseline([fast, slow], base)
    assert fast["baseline_acc_reached_in"] == "start trial"
    assert slow["baseline_acc_reached_in"] is None and base["baseline_acc_reached_in"] == "final run"
    assert "after 4 s (tuning included), in the trial its final run continues from" in \
        "\n".join(report.versus_baseline_lines([base, fast]))
    # an earlier baseline whose test accuracy was NaN, written as null: no difference, no
    # TypeError
    scenario.compare_to_baseline([fast], {**base, "test_acc": None})
    assert fast["test_acc_vs_baseline"] is None


def test_a_start_trial_counts_its_epochs_where_they_ended_on_the_scenarios_clock():
    """An epoch that ended before the scenario's first session (a trial of another run) is not
    counted; one of an earlier session (--resume) counts where it ended on that session's
    clock (dropped, a resumed row reached the baseline's accuracy later than it did); one of
    this session after it, and after a reused trial's seconds (before_s)."""
    curve = [{"at": 90.0, "val_acc": 0.2}, {"at": 101.0, "val_acc": 0.4},
             {"at": 103.5, "val_acc": 0.5}]
    warm = {"curve": list(curve)}
    scenario.lineage(warm, [[100.0, 0.0]], tuning_s=3.0)
    assert warm["curve"] == [{"elapsed_s": 1.0, "val_acc": 0.4},
                             {"elapsed_s": 3.0, "val_acc": 0.5}]  # never after the tuning
    # session 1 started at 100 and tuned 4 s; session 2 started at 200
    warm = {"curve": list(curve) + [{"at": 201.0, "val_acc": 0.6}]}
    scenario.lineage(warm, [[100.0, 0.0], [200.0, 4.0]], tuning_s=20.0, before_s=4.0)
    assert [p["elapsed_s"] for p in warm["curve"]] == [5.0, 7.5, 9.0]
    # the start trial is the default trial reused from the resolution scenario, which trained
    # it before this scenario's first session: its epochs end where its 4 s counted do
    reused = [{"at": 50.0, "val_acc": 0.2}, {"at": 52.5, "val_acc": 0.4}]
    warm = {"curve": list(reused)}
    scenario.lineage(warm, [[100.0, 0.0]], tuning_s=20.0, before_s=4.0, reused_start=True)
    assert warm["curve"] == [{"elapsed_s": 1.5, "val_acc": 0.2},
                             {"elapsed_s": 4.0, "val_acc": 0.4}]
    scenario.lineage(None, [[100.0, 0.0]], 3.0)  # no start trial: nothing to do


def _estimate_at_speeds(monkeypatch, slow: float, fast: float) -> None:
    """The estimate's speed probe at fixed speeds, in images per second: `slow` for the
    baseline's data path, `fast` for the decoded cache. Decoding is timed as free: a measured
    decode (slower on a loaded machine) would weigh on the tuning's share and hide the fill's
    bounds."""
    class Probe:
        def __init__(self, config, num_classes, batch_size=None):
            self.img_s = fast if config.cache_decoded else slow

        def measure(self, **_):
            return {"img_s": self.img_s}
    monkeypatch.setattr(scenario, "ComputeProbe", Probe)
    monkeypatch.setattr(scenario, "train_transform", lambda size: lambda image: image)
    monkeypatch.setattr(scenario, "load_rgb", lambda path: None)


def test_the_estimate_covers_every_scenario_and_match_times_fill(small, tmp_path, monkeypatch):
    """The duration printed before a run: one figure per scenario, from a measured speed (here
    a fixed one); --match-time lengthens the tuned final runs toward 80% of the baseline's
    time, at most 3x their epochs."""
    # the baseline's steps slow, the tuned scenarios' fast: the fill applies
    _estimate_at_speeds(monkeypatch, slow=10.0, fast=1000.0)
    argv = ["--data-dir", str(small), "--image-size", "32", "--weights", "none",
            "--output-dir", str(tmp_path / "out")]
    index = pipeline.load_data(pipeline.parse_args(argv), tmp_path / "out")
    plain = pipeline.estimate(pipeline.parse_args(argv + ["--no-match-time"]), index)
    filled = pipeline.estimate(pipeline.parse_args(argv), index)
    assert list(plain["scenarios"]) == ["baseline", "resolution", "hpo"]
    assert plain["total_s"] == pytest.approx(sum(plain["scenarios"].values()))
    assert plain["least_total_s"] == pytest.approx(sum(plain["least"].values()))
    assert plain["least"]["baseline"] == plain["scenarios"]["baseline"]
    for name in ("resolution", "hpo"):
        assert plain["scenarios"][name] > 0
        # tuning runs stopped where they first can be: less tuning, and (unfilled) less time;
        # filled, the final run takes up what the tuning left of the baseline's share
        assert 0 < plain["least"][name] <= plain["scenarios"][name]
        assert filled["least"][name] <= filled["scenarios"][name]
        assert 1.2 * plain["scenarios"][name] < filled["scenarios"][name] \
            <= 3 * plain["scenarios"][name]
    assert plain["least"]["hpo"] < plain["scenarios"]["hpo"]  # its trials can be pruned
    # where no trial could stop early, the two ends meet: each epoch validates in both
    with monkeypatch.context() as patch:
        patch.setattr(scenario, "least_tuning_epochs", lambda name, args, config, *_: (
            scenario.tuning_runs(name, args, config, torch.device("cpu"))
            * scenario.short_budget(config)))
        closed = pipeline.estimate(pipeline.parse_args(
            argv + ["--no-match-time", "--scenarios", "baseline,resolution"]), index)
    assert closed["least"]["resolution"] == pytest.approx(closed["scenarios"]["resolution"])
    # after the resolution scenario the search may take its trial and final run (a run of
    # 110 s read 3.1-3.3 min: hpo, which took both, 17 s against 1.0-1.1 min)
    searched = pipeline.estimate(pipeline.parse_args(
        argv + ["--no-match-time", "--scenarios", "baseline,hpo"]), index)["least"]["hpo"]
    assert plain["least"]["hpo"] < 0.7 * searched
    # trials at 112 px for a 150 px final run (--search-size auto) cost less than at 150 px
    at_150 = [*argv[:2], "--image-size", "150", *argv[4:], "--no-match-time", "--scenarios", "hpo"]
    auto, full = (pipeline.estimate(pipeline.parse_args(at_150 + extra), index)["scenarios"]["hpo"]
                  for extra in ([], ["--search-size", "full"]))
    assert auto < full
    # without a baseline in this run, an earlier run's bounds the search and sets the fill,
    # as in the run; none at all, and the final runs keep their own epochs
    tuned = argv + ["--scenarios", "resolution,hpo"]
    monkeypatch.setattr(scenario, "baseline_seconds", lambda *_: filled["scenarios"]["baseline"])
    alone = pipeline.estimate(pipeline.parse_args(tuned), index)["scenarios"]
    # (the no-op decode still times a few microseconds, differently each call)
    assert alone == pytest.approx({k: filled["scenarios"][k] for k in ("resolution", "hpo")},
                                  rel=1e-3)
    monkeypatch.setattr(scenario, "baseline_seconds", lambda *_: None)
    unfilled = pipeline.estimate(pipeline.parse_args(tuned), index)["scenarios"]
    assert unfilled["resolution"] == pytest.approx(plain["scenarios"]["resolution"], rel=1e-3)


def test_the_estimate_s_range_never_runs_backwards_and_says_what_its_low_end_takes(
        tmp_path, monkeypatch):
    """--match-time fills each end to within an epoch of 80% of the baseline's time, so the
    shorter tuning's total came out the larger ("resolution 4.4-4.3 min"); and the shorter hpo
    figure, which takes the resolution scenario's final run, did not say so."""
    data = make_folder(tmp_path / "data", layout="class folders", n_train=60, n_test=0)
    argv = ["--data-dir", str(data), "--quick", "--weights", "none",
            "--output-dir", str(tmp_path / "out")]
    index = pipeline.load_data(pipeline.parse_args(argv), tmp_path / "out")
    for slow, fast in ((5, 17), (13, 60)):
        _estimate_at_speeds(monkeypatch, slow, fast)
        plan = pipeline.estimate(pipeline.parse_args(argv), index)
        for name, seconds in plan["scenarios"].items():
            assert plan["least"][name] <= seconds, (slow, fast, name)
        assert "early and the search keeps the resolution scenario's model, before" in \
            pipeline.estimate_words(plan)


def test_the_estimate_s_search_trains_the_trial_its_time_budget_finds_under_way(
        small, tmp_path, monkeypatch):
    """The time budget stops only new trials: the default's, the first, trains to its end
    however small the budget (--time-budget 1 read "about 39 s" for a run of 56 s, its 4-epoch
    default trial left out); the search is no longer than every trial in full either."""
    _estimate_at_speeds(monkeypatch, slow=10.0, fast=10.0)
    argv = ["--data-dir", str(small), "--image-size", "32", "--weights", "none",
            "--output-dir", str(tmp_path / "out"), "--scenarios", "hpo", "--no-match-time",
            "--n-trials", "4"]
    index = pipeline.load_data(pipeline.parse_args(argv), tmp_path / "out")

    def hpo(*more: str) -> float:
        return pipeline.estimate(pipeline.parse_args(argv + list(more)), index)["scenarios"]["hpo"]
    one, every = hpo("--n-trials", "1"), hpo()
    trial_s = (every - one) / 3  # four trials against one
    assert trial_s > 5
    assert hpo("--time-budget", "1") == pytest.approx(one + 1, rel=1e-3)
    assert hpo("--time-budget", "100000") == pytest.approx(every, rel=1e-3)


def test_the_estimate_reads_as_a_range_where_the_tuners_can_stop_early():
    """Every trial in full alone read 1.8x what a tuned scenario took (hpo: 97 s for 55)."""
    plan = {"device": "cpu", "scenarios": {"baseline": 75.6, "resolution": 79.0, "hpo": 96.7},
            "total_s": 251.3, "least": {"baseline": 75.6, "resolution": 79.0, "hpo": 41.0},
            "least_total_s": 195.6}
    words = pipeline.estimate_words(plan)
    assert words.startswith("about 3.3-4.2 min on cpu: baseline 1.3 min, resolution 1.3 min, "
                            "hpo 0.7-1.6 min; the shorter figure if the tuners stop")
    single = {"device": "cuda", "scenarios": {"baseline": 30.0}, "total_s": 30.0,
              "least": {"baseline": 30.0}, "least_total_s": 30.0}
    assert pipeline.estimate_words(single, resumed=True) == (
        "about 30 s on cuda: baseline 30 s (the whole run: resumed, it trains only what is "
        "left)")


def test_the_estimate_times_a_batch_too_large_for_the_gpu_in_halves(monkeypatch):
    """A batch the GPU cannot hold is trained in smaller passes; the estimate times those
    rather than stopping the notebook's cell with out of memory."""
    tried = []

    class Probe:
        def __init__(self, config, num_classes, batch_size=None):
            tried.append(batch_size)
            if batch_size > 100:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

        def measure(self, **_):
            return {"img_s": 500.0}
    monkeypatch.setattr(scenario, "ComputeProbe", Probe)
    config = scenario.TrainConfig(batch_size=512)
    assert scenario._images_per_s(config, 3, torch.device("cpu")) == 500.0
    assert tried == [512, 256, 128, 64]
    monkeypatch.setattr(Probe, "measure", lambda self, **_: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # not out of memory: not the user's, not hidden
        scenario._images_per_s(config, 3, torch.device("cpu"))


def test_schedule_momentum_cudnn_and_pruner_options_reach_the_run(tmp_path, monkeypatch):
    args = pipeline.parse_args(["--scheduler", "onecycle", "--momentum", "0.5",
                                "--no-cudnn-benchmark", "--pruner", "hyperband",
                                "--output-dir", str(tmp_path)])
    for name in pipeline.SCENARIOS:
        config = pipeline.scenario_config(name, args, torch.device("cpu"))
        assert (config.scheduler, config.momentum, config.cudnn_benchmark) == \
            ("onecycle", 0.5, False)
    seen = record_tuner(monkeypatch)
    data = make_folder(tmp_path / "d")
    index = pipeline.load_data(pipeline.parse_args(["--data-dir", str(data)]), tmp_path)
    with pytest.raises(Recorded):
        scenario.tune_hyperparameters(config, args, index, tmp_path, torch.device("cpu"))
    assert seen["pruner"] == "hyperband"


def test_the_search_looks_at_a_smaller_size_from_144_px_up(tmp_path, monkeypatch):
    """From FIDELITY_FROM up the search's trials train at 3/4 of the final run's size, to a
    multiple of 16 (auto); --search-size full keeps the final run's size, N sets it. The
    final run trains at its own size, and the measuring budget counts the cheaper trials."""
    size = lambda value, px: scenario.search_size(  # noqa: E731
        pipeline.parse_args([] if value is None else ["--search-size", value]), px)
    assert [size(None, px) for px in (64, 128, 144, 150, 160, 176, 192)] == \
        [64, 128, 112, 112, 128, 128, 144]
    assert size("full", 192) == 192 and size("96", 150) == 96 and size("auto", 150) == 112
    for bad, said in (("half", "expected auto, full or a size"), ("0", "must be auto, full"),
                      ("-5", "must be auto, full")):
        with pytest.raises(pipeline.UserError, match=f"--search-size: {said}"):
            pipeline.parse_args(["--search-size", bad])
    with pytest.raises(pipeline.UserError, match="--search-size: 8 px is refused"):
        pipeline.parse_args(["--search-size", "8"])
    assert pipeline.options(search_size="full").search_size == "full"
    data = make_folder(tmp_path / "d")
    index = pipeline.load_data(pipeline.parse_args(["--data-dir", str(data)]), tmp_path)
    cpu = torch.device("cpu")
    runs = [(pipeline.parse_args([] if value is None else ["--search-size", value]), trials)
            for value, trials in ((None, 112), ("full", 150))]
    config = pipeline.scenario_config("hpo", runs[0][0], cpu)
    assert config.image_size == 150
    least = [scenario.least_tuning_epochs("hpo", args, config, index, cpu) for args, _ in runs]
    assert least[0] == pytest.approx(least[1] * (112 / 150) ** 2)
    seen = record_tuner(monkeypatch)
    for args, trials in runs:
        with pytest.raises(Recorded):
            scenario.tune_hyperparameters(config, args, index, tmp_path, cpu)
        assert (seen["base"].image_size, seen["final_size"]) == (trials, 150)
        assert seen["keep_study_size"] == (args.search_size == "auto")  # a resumed study's size


def test_the_search_stops_at_the_baselines_time_unless_the_user_bounds_it():
    """Without --n-trials or --time-budget the search's trials train at most SEARCH_SHARE of
    the baseline's total time; the user's bound wins, and a shared study's workers each run
    their --n-trials."""
    budget = scenario.search_budget
    assert budget(pipeline.parse_args([]), 200.0)[0] == scenario.SEARCH_SHARE * 200.0
    assert "the baseline's 200 s" in budget(pipeline.parse_args([]), 200.0)[1]
    assert budget(pipeline.parse_args([]), None) == (None, "")  # no baseline to measure by
    assert budget(pipeline.parse_args(["--n-trials", "30"]), 200.0) == (None, "")
    assert budget(pipeline.parse_args(["--time-budget", "50"]), 200.0) == (50.0, "--time-budget")
    assert budget(pipeline.parse_args(["--n-trials", "30", "--time-budget", "50"]), 200.0)[0] == 50
    shared = pipeline.parse_args(["--storage", "sqlite:///x.db"])
    assert budget(shared, 200.0) == (None, "")


def test_the_hpo_scenario_bounds_its_search_and_measuring_by_the_baselines_time(tmp_path,
                                                                                 monkeypatch):
    """The baseline's total time of the same run reaches the search as its time budget, and
    the autotuner, whose measuring share counts the search's steps only as far as it reaches."""
    seen = record_tuner(monkeypatch)

    def measured(config, args, index, steps, saved, time_capped=None, unbudgeted=0,
                 finished=False):
        seen["time_capped"] = time_capped
        return config, None
    monkeypatch.setattr(scenario, "autotune_scenario", measured)
    data = make_folder(tmp_path / "d")
    args = pipeline.parse_args(["--data-dir", str(data), "--output-dir", str(tmp_path / "o")])
    index = pipeline.load_data(args, tmp_path)
    config = pipeline.scenario_config("hpo", args, torch.device("cpu"))
    with pytest.raises(Recorded):
        scenario.tune_scenario("hpo", config, args, index, tmp_path / "o", torch.device("cpu"),
                               {"baseline_total_s": 90.0})
    assert seen["timeout_s"] == scenario.SEARCH_SHARE * 90.0
    steps, seconds = seen["time_capped"]
    assert seconds == seen["timeout_s"] and steps > 0
    seen.clear()
    args = pipeline.parse_args(["--data-dir", str(data), "--output-dir", str(tmp_path / "o"),
                                "--n-trials", "3"])
    with pytest.raises(Recorded):
        scenario.tune_scenario("hpo", config, args, index, tmp_path / "o", torch.device("cpu"),
                               {"baseline_total_s": 90.0})
    assert seen["timeout_s"] is None and seen["time_capped"] is None


def test_run_options_hold_every_command_line_option_and_nothing_else():
    dests = {a.dest for a in pipeline.build_parser()._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(scenario.RunOptions)}
    assert fields - {"run_id", "command"} == dests


def test_local_dir_keeps_the_generated_set_off_the_output_dir(tmp_path, monkeypatch):
    """With the outputs on Google Drive (--local-dir given), the baseline would read every
    epoch's images from Drive: the synthetic set is made on the local disk instead."""
    monkeypatch.setattr(scenario, "QUICK_SYNTHETIC_PER_CLASS", (12, 4))
    args = pipeline.options(quick=True, local_dir=str(tmp_path / "local"))
    index = scenario.load_data(args, tmp_path / "drive")
    assert index.name == "synthetic" and index.train
    assert all(Path(p).is_relative_to(tmp_path / "local" / "data") for p, _ in index.train)
    assert not (tmp_path / "drive" / "data").exists()


def test_on_main_raises_rank_0s_own_error_outside_torchrun():
    """Outside torchrun the process is rank 0: an error of its action comes back as it was (a
    bug keeps its type and traceback), and nothing is raised when the action succeeds."""
    done = []
    scenario.on_main(lambda: done.append(1))
    assert done == [1]
    with pytest.raises(ZeroDivisionError):
        scenario.on_main(lambda: 1 / 0)
    with pytest.raises(scenario.UserError, match="wrong URL"):
        scenario.on_main(lambda: (_ for _ in ()).throw(scenario.UserError("wrong URL")))


def test_an_earlier_runs_rows_count_only_for_the_same_setup(tmp_path, monkeypatch):
    """`--scenarios hpo` takes the resolution pick, and every row its comparison with the
    baseline, from earlier rows in the output dir: only rows of the same data split, model,
    kind of device and baseline (a --quick run's baseline is not a full run's), and of the
    same images, not another folder of the same name."""
    from types import SimpleNamespace
    from modules.results import previous_row
    index = SimpleNamespace(name="d", val=[0] * 30, test=[0] * 40,
                            same_data=lambda recorded: recorded == "fp")
    cpu = torch.device("cpu")

    quick_baseline = scenario.scenario_config("baseline", pipeline.parse_args(["--quick"]), cpu)

    from modules import models
    from modules.models import start_weights
    # this process fetched the ImageNet weights: a baseline of random weights is another start
    monkeypatch.setattr(models, "_TRIED", {"squeezenet1_1"})
    monkeypatch.setattr(models, "_UNREACHABLE", set())
    started = start_weights("squeezenet1_1", "imagenet")

    def row(scenario, size, epochs, device="cpu", n_val=30, model="squeezenet1_1", trials=None,
            trial_epochs=4, begun=started, **settings):
        return {"scenario": scenario, "dataset": "d", "model": model, "n_val": n_val,
                "n_test": 40, "best_resolution": 48 if trials else size, "start_weights": begun,
                "settings": {**quick_baseline.to_dict(), "device": device, "image_size": size,
                             "epochs": epochs, **settings},
                **({"resolution_trials": [
                    {"image_size": s, "val_curve": [0.5] * scenario_epochs(trial_epochs, s)}
                    for s in trials]} if trials else {})}

    def scenario_epochs(epochs, size):  # the resolution trials' equal compute, 64 px default
        return max(1, round(epochs * (64 / size) ** 2))
    path = tmp_path / "results.json"
    quick = [row("baseline", 64, 12), row("resolution", 48, 21, trials=[48, 64, 96])]
    path.write_text(json.dumps(quick))
    for flags, found in (([], None), (["--quick"], quick)):
        match = scenario.same_setup(pipeline.parse_args(flags), index, cpu)
        assert [previous_row(path, s, "d", match=match) for s in ("baseline", "resolution")] \
            == (found or [None, None])
    others = [row("baseline", 64, 12, device="cuda:0"), row("baseline", 64, 12, n_val=31),
              row("baseline", 64, 12, model="resnet18"), row("baseline", 64, 5),
              {**row("baseline", 64, 12), "data_fingerprint": "another folder named d"},
              row("baseline", 64, 12, weights="none"), row("baseline", 64, 12, lr=0.01),
              row("baseline", 64, 12, batch_size=64),  # another start or learning setting
              row("baseline", 64, 12, world_size=2),  # torchrun's 2 processes: another batch
              # a speed knob set for it: not the plain baseline this run is judged against
              row("baseline", 64, 12, num_workers=2), row("baseline", 64, 12, amp="bf16"),
              # "imagenet" asked for, but unreachable there: it trained from random weights
              row("baseline", 64, 12, begun="random (ImageNet weights unreachable)")]
    path.write_text(json.dumps(others))
    match = scenario.same_setup(pipeline.parse_args(["--quick"]), index, cpu)
    assert previous_row(path, "baseline", "d", match=match) is None
    path.write_text(json.dumps([row("baseline", 64, 12, seed=7)]))  # another draw: the same setup
    assert previous_row(path, "baseline", "d", match=match) is not None
    path.write_text(json.dumps([row("baseline", 64, 12, cpu_threads=2)]))  # measured, not set
    assert previous_row(path, "baseline", "d", match=match) is not None
    # a --resume without the baseline scenario takes its own run's baseline, not a newer one
    own, newer = ({**row("baseline", 64, 12), "run_id": run_id, "total_s": total_s}
                  for run_id, total_s in (("20261206-1000", 6.5), ("20261206-1100", 8.4)))
    path.write_text(json.dumps([own, newer]))
    for run_id, total_s in ((own["run_id"], 6.5), ("20261206-1200", 8.4)):
        args = pipeline.parse_args(["--quick"])
        args.run_id = run_id
        assert scenario.baseline_seconds(args, tmp_path, index, {}, cpu) == total_s
    # a row of a version without a later setting had it at its default
    older = row("baseline", 64, 12)
    del older["settings"]["max_nonfinite_steps"]
    path.write_text(json.dumps([older]))
    assert previous_row(path, "baseline", "d", match=match) is not None
    # before this process has tried to fetch them (the hpo budget is set before any model is
    # built), an offline baseline's random start may be this run's too
    unreachable = [row("baseline", 64, 12, begun=models.UNREACHABLE_START)]
    path.write_text(json.dumps(unreachable))
    assert previous_row(path, "baseline", "d", match=match) is None
    monkeypatch.setattr(models, "_TRIED", set())
    fresh = scenario.same_setup(pipeline.parse_args(["--quick"]), index, cpu)
    assert previous_row(path, "baseline", "d", match=fresh) is not None
    # a pick from trials of other epochs (--epochs 6: 2 at 64 px), other start weights or
    # another lr is not this run's
    picks = [row("resolution", 48, 21, trials=[48, 64, 96], trial_epochs=2),
             row("resolution", 48, 21, trials=[48, 64, 96], begun="none"),
             row("resolution", 48, 21, trials=[48, 64, 96], lr=0.01)]
    path.write_text(json.dumps(picks))
    assert previous_row(path, "resolution", "d", match=match) is None


def test_the_hpo_measuring_budget_is_a_share_of_its_search_when_its_final_may_be_taken(
        small, tmp_path, monkeypatch):
    """An hpo final run that would learn what the resolution final learned is taken, not
    trained: a budget of 10% of search and final run was 11-13% of what the scenario ran."""
    seen = []
    monkeypatch.setattr(scenario, "autotune_scenario", lambda config, args, index, planned,
                        saved, capped, unbudgeted, finished: seen.append((planned, unbudgeted))
                        or (config, None))
    monkeypatch.setattr(scenario, "tune_hyperparameters", lambda config, *a, **k: (config, {}))
    monkeypatch.setattr(scenario, "least_tuning_epochs", lambda *a, **k: 4)
    args = pipeline.parse_args(["--data-dir", str(small), "--image-size", "32", "--epochs", "8",
                                "--scenarios", "resolution,hpo", "--n-trials", "2",
                                "--output-dir", str(tmp_path / "out")])
    index = pipeline.load_data(args, tmp_path / "out")
    config = scenario.scenario_config("hpo", args, scenario.torch.device("cpu"))
    for tuned in ({"image_size": 32}, {"image_size": 32, "final": {"scenario": "resolution"}}):
        scenario.tune_scenario("hpo", config, args, index, tmp_path / "out",
                               scenario.torch.device("cpu"), tuned)
    (planned, alone), (same, unbudgeted) = seen
    assert planned == same and alone == 0  # compile still counts the final run's steps
    assert unbudgeted == scenario.planned_steps(config, len(index.train))
    assert planned - unbudgeted == scenario.planned_steps(config, len(index.train), epochs=1) * 4


def test_the_hpo_final_steps_planned_below_the_baseline_size_are_its_own_epochs(
        small, tmp_path, monkeypatch):
    """At a size below the baseline's the final run trains the epochs that cost what the
    baseline's do (fill_time): planned at the baseline's count, the autotuner's "final run"
    and compile's payback horizon were 432 steps where it trained 756."""
    seen = []
    monkeypatch.setattr(scenario, "autotune_scenario", lambda config, args, index, planned,
                        saved, capped, unbudgeted, finished: seen.append(unbudgeted)
                        or (config, None))
    monkeypatch.setattr(scenario, "tune_hyperparameters", lambda config, *a, **k: (config, {}))
    monkeypatch.setattr(scenario, "least_tuning_epochs", lambda *a, **k: 4)
    argv = ["--data-dir", str(small), "--quick", "--scenarios", "resolution,hpo",  # 64 px
            "--n-trials", "2", "--output-dir", str(tmp_path / "out")]
    epochs = []
    for extra in ([], ["--epochs", "8"]):
        args = pipeline.parse_args(argv + extra)
        index = pipeline.load_data(args, tmp_path / "out")
        config = scenario.scenario_config("hpo", args, scenario.torch.device("cpu"))
        epochs.append(config.epochs)
        scenario.tune_scenario("hpo", config, args, index, tmp_path / "out",
                               scenario.torch.device("cpu"),
                               {"image_size": 32, "final": {"scenario": "resolution"}})
    at_32 = dataclasses.replace(config, image_size=32)
    # (64 / 32)^2 = 4 times the baseline's epochs; --epochs N keeps N
    assert seen == [scenario.planned_steps(at_32, len(index.train), epochs=4 * epochs[0]),
                    scenario.planned_steps(at_32, len(index.train), epochs=8)]


def test_the_steps_planned_under_torchrun_are_one_processs_share(monkeypatch):
    """Each process trains its shard: counted as one process's steps, the autotuner's budget
    (10% of the planned time) was world_size times too large."""
    from modules import distributed
    from modules.config import TrainConfig
    config = TrainConfig(batch_size=32, epochs=2)
    assert scenario.planned_steps(config, 1152) == 72
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    assert scenario.planned_steps(config, 1152) == 36


def test_a_resumed_scenario_counts_the_tuning_of_earlier_sessions(small, tmp_path,
                                                                  monkeypatch):
    """Ctrl-C after the search, then --resume: the row's tuning time (and so its time against
    the baseline and --match-time's budget) includes the interrupted session's search."""
    out = tmp_path / "out"
    argv = small_hpo(small, out, "--n-trials", "2")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as patch:
        patch.setattr(scenario, "train", interrupted)
        assert run_main(*argv) != 0
    (clock,) = run_path(out).glob("hpo.clock.json")
    first = json.loads(clock.read_text())["tuning_s"]
    assert first > 0
    assert run_main(*argv, "--resume") == 0
    row = json.loads((out / "results.json").read_text())[-1]
    assert row["tuning_s"] >= first and row["total_s"] >= row["tuning_s"] + row["wall_s"] - 1e-6


def test_a_growth_cut_short_before_its_final_run_trains_it_on_the_next_resume(
        small, tmp_path, monkeypatch):
    """`--resume --n-trials 3` grew the study to a new winner, then was interrupted before
    its final run was trained again: the next plain --resume trains the winner's final run,
    not the earlier checkpoint's settings under the winner's name."""
    out = tmp_path / "out"
    argv = small_hpo(small, out)
    assert run_main(*argv, "--n-trials", "2") == 0
    better = {"lr": 0.005, "batch_size": 16, "optimizer": "sgd", "weight_decay": 1e-4}
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (better, "a new winner"))

    def interrupted(self, summary=None):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(scenario.OptunaTuner, "save_plots", interrupted)
        assert run_main(*argv, "--resume", "--n-trials", "3") != 0
    assert run_main(*argv, "--resume") == 0
    row = json.loads((out / "results.json").read_text())[-1]
    assert row["hpo"]["n_trials"] == 3 and row["resumed_from_epoch"] is None
    assert (row["settings"]["lr"], row["settings"]["optimizer"]) == (0.005, "sgd")


def test_a_growth_cut_short_is_finished_under_a_spent_automatic_budget(small, tmp_path,
                                                                        monkeypatch):
    """Without --n-trials the search's automatic budget (the baseline's time) was spent before
    the final run started: a plain --resume still finishes the growth cut short, which it had
    settled as done with no trial added."""
    out = tmp_path / "out"
    argv = small_hpo(small, out)
    assert run_main(*argv, "--n-trials", "2") == 0

    def interrupted(self, summary=None):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(scenario.OptunaTuner, "save_plots", interrupted)
        m.setattr(scenario.OptunaTuner, "objective", interrupted)  # cut short in its new trial
        assert run_main(*argv, "--resume", "--n-trials", "3") != 0
    monkeypatch.setattr(scenario, "search_budget", lambda args, baseline_s: (1e-3, "spent"))
    assert run_main(*argv, "--resume") == 0
    row = json.loads((out / "results.json").read_text())[-1]
    assert row["hpo"]["n_trials"] == 3 and row["hpo"]["time_budget_s"] is None


def test_a_finished_scenario_resumed_keeps_its_pure_step_timing(small, tmp_path, monkeypatch):
    """A --resume that finds a scenario finished only evaluates it, and its row keeps the
    figures measured while it trained: its pure-step timing too, which a probe under this
    session's load gave a diagnosis at odds with the carried step time (a fixed cost above
    the step itself on a busy machine)."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--image-size", "32", "--epochs", "1", "--batch-size",
            "4", "--weights", "none", "--no-progress", "--output-dir", str(out))
    assert run_main(*argv) == 0
    first = json.loads((out / "results.json").read_text())[-1]
    assert first.get("fixed_step")
    busy = {"batch": 4, "step_ms": 900.0, "double_step_ms": 300.0, "fixed_ms": 1500.0,
            "seconds": 9.0}
    monkeypatch.setattr(scenario, "fixed_step_cost", lambda *a, **k: busy)
    assert run_main(*argv, "--resume") == 0
    again = json.loads((out / "results.json").read_text())[-1]
    assert again["fixed_step"] == first["fixed_step"]
    assert again["diagnosis"] == first["diagnosis"]


def test_a_finished_search_resumed_keeps_its_row(small, tmp_path, monkeypatch):
    """--resume of a finished run only evaluates: its row kept the budget the search ran
    under (the session, its final run begun, was given none), the session it resumed from
    and where its speed settings were measured."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "hpo", "--image-size", "32", "--epochs",
            "2", "--weights", "none", "--no-progress", "--output-dir", str(out))
    monkeypatch.setattr(scenario, "search_budget", lambda args, baseline_s: (1e-3, "spent"))
    assert run_main(*argv) == 0
    first = json.loads((out / "results.json").read_text())[-1]
    assert first["hpo"]["time_budget_s"] == 1e-3 and first["resumed_from_epoch"] is None
    assert run_main(*argv, "--resume") == 0
    again = json.loads((out / "results.json").read_text())[-1]
    for key in ("hpo", "autotune", "resumed_from_epoch", "test_acc", "history"):
        assert again[key] == first[key] or key == "autotune", key
    assert again["autotune"] == {**first["autotune"], "resumed_from": str(
        run_path(out) / "hpo.autotune.json")}


def test_the_time_to_the_baselines_accuracy_counts_the_final_runs_preparation():
    """Decoding the images into the cache and building the model come after the tuning and
    before the training clock starts: the time to the baseline's accuracy counts them."""
    from modules.results import compare_to_baseline
    baseline = {"scenario": "baseline", "val_acc": 0.6, "test_acc": 0.5, "total_s": 100.0}
    row = {"scenario": "resolution", "test_acc": 0.7, "tuning_s": 10.0, "prepare_s": 5.0,
           "wall_s": 20.0, "total_s": 35.0,
           "history": [{"elapsed_s": 2.0, "val_acc": 0.5}, {"elapsed_s": 3.0, "val_acc": 0.65}]}
    compare_to_baseline([row], baseline)
    assert row["time_to_baseline_acc_s"] == 18.0 and row["baseline_acc_reached_in"] == "final run"


def test_a_resumed_final_run_keeps_its_start_trials_epochs(small, tmp_path, monkeypatch):
    """Stopped as the resolution final run started and resumed, the row counted its tuning
    seconds but dropped the picked trial's epochs (they ended in the first session), so it
    reached the baseline's accuracy later than it had: they count where they ended."""
    argv = ["--data-dir", str(small), "--scenarios", "resolution", "--resolutions", "32",
            "--image-size", "32", "--epochs", "2", "--weights", "none", "--no-progress",
            "--no-autotune", "--output-dir", str(tmp_path / "out")]
    real = scenario.train

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(scenario, "train", stopped)
    assert run_main(*argv) == 130
    monkeypatch.setattr(scenario, "train", real)
    assert run_main(*argv, "--resume") == 0
    row = json.loads((tmp_path / "out" / "results.json").read_text())[-1]
    curve = row["warm_start"]["curve"]
    assert [p["val_acc"] for p in curve] == row["resolution_trials"][0]["val_curve"]
    elapsed = [p["elapsed_s"] for p in curve]
    assert 0 < elapsed[0] and elapsed == sorted(elapsed) and elapsed[-1] <= row["tuning_s"]


def test_the_tuning_clock_is_written_while_tuning(tmp_path, monkeypatch):
    """kill -9 (a lost Colab VM) runs no finally: the seconds tuned so far are on disk already,
    for the resumed row's tuning_s."""
    monkeypatch.setattr("modules.clock.CLOCK_EVERY_S", 0.05)
    clock = tmp_path / "hpo.clock.json"
    started = time.perf_counter()
    with ticking(clock, 30.0, started):
        deadline = time.monotonic() + 10
        while not clock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert read_kept(clock).seconds >= 30.0  # earlier sessions' seconds and this one's
    assert read_kept(clock).seconds >= 30.0
    # the sessions given are written; a write without them keeps those recorded
    with ticking(clock, 30.0, started, [[1.0, 0.0], [5.0, 30.0]]):
        time.sleep(0.2)
    assert read_kept(clock).sessions == [[1.0, 0.0], [5.0, 30.0]]
    write_clock(clock, 40.0)
    assert read_kept(clock).sessions == [[1.0, 0.0], [5.0, 30.0]]
    # each ended session's load on the machine too, kept by a write that does not give them
    write_clock(clock, 40.0, loads=[{"wall_s": 30.0, "cpu_util_pct": 99.0,
                                     "process_cpu_pct": None}])
    write_clock(clock, 40.0)
    assert read_kept(clock).loads == [{"wall_s": 30.0, "cpu_util_pct": 99.0,
                                       "process_cpu_pct": None}]
    damaged = tmp_path / "damaged.clock.json"
    damaged.write_text(json.dumps({"tuning_s": 1.0, "loads": [{"wall_s": "x"}]}))
    assert read_kept(damaged).loads == []  # none, as for the sessions
    assert read_kept(clock).seconds == 40.0


def test_a_grown_studys_new_final_run_gives_way_to_a_better_earlier_one(tmp_path):
    """`--resume --n-trials K` changed the choice and trained it in full; it validated below
    the final run before it: the row takes that run's model and figures, and its checkpoint
    comes back as the hpo checkpoint, so a later --resume continues the model the row shows."""
    from modules.results import checkpoint_file
    final = checkpoint_file(tmp_path, "hpo", run_id="r")
    final.parent.mkdir(parents=True)
    final.write_bytes(b"new final")
    aside = final.with_name("hpo.before-1.pt")
    aside.write_bytes(b"earlier final")
    replaced = {"checkpoint": str(aside), "seconds": 30.0, "finished": True}
    earlier = {"scenario": "hpo", "run_id": "r", "val_acc": 0.6, "test_acc": 0.7,
               "history": [{"epoch": 1}], "tuning_s": 20.0, "total_s": 50.0,
               "settings": {"lr": 1e-3}, "hpo": {"n_trials": 2}}
    new = {"scenario": "hpo", "run_id": "r", "val_acc": 0.5, "test_acc": 0.8, "epochs": 4,
           "wall_s": 40.0, "tuning_s": 60.0, "total_s": 100.0, "settings": {"lr": 5e-3},
           "hpo": {"n_trials": 3}, "replaced_final": replaced}
    assert final_runs.earlier_if_better(new, replaced, {**earlier, "val_acc": 0.5}, tmp_path,
                                        "r") is new  # a tie keeps the new run
    assert final.read_bytes() == b"new final"
    kept = final_runs.earlier_if_better(new, replaced, earlier, tmp_path, "r")
    assert (kept["test_acc"], kept["settings"], kept["hpo"]) == (0.7, {"lr": 1e-3},
                                                                 {"n_trials": 3})
    assert kept["grown_final"]["val_acc"] == 0.5 and "replaced_final" not in kept
    # all that ran still counts: the new final run as tuning, the earlier one as the final
    assert (kept["total_s"], kept["tuning_s"]) == (100.0, 70.0)
    assert final.read_bytes() == b"earlier final" and not aside.exists()
    assert [p.read_bytes() for p in final.parent.glob("hpo.grown-*.pt")] == [b"new final"]
    told = " ".join(report.versus_baseline_lines([{**earlier, "scenario": "baseline"}, kept]))
    assert "its new choice was trained in full and validated at 50.0% (test 80.0%)" in told
    assert final_runs.earlier_if_better(new, None, None, tmp_path, "r") is new


def test_an_earlier_final_run_that_cannot_come_back_leaves_the_new_one_in_place(tmp_path,
                                                                                 caplog):
    """The earlier checkpoint was removed: the new run's row is kept, and so is its checkpoint
    as the hpo one, which a later --resume finds finished."""
    from modules.results import checkpoint_file
    final = checkpoint_file(tmp_path, "hpo", run_id="r")
    final.parent.mkdir(parents=True)
    final.write_bytes(b"new final")
    replaced = {"checkpoint": str(final.with_name("hpo.before-1.pt")), "seconds": 30.0}
    new = {"val_acc": 0.5, "total_s": 100.0}
    with caplog.at_level(logging.WARNING):
        assert final_runs.earlier_if_better(new, replaced, {"val_acc": 0.6}, tmp_path, "r") is new
    assert "keeping the new final run" in caplog.text
    assert [p.name for p in final.parent.iterdir()] == ["hpo.pt"]
    assert final.read_bytes() == b"new final"


def test_tensorboards_hpo_run_is_the_final_run_the_row_keeps(tmp_path):
    """A winner's final run that gave way to the resolution scenario's: TensorBoard drew the
    winner's curves as hpo beside a table showing the other run's."""
    runs = tmp_path / "runs"
    for name, text in (("hpo", "winner"), ("resolution", "kept")):
        (runs / name).mkdir(parents=True)
        (runs / name / "events").write_text(text)
    final_runs.show_in_tensorboard(runs, aside="winner-1", kept=runs / "resolution", copy=True)
    assert (runs / "hpo" / "events").read_text() == "kept"
    assert (runs / "resolution" / "events").read_text() == "kept"
    assert (runs / "hpo.winner-1" / "events").read_text() == "winner"
    # a --resume that finds the run finished takes the same row again: shown already
    final_runs.show_in_tensorboard(runs, aside="winner-2", kept=runs / "resolution", copy=True)
    assert not (runs / "hpo.winner-2").exists()
    assert (runs / "hpo" / "events").read_text() == "kept"
    final_runs.show_in_tensorboard(runs, aside="grown-1", kept=runs / "hpo.winner-1")  # moved
    assert (runs / "hpo" / "events").read_text() == "winner"
    assert not (runs / "hpo.winner-1").exists() and (runs / "hpo.grown-1").is_dir()


def test_a_kept_earlier_final_run_is_what_a_later_resume_continues(small, tmp_path,
                                                                  monkeypatch):
    """Its checkpoint came back as the hpo checkpoint: a --resume finds it finished, rather
    than the new run the row does not show."""
    out = tmp_path / "out"
    argv = small_hpo(small, out)
    real_prepare = scenario.prepare

    def slow_prepare(*a, **k):  # a final run long enough that counting it twice shows
        time.sleep(3)
        return real_prepare(*a, **k)
    with monkeypatch.context() as m:
        m.setattr(scenario, "prepare", slow_prepare)
        assert run_main(*argv, "--n-trials", "2") == 0
    first = json.loads((out / "results.json").read_text())[-1]
    better = {"lr": 0.005, "batch_size": 16, "optimizer": "sgd", "weight_decay": 1e-4}
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (better, "a new winner"))
    real = final_runs.default_if_better
    # the new choice's final run validates below the earlier one
    monkeypatch.setattr(scenario, "default_if_better",
                        lambda row, same: {**real(row, same), "val_acc": -1.0})
    assert run_main(*argv, "--resume", "--n-trials", "3") == 0
    kept = json.loads((out / "results.json").read_text())[-1]
    assert kept["history"] == first["history"] and kept["test_acc"] == first["test_acc"]
    assert kept["grown_final"]["settings"]["lr"] == 0.005
    assert "validated at -100.0%" in (out / "report.md").read_text()
    # TensorBoard's hpo run is the kept one's too, the new run's scalars beside it
    runs = run_path(out, "runs")
    assert [p.name[:10] for p in runs.glob("hpo.*")] == ["hpo.grown-"]
    assert list((runs / "hpo").glob("events.out.tfevents.*"))
    assert list(next(runs.glob("hpo.grown-*")).glob("events.out.tfevents.*"))
    # nothing left to do: the kept run is found finished (resumed after its last epoch, not
    # trained again), and the row stays
    monkeypatch.undo()
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (better, "a new winner"))
    assert run_main(*argv, "--resume", "--n-trials", "3") == 0
    again = json.loads((out / "results.json").read_text())[-1]
    # it resumed nothing: it evaluated the finished run
    assert again["resumed_from_epoch"] is None and again["history"] == first["history"]
    assert again["grown_final"] == kept["grown_final"]
    # counted once, as the final run: the clock had it as tuning too (the set-aside's seconds)
    assert again["tuning_s"] == pytest.approx(kept["tuning_s"], abs=1.5)
    assert again["total_s"] == pytest.approx(kept["total_s"], abs=1.5)


def test_a_new_final_run_cut_short_is_still_compared_with_the_one_it_replaced(small, tmp_path,
                                                                              monkeypatch):
    """The set-aside final run was known only in memory: a grown study's new final run cut
    short (a Colab disconnect) and resumed was kept however it validated, and the earlier
    model stayed aside."""
    from modules import checkpoints
    out = tmp_path / "out"
    argv = small_hpo(small, out)
    assert run_main(*argv, "--n-trials", "2") == 0
    first = json.loads((out / "results.json").read_text())[-1]
    better = {"lr": 0.005, "batch_size": 16, "optimizer": "sgd", "weight_decay": 1e-4}
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (better, "a new winner"))
    real = final_runs.default_if_better
    monkeypatch.setattr(scenario, "default_if_better",  # the new final run validates lower
                        lambda row, same: {**real(row, same), "val_acc": -1.0})
    real_save = checkpoints.CheckpointSaver.save

    def save_then_stop(self, *a, **k):
        real_save(self, *a, **k)
        if self.path is not None and self.path.name == "hpo.pt":
            raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(checkpoints.CheckpointSaver, "save", save_then_stop)
        assert run_main(*argv, "--resume", "--n-trials", "3") != 0
    assert run_main(*argv, "--resume", "--n-trials", "3") == 0
    row = json.loads((out / "results.json").read_text())[-1]
    assert row["history"] == first["history"] and row["grown_final"]["settings"]["lr"] == 0.005
    checkpoints_dir = run_path(out)
    assert not list(checkpoints_dir.glob("hpo.before-*.pt"))  # it came back as hpo.pt
    assert not (checkpoints_dir / "hpo.replaced.json").exists()


def test_a_final_run_continued_from_its_checkpoint_is_what_the_summary_names():
    """On a shared study another worker's trial can overtake while this run's final run is
    cut short; resumed, the run continues its checkpoint's parameters, and the row and
    best_params.json named the new winner all the same."""
    from types import SimpleNamespace
    from modules.config import TrainConfig
    default = TrainConfig(lr=1e-4, batch_size=8, optimizer="adam", weight_decay=0.0)
    stub = SimpleNamespace(default_config=lambda: default)
    winner = {"lr": 3e-3, "batch_size": 16, "optimizer": "adamw", "weight_decay": 1e-4}
    moved = {"chosen_params": winner, "keeps_default": False, "choice": "trial 2 beats it"}
    kept = scenario.continued_summary(moved, default, stub)
    assert kept["keeps_default"] and kept["chosen_params"] is None
    assert "continues with them" in kept["choice"] and "trial 2 beats it" in kept["choice"]
    same = scenario.continued_summary(moved, scenario.dataclasses.replace(default, **winner), stub)
    assert same is moved  # nothing moved: as the study says


def test_an_hpo_checkpoint_of_another_kind_is_refused_in_one_line(small, tmp_path, monkeypatch,
                                                                  capsys):
    """A torch file that is not a checkpoint (a bare state_dict) where the hpo final run's
    checkpoint is: KeyError 'config', where the other scenarios refuse it in one line."""
    from modules.models import build_model
    out = tmp_path / "out"
    argv = small_hpo(small, out, "--n-trials", "1")

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(scenario, "train", interrupted)
        assert run_main(*argv) != 0
    torch.save(build_model("squeezenet1_1", 3, "none").state_dict(), run_path(out) / "hpo.pt")
    capsys.readouterr()
    assert run_main(*argv, "--resume") == 2
    assert "has an unknown format; delete it to start over" in capsys.readouterr().err


def test_a_resume_from_other_weights_is_refused_in_one_line(small, tmp_path, monkeypatch,
                                                            capsys):
    """The baseline's checkpoint went on from the earlier start without a word, and its row
    said it started from the new one."""
    from modules.models import build_model
    start = tmp_path / "start.pt"
    torch.save(build_model("squeezenet1_1", 3, "none").state_dict(), start)
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "baseline", "--image-size", "32",
            "--epochs", "2", "--no-progress", "--output-dir", str(out))
    assert run_stopped_after_a_checkpoint(monkeypatch, *argv, "--weights", str(start)) != 0
    capsys.readouterr()
    assert run_main(*argv, "--weights", "none", "--resume") == 2
    err = capsys.readouterr().err
    assert f"started from --weights {start}" in err and "this one from --weights none" in err
    # the same file named another way continues it
    monkeypatch.chdir(tmp_path)
    assert run_main(*argv, "--weights", "start.pt", "--resume") == 0
    assert json.loads((out / "results.json").read_text())[-1]["resumed_from_epoch"] == 1


def test_a_resumed_run_keeps_the_start_it_had_when_imagenet_was_unreachable(
        small, tmp_path, monkeypatch, capsys):
    """Started while the ImageNet weights could not be fetched (random start), resumed where
    they can: the rest of the run trained from them and was compared with the trials of the
    random start, every row saying "imagenet". It keeps the random start now; and a run that
    fetched them, resumed where they cannot be, is refused in one line."""
    import urllib.error

    import torchvision

    from modules import models
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = torchvision.models.SqueezeNet1_1_Weights.IMAGENET1K_V1.url
    cached = tmp_path / "torch" / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]

    def offline(*_, **__):  # torch.hub offline: its cache, or no weights
        if cached.is_file():
            return torch.load(cached, weights_only=True)
        raise urllib.error.URLError("[Errno -2] Name or service not known")
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)

    def new_process():
        monkeypatch.setattr(models, "_TRIED", set())
        monkeypatch.setattr(models, "_UNREACHABLE", set())

    def reachable(yes: bool):
        if yes:
            cached.parent.mkdir(parents=True, exist_ok=True)
            torch.save(torchvision.models.squeezenet1_1(weights=None).state_dict(), cached)
        else:
            cached.unlink(missing_ok=True)
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "baseline", "--image-size", "32",
            "--epochs", "2", "--weights", "imagenet", "--no-progress", "--output-dir", str(out))
    for first in (False, True):
        shutil.rmtree(out, ignore_errors=True)
        new_process()
        reachable(first)
        assert run_stopped_after_a_checkpoint(monkeypatch, *argv) != 0
        new_process()
        reachable(not first)
        capsys.readouterr()
        code = run_main(*argv, "--resume")
        err = capsys.readouterr().err
        if first:  # fetched then, unreachable now
            assert code == 2 and "started from the ImageNet weights, which this session " \
                "cannot fetch" in err and "Traceback" not in err
        else:
            assert code == 0 and "its models keep that start" in err
            row = json.loads((out / "results.json").read_text())[-1]
            assert row["resumed_from_epoch"] == 1
            assert row["start_weights"] == models.UNREACHABLE_START
            # a new run in the same process (the notebook's) starts from the weights
            assert run_main(*argv) == 0
            row = json.loads((out / "results.json").read_text())[-1]
            assert row["start_weights"] == "imagenet" and row.get("resumed_from_epoch") is None


def test_scenarios_run_in_the_order_each_builds_on_whatever_order_they_are_typed():
    """hpo typed first ran first: without the resolution scenario's size and trial, and
    without this run's baseline time for its budget."""
    assert pipeline.parse_args(["--scenarios", "hpo,resolution,baseline"]).scenarios == [
        "baseline", "resolution", "hpo"]
    assert pipeline.parse_args(["--scenarios", "hpo,baseline"]).scenarios == ["baseline", "hpo"]


def test_a_resumed_sessions_report_does_not_call_finished_rows_unfinished(small, tmp_path,
                                                                          monkeypatch):
    """Stopped in a resumed session of a finished run, report.md showed the earlier
    session's resolution row in its table and said resolution did not finish."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "baseline,resolution", "--epochs", "1",
            "--image-size", "32", "--resolutions", "24", "--weights", "none", "--no-progress",
            "--output-dir", str(out))
    assert run_main(*argv) == 0

    def stop(*_, **__):
        raise KeyboardInterrupt  # Stop pressed while the resumed run tunes again
    monkeypatch.setattr(scenario, "tune_resolution", stop)
    assert run_main(*argv, "--resume") != 0
    report = (out / "report.md").read_text()
    assert "| resolution |" in report and "did not finish" not in report
    from types import SimpleNamespace
    assert scenario.unfinished([{"scenario": "baseline", "run_id": "b"},
                                {"scenario": "resolution", "run_id": "a"}],
                               SimpleNamespace(run_id="b", scenarios=["baseline", "resolution"])
                               ) == ["resolution"]


def test_resuming_a_finished_run_leaves_its_times_as_they_were(small, tmp_path):
    """Nothing was trained, yet each resume (RESUME left ticked, Run all again) added its
    reading back of the journal and study to tuning_s, total_s and the time ratios."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--epochs", "2", "--image-size", "32", "--resolutions",
            "24", "--n-trials", "2", "--weights", "none", "--no-progress", "--no-autotune",
            "--output-dir", str(out))
    assert run_main(*argv) == 0

    def times():
        rows = json.loads((out / "results.json").read_text())
        return {r["scenario"]: (r["tuning_s"], r["total_s"], r.get("total_vs_baseline"))
                for r in rows}
    first = times()
    for _ in range(2):
        assert run_main(*argv, "--resume") == 0
        assert times() == first


def test_a_grown_studys_choice_taken_from_the_resolution_final_leaves_no_pending_record(
        small, tmp_path, monkeypatch):
    """The set-aside final run is recorded until a trained final run is compared with it; a
    choice back to the default, whose final run is the resolution scenario's, trains none:
    the record stayed behind, and its private keys reached the row."""
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "resolution,hpo", "--resolutions", "32",
            "--image-size", "32", "--epochs", "2", "--weights", "none", "--no-progress",
            "--no-autotune", "--output-dir", str(out))
    better = {"lr": 0.005, "batch_size": 16, "optimizer": "sgd", "weight_decay": 1e-4}
    with monkeypatch.context() as m:
        m.setattr(scenario.OptunaTuner, "choice", lambda self: (better, "a winner"))
        assert run_main(*argv, "--n-trials", "1") == 0
    assert json.loads((out / "results.json").read_text())[-1].get("final_from") is None
    monkeypatch.setattr(scenario.OptunaTuner, "choice", lambda self: (None, "the default"))
    assert run_main(*argv, "--resume", "--n-trials", "2") == 0
    row = json.loads((out / "results.json").read_text())[-1]
    assert row["final_from"] == "resolution" and row["replaced_final"]["params"]["lr"] == 0.005
    assert not {"_row", "_counted"} & set(row["replaced_final"])
    assert not (run_path(out) / "hpo.replaced.json").exists()


def test_ctrl_c_before_the_run_started_offers_no_resume(monkeypatch, capsys):
    """Stopped while the data was being read, the line said to rerun with --resume, where
    there was nothing to resume."""
    def stopped(args, started):
        if started:
            args.run_id = "20261206-120000"
        raise KeyboardInterrupt
    for started, said in ((False, "interrupted before the run started: nothing to resume."),
                          (True, "interrupted: rerun the same command with --resume")):
        monkeypatch.setattr(pipeline, "run", lambda args, started=started: stopped(args, started))
        assert pipeline.main(["--dataset", "synthetic", "--quick"]) == 130
        assert capsys.readouterr().err.startswith(said)
    # resuming, the run it resumes is still there to continue
    monkeypatch.setattr(pipeline, "run", lambda args: stopped(args, False))
    assert pipeline.main(["--dataset", "synthetic", "--quick", "--resume"]) == 130
    assert capsys.readouterr().err.startswith("interrupted while reading the data: rerun the "
                                              "same command (with --resume)")


def test_a_run_resumed_mid_training_records_no_energy_of_one_session(small, tmp_path,
                                                                      monkeypatch):
    """energy_j of a run resumed after its first epoch counted the second session only, while
    wall_s counts both: 8.96 W read off a 10 W counter. A share is not recorded as a total."""
    from modules.monitor import SystemSampler
    summary = SystemSampler.summary
    monkeypatch.setattr(SystemSampler, "summary", lambda self: {**summary(self),
                                                                "energy_j": 50.0})
    out = tmp_path / "out"
    argv = ("--data-dir", str(small), "--scenarios", "baseline", "--image-size", "32",
            "--epochs", "2", "--no-progress", "--weights", "none", "--output-dir", str(out))
    assert run_stopped_after_a_checkpoint(monkeypatch, *argv) != 0
    assert run_main(*argv, "--resume") == 0
    row = json.loads((out / "results.json").read_text())[-1]
    assert row["resumed_from_epoch"] == 1 and row["energy_j"] is None
    assert run_main(*argv) == 0  # uninterrupted: recorded
    assert json.loads((out / "results.json").read_text())[-1]["energy_j"] == 50.0


def test_the_report_says_which_accuracy_chose_the_models():
    """The validation figure picked each model's epoch, size and settings; printed beside test
    with a standard error and nothing more, it read as an unbiased estimate."""
    text = report.render_report([{"scenario": "baseline", "settings": {}}], [])
    assert "Val Acc chose each model's epoch" in text
    assert "Test Acc, on images nothing was chosen by, is the estimate" in text


BUSY = {"cpu_util_pct": 99.0, "process_cpu_pct": 40.0}    # other processes took the cores
IDLE = {"cpu_util_pct": 50.0, "process_cpu_pct": 190.0}   # this run had them
UNREAD = {"cpu_util_pct": None, "process_cpu_pct": None}  # a moment's sampling read nothing


def watched(monkeypatch, small, out, figures):
    """A resolution-only run's command line on `small`, its machine sampled as `figures(tuning)`
    says (tuning: the sampler is the first made since `made` was last cleared, the tuning's,
    made before its final run's; returns the figures, which replace the sampler's), with the
    contention rule's thresholds back (conftest turns them off), 2 cores, and any tuning long
    enough to judge. Returns (argv, made)."""
    from modules import diagnosis
    monkeypatch.setattr(diagnosis, "THRESHOLDS", diagnosis.Thresholds())
    monkeypatch.setattr(scenario, "MIN_JUDGED_TUNING_S", 0.0)  # these tunings take a second
    monkeypatch.setattr(scenario, "usable_cpus", lambda: 2)
    made = []

    class Sampler(scenario.SystemSampler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def summary(self):
            return {**super().summary(), **figures(self is made[0])}
    monkeypatch.setattr(scenario, "SystemSampler", Sampler)
    return ("--data-dir", str(small), "--scenarios", "resolution", "--resolutions", "32",
            "--image-size", "32", "--epochs", "2", "--weights", "none", "--no-autotune",
            "--no-progress", "--output-dir", str(out)), made


def test_a_tuning_slowed_by_other_processes_is_said_and_advised(small, tmp_path, monkeypatch,
                                                                capsys):
    """A quick start beside a test run: the resolution scenario's 64 px trial ran at 58 img/s
    where its final run ran at 334, and the row read 3.25x the baseline's time with a
    compute-bound diagnosis of its final run alone. The machine is now watched while a tuned
    scenario tunes, and a contended tuning is said, advised in the row's diagnosis, and makes
    the benchmark's verdicts unreliable."""
    from modules import diagnosis
    argv, _ = watched(monkeypatch, small, tmp_path / "out",
                      lambda tuning: BUSY if tuning else IDLE)
    assert run_main(*argv) == 0
    row = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    load = row["tuning_load"]
    assert load["cpu_util_pct"] == 99.0 and load["process_cpu_pct"] == 40.0
    assert load["wall_s"] > 0 and "used 40% of one core, of the " in load["contended"]
    recs = row["diagnosis"]["recommendations"]
    assert recs[0].startswith(diagnosis.TUNING_CONTENDED) and "overstate" in recs[0]
    assert row["diagnosis"]["bottleneck"] != "cpu-contended"  # its final run was not
    assert "resolution: Its tuning ran while other processes took the cores" in \
        capsys.readouterr().err
    assert diagnosis.TUNING_CONTENDED in (tmp_path / "out" / "report.md").read_text()
    # shown once, however often the row's diagnosis is advised again (a row taken whole)
    assert scenario.advise_on_tuning_load(row)["diagnosis"]["recommendations"] == recs
    # an idle tuning: figures kept, nothing said
    assert scenario.tuning_load("hpo", [{"wall_s": 30.0, **IDLE}],
                                scenario.TrainConfig(cpu_threads=2))["contended"] is None
    # sessions of a resumed tuning are judged together, weighted by their seconds
    both = scenario.tuning_load("hpo", [{"wall_s": 30.0, **BUSY}, {"wall_s": 10.0, **IDLE}],
                                scenario.TrainConfig(cpu_threads=2))
    assert both["wall_s"] == 40.0 and both["sessions"] == 2
    assert both["cpu_util_pct"] == pytest.approx(86.75) and both["contended"] is None
    assert scenario.tuning_load("hpo", [{"wall_s": 30.0, **BUSY}, {"wall_s": 1.0, **IDLE}],
                                scenario.TrainConfig(cpu_threads=2))["contended"]
    # too short to say (a resumed scenario reading its journal back)
    monkeypatch.setattr(scenario, "MIN_JUDGED_TUNING_S", 5.0)
    assert scenario.tuning_load("hpo", [{"wall_s": 1.0, **BUSY}],
                                scenario.TrainConfig(cpu_threads=2))["contended"] is None


def test_a_resume_of_a_finished_scenario_keeps_its_contended_tuning(small, tmp_path,
                                                                   monkeypatch):
    """review: a finished scenario resumed re-reads its tuning in under MIN_JUDGED_TUNING_S; the
    row written again kept the earlier session's tuning_s but lost its tuning_load's facts."""
    from modules import diagnosis
    state = {"first": True}
    # the first session's tuning was contended; the resumed one's, a moment, read nothing
    argv, _ = watched(monkeypatch, small, tmp_path / "out",
                      lambda tuning: BUSY if tuning and state["first"] else UNREAD)
    assert run_main(*argv) == 0
    first = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert first["tuning_load"]["contended"]
    state["first"] = False
    assert run_main(*argv, "--resume") == 0
    again = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert again["tuning_s"] == pytest.approx(first["tuning_s"])  # the contended seconds stay
    assert again["tuning_load"]["contended"], again["tuning_load"]  # ... and so does the flag
    # the re-read tuned nothing: its load, a moment's, is neither judged nor kept
    assert again["tuning_load"] == first["tuning_load"]
    assert again["diagnosis"]["recommendations"][0].startswith(diagnosis.TUNING_CONTENDED)
    clock = scenario.checkpoint_file(tmp_path / "out", "resolution", scenario.CLOCK_SUFFIX,
                                     first["run_id"])
    assert [load["cpu_util_pct"] for load in read_kept(clock).loads] == [99.0]


def test_a_finished_scenario_resumed_does_not_judge_the_seconds_its_row_leaves_out(
        small, tmp_path, monkeypatch):
    """review: a finished scenario resumed re-reads its tuning, and row_tuning_s keeps the
    earlier row's tuning_s without the re-read's seconds, but the re-read's load was judged
    with the tuning's: a resume on a busy machine flipped a quiet tuning to contended."""
    state = {"first": True, "pause": 0.0}

    def figures(tuning):
        if tuning and not state["first"]:
            time.sleep(state["pause"])  # a long re-read on a busy machine
        return IDLE if state["first"] or not tuning else BUSY
    argv, made = watched(monkeypatch, small, tmp_path / "out", figures)
    assert run_main(*argv) == 0
    first = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert first["tuning_load"]["contended"] is None
    state["first"] = False
    made.clear()
    state["pause"] = 3 * first["tuning_load"]["wall_s"]
    assert run_main(*argv, "--resume") == 0
    again = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert again["tuning_s"] == pytest.approx(first["tuning_s"])  # the re-read not counted
    assert again["tuning_load"] == first["tuning_load"]  # nor judged
    clock = scenario.checkpoint_file(tmp_path / "out", "resolution", scenario.CLOCK_SUFFIX,
                                     first["run_id"])
    assert len(read_kept(clock).loads) == 1  # nor kept for the next resume


def test_an_hpo_row_that_takes_the_resolution_final_keeps_its_own_tuning_load():
    """review: default_if_better's row kept the resolution row's keys: the hpo scenario's own
    tuning_load was dropped (the in-session row has none) or replaced by the resolution
    scenario's (a row read back from results.json), its advice with it."""
    from modules.diagnosis import TUNING_CONTENDED, tuning_contended_advice
    from modules.final_runs import default_if_better

    def row(name, val, load, recs):
        return {"scenario": name, "val_acc": val, "test_acc": val, "epochs": 2, "wall_s": 10.0,
                "prepare_s": 1.0, "tuning_s": 20.0, "total_s": 31.0,
                "settings": {"weights": "w"}, "history": [], "tuning_load": load,
                "diagnosis": {"bottleneck": "compute-bound", "summary": "",
                              "recommendations": recs}}
    summary = {"default_reused_from": "resolution", "keeps_default": True}
    hpo = {**row("hpo", 0.5, {"contended": "busy (hpo)"},
                 [tuning_contended_advice("busy (hpo)"), "x"]), "hpo": dict(summary)}
    taken = row("resolution", 0.6, None, ["y"])
    del taken["tuning_load"]  # tuned["final"]'s copy is made before the row gets one
    kept = scenario.advise_on_tuning_load(default_if_better(hpo, {"scenario": "resolution",
                                                                  "row": taken}))
    assert kept["final_from"] == "resolution"
    assert kept["tuning_load"] == {"contended": "busy (hpo)"}
    assert kept["diagnosis"]["recommendations"][0].startswith(TUNING_CONTENDED)
    # from results.json: the resolution row's own tuning_load and advice are not the hpo's
    taken = row("resolution", 0.6, {"contended": "busy (res)"},
                [tuning_contended_advice("busy (res)"), "y"])
    hpo = {**row("hpo", 0.5, {"contended": None}, ["x"]), "hpo": dict(summary)}
    kept = scenario.advise_on_tuning_load(default_if_better(hpo, {"scenario": "resolution",
                                                                  "row": taken}))
    assert kept["tuning_load"] == {"contended": None}
    assert kept["diagnosis"]["recommendations"] == ["y"]


def test_a_tuning_left_at_the_default_thread_count_is_judged_by_the_threads_it_ran(monkeypatch):
    """review: config.cpu_threads None read as every core: one thread beside a one-core load,
    not slowed, read as contended ('of the 200% its 2 threads could')."""
    from modules import diagnosis
    monkeypatch.setattr(diagnosis, "THRESHOLDS", diagnosis.Thresholds())  # conftest's off
    monkeypatch.setattr(scenario, "usable_cpus", lambda: 2)
    monkeypatch.setattr(scenario.torch, "get_num_threads", lambda: 1)
    load = scenario.tuning_load("resolution", [{"wall_s": 30.0, "cpu_util_pct": 97.0,
                                                "process_cpu_pct": 95.0}],
                                scenario.TrainConfig(cpu_threads=None, cache_decoded=True))
    assert load["contended"] is None, load


def test_a_resume_of_an_interrupted_final_run_keeps_its_contended_tuning(small, tmp_path,
                                                                         monkeypatch):
    """review: tuned (contended) in one session, the final run stopped, finished in the next:
    the row's tuning_s counts the first session's tuning, its tuning_load only the second's."""
    from modules import checkpoints
    state = {"first": True}
    argv, _ = watched(monkeypatch, small, tmp_path / "out",
                      lambda tuning: BUSY if tuning and state["first"] else UNREAD)
    real = checkpoints.CheckpointSaver.save

    def save_then_stop(self, *a, **k):
        real(self, *a, **k)
        if self.path is not None and self.path.name == "resolution.pt":  # the final run's
            raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(checkpoints.CheckpointSaver, "save", save_then_stop)
        assert run_main(*argv) != 0
    state["first"] = False
    assert run_main(*argv, "--resume") == 0
    row = json.loads((tmp_path / "out" / "results.json").read_text())[0]
    assert row["tuning_load"]["contended"], (row["tuning_s"], row["tuning_load"])
    assert row["tuning_load"]["sessions"] == 1  # the resumed session only read the tuning back
