"""The bottleneck of a run, named from its measured figures, with what to change."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from modules.config import UserError
from modules.selection import MIN_GAIN


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
    fixed_step_frac: float = 0.50     # CPU: the part of a step that does not grow with the
                                      # batch above this share: overhead-bound
    busy_machine_pct: float = 90.0    # the whole CPU busy above this, % of time, while ...
    own_cpu_frac: float = 0.60        # ... the run's processes used below this share of what
                                      # its threads could: other processes took the cores


THRESHOLDS = Thresholds()

BOTTLENECKS = ("input-bound", "transfer-bound", "compute-bound", "memory-bound", "overhead-bound",
               "cpu-contended")


def diagnose(figures: dict[str, Any]) -> dict[str, Any]:
    """Name the bottleneck of a run from its measured figures, with 1-3 recommendations.

    Any figure may be missing or None; a rule whose figures are missing is skipped. Returns
    {"bottleneck": one of BOTTLENECKS, "summary": a sentence, "recommendations": [str, ...]}.
    """
    if not isinstance(figures, dict):
        raise UserError(f"diagnose needs a dict of figures, but got {type(figures).__name__}.")
    f = _Figures(figures)
    for rule in (_memory_bound, _contended, _input_bound, _transfer_bound, _overhead_bound):
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


def _count(n: float, what: str) -> str:
    return f"{n:.0f} {what}{'' if n == 1 else 's'}"


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
    if f.cuda and f.get("amp_dtype") in (None, "fp32") and not _amp_slower(f)[1]:
        recs.append(f"Turn on AMP (--amp auto): 16-bit activations take half the memory of fp32; "
                    f"{used}.")
    if retries:
        recs.append(f"Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut fragmentation: "
                    f"the allocator had to free its cache and retry {retries:.0f} times.")
    return _result("memory-bound", f"Memory-bound: {used}{retry_txt}.", recs)


def _input_bound(f: _Figures) -> dict[str, Any] | None:
    """Input waits take much of each step; or a GPU busy less than half the time, whose steps
    wait for data and copies together that much (neither alone crossed its line)."""
    wait, copy, util = f.num("data_wait_frac"), f.num("h2d_frac"), f.num("gpu_util_pct")
    starved = (f.cuda and wait is not None and copy is not None and util is not None
               and util < THRESHOLDS.low_gpu_util_pct
               and wait + copy > THRESHOLDS.data_wait_frac)
    if wait is None or (wait <= THRESHOLDS.data_wait_frac and not starved):
        return None
    workers, cores = f.num("num_workers"), f.num("cpu_count")
    setup = ""
    if workers is not None:
        setup = f" with {_count(workers, 'worker')}"
        if cores is not None:
            setup += f" on {_count(cores, 'core')}"
    waits = f"{_pct(wait)} of each{_step(f)} step waits for data{setup}"
    if wait <= THRESHOLDS.data_wait_frac:  # starved
        waits = (f"the GPU is busy {util:.0f}% of the time while {waits} and "
                 f"{_pct(copy)} for copies to the device")
    if f.get("cached_decode"):  # no decoding left: the wait is the batched augmentation
        return _result("input-bound", f"Input-bound: {waits}.", [
            f"The decoded cache already skips decoding; the wait is batched augmentation on the "
            f"{'GPU' if f.cuda else 'CPU'}: {waits}. A smaller --image-size shrinks it with the "
            f"model's own work; on a CPU a GPU run moves it off the cores."])
    recs = []
    more = _more_workers_no_faster(f, workers)
    if more:
        recs.append(f"More loader workers were measured no faster here ({more}): the cores, "
                    f"not the worker count, bound decoding ({waits}).")
    elif workers is None or cores is None or workers < cores:
        target = f" toward {cores:.0f} (one per core)" if cores else " (up to one per core)"
        start = f" from {workers:.0f}" if workers is not None else ""
        recs.append(f"Raise num_workers{start}{target}: {waits}.")
    recs.append(f"Cache the decoded images in memory so later epochs skip JPEG decoding: "
                f"{waits}.")
    recs.append(f"Lower the decode cost: store images pre-resized to the input size, or decode "
                f"JPEGs at reduced size (PIL draft mode) for training and testing alike: it gives "
                f"other pixels ({_pct(wait)} of step time is input).")
    if f.cuda:
        recs.append(f"Move augmentation to the GPU (batched transforms after the copy) to take "
                    f"it off the {cores:.0f} CPU cores." if cores else
                    "Move augmentation to the GPU (batched transforms after the copy).")
    return _result("input-bound", f"Input-bound: {waits}.", recs)


def contention(figures: dict[str, Any] | _Figures) -> str | None:
    """Whether a CPU run was slowed by other processes, as the facts that say so (None: not
    so, a GPU run, or figures missing): the machine was busy while the run's own processes
    (DataLoader workers included) used much less CPU than its threads and workers could. Its
    step time, and the bottleneck the other rules would read from it, are then the other
    load's, not the run's (a --quick baseline read compute-bound at 2780 ms a step,
    input-bound at 78 ms alone)."""
    f = figures if isinstance(figures, _Figures) else _Figures(figures)
    if f.cuda:
        return None
    machine, own = f.num("cpu_util_pct"), f.num("process_cpu_pct")
    cores = f.num("cpu_count")
    threads = f.num("cpu_threads") or cores
    workers = 0 if f.get("cached_decode") else f.num("num_workers") or 0  # none decode then
    if machine is None or own is None or not cores or not threads:
        return None
    # The workers' CPU is in `own` too: a 1-thread run decoding in a worker could use two
    # cores, and read as compute-bound at 74% of one core while another load held both.
    could = 100 * min(threads + workers, cores)
    if machine < THRESHOLDS.busy_machine_pct or own >= THRESHOLDS.own_cpu_frac * could:
        return None
    mine = _count(threads, "thread") + (f" and {_count(workers, 'loader worker')}" if workers
                                        else "")
    return (f"the machine's CPU was busy {machine:.0f}% of the time while this run's processes "
            f"used {own:.0f}% of one core, of the {could:.0f}% its {mine} could")


def _contended(f: _Figures) -> dict[str, Any] | None:
    facts = contention(f)
    if facts is None:
        return None
    recs = [f"Run it again with the machine otherwise idle before tuning from these figures: its "
            f"step time and throughput are the other load's ({facts})."]
    if (f.num("cpu_threads") or f.num("cpu_count")) > 1:  # with one, there is no fewer to give
        recs.append("Where the other load must stay, give this run fewer threads so the two do "
                    "not thrash each other's caches (torch.set_num_threads, OMP_NUM_THREADS).")
    return _result("cpu-contended", f"CPU-contended: {facts}; other processes took the cores.",
                   recs)


def tuning_contended_advice(facts: str) -> str:
    """The recommendation for a scenario whose tuning (not its final run) shared the CPU with
    other processes: what its figures then overstate."""
    return (f"{TUNING_CONTENDED} ({facts}): its tuning seconds and its time against the "
            f"baseline overstate what an idle machine takes, and what it measured and trained "
            f"while the load ran (trials, the speed knobs where it measured them) was slowed by "
            f"it; run it again with the machine otherwise idle to compare.")


TUNING_CONTENDED = "Its tuning ran while other processes took the cores"


def _transfer_bound(f: _Figures) -> dict[str, Any] | None:
    h2d = f.num("h2d_frac")
    # On a CPU the timed copy is a layout conversion in RAM: no transfer that pinning speeds.
    if not f.cuda or h2d is None or h2d <= THRESHOLDS.h2d_frac:
        return None
    share = f"{_pct(h2d)} of each{_step(f)} step is spent copying batches to the device"
    recs = []
    if not f.get("pin_memory"):
        recs.append(f"Set pin_memory=True (--pin-memory) and copy with non_blocking=True so the "
                    f"copy overlaps compute: {share}.")
    if not f.get("cached_decode"):  # the decoded cache's batches are uint8 already
        recs.append(f"Send uint8 images (a quarter of float32's bytes) and convert/normalise on "
                    f"the device: {share}.")
    if not recs:
        recs.append(f"The copies are pinned and uint8 already: a smaller --image-size copies "
                    f"fewer bytes a step, a larger --batch-size fewer copies an epoch: {share}.")
    return _result("transfer-bound", f"Transfer-bound: {share}.", recs)


def _overhead_bound(f: _Figures) -> dict[str, Any] | None:
    ms, util, wait = f.num("avg_step_ms"), f.num("gpu_util_pct"), f.num("data_wait_frac")
    tiny = THRESHOLDS.tiny_step_ms_cuda if f.cuda else THRESHOLDS.tiny_step_ms_cpu
    # A GPU idle most of the time with little input and copy left to blame (_input_bound
    # took the rest): per-step overhead. Else its figures would read compute-bound.
    idle_gpu = f.cuda and util is not None and util < THRESHOLDS.low_gpu_util_pct
    # On a CPU no step is that short: a short one was timed again at twice its batch
    # (autotune.fixed_step_cost), and what did not grow with the batch is the overhead.
    fixed, probed = f.num("fixed_step_ms"), f.num("probe_step_ms")
    batch = f.num("batch_size")
    fixed_heavy = not f.cuda and fixed is not None and bool(probed) and \
        fixed / probed > THRESHOLDS.fixed_step_frac
    if not ((ms is not None and ms < tiny) or idle_gpu or fixed_heavy):
        return None
    why = []
    if ms is not None and ms < tiny:
        why.append(f"each step takes only {ms:.2f} ms (under {tiny:g} ms)")
    if fixed_heavy:
        at = f" at batch {batch:.0f}" if batch else ""
        again = f", timed at {2 * batch:.0f} too" if batch else ""
        why.append(f"{fixed:.1f} ms of a pure training step of {probed:.1f} ms{at} does not "
                   f"grow with the batch{again}")
    if idle_gpu:
        why.append(f"the GPU is busy {util:.0f}% of the time" + (
            "" if wait is None else f" while input waits only {_pct(wait)}"
            if wait < THRESHOLDS.low_data_wait_frac else f" while input takes {_pct(wait)} of each step"))
    why_txt = " and ".join(why)
    accum = f.num("grad_accum_steps")
    if batch and accum and accum > 1:  # the same updates, fewer and larger batches
        recs = [f"Raise batch_size from {batch:.0f} and lower grad_accum_steps from {accum:.0f}, "
                f"keeping the effective batch of {batch * accum:.0f}: the same optimizer steps, "
                f"their fixed costs shared by more samples ({why_txt})."]
    else:
        recs = [f"Raise batch_size{f' from {batch:.0f}' if batch else ''} so fixed per-step "
                f"costs are shared by more samples: {why_txt}." + (
                    " A larger batch also takes fewer optimizer steps an epoch, which can cost a "
                    "short run accuracy: compare the validation accuracy." if fixed_heavy else "")]
    compiled = _measured_slower(f, "compile")
    if f.get("compile_failed"):  # asked for, could not build: the steps ran eager
        recs.append(f"torch.compile failed here ({f.get('compile_failed')}), so these steps ran "
                    f"eager, not compiled: a larger batch or input size spreads their fixed "
                    f"costs ({why_txt}).")
    elif f.get("compile"):
        recs.append(f"torch.compile is on already: what is left per step is launch and Python "
                    f"overhead that a larger batch or input size spreads ({why_txt}).")
    elif compiled:
        recs.append(f"torch.compile was measured no faster here ({compiled}): leave it off "
                    f"({why_txt}).")
    elif "true" not in (((f.get("raced") or {}).get("compile")) or {"true": None}):
        # the autotuner weighed it and did not try it: its warm-up would not pay back here
        recs.append(f"torch.compile was left untried: its warm-up would not pay back within "
                    f"this run's steps or measuring budget; for a run several times longer, try "
                    f"--compile ({why_txt}).")
    elif f.cuda:
        recs.append(f"Try --compile (torch.compile) to fuse small kernels and cut kernel-launch "
                    f"and Python overhead: {why_txt}.")
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
    if not recs:  # every usual knob is on already
        recs.append(f"The usual speed knobs are on; a smaller model or input size is what is left "
                    f"({basis}).")
    return _result("compute-bound", summary, recs)


def _more_workers_no_faster(f: _Figures, workers: float | None) -> str | None:
    """The autotuner's worker race, when every count above the one kept measured no faster
    than it (or faster by less than MIN_GAIN, which the autotuner does not keep): advice to
    raise it would go against what was measured."""
    raced = (f.get("raced") or {}).get("num_workers") or {}
    speeds = {int(k): v for k, v in raced.items()
              if str(k).isdigit() and isinstance(v, (int, float))}
    if workers is None or int(workers) not in speeds:
        return None
    above = {n: v for n, v in speeds.items() if n > workers}
    kept = speeds[int(workers)]
    if not above or any(v >= MIN_GAIN * kept for v in above.values()):
        return None
    return ", ".join(f"{n}: {v:.0f}" for n, v in sorted(above.items())) + \
        f" against {int(workers)}: {kept:.0f} img/s" + _under_gain(max(above.values()), kept)


def _under_gain(fastest: float, kept: float) -> str:
    """What a race's figures say when the fastest beat the kept by less than MIN_GAIN."""
    return (f", under the {100 * (MIN_GAIN - 1):.0f}% gain the autotuner keeps a setting for"
            if fastest > kept else "")


