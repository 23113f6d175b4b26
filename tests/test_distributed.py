"""torchrun with two CPU processes on gloo: DDP training, sharded data, outputs from rank 0."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import make_folder

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
    assert (out / "checkpoints" / "baseline.pt").exists() and (out / "d_model.pt").exists()
    assert len(list((out / "runs" / "baseline").glob("events.out.tfevents.*"))) == 1  # rank 0
    assert proc.stderr.count("info: epoch 2/2") == 1  # one set of logs


def test_tuning_under_torchrun_is_refused_in_one_line(tmp_path):
    data = make_folder(tmp_path / "d", n_train=4, n_test=2)
    proc = torchrun("--scenarios", "hpo", "--data-dir", str(data), "--output-dir",
                    str(tmp_path / "out"))
    assert proc.returncode != 0
    assert "error: under torchrun only --scenarios baseline runs so far" in proc.stderr
    assert "Traceback" not in proc.stderr.split("error:")[0]
