"""Where a training step's time goes: a torch.profiler trace of a few steps, a background sampler of
CPU/RAM/GPU/energy use, and `diagnose`, which names the bottleneck and what to change."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from modules.config import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thresholds:
    """Where `diagnose` draws its lines. Fractions are shares of the measured step time."""

    mem_frac: float = 0.90            # peak / limit of device memory above this: memory-bound
    data_wait_frac: float = 0.30      # share of step time blocked in next(loader): input-bound
    h2d_frac: float = 0.15            # share of step time in host-to-device copies: transfer-bound
    tiny_step_ms_cuda: float = 5.0    # CUDA steps shorter than this, ms: launch/Python overhead rules
    tiny_step_ms_cpu: float = 2.0     # CPU steps shorter than this, ms: framework overhead rules
    low_gpu_util_pct: float = 50.0    # GPU busy below this, % of time, ...
    low_data_wait_frac: float = 0.10  # ... while input waits below this share: overhead-bound
    batch_headroom_frac: float = 0.50  # peak / limit below this: a larger batch fits


THRESHOLDS = Thresholds()

BOTTLENECKS = ("input-bound", "transfer-bound", "compute-bound", "memory-bound", "overhead-bound")
KEY_AVERAGES_TXT = "key_averages.txt"
_MB = 2**20  # bytes


# ----------------------------------------------------------------------------- torch.profiler

class TorchProfiler:
    """`torch.profiler.profile` over a few training steps; call `step()` once per step.

    Writes a `*.pt.trace.json` (TensorBoard's profiler plugin, Perfetto, chrome://tracing) and
    `key_averages.txt` (the 40 costliest ops) to trace_dir. enabled=False makes it a no-op.
    """

    def __init__(self, trace_dir: str | os.PathLike, *, enabled: bool = True, wait: int = 1,
                 warmup: int = 1, active: int = 3, repeat: int = 1):
        for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                 ("repeat", repeat, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"profiler {name} must be an integer >= {low}, but got "
                                f"{name}={value!r}.")
        self.trace_dir = Path(trace_dir)
        self.enabled = enabled
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.traces_written = 0
        self.averages = None  # key_averages() of the latest trace, for callers that compare
        self._prof: torch.profiler.profile | None = None
        self._steps = 0

    def __enter__(self) -> TorchProfiler:
        if not self.enabled:
            return self
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        self._cuda = torch.cuda.is_available()
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        self._handler = torch.profiler.tensorboard_trace_handler(str(self.trace_dir))
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup,
                                             active=self.active, repeat=self.repeat),
            record_shapes=True, profile_memory=True, on_trace_ready=self._trace_ready)
        self._prof.__enter__()
        return self

    def step(self) -> None:
        """Mark the end of one training step (drives the wait/warmup/active schedule)."""
        if self._prof is not None:
            self._steps += 1
            self._prof.step()

    def __exit__(self, exc_type, exc, tb) -> bool:
        prof, self._prof = self._prof, None
        if prof is None:
            return False
        try:
            ended_in = prof.current_action
            prof.__exit__(None, None, None)  # exports the trace if the schedule was recording
            if self.traces_written == 0:
                # Warmup events are discarded by design, so a run that never recorded has no
                # trace worth writing: say so rather than leave an empty file.
                phase = "warmup" if ended_in == ProfilerAction.WARMUP else "wait"
                log.info("profiler: the run ended after %d steps, in the %s phase, before any "
                         "recorded step (needs at least %d); no trace written to %s",
                         self._steps, phase, self.wait + self.warmup + 1, self.trace_dir)
        except Exception as err:  # the profile is a side product: never fail the run over it
            log.warning("profiler: could not finish the trace in %s (%s: %s)", self.trace_dir,
                        type(err).__name__, err)
        return False

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        # Written with each trace (not only at exit) so the table always matches the latest trace
        # on disk, even if the run dies later.
        try:
            self._handler(prof)
            self.traces_written += 1
            sort_by = "self_cuda_time_total" if self._cuda else "self_cpu_time_total"
            self.averages = prof.key_averages()
            table = self.averages.table(sort_by=sort_by, row_limit=40)
            (self.trace_dir / KEY_AVERAGES_TXT).write_text(table + "\n")
            log.info("profiler: trace of steps up to %d written to %s", self._steps,
                     self.trace_dir)
        except Exception as err:
            log.warning("profiler: could not write the trace to %s (%s: %s)", self.trace_dir,
                        type(err).__name__, err)


# ----------------------------------------------------------------------------- system sampler

_RAPL_DIR = Path("/sys/class/powercap/intel-rapl:0")  # CPU package 0 (the whole socket)


class SystemSampler:
    """A daemon thread that samples CPU, RAM, GPU and energy use every `interval_s` seconds.

    Use as a context manager (or start()/stop()) around one scenario, then read `summary()`.
    cuda_device: CUDA index whose GPU to watch through NVML (`nvidia-ml-py`); None for CPU runs.
    """

    def __init__(self, interval_s: float = 0.5, *, cuda_device: int | None = None,
                 pid: int | None = None):
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s)
                and interval_s > 0):
            raise UserError(f"sampler interval_s must be a number > 0, but got {interval_s=}.")
        self.interval_s = float(interval_s)
        self.cuda_device = cuda_device
        self._proc = psutil.Process(pid)
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._cpu_times: dict[tuple[int, float], float] = {}  # (pid, create_time) -> CPU seconds
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
        psutil.cpu_percent(interval=None)  # primes it: its first reading is always 0
        for key, cpu_s in self._tree_cpu_times().items():  # baseline: count only CPU from now on
            self._cpu_times[key] = cpu_s
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
        machine_pct = psutil.cpu_percent(interval=None)
        self._process_cpu_s += self._cpu_delta()
        self._rss_peak = max(self._rss_peak, self._tree_rss())
        self._machine_pct_s += machine_pct * dt
        self._wall_s += dt

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self._proc, *self._proc.children(recursive=True)]
        except psutil.Error:
            return [self._proc]

    def _tree_cpu_times(self) -> dict[tuple[int, float], float]:
        out = {}
        for p in self._tree():
            try:  # workers may exit between listing and reading
                t = p.cpu_times()
                out[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def _cpu_delta(self) -> float:
        """CPU seconds the process tree used since the last reading. A child first seen now was
        born after start() (all earlier ones are in the baseline), so all its CPU time counts.
        A child that exits between readings loses its last interval (at most interval_s)."""
        now = self._tree_cpu_times()
        delta = sum(cpu_s - self._cpu_times.get(key, 0.0) for key, cpu_s in now.items())
        self._cpu_times.update(now)
        return max(delta, 0.0)

    def _tree_rss(self) -> int:
        # Summed RSS counts pages a forked worker shares with its parent once per process: an
        # upper bound, but cheap (USS would read every smaps page table).
        total = 0
        for p in self._tree():
            try:
                total += p.memory_info().rss
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
                self._nvml = self._gpu = None
        if self._gpu is not None:
            try:  # Volta and newer; mJ since the driver loaded
                self._gpu_energy0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._gpu)
            except Exception:
                self._gpu_energy0 = None
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
        self._gpu_util.append(float(nvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu))
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
            # The GPU's own counter when watching a GPU (even if unsupported: no CPU figure
            # stands in for it), else the CPU package's.
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


def _nvml_handle(pynvml, cuda_index: int):
    """NVML numbers GPUs by PCI order, CUDA by CUDA_VISIBLE_DEVICES: match them by PCI bus id."""
    try:
        props = torch.cuda.get_device_properties(cuda_index)
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)


# ----------------------------------------------------------------------------- diagnosis

def native_bf16_cpu() -> bool:
    """Whether /proc/cpuinfo lists native bf16 units (AVX512-BF16 or AMX-BF16). A hint only:
    measured speed with and without bf16 autocast is what counts. False off Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def diagnose(figures: dict[str, Any]) -> dict[str, Any]:
    """Name the bottleneck of a run from its measured figures, with 1-3 recommendations.

    Any figure may be missing or None; a rule whose figures are missing is skipped. Returns
    {"bottleneck": one of BOTTLENECKS, "summary": a sentence, "recommendations": [str, ...]}.
    """
    if not isinstance(figures, dict):
        raise UserError(f"diagnose needs a dict of figures, but got {type(figures).__name__}.")
    f = _Figures(figures)
    for rule in (_memory_bound, _input_bound, _transfer_bound, _overhead_bound):
        found = rule(f)
        if found is not None:
            return found
    return _compute_bound(f)


class _Figures:
    """The figures, with NaN/inf and wrong types read as missing."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def num(self, key: str) -> float | None:
        v = self.raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        return float(v)

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    @property
    def cuda(self) -> bool:
        return str(self.raw.get("device") or "").startswith("cuda")


def _pct(frac: float) -> str:
    return f"{100 * frac:.0f}%"


def _step(f: _Figures) -> str:
    ms = f.num("avg_step_ms")
    return f" {ms:.1f} ms" if ms is not None else ""


def _result(bottleneck: str, summary: str, recs: list[str]) -> dict[str, Any]:
    return {"bottleneck": bottleneck, "summary": summary, "recommendations": recs[:3]}


def _memory_bound(f: _Figures) -> dict[str, Any] | None:
    peak, limit = f.num("peak_mem_mb"), f.num("mem_limit_mb")
    retries = f.num("alloc_retries") or 0
    frac = peak / limit if peak is not None and limit else None
    if not ((frac is not None and frac > THRESHOLDS.mem_frac) or retries > 0):
        return None
    used = (f"peak memory {peak:.0f} of {limit:.0f} MB ({_pct(frac)})" if frac is not None
            else "device memory is full")
    retry_txt = f", {retries:.0f} allocator retries" if retries else ""
    batch = f.num("batch_size")
    recs = [f"Lower batch_size{f' from {batch:.0f}' if batch else ''} and raise "
            f"grad_accum_steps to keep the effective batch: {used}{retry_txt}."]
    if f.cuda and f.get("amp_dtype") in (None, "fp32"):
        recs.append(f"Turn on AMP (--amp auto): 16-bit activations take half the memory of fp32; "
                    f"{used}.")
    if retries:
        recs.append(f"Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut fragmentation: "
                    f"the allocator had to free its cache and retry {retries:.0f} times.")
    return _result("memory-bound", f"Memory-bound: {used}{retry_txt}.", recs)


def _input_bound(f: _Figures) -> dict[str, Any] | None:
    wait = f.num("data_wait_frac")
    if wait is None or wait <= THRESHOLDS.data_wait_frac:
        return None
    workers, cores = f.num("num_workers"), f.num("cpu_count")
    setup = ""
    if workers is not None:
        setup = f" with {workers:.0f} worker{'s' if workers != 1 else ''}"
        if cores is not None:
            setup += f" on {cores:.0f} core{'s' if cores != 1 else ''}"
    waits = f"{_pct(wait)} of each{_step(f)} step waits for data{setup}"
    if f.get("cached_decode"):  # no decoding left: the wait is the batched augmentation
        return _result("input-bound", f"Input-bound: {waits}.", [
            f"The decoded cache already skips decoding; the wait is batched augmentation on the "
            f"{'GPU' if f.cuda else 'CPU'}: {waits}. A smaller --image-size shrinks it with the "
            f"model's own work; on a CPU a GPU run moves it off the cores."])
    recs = []
    if workers is None or cores is None or workers < cores:
        target = f" toward {cores:.0f} (one per core)" if cores else " (up to one per core)"
        start = f" from {workers:.0f}" if workers is not None else ""
        recs.append(f"Raise num_workers{start}{target}: {waits}.")
    recs.append(f"Cache the decoded images in memory so later epochs skip JPEG decoding: "
                f"{waits}.")
    recs.append(f"Lower the decode cost: decode JPEGs at reduced size (PIL draft mode) or store "
                f"images pre-resized to the input size ({_pct(wait)} of step time is input).")
    if f.cuda:
        recs.append(f"Move augmentation to the GPU (batched transforms after the copy) to take "
                    f"it off the {cores:.0f} CPU cores." if cores else
                    "Move augmentation to the GPU (batched transforms after the copy).")
    return _result("input-bound", f"Input-bound: {waits}.", recs)


def _transfer_bound(f: _Figures) -> dict[str, Any] | None:
    h2d = f.num("h2d_frac")
    if h2d is None or h2d <= THRESHOLDS.h2d_frac:
        return None
    share = f"{_pct(h2d)} of each{_step(f)} step is spent copying batches to the device"
    recs = [f"Set pin_memory=True and copy with non_blocking=True so the copy overlaps compute: "
            f"{share}.",
            f"Send uint8 images (a quarter of float32's bytes) and convert/normalise on the device: "
            f"{share}."]
    return _result("transfer-bound", f"Transfer-bound: {share}.", recs)


def _overhead_bound(f: _Figures) -> dict[str, Any] | None:
    ms, util, wait = f.num("avg_step_ms"), f.num("gpu_util_pct"), f.num("data_wait_frac")
    tiny = THRESHOLDS.tiny_step_ms_cuda if f.cuda else THRESHOLDS.tiny_step_ms_cpu
    idle_gpu = (f.cuda and util is not None and util < THRESHOLDS.low_gpu_util_pct
                and wait is not None and wait < THRESHOLDS.low_data_wait_frac)
    if not ((ms is not None and ms < tiny) or idle_gpu):
        return None
    why = []
    if ms is not None and ms < tiny:
        why.append(f"each step takes only {ms:.2f} ms (under {tiny:g} ms)")
    if idle_gpu:
        why.append(f"the GPU is busy {util:.0f}% of the time while input waits only {_pct(wait)}")
    why_txt = " and ".join(why)
    batch = f.num("batch_size")
    recs = [f"Raise batch_size{f' from {batch:.0f}' if batch else ''} so fixed per-step costs "
            f"are shared by more samples: {why_txt}."]
    if f.cuda:
        recs.append(f"Try --compile (torch.compile; mode='reduce-overhead' adds CUDA graphs) to cut "
                    f"kernel-launch and Python overhead: {why_txt}.")
    else:
        recs.append(f"Try --compile (torch.compile) to fuse small ops and cut Python overhead: "
                    f"{why_txt}.")
    return _result("overhead-bound", f"Overhead-bound: {why_txt}.", recs)


def _compute_bound(f: _Figures) -> dict[str, Any]:
    wait, rate = f.num("data_wait_frac"), f.num("samples_per_s")
    facts = []
    if wait is not None:
        facts.append(f"input waits only {_pct(wait)} of each{_step(f)} step")
    elif f.num("avg_step_ms") is not None:
        facts.append(f"each step takes{_step(f)}")
    if rate is not None:
        facts.append(f"the model runs at {rate:.0f} samples/s")
    if f.cuda and f.num("gpu_util_pct") is not None:
        facts.append(f"the GPU is busy {f.num('gpu_util_pct'):.0f}% of the time")
    if not facts:
        return _result("compute-bound",
                       "Compute-bound by default: no figures on input, copies or memory were given.",
                       ["Measure the step-time breakdown (data_wait_frac, h2d_frac, avg_step_ms) "
                        "before tuning: without numbers there is nothing to act on."])
    basis = "; ".join(facts)
    summary = f"Compute-bound: {basis}, so the model's arithmetic sets the pace."
    recs = []
    if f.cuda:
        recs += _gpu_compute_recs(f, basis)
    else:
        recs += _cpu_compute_recs(f, basis)
    return _result("compute-bound", summary, recs)


def _cpu_compute_recs(f: _Figures, basis: str) -> list[str]:
    recs = []
    if not f.get("channels_last"):
        recs.append(f"Try channels_last (--channels-last): oneDNN's convolutions on CPU are faster in NHWC layout "
                    f"({basis}).")
    amp, native = f.get("amp_dtype"), f.get("native_bf16")
    if native:
        if amp != "bfloat16":
            recs.append(f"Try --amp bf16: this CPU has native bf16 units (AVX512-BF16/AMX); keep "
                        f"it only if samples/s beats today's ({basis}).")
    elif amp == "bfloat16":
        recs.append(f"Turn bf16 autocast off (--amp off): with no native bf16 on this CPU it is "
                    f"emulated and slower than fp32 ({basis}).")
    else:
        recs.append(f"bf16 autocast would not help: there is no native bf16 here, so it is "
                    f"emulated and slower than fp32 ({basis}).")
    return recs


def _gpu_compute_recs(f: _Figures, basis: str) -> list[str]:
    recs = []
    if f.get("amp_dtype") in (None, "fp32"):
        recs.append(f"Turn on AMP (--amp auto): bf16/fp16 tensor cores run several times faster "
                    f"than fp32 ({basis}).")
    if not f.get("channels_last"):
        recs.append(f"Try channels_last (--channels-last): cuDNN's tensor-core convolutions prefer NHWC ({basis}).")
    peak, limit, batch = f.num("peak_mem_mb"), f.num("mem_limit_mb"), f.num("batch_size")
    if peak is not None and limit and peak / limit < THRESHOLDS.batch_headroom_frac:
        recs.append(f"Raise batch_size{f' from {batch:.0f}' if batch else ''}: only "
                    f"{peak:.0f} of {limit:.0f} MB ({_pct(peak / limit)}) of device memory is used.")
    if not recs:
        recs.append(f"The usual speed knobs are on; a smaller model or input size is what is left "
                    f"({basis}).")
    return recs