def _race(f: _Figures, knob: str, on: str, off: str) -> tuple[Any, Any]:
    """The autotuner's figures for `knob` at `on` and at `off` (img/s, or why not measured)."""
    raced = ((f.get("raced") or {}).get(knob)) or {}
    return raced.get(on), raced.get(off)


def _slower_or_no_faster(f: _Figures, knob: str, on: str, off: str) -> str:
    """How a race that `on` lost reads: slower, or no faster when it was within MIN_GAIN."""
    with_it, without = _race(f, knob, on, off)
    numbers = all(isinstance(v, (int, float)) for v in (with_it, without))
    return "slower" if numbers and with_it < without else "no faster"


def _measured_slower(f: _Figures, knob: str, on: str = "true", off: str = "false") -> str | None:
    """The autotuner's race of `knob` on this machine (`raced`: img/s per value) when it
    measured `on` no faster than `off` (or faster by less than MIN_GAIN, which it does not
    keep), or `on` failing: advice to turn it on would go against what was measured. None
    when it was not raced."""
    with_it, without = _race(f, knob, on, off)
    if not isinstance(without, (int, float)):
        return None
    if isinstance(with_it, str):  # failed, or abandoned at its deadline; unmeasured says nothing
        return None if with_it.startswith("not measured") else with_it
    if isinstance(with_it, (int, float)) and with_it < MIN_GAIN * without:
        return f"{with_it:.0f} against {without:.0f} img/s without it" + \
            _under_gain(with_it, without)
    return None


