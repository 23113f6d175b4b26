"""The CPU allocator knob: "retain" keeps freed memory in the process, so a step that frees and
re-allocates its activations stops paying a page fault per page, every step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from modules import hostmem
from modules.config import TrainConfig, UserError
from modules.device import apply_process_settings

ROOT = Path(__file__).resolve().parents[1]
glibc = pytest.mark.skipif(hostmem.candidates() == ["system"], reason="needs glibc malloc")


@pytest.fixture(autouse=True)
def system_afterwards():
    yield
    hostmem.apply("system")


PROBE = textwrap.dedent("""
    import json, resource, psutil, torch
    from modules import hostmem

    def faults_per_cycle(cycles, mb=64):
        # minor page faults per allocate-touch-free cycle of an mb MiB tensor (an activation)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(cycles):
            torch.empty(mb << 18).fill_(1.0)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / cycles

    rss = lambda: psutil.Process().memory_info().rss
    out = {"pages": (64 << 20) // resource.getpagesize()}
    faults_per_cycle(2)
    out["system"] = faults_per_cycle(4)
    hostmem.apply("retain")
    faults_per_cycle(16)  # the heap grows until glibc's aligned allocations fit in it
    out["retain"] = faults_per_cycle(4)
    held = rss()
    hostmem.apply("system")
    out["released_mb"] = (held - rss()) / 2**20
    print(json.dumps(out))
""")


def _probe() -> dict:
    """The allocator's effect in a fresh process: an earlier test's retained heap would hide it."""
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@glibc
def test_retain_stops_the_page_faults_of_a_reallocated_block_and_system_gives_it_back():
    figures = _probe()
    pages = figures["pages"]
    assert figures["system"] > 0.5 * pages  # returned to the kernel and faulted back in
    assert figures["retain"] < 0.01 * pages  # reused in place
    assert figures["released_mb"] > 64  # switching back hands the retained heap back


DROP_PROBE = textwrap.dedent("""
    import json, psutil, torch
    from modules import fastdata, hostmem
    hostmem.apply("retain")
    rss = lambda: psutil.Process().memory_info().rss / 2**20
    for size in (64, 96, 128):  # three decoded caches of about 170 MB each
        images = torch.empty(170 * 2**20, dtype=torch.uint8).fill_(1)
        fastdata._MEMO[("train", size)] = images, torch.zeros(3)
    del images
    before = rss()
    fastdata.keep_sizes({64})
    print(json.dumps({"freed_mb": before - rss()}))
""")


@glibc
def test_a_dropped_cache_is_handed_back_under_retain():
    """Under "retain" freed blocks stay in the process: the caches of the sizes a run no
    longer trains at, 340 MB here, stayed resident, unseen by the cache's budget, counted in
    the final run's peak memory."""
    proc = subprocess.run([sys.executable, "-c", DROP_PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["freed_mb"] > 300


def test_a_bad_setting_is_a_one_line_error():
    with pytest.raises(UserError, match="cpu_allocator must be one of"):
        TrainConfig(cpu_allocator="jemalloc")


def test_retain_without_glibc_is_refused_before_any_work(monkeypatch, tmp_path):
    """macOS and Windows have no glibc: the option is refused with the others' checks, not
    after the data was indexed and a run folder made."""
    import pipeline
    monkeypatch.setattr(hostmem, "_libc", False)
    with pytest.raises(UserError, match="--cpu-allocator retain needs glibc.*offers system"):
        pipeline.parse_args(["--cpu-allocator", "retain", "--output-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())
    pipeline.parse_args(["--cpu-allocator", "system", "--output-dir", str(tmp_path)])


def test_retain_without_glibc_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(hostmem, "_libc", False)
    assert hostmem.candidates() == ["system"]
    cpu = torch.device("cpu")
    with pytest.raises(UserError, match="needs glibc"):
        apply_process_settings(TrainConfig(cpu_allocator="retain"), cpu)
    apply_process_settings(TrainConfig(cpu_allocator="system"), cpu)  # nothing to change
