"""Smoke tests: the benchmarks run and write their figures (their targets are not tested here)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_timing_overhead_benchmark_runs(tmp_path):
    out = tmp_path / "ovh.json"
    subprocess.run([sys.executable, "benchmarks/timing_overhead.py", "--image-size", "32",
                    "--batch-size", "4", "--rounds", "2", "--json", str(out)], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["instrumentation_us_per_step"] > 0 and result["bare_step_ms"] > 0
    assert 0 < result["overhead_frac"] < 1
