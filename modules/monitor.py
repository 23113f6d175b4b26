"""The machine while a scenario trains: a background sampler of CPU, RAM and, on NVIDIA GPUs,
utilisation, memory and energy (NVML; RAPL for the CPU package where readable)."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from modules.config import UserError

log = logging.getLogger(__name__)
_MB = 2**20  # bytes


_RAPL_DIR = Path("/sys/class/powercap/intel-rapl:0")  # CPU package 0 (the whole socket)


CHILD_USS_EVERY_S = 5.0


class SystemSampler:
    """A daemon thread that samples CPU, RAM, GPU and energy use every `interval_s` seconds.

    Use as a context manager (or start()/stop()) around one scenario, then read `summary()`.
    cuda_device: CUDA index whose GPU to watch through NVML (`nvidia-ml-py`); None for CPU runs.
    """

    def __init__(self, interval_s: float = 0.5, *, cuda_device: int | None = None):
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s)
                and interval_s > 0):
            raise UserError(f"sampler interval_s must be a number > 0, but got {interval_s=}.")
        self.interval_s = float(interval_s)
        self.cuda_device = cuda_device
        self._proc = psutil.Process()  # this process, and the workers it starts
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        # (pid, create_time) -> _cpu_readings' tuple, for each process of the tree
        self._cpu_times: dict[tuple[int, float | None], tuple[float, float, bool, bool]] = {}
        self._pending_s = 0.0  # last readings of processes gone, not yet in a waiter's
        self._before: set[tuple[int, float | None]] = set()  # children running at start()
        # each child's own pages (USS) as a share of its RSS, and when it was read
        self._child_own: dict[tuple[int, float | None], tuple[float, float]] = {}
        self._machine_pct_s = 0.0    # machine-wide busy % x seconds, for a time-weighted mean
        self._process_cpu_s = 0.0    # CPU seconds of process + children since start
        self._wall_s = 0.0
        self._rss_peak = 0           # bytes
        self._gpu_util: list[float] = []
        self._gpu_mem_peak: int | None = None  # bytes
        self._n = 0
        self._errors = 0
        self._nvml = self._gpu = None
        self._gpu_energy0: int | None = None   # mJ
        self._gpu_energy_j: float | None = None
        self._rapl_j: float | None = None      # joules summed across counter wraps
        self._rapl_last: int | None = None     # uJ
        self._rapl_max: int | None = None      # uJ

    # -- lifecycle

    def __enter__(self) -> SystemSampler:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.stop()
        return False

    def start(self) -> SystemSampler:
        if self._thread is not None:
            return self
        self._reset()
        self._halt.clear()
        psutil.cpu_percent(interval=None, percpu=True)  # primes it: its first reading is 0
        # Children already running (the notebook's TensorBoard, an earlier scenario's loader
        # workers) are not this scenario's: their memory and CPU time are left out.
        self._before = {(p.pid, _created(p)) for p in self._tree()[1:]}
        self._cpu_times = self._cpu_readings()  # baseline: count only CPU from now on
        self._open_energy()
        self._t_last = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="SystemSampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        """Stop sampling (taking one last sample, so even short scenarios have one); summary()."""
        thread, self._thread = self._thread, None
        if thread is None:
            return self.summary()
        self._halt.set()
        thread.join(timeout=5 * self.interval_s + 1)
        self._sample()
        self._close_energy()
        return self.summary()

    def _run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self._sample()

    # -- one reading

    def _sample(self) -> None:
        """Never raises: a failed reading is counted and skipped, the training thread carries on.
        Each source fails alone, so a GPU hiccup does not lose the CPU reading."""
        with self._lock:
            now = time.perf_counter()
            dt, self._t_last = now - self._t_last, now
            ok = self._try(self._read_cpu, dt)
            self._try(self._read_gpu)
            self._try(self._read_rapl)
            self._n += ok

    def _try(self, read, *args) -> bool:
        try:
            read(*args)
            return True
        except Exception as err:
            self._errors += 1
            if self._errors == 1:
                log.debug("sampler: a reading failed (%s: %s)", type(err).__name__, err)
            return False

    def _read_cpu(self, dt: float) -> None:
        machine_pct = _busy_pct(psutil.cpu_percent(interval=None, percpu=True))
        self._process_cpu_s += self._cpu_delta()
        self._rss_peak = max(self._rss_peak, self._tree_rss())
        self._machine_pct_s += machine_pct * dt
        self._wall_s += dt

    def _tree(self) -> list[psutil.Process]:
        """This process and the children it started since start()."""
        try:
            children = self._proc.children(recursive=True)
        except psutil.Error:
            return [self._proc]
        return [self._proc, *(p for p in children if (p.pid, _created(p)) not in self._before)]

    def _cpu_readings(self) -> dict[tuple[int, float | None], tuple[float, float, bool, bool]]:
        """(own CPU seconds, waited-for children's, foreign, a child of this process) of this
        process and all its children. Foreign: running at start() (not this scenario's), or
        started since by one that was."""
        try:
            tree = [self._proc, *self._proc.children(recursive=True)]
        except psutil.Error:
            tree = [self._proc]
        keys = {p.pid: (p.pid, _created(p)) for p in tree}
        parents = {}
        for p in tree:
            try:
                parents[p.pid] = p.ppid()
            except psutil.Error:  # gone meanwhile
                pass
        out = {}
        for p in tree:
            try:  # workers may exit between listing and reading
                t = p.cpu_times()
            except (psutil.Error, AttributeError):  # AttributeError: no children's times here
                continue
            key, parent = keys[p.pid], parents.get(p.pid)
            foreign = key in self._before
            while not foreign and parent in keys and parent != self._proc.pid:
                foreign, parent = keys[parent] in self._before, parents.get(parent)
            out[key] = (t.user + t.system, t.children_user + t.children_system, foreign,
                        parents.get(p.pid) == self._proc.pid)
        return out

    def _cpu_delta(self) -> float:
        """CPU seconds the process tree used since the last reading: the own CPU of this
        process and of the children it started since start(), and what those waited for (the
        loaders' workers, joined every epoch) used after their last reading. A process that
        exits between readings shows its whole time, once waited for, in its waiter's
        children's times; the last reading it had (counted already) is taken off that growth.
        A child first seen now was born after start(), so all its CPU time counts. Children
        running at start(), and what they start, are not this scenario's; one of them that
        ends adds the tail it used after its last reading, up to interval_s."""
        now = self._cpu_readings()
        own = reaped = 0.0
        for key, (own_s, reaped_s, foreign, _) in now.items():
            if foreign:
                continue
            last_own, last_reaped = self._cpu_times.get(key, (0.0, 0.0, False, False))[:2]
            own += own_s - last_own
            reaped += reaped_s - last_reaped
        for key in [k for k in self._cpu_times if k not in now]:
            own_s, reaped_s, foreign, ours = self._cpu_times.pop(key)
            # Its whole time arrives in its waiter's reading: counted there, less this, when
            # the waiter is this scenario's; an orphan still alive elsewhere never arrives.
            if (ours or not foreign) and not _alive(key):
                self._pending_s += own_s + reaped_s
        counted = min(max(reaped, 0.0), self._pending_s)
        self._pending_s -= counted
        self._cpu_times.update(now)
        return max(own + reaped - counted, 0.0)

    def _tree_rss(self) -> int:
        """This process's resident memory and what its children hold of their own. A forked
        DataLoader worker's RSS counts every page it still shares with its parent: summed,
        two workers read 2335 MB where 0 workers read 1124 MB. A child's own pages (USS) are
        read at most every CHILD_USS_EVERY_S (each reading walks its page tables, tens of ms
        for a process of a GB), and its RSS scaled by its last such reading in between."""
        total, now = 0, time.monotonic()
        tree = self._tree()
        for p in tree:
            try:
                rss = p.memory_info().rss
                if p is tree[0]:
                    total += rss
                    continue
                key = (p.pid, _created(p))
                share, at = self._child_own.get(key, (None, -math.inf))
                if share is None or now - at >= CHILD_USS_EVERY_S:
                    try:
                        share = p.memory_full_info().uss / max(1, rss)
                    except psutil.AccessDenied:  # a platform that will not tell: all of it
                        share = 1.0
                    self._child_own[key] = (share, now)
                total += int(rss * share)
            except psutil.Error:
                pass
        return total

    # -- GPU (NVML) and energy

    def _open_energy(self) -> None:
        if self.cuda_device is not None:
            try:
                import pynvml  # from the nvidia-ml-py package
                pynvml.nvmlInit()
                self._nvml = pynvml
                self._gpu = _nvml_handle(pynvml, self.cuda_device)
            except Exception as err:
                log.info("sampler: no GPU readings (NVML unavailable: %s: %s)",
                         type(err).__name__, err)
                if self._nvml is not None:  # initialised, but no handle: undo the init
                    try:
                        self._nvml.nvmlShutdown()
                    except Exception:
                        pass
                self._nvml = self._gpu = None
        if self._gpu is not None:
            try:  # Volta and newer; mJ since the driver loaded
                self._gpu_energy0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._gpu)
            except Exception:
                self._gpu_energy0 = None
            return
        if self.cuda_device is not None:  # a GPU run without NVML: the CPU's figure is not its
            self._rapl_j = self._rapl_last = self._rapl_max = None
            return
        try:  # RAPL is often root-only; unreadable means no energy figure, not an error
            self._rapl_max = int((_RAPL_DIR / "max_energy_range_uj").read_text())
            self._rapl_last = int((_RAPL_DIR / "energy_uj").read_text())
            self._rapl_j = 0.0
        except (OSError, ValueError):
            self._rapl_j = self._rapl_last = self._rapl_max = None

    def _read_gpu(self) -> None:
        if self._gpu is None:
            return
        nvml = self._nvml
        # Apart: NVML reports no utilisation on a MIG slice, and the memory peak stays.
        self._try(lambda: self._gpu_util.append(
            float(nvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)))
        used = int(nvml.nvmlDeviceGetMemoryInfo(self._gpu).used)
        self._gpu_mem_peak = used if self._gpu_mem_peak is None else max(self._gpu_mem_peak, used)

    def _read_rapl(self) -> None:
        # Read every sample, not just at the ends: the counter wraps (every ~40 min at 100 W),
        # and one wrap per interval is the most a delta can undo.
        if self._rapl_last is None:
            return
        now = int((_RAPL_DIR / "energy_uj").read_text())
        delta = now - self._rapl_last
        if delta < 0:
            delta += self._rapl_max
        self._rapl_j += delta / 1e6
        self._rapl_last = now

    def _close_energy(self) -> None:
        if self._gpu is None:
            return
        try:
            if self._gpu_energy0 is not None:
                end = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._gpu)
                self._gpu_energy_j = (end - self._gpu_energy0) / 1e3
        except Exception:
            self._gpu_energy_j = None
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def summary(self) -> dict[str, Any]:
        """Means are time-weighted over the sampled span. None means not measured, never 0."""
        with self._lock:
            wall = self._wall_s
            # The GPU's own counter when watching a GPU (even if unsupported or unreadable: no
            # CPU figure stands in for it), else the CPU package's.
            energy = self._gpu_energy_j if self._gpu is not None else self._rapl_j
            return {
                "cpu_util_pct": self._machine_pct_s / wall if wall > 0 else None,
                "process_cpu_pct": 100 * self._process_cpu_s / wall if wall > 0 else None,
                "process_cpu_s": self._process_cpu_s,
                "ram_peak_mb": self._rss_peak / _MB if self._n else None,
                "gpu_util_pct": sum(self._gpu_util) / len(self._gpu_util) if self._gpu_util
                else None,
                "gpu_mem_peak_mb": self._gpu_mem_peak / _MB if self._gpu_mem_peak is not None
                else None,
                "energy_j": energy,
                "n_samples": self._n,
            }


def _busy_pct(per_cpu: list[float]) -> float:
    """How busy the CPUs this process may run on were (taskset, a cpuset), in percent: the
    others' idle time would hide another load on these (the diagnosis' cpu-contended)."""
    try:
        mine = [per_cpu[i] for i in os.sched_getaffinity(0) if i < len(per_cpu)]
    except (AttributeError, OSError):  # macOS, Windows: no affinity to read
        mine = []
    mine = mine or per_cpu
    return sum(mine) / len(mine) if mine else 0.0


def _alive(key: tuple[int, float | None]) -> bool:
    """Whether the process of `key` (pid, create_time) still runs (re-parented elsewhere)."""
    try:
        return psutil.Process(key[0]).create_time() == key[1]
    except psutil.Error:
        return False


def _created(process: psutil.Process) -> float | None:
    try:
        return process.create_time()
    except psutil.Error:  # gone already
        return None


def _nvml_handle(pynvml, cuda_index: int):
    """NVML numbers GPUs by PCI order, CUDA by CUDA_VISIBLE_DEVICES: match them by PCI bus id."""
    try:
        props = torch.cuda.get_device_properties(cuda_index)
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