def _amp_slower(f: _Figures) -> tuple[str, str | None]:
    """The fastest 16-bit mode the autotuner raced (a failed one ranks below any speed), and
    _measured_slower's reading of it against fp32."""
    amp = (f.get("raced") or {}).get("amp") or {}
    best = max(("bf16", "fp16"), key=lambda m: amp[m] if isinstance(amp.get(m), (int, float))
               else -1 if m in amp else -2)
    return best, _measured_slower(f, "amp", best, "off")


def _cpu_compute_recs(f: _Figures, basis: str) -> list[str]:
    recs = []
    if not f.get("channels_last") and not _measured_slower(f, "channels_last"):
        recs.append(f"Try channels_last (--channels-last): oneDNN's convolutions on CPU are faster in NHWC layout "
                    f"({basis}).")
    amp, native = f.get("amp_dtype"), f.get("native_bf16")
    slower = _measured_slower(f, "amp", "bf16", "off")
    if slower and amp != "bfloat16":
        recs.append(f"bf16 autocast was measured "
                    f"{_slower_or_no_faster(f, 'amp', 'bf16', 'off')} here ({slower}): keep it "
                    f"off ({basis}).")
    elif native:
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
        best, slower = _amp_slower(f)
        if slower:
            recs.append(f"AMP was measured {_slower_or_no_faster(f, 'amp', best, 'off')} here "
                        f"({best} {slower}): keep it off ({basis}).")
        else:
            recs.append(f"Turn on AMP (--amp auto): bf16/fp16 tensor cores run several times "
                        f"faster than fp32 ({basis}).")
    if not f.get("channels_last") and not _measured_slower(f, "channels_last"):
        recs.append(f"Try channels_last (--channels-last): cuDNN's tensor-core convolutions prefer NHWC ({basis}).")
    peak, limit, batch = f.num("peak_mem_mb"), f.num("mem_limit_mb"), f.num("batch_size")
    if peak is not None and limit and peak / limit < THRESHOLDS.batch_headroom_frac:
        recs.append(f"Raise batch_size{f' from {batch:.0f}' if batch else ''}: only "
                    f"{peak:.0f} of {limit:.0f} MB ({_pct(peak / limit)}) of device memory is used.")
    return recs
