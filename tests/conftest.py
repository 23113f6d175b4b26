"""Shared fixtures: tiny generated image folders and a CPU-only, quiet environment."""
from __future__ import annotations

import dataclasses
import os
import zlib
from pathlib import Path

# Under pytest-xdist (pytest.ini) each worker takes its share of the cores, and so do the
# processes its tests start: two torch processes both spinning on every core run several times
# slower than one after the other. Set before numpy and torch size their thread pools.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

import numpy as np
import pytest
import torch
from PIL import Image

# Tests must never reach the network, even where it exists: every HTTP(S) request, the ImageNet
# weights' download included, goes to a proxy that refuses it at once (a run started as a
# subprocess inherits that), so a test meets the offline fallback on any machine, as in CI.
os.environ.setdefault("KAGGLEHUB_CACHE", "/nonexistent-kagglehub-cache")
for _name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
    os.environ[_name] = "http://127.0.0.1:9"  # the discard port: nothing listens
os.environ["no_proxy"] = os.environ["NO_PROXY"] = "localhost,127.0.0.1"  # the notebook's browser
if "OMP_NUM_THREADS" not in os.environ:  # a caller that sets it wins
    torch.set_num_threads(_THREADS)


@pytest.fixture(scope="session", autouse=True)
def _own_torch_home(tmp_path_factory):
    """No test reads or fills the user's torch.hub cache (~/.cache/torch): weights cached
    there would start a test's models from ImageNet where CI starts them at random."""
    os.environ["TORCH_HOME"] = str(tmp_path_factory.mktemp("torch-home"))


class Recorded(Exception):
    """Raised by record_tuner's stand-in once it has recorded what it was given."""


def record_tuner(monkeypatch) -> dict:
    """scenario.OptunaTuner replaced by a subclass that records what a search is given (its
    keyword arguments, and its start configuration as "base") in the dict returned, then
    raises Recorded instead of searching."""
    import scenario
    seen: dict = {}

    class Tuner(scenario.OptunaTuner):
        def __init__(self, index, base, **kwargs):
            seen.update(kwargs, base=base)
            raise Recorded
    monkeypatch.setattr(scenario, "OptunaTuner", Tuner)
    return seen


def write_image(path: Path, colour: tuple[int, int, int], size: int = 32, mode: str = "RGB",
                fmt: str | None = None, seed: int | None = None) -> Path:
    """A noisy image whose dominant colour carries its class; its noise seeded by the path's
    last three parts unless `seed` is given (the same seed writes the same image: indexing
    leaves out a training copy of a test image)."""
    if seed is None:
        seed = zlib.crc32(os.fsencode("/".join(Path(path).parts[-3:])))
    rng = np.random.default_rng(seed)
    arr = np.clip(np.array(colour)[None, None, :] + rng.normal(0, 25, (size, size, 3)), 0, 255)
    img = Image.fromarray(arr.astype(np.uint8))
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt)
    return path


COLOURS = {"red": (200, 40, 40), "green": (40, 200, 40), "blue": (40, 40, 200)}


def make_folder(root: Path, layout: str = "train/test", n_train: int = 12, n_test: int = 4,
                classes=("red", "green", "blue")) -> Path:
    """An image folder in one of the accepted layouts, learnable from colour."""
    splits = {"intel": {"seg_train/seg_train": n_train, "seg_test/seg_test": n_test},
              "train/test": {"train": n_train, "test": n_test},
              "class folders": {".": n_train + n_test}}[layout]
    for split, n in splits.items():
        for c in classes:
            for i in range(n):
                write_image(root / split / c / f"{i}.jpg", COLOURS[c], seed=zlib.crc32(f"{split}/{c}/{i}".encode()))
    return root


def load_module(path: Path):
    """A script (a benchmark, a test helper) loaded as a module, so that its functions run in
    this process instead of a second Python process that spends seconds importing torch."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh_autotune_choices():
    """Each test starts as a new process does: no speed choice remembered from another test."""
    from modules import autotune
    autotune._RESULTS.clear()


@pytest.fixture(autouse=True)
def _no_contention_reading(monkeypatch):
    """Tests run side by side on a few cores (pytest-xdist): every run is contended there, and
    the diagnosis would say so instead of what a test checks; its own test turns it back on."""
    from modules import diagnosis
    monkeypatch.setattr(diagnosis, "THRESHOLDS", dataclasses.replace(
        diagnosis.THRESHOLDS, busy_machine_pct=float("inf")))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "data")


def run_path(out: Path, kind: str = "checkpoints") -> Path:
    """out/kind/<the newest run's id>: where that run keeps its checkpoints (runs: scalars,
    profiler: traces). A path that does not exist until the run has started."""
    import json
    try:
        run_id = json.loads((Path(out) / "latest_run.json").read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return Path(out) / kind / "no-run-yet"
    return Path(out) / kind / run_id
