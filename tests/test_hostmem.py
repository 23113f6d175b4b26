"""The CPU allocator knob: "retain" keeps freed memory in the process, so a step that frees and
re-allocates its activations stops paying a page fault per page, every step."""
from __future__ import annotations

import resource

import pytest
import torch

from modules import hostmem
from modules.config import TrainConfig, UserError
from modules.trainer import apply_allocator

glibc = pytest.mark.skipif(hostmem.candidates() == ["system"], reason="needs glibc malloc")


@pytest.fixture(autouse=True)
def system_afterwards():
    yield
    hostmem.apply("system")


def _faults_per_cycle(cycles: int = 4, mb: int = 64) -> float:
    """Minor page faults per allocate-touch-free cycle of an `mb` MiB tensor (an activation)."""
    torch.empty(mb << 18).fill_(1.0)  # the first cycle may fault under any setting
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        torch.empty(mb << 18).fill_(1.0)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / cycles


@glibc
def test_retain_stops_the_page_faults_of_a_reallocated_block():
    hostmem.apply("system")
    pages = (64 << 20) // resource.getpagesize()
    assert _faults_per_cycle() > 0.5 * pages  # returned to the kernel and faulted back in
    hostmem.apply("retain")
    assert hostmem.current() == "retain"
    assert _faults_per_cycle() < 0.01 * pages  # reused in place


@glibc
def test_switching_back_returns_the_memory():
    hostmem.apply("retain")
    _faults_per_cycle()
    hostmem.apply("system")
    assert hostmem.current() == "system"
    assert _faults_per_cycle() > 0.5 * (64 << 20) / resource.getpagesize()


def test_a_bad_setting_is_a_one_line_error():
    with pytest.raises(UserError, match="cpu_allocator must be one of"):
        TrainConfig(cpu_allocator="jemalloc")


def test_retain_without_glibc_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(hostmem, "_libc", False)
    assert hostmem.candidates() == ["system"]
    with pytest.raises(UserError, match="needs glibc"):
        apply_allocator("retain")
    apply_allocator("system")  # nothing to change: fine everywhere
