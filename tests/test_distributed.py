"""torchrun with two CPU processes on gloo: data-parallel training and tuning, sharded data,
outputs from rank 0."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_folder, run_path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "pipeline.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_two_processes_train_one_model(tmp_path):
    data = make_folder(tmp_path / "d", n_train=12, n_test=4)
    out = tmp_path / "out"
    proc = torchrun("--scenarios", "baseline", "--data-dir", str(data), "--epochs", "2",
                    "--image-size", "32", "--batch-size", "4", "--weights", "none",
                    "--no-progress", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[:3000]  # the ranks' own lines come first
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 1 and rows[0]["settings"]["world_size"] == 2
    assert len(rows[0]["history"]) == 2 and 0 <= rows[0]["test_acc"] <= 1
    assert (run_path(out) / "baseline.pt").exists() and (out / "d_model.pt").exists()
    assert len(list((run_path(out, "runs") / "baseline").glob("events.out.tfevents.*"))) == 1
    assert proc.stderr.count("info: epoch 2/2") == 1  # one set of logs


def test_all_three_scenarios_run_under_torchrun(tmp_path):
    """Resolution and hpo tune data-parallel: rank 0 measures the speed knobs and runs the
    study, every trial trains on both ranks, and one set of results and logs comes out."""
    data = make_folder(tmp_path / "d", n_train=16, n_test=4)
    out = tmp_path / "out"
    proc = torchrun("--data-dir", str(data), "--epochs", "2", "--image-size", "32",
                    "--resolutions", "32,40", "--n-trials", "2", "--batch-size", "4",
                    "--weights", "none", "--no-progress", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline", "resolution", "hpo"]
    assert all(r["settings"]["world_size"] == 2 for r in rows)
    assert {t["image_size"] for t in rows[1]["resolution_trials"]} == {32, 40}
    assert rows[2]["hpo"]["n_trials"] == 2
    threads = rows[1]["autotune"]["knobs"]["cpu_threads"]
    assert "torchrun" in threads["reason"]
    assert proc.stderr.count("autotune: measuring the speed knobs") == 1  # rank 0's alone
    assert proc.stderr.count("trial 1 ") == 1  # one study, on rank 0
    assert "Traceback" not in proc.stderr


def _two_ranks_against_one(tmp_path, *extra: str) -> list[dict]:
    """Both ranks' saved weights, after checking they equal each other and one process's."""
    script = str(ROOT / "tests" / "helpers" / "ddp_same_as_one_process.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    one = subprocess.run([sys.executable, script, str(tmp_path / "one"), "8"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", script, str(tmp_path / "two"), "4", *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    single = torch.load(tmp_path / "one.rank0.pt")
    ranks = [torch.load(tmp_path / f"two.rank{r}.pt") for r in (0, 1)]
    for name, value in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        assert torch.allclose(ranks[0]["weights"][name], value, atol=1e-5), name
    assert ranks[0]["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert ranks[1]["val_loss"] == ranks[0]["val_loss"]
    return ranks


def test_data_parallel_training_matches_one_process_over_the_same_global_batch(tmp_path):
    """Each rank trains on its half of every global batch, with gradient accumulation (averaged
    once per optimizer step) and sharded evaluation: the ranks end with identical weights, equal
    to one process's over the whole batches. Without gradient averaging the ranks would part
    ways; without the summed evaluation the validation losses would differ."""
    ranks = _two_ranks_against_one(tmp_path)
    assert [r["oom_recoveries"] for r in ranks] == [0, 0]


def test_one_rank_out_of_memory_recovers_and_the_ranks_stay_in_step(tmp_path):
    """Rank 1 alone runs out of memory mid-step: it replays its micro-batches in halves, the
    other rank waits at the gradient average, and both still end as one process would."""
    ranks = _two_ranks_against_one(tmp_path, "1")
    assert [r["oom_recoveries"] for r in ranks] == [0, 1]
