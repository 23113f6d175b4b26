"""The device and the process: which device a run uses, its autocast dtype, the process-wide
settings a config asks for, and the profiler regions a step is split into. The bottom layer:
everything that trains or measures imports it; it imports only the config and the CPU
allocator."""
from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import record_function

from modules import hostmem
from modules.config import TrainConfig, UserError, first_line

log = logging.getLogger(__name__)

STARTUP_THREADS = torch.get_num_threads()
_own_threads = STARTUP_THREADS  # the count a run found (process_settings_kept)
_kept = 0  # process_settings_kept blocks now open


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU here "
                        "(use --device auto or cpu).")
    return torch.device(name)


def library_device(device) -> torch.device:
    """A `device` argument of the library's functions (load_model, predict): a torch.device or
    its name ("cpu", "cuda:0", "auto"); one that does not exist here is a one-line UserError."""
    if isinstance(device, str) and device.strip() == "auto":
        return resolve_device("auto")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"device {device!r} is not one PyTorch knows ({first_line(exc)}).") \
            from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (
            device.index is not None and device.index >= torch.cuda.device_count())):
        raise UserError(f"device {str(device)!r} was asked for, but PyTorch sees "
                        f"{torch.cuda.device_count()} CUDA GPU(s) here (use 'cpu' or 'auto').")
    # Any other type would fail inside model.to() with its own traceback, and "meta" would
    # empty the model's weights there first.
    if device.type not in ("cpu", "cuda") and not (
            device.type == "mps" and torch.backends.mps.is_available() or
            device.type == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise UserError(f"device {str(device)!r} is not one that can run a model here "
                        "(use 'cpu', 'cuda' or 'auto').")
    return device


# The record_function regions each training step is split into (in a trace, and in TensorBoard).
REGIONS = ("data_wait", "h2d", "forward", "backward", "optimizer_step")


def region(name: str):
    """A named profiler region (record_function) while a profiler records, else nothing:
    one costs about 5 us of host time even when nothing records it (0.3 us this way), 25 us
    per step for the five, a share a launch-bound GPU step of a few milliseconds feels."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def apply_process_settings(config: TrainConfig, device: torch.device) -> None:
    """The process-wide knobs of `config`, on purpose: CPU threads, the CPU allocator
    (modules.hostmem) and, on a GPU, cuDNN's algorithm search."""
    # A scenario without a thread count of its own (the baseline after a tuned one, a
    # notebook's next run) gets the one the run found (a notebook's torch.set_num_threads in
    # a cell before), not the last one tuned.
    torch.set_num_threads(config.cpu_threads if config.cpu_threads is not None
                          else _own_threads)
    try:
        hostmem.apply(config.cpu_allocator)
    except RuntimeError as exc:
        raise UserError(str(exc)) from None
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = config.cudnn_benchmark


@contextmanager
def process_settings_kept() -> Iterator[None]:
    """The process-wide knobs (apply_process_settings) as they were, put back however the block
    ends: after a run from a notebook, the user's next cell ran with the last scenario's tuned
    thread count, allocator and cuDNN search, not the ones it had set. Inside, a scenario
    without a thread count of its own trains with the count found here."""
    global _own_threads, _kept
    threads, allocator = torch.get_num_threads(), hostmem.current()
    benchmark = torch.backends.cudnn.benchmark
    before, _own_threads = _own_threads, threads
    _kept += 1
    try:
        yield
    finally:
        _kept -= 1
        _own_threads = before
        torch.set_num_threads(threads)
        hostmem.apply(allocator)  # the allocator it ran with: switching back is possible
        torch.backends.cudnn.benchmark = benchmark


def settings_kept_by_caller():
    """process_settings_kept() for a library call made outside a run (fit from a user's
    script), whose thread count the caller may have set after import; inside a run, where the
    run keeps them, nothing."""
    return process_settings_kept() if _kept == 0 else nullcontext()


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for an --amp mode on a device; None means full fp32."""
    if amp == "off":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise UserError("--amp fp16 needs a CUDA GPU; on CPU use --amp off or bf16.")
        return torch.float16
    if amp == "bf16":
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
            _warn_emulated_bf16(torch.cuda.get_device_name(device))
        return torch.bfloat16
    # auto: bf16 on Ampere and newer (no GradScaler needed), fp16 + GradScaler on older GPUs
    # such as the T4. On CPU autocast stays off: without native bf16 units it is several times
    # slower (docs/speed.md); the autotuner races bf16 against fp32 on each machine.
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    return None


@functools.cache
def _warn_emulated_bf16(gpu: str) -> None:
    """Once a GPU: a run resumed on an older GPU keeps the bf16 its settings were saved with."""
    log.warning("--amp bf16 on %s: GPUs before Ampere (compute capability 8) have no bf16 "
                "units, so it is emulated and slower than --amp fp16 or auto", gpu)


def native_bf16_cpu() -> bool:
    """Whether /proc/cpuinfo lists native bf16 units (AVX512-BF16 or AMX-BF16) that PyTorch
    may use: not when its kernels are capped below AVX-512 (ATEN_CPU_CAPABILITY=avx2), nor
    when oneDNN's are (ONEDNN_MAX_CPU_ISA=AVX2), which run the convolutions. A hint only:
    measured speed with and without bf16 autocast is what counts. False off Linux."""
    if not torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512"):
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):  # a build without oneDNN: ATen's check alone
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


# A container's CPU quota, as (quota, period) files: cgroup v2 ("max 100000" is none), then v1
# (a quota of -1 is none). Docker's --cpus and Kubernetes' limits set it, not the affinity.
CGROUP_CPU_FILES = (("/sys/fs/cgroup/cpu.max", None),
                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpus() -> int | None:
    """The CPUs a container's quota allows (rounded up), or None where none is set or read."""
    for quota_file, period_file in CGROUP_CPU_FILES:
        try:
            fields = Path(quota_file).read_text().split()
            if period_file is not None:
                fields = [fields[0], Path(period_file).read_text().strip()]
            quota, period = (int(f) for f in fields[:2])
        except (OSError, ValueError, IndexError):
            continue  # "max", absent, unreadable
        return math.ceil(quota / period) if quota > 0 and period > 0 else None
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (narrowed by taskset, cpusets and
    containers), or every CPU where the platform has none (macOS, Windows), within a
    container's CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpus()
    return max(1, min(cpus, quota)) if quota else cpus
