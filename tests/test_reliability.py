"""Faults tried on purpose: kill -9 mid-run then --resume, bad option values, bad input files."""
from __future__ import annotations

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
from conftest import COLOURS, make_folder, write_image
from modules.config import UserError
from modules.dataset import index_dataset

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--scenarios", "baseline", "--epochs", "5", "--image-size", "64", "--batch-size", "4",
       "--weights", "none", "--no-progress"]


def command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "pipeline.py", "--data-dir", str(data), "--output-dir", str(out),
            *RUN, *extra]


def checkpoint_epoch(out: Path) -> int:
    try:
        return torch.load(out / "checkpoints" / "baseline.pt", weights_only=True)["epoch"]
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


@pytest.mark.parametrize("kill_after_epoch", [0, 1, 3])
def test_kill_9_then_resume_ends_like_an_uninterrupted_run(data, uninterrupted, tmp_path,
                                                           kill_after_epoch):
    out = tmp_path / "out"
    proc = subprocess.Popen(command(data, out), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while checkpoint_epoch(out) < kill_after_epoch and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if kill_after_epoch == 0:
        time.sleep(3)  # somewhere in start-up or the first epoch
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "results.json").exists()
    reached = checkpoint_epoch(out)  # the last checkpoint is always readable
    resumed = run_to_end(data, out, "--resume")
    assert resumed["resumed_from_epoch"] == (reached or None)
    assert [r["val_acc"] for r in resumed["history"]] == \
        [r["val_acc"] for r in uninterrupted["history"]]
    assert [r["train_loss"] for r in resumed["history"]] == \
        pytest.approx([r["train_loss"] for r in uninterrupted["history"]], rel=1e-6)
    assert resumed["test_acc"] == uninterrupted["test_acc"]


NUMERIC = ["--epochs", "--image-size", "--batch-size", "--lr", "--grad-accum-steps",
           "--max-grad-norm", "--early-stopping", "--num-workers", "--seed", "--n-trials",
           "--time-budget", "--resolutions"]


@pytest.mark.parametrize("option", NUMERIC)
@pytest.mark.parametrize("value", ["0", "-1", "99999999999", "1e400", "abc", ""])
def test_every_numeric_option_is_used_or_refused_in_one_line(option, value, tmp_path):
    try:
        pipeline.parse_args([option, value, "--output-dir", str(tmp_path)])
    except UserError as err:
        assert "\n" not in str(err) and option.lstrip("-").replace("-", "_") in \
            str(err).replace("-", "_")


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
    os.symlink(root / "train" / "blue", root / "train" / "teal")           # followed
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
