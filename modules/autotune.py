"""Measure the machine and pick the speed knobs: every candidate runs a few real training steps
(forward, backward, optimizer step on in-memory tensors) on the actual device, and a setting is
kept only when it measured faster. Nothing here assumes a knob helps: on a CPU without native
bf16, for example, bf16 autocast measures several times slower and is rejected by that figure."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import psutil
import torch
from torch import nn

from modules import hostmem
from modules.config import LEARNING_ONLY, NO_WORKERS, TrainConfig, UserError, first_line
from modules.deadline import run_with_deadline
from modules.device import apply_process_settings, autocast_dtype, resolve_device, usable_cpus
from modules.files import atomic_write_text, compile_failure, user_error, worker_free
from modules.hardware import PROBE_BATCHES, PROBE_UPTO, max_batch_size
from modules.models import ByteMaskDropout, build_model, has_bytemask_dropout
from modules.oom import is_out_of_memory, release
from modules.selection import MIN_GAIN
from modules.trainer import make_optimizer, train_step

log = logging.getLogger(__name__)

# A race of two candidates times each for at least MIN_STEPS steps and at most MAX_STEPS, and
# runs for at least MIN_S seconds in all.
MIN_STEPS, MAX_STEPS, MIN_S = 3, 12, 1.5
# For a short planned run the measuring may take at most MEASURE_SHARE of the run's own
# (estimated) time: each candidate then gets less than MIN_S, but at least MIN_S_FLOOR.
MEASURE_SHARE, MIN_S_FLOOR = 0.1, 0.3
# A challenger whose last warm-up step and first timed step (or first two timed steps) are both
# this much slower than the incumbent in its race is dropped after them (bf16 on a CPU without
# bf16 units: two steps are proof enough).
ABORT_FACTOR = 1.5
# The dropout implementation is decided on the dropout layers alone, not by a training-step
# race: the two draw different masks, so the choice decides the model trained, and where the
# layers are a few percent of a step the race's noise would pick it (two runs of one seed then
# trained different models). bytemask is taken when its layers ran at least DROPOUT_OP_GAIN
# times faster than PyTorch's, best of DROPOUT_OP_ROUNDS turns each: a gap that noise does not
# make or unmake (docs/speed.md).
DROPOUT_OP_GAIN, DROPOUT_OP_ROUNDS = 2.0, 5
# Knobs that are process-wide (modules.trainer.apply_process_settings): two candidates that
# differ in one take turns of TURN_STEPS steps, the first step of each turn not counted (the
# switch itself: a thread pool resized, freed memory handed back).
PROCESS_KNOBS = ("cpu_threads", "cpu_allocator")
TURN_STEPS = 2
# torch.compile's warm-up for these models is at least this long; a run whose measuring budget
# (MEASURE_SHARE of its planned time) has less than this left does not try it, and a warm-up
# still running when the budget is spent is abandoned (it runs in a child process).
COMPILE_WARMUP_FLOOR_S = 20.0
# A new setting's first steps on a GPU (cuDNN's algorithm search for a new layout or dtype) take
# at least this long (docs/speed.md); a race is started only when the budget holds it.
GPU_WARMUP_S = 5.0
COMPILE_BEST_GAIN = 0.5
# A DataLoader keeps up when it delivers this much more than the model consumes.
LOADER_HEADROOM = 1.1


class _Choice(NamedTuple):
    config: TrainConfig
    findings: dict[str, Any]
    run_id: str | None  # the run that measured it (or took it from its cache file)
    origin: str  # where and when, for a later run in the same process (a notebook's kernel)


# Choices made in this process, by speed_key: a later scenario at the same size and batch
# reuses them instead of measuring again.
_RESULTS: dict[str, _Choice] = {}


class ComputeProbe:
    """A model, optimizer and one in-memory batch for `config`: times pure training steps."""

    def __init__(self, config: TrainConfig, num_classes: int, batch_size: int | None = None):
        self.device = resolve_device(config.device)
        self.config = config
        self.batch = batch_size or config.batch_size
        apply_process_settings(config, self.device)
        fmt = torch.channels_last if config.channels_last else torch.contiguous_format
        self.model = build_model(config.model, num_classes, "none", config.dropout_impl).to(
            self.device, memory_format=fmt)
        self.optimizer = make_optimizer(self.model, config, self.device)
        self.dtype = autocast_dtype(config.amp, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self.forward = torch.compile(self.model) if config.compile else self.model
        g = torch.Generator().manual_seed(0)
        size = config.image_size
        self.x = torch.randn(self.batch, 3, size, size, generator=g).to(self.device, memory_format=fmt)
        self.y = torch.randint(0, num_classes, (self.batch,), generator=g).to(self.device)

    def step(self) -> None:
        train_step(self.forward, self.model, self.optimizer, self.scaler, self.x, self.y,
                   device=self.device, dtype=self.dtype, max_grad_norm=self.config.max_grad_norm)

    def activate(self) -> None:
        """Put the process in this probe's process-wide settings (another probe may have run)."""
        apply_process_settings(self.config, self.device)

    def sync(self) -> None:
        _sync(self.device)

    def timed_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        self.sync()
        return time.perf_counter() - t0

    def measure(self, *, warmup: int = 1, min_steps: int = MIN_STEPS, max_steps: int = MAX_STEPS,
                min_s: float = MIN_S) -> dict[str, float]:
        """{"img_s": median throughput, "warmup_s": time of the warm-up steps, "steps": n}."""
        warm = sum(self.timed_step() for _ in range(warmup))
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < max_steps and (len(times) < min_steps
                                          or time.perf_counter() - started < min_s):
            times.append(self.timed_step())
        return {"img_s": self.batch / statistics.median(times), "warmup_s": warm,
                "steps": len(times)}


# A CPU run whose training steps took less than this, ms, is timed again at twice its batch for
# the diagnosis: what is left of a step that does not grow with the batch (the optimizer's
# pass over every tensor, Python, the framework's dispatch) can rule a short step. Longer
# steps are the arithmetic's (SqueezeNet at 64 px, batch 32: 71 ms, 23% of it fixed), and
# timing them at twice the batch would cost more.
FIXED_PROBE_MS = 40.0


def fixed_step_cost(config: TrainConfig, num_classes: int) -> dict[str, Any] | None:
    """How much of a pure training step at config.batch_size does not grow with the batch: the
    step timed at the batch and at twice it (a step takes about fixed + per image x batch).
    {"batch", "step_ms", "double_step_ms", "fixed_ms" (at least 0), "seconds"}; None when a
    probe could not run (out of memory at twice the batch)."""
    started = time.perf_counter()
    steps_ms = []
    try:
        for batch in (config.batch_size, 2 * config.batch_size):
            probe = ComputeProbe(config, num_classes, batch)
            steps_ms.append(1000 * batch / probe.measure(warmup=2, min_steps=8, max_steps=8,
                                                         min_s=0.0)["img_s"])
            del probe
    except RuntimeError as exc:  # torch's OutOfMemoryError is one
        log.info("diagnosis: could not time a step at twice the batch (%s)", _error(exc))
        return None
    finally:
        _release()
    one, two = steps_ms
    return {"batch": config.batch_size, "step_ms": one, "double_step_ms": two,
            "fixed_ms": max(0.0, 2 * one - two), "seconds": time.perf_counter() - started}


def race(incumbent: ComputeProbe, challenger: ComputeProbe, *, warmup: int = 2,
         min_steps: int | None = None, max_steps: int | None = None, min_s: float | None = None,
         drop_slow: bool = True, deadline: float | None = None) -> dict[str, Any]:
    """Time two probes in turns: a step of one, then a step of the other (TURN_STEPS each when
    a process-wide knob differs), until both have min_steps and min_s has passed in all. The
    machine's drift (docs/speed.md) then falls on both alike, where timing one candidate after
    another compares each with a figure taken seconds before. The order alternates (incumbent
    first, then challenger first) over an even number of pairs: the probe that runs second in
    a pair measures a little faster.

    The challenger warms up first (its one-time costs: kernel selection, a JIT, compiling).
    With drop_slow it is dropped early when two of its steps in a row, its last warm-up step
    included, take ABORT_FACTOR times the incumbent's median or more (bf16 on a CPU without
    bf16 units); its figures then rest on a step or two.
    deadline: a time.perf_counter() value (the measuring budget's end): the race stops at the
    first even pair after it, min_steps or not ("cut"); a challenger still warming up then (far
    slower than race_cost assumes: bf16 on a CPU without bf16 units) is cut with no figures
    ("img_s" None).
    Returns {"img_s": (incumbent, challenger), "warmup_s": the challenger's warm-up,
    "steps": the challenger's timed steps, "dropped": bool, "cut": bool}."""
    min_steps = MIN_STEPS if min_steps is None else min_steps
    max_steps = MAX_STEPS if max_steps is None else max_steps
    min_s = MIN_S if min_s is None else min_s
    turn = TURN_STEPS if any(getattr(incumbent.config, k) != getattr(challenger.config, k)
                             for k in PROCESS_KNOBS) else 1

    def take_turn(probe: ComputeProbe) -> list[float]:
        probe.activate()
        times = [probe.timed_step() for _ in range(turn)]
        return times[1:] if turn > 1 else times

    mine: list[float] = []
    theirs: list[float] = []
    dropped, cut, pairs = False, False, 0
    try:
        challenger.activate()
        warm = []
        for _ in range(warmup):
            warm.append(challenger.timed_step())
            if deadline is not None and time.perf_counter() >= deadline:
                return {"img_s": None, "warmup_s": sum(warm), "steps": 0, "dropped": False,
                        "cut": True}
        recent = warm[-1:] if warmup > 1 else []
        started = time.perf_counter()
        while True:
            if pairs % 2 == 0:
                mine += take_turn(incumbent)
                new = take_turn(challenger)
            else:
                new = take_turn(challenger)
                mine += take_turn(incumbent)
            pairs += 1
            theirs += new
            recent = (recent + new)[-2:]
            if drop_slow and len(recent) == 2 and \
                    min(recent) > ABORT_FACTOR * statistics.median(mine):
                dropped = True
                break
            if pairs % 2 == 0 and (len(theirs) >= max_steps or (
                    len(theirs) >= min_steps and time.perf_counter() - started >= min_s)):
                break
            if pairs % 2 == 0 and deadline is not None and time.perf_counter() >= deadline:
                cut = True
                break
    finally:
        incumbent.activate()
    return {"img_s": (incumbent.batch / statistics.median(mine),
                      challenger.batch / statistics.median(theirs)),
            "warmup_s": sum(warm), "steps": len(theirs), "dropped": dropped, "cut": cut}


def race_cost(knob: str, step_s: float, min_s: float, warmup_s: float) -> float:
    """Seconds one race of `knob` takes, about: race() times each candidate for at least
    MIN_STEPS steps over an even number of pairs (TURN_STEPS per turn for a process-wide knob,
    the first of each turn not counted), the challenger up to ABORT_FACTOR slower, and for
    at least min_s in all; plus the challenger's warm-up."""
    turn = TURN_STEPS if knob in PROCESS_KNOBS else 1
    pairs = math.ceil(MIN_STEPS / (turn - 1 if turn > 1 else 1))
    pairs += pairs % 2
    stepping = pairs * turn * step_s * (1 + ABORT_FACTOR)
    return max(2 * min_s, stepping) + warmup_s


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it times that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


def _release() -> None:
    if torch.cuda.is_available():
        release(torch.device("cuda"))


def _challenge(incumbent: ComputeProbe, config: TrainConfig, num_classes: int,
               warmup: int = 2, min_s: float = MIN_S, drop_slow: bool = True,
               deadline: float | None = None) -> tuple[ComputeProbe | None, dict[str, Any]]:
    """(the challenger's probe, race()'s figures), or (None, {"error": ...}) when `config`
    cannot run here (unsupported, out of memory, a compiler failure ...)."""
    try:
        challenger = ComputeProbe(config, num_classes)
        return challenger, race(incumbent, challenger, warmup=warmup, min_s=min_s,
                                drop_slow=drop_slow, deadline=deadline)
    except Exception as exc:
        failed = {"error": _error(exc)}
    # Outside the except block, the failed challenger dropped: until then its model and the
    # traceback's tensors hold their memory.
    challenger = None
    incumbent.activate()
    _release()
    return None, failed


def _first_probe(config: TrainConfig, num_classes: int, min_s: float
                 ) -> tuple[ComputeProbe | None, dict[str, Any]]:
    """A probe of `config`, measured on its own (the process's first steps are slow: warm up
    once so that cost is not charged to whichever candidate happens to go first). On failure:
    (None, {"error": its first line, "out_of_memory": whether the batch did not fit})."""
    try:
        probe = ComputeProbe(config, num_classes)
        return probe, probe.measure(warmup=2, min_s=min_s)
    except Exception as exc:
        failed = {"error": _error(exc), "out_of_memory": is_out_of_memory(exc)}
    probe = None  # as in _challenge
    _release()
    return None, failed


def _set_by_user(config: TrainConfig, knob: str) -> dict[str, Any]:
    """The findings entry of a knob the user fixed: kept as given, not measured."""
    return {"choice": getattr(config, knob), "reason": "set by the user", "img_s": {}}


def _label(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _pick(knob: str, candidates: list[Any], config: TrainConfig, num_classes: int,
          current: dict[str, Any], min_s: float = MIN_S,
          deadline: Callable[[], float | None] | float | None = None
          ) -> tuple[TrainConfig, dict[str, Any]]:
    """Race each other candidate value of `knob` against the best so far, with the other knobs
    as chosen so far; keep the first candidate (the default, whose probe the previous knob left
    in `current`) unless another is at least MIN_GAIN faster in the same race. `deadline` is
    read again before each challenger when it is a callable: a faster winner shrinks the
    budget, which the knob's later races must keep to."""
    def ends() -> float | None:
        return deadline() if callable(deadline) else deadline
    figures: dict[str, Any] = {}
    races: list[str] = []  # each challenger against the setting it raced, at the same moment
    best = current.get("probe")
    if best is not None and best.config == config:
        best_value, rest = candidates[0], candidates[1:]
        figures[_label(best_value)] = round(current["img_s"], 2)
    else:  # the setting so far could not run: the first candidate that runs starts
        best, best_value, rest = None, None, list(candidates)
        while rest and best is None:
            best_value = rest.pop(0)
            best, result = _first_probe(dataclasses.replace(config, **{knob: best_value}),
                                        num_classes, min_s)
            figures[_label(best_value)] = result.get("error") or round(result["img_s"], 2)
            current.update(probe=best, img_s=result.get("img_s"))
        if best is None:
            raise UserError(f"no {knob} setting could train on this device: {figures}")
    for value in rest:
        until = ends()
        if until is not None and time.perf_counter() >= until:
            figures[_label(value)] = "not measured: the measuring budget was spent"
            continue
        challenger, result = _challenge(best, dataclasses.replace(config, **{knob: value}),
                                        num_classes, min_s=min_s, deadline=until)
        if challenger is None:
            figures[_label(value)] = result["error"]
            continue
        if result["img_s"] is None:
            figures[_label(value)] = "not measured: the measuring budget was spent in its warm-up"
            del challenger
            _release()
            continue
        mine, theirs = result["img_s"]
        figures[_label(value)] = round(theirs, 2)
        races.append(f"{_label(value)} {theirs:.1f} vs {_label(best_value)} {mine:.1f}"
                     + (" (dropped after its first steps)" if result["dropped"] else "")
                     + (" (cut short: the measuring budget was spent)" if result.get("cut")
                        else ""))
        if theirs > MIN_GAIN * mine:
            if not result["dropped"]:  # the loser's figure from this race, as the winner's is
                figures[_label(best_value)] = round(mine, 2)
            best, best_value = challenger, value
            current.update(probe=challenger, img_s=theirs)
        elif not result["dropped"]:  # a dropped race timed the incumbent for a step or two
            current["img_s"] = mine
        figures[_label(best_value)] = round(current["img_s"], 2)
        del challenger  # the loser's memory goes now, whichever it was
        _release()
    best_img_s = current["img_s"]
    chosen = dataclasses.replace(config, **{knob: best_value})
    errors = {k: v for k, v in figures.items() if not isinstance(v, float)}
    if races:  # figures from different races were taken at different moments: not compared
        reason = f"{_label(best_value)} measured {best_img_s:.1f} img/s; raced: " + "; ".join(races)
    elif any(v.startswith("not measured") for v in errors.values()):
        # No race ran: the choice is the default kept, not a measurement (a later run with
        # more budget measures it: _budget_skipped).
        reason = f"not measured: {_label(best_value)} kept ({best_img_s:.1f} img/s)"
    else:
        reason = f"only {_label(best_value)} runs here ({best_img_s:.1f} img/s)"
    if errors:
        reason += "; " + "; ".join(f"{k} {v}" if v.startswith("not measured")
                                   else f"{k} unavailable ({v})" for k, v in errors.items())
    return chosen, {"choice": best_value, "reason": reason, "img_s": figures}


def dropout_by_layer(config: TrainConfig, num_classes: int, device: torch.device
                     ) -> dict[str, Any]:
    """The findings entry of dropout_impl: each implementation's forward time through the
    model's dropout layers that bytemask would replace, at their input shapes for this size
    and batch (fp32), alternating, best of DROPOUT_OP_ROUNDS after one unrounded warm-up."""
    model = build_model(config.model, num_classes, "none")
    shapes: list[tuple[float, torch.Size]] = []
    for layer in model.modules():
        if type(layer) is nn.Dropout and ByteMaskDropout.applies(layer.p):
            layer.register_forward_pre_hook(
                lambda mod, args: shapes.append((mod.p, args[0].shape)))
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, config.image_size, config.image_size))
    del model
    inputs = [(p, torch.randn((config.batch_size, *shape[1:]), device=device))
              for p, shape in shapes]
    impls = {"native": [nn.Dropout(p) for p, _ in inputs],
             "bytemask": [ByteMaskDropout(p) for p, _ in inputs]}

    best = dict.fromkeys(impls, math.inf)
    with torch.no_grad():
        for turn in range(DROPOUT_OP_ROUNDS + 1):
            for name, layers in impls.items():
                _sync(device)
                mark = time.perf_counter()
                for layer, (_, x) in zip(layers, inputs):
                    layer(x)
                _sync(device)
                if turn:  # the first turn pays each kernel's first call
                    best[name] = min(best[name], time.perf_counter() - mark)
    del inputs
    _release()
    choice = "bytemask" if best["bytemask"] * DROPOUT_OP_GAIN <= best["native"] else "native"
    ms = {name: round(1000 * t, 3) for name, t in best.items()}
    return {"choice": choice, "img_s": {}, "layer_ms": ms, "reason": (
        f"dropout layers timed alone, batch {config.batch_size}: bytemask {ms['bytemask']:.3f} "
        f"ms, native {ms['native']:.3f} ms; bytemask is kept at {DROPOUT_OP_GAIN:g}x faster or "
        "more (not raced: the two draw different masks)")}


def thread_candidates() -> list[int]:
    """Thread counts to race, the current one first, none above the CPUs this process may run
    on (taskset, a container's cpuset)."""
    logical = usable_cpus()
    physical = min(logical, psutil.cpu_count(logical=False) or logical)
    current = min(logical, torch.get_num_threads())
    return sorted({current, physical, logical, max(1, logical // 2)},
                  key=lambda n: (n != current, n))


def amp_candidates(device: torch.device, start: str = "off") -> list[str]:
    """The AMP modes to race, the starting mode first ("auto" as what it means on `device`):
    a knob left unmeasured when the budget is spent keeps its first candidate, and on a GPU
    that must be the mixed precision it would have chosen, not fp32."""
    if device.type == "cuda":
        modes = ["off", "fp16"]
        # Native bf16 from Ampere (compute capability 8) on; before it (a T4) torch emulates
        # it, slowly: not worth a share of the measuring budget.
        if torch.cuda.get_device_capability(device)[0] >= 8:
            modes.insert(1, "bf16")
    else:
        modes = ["off", "bf16"]
    if start == "auto":
        start = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
            autocast_dtype("auto", device), "off")
    return [start] + [m for m in modes if m != start] if start in modes else modes


def optimizer_candidates(device: torch.device) -> list[str]:
    return ["fused", "foreach"] if device.type == "cuda" else ["forloop", "foreach", "fused"]


def _tune_compile(config: TrainConfig, num_classes: int, current: dict[str, Any],
                  planned_steps: int | None, deadline_s: float | None = None
                  ) -> tuple[TrainConfig, dict[str, Any]]:
    """Eager against torch.compile. deadline_s: the measuring budget left; the compiled probe
    then runs in a child process that is killed when its warm-up has not finished by then."""
    eager_img_s = current["img_s"]
    # planned_steps counts optimizer steps: each is grad_accum_steps micro-batches.
    step_s = config.effective_batch_size / eager_img_s
    not_tried = {"choice": False, "img_s": {"false": round(eager_img_s, 2)}}
    if planned_steps is not None:
        best_saving = planned_steps * step_s * COMPILE_BEST_GAIN
        if best_saving < COMPILE_WARMUP_FLOOR_S:
            return config, {**not_tried, "reason": (
                f"not tried: the planned {planned_steps} steps take about {planned_steps * step_s:.0f} "
                f"s eager; even halving every step saves at most {best_saving:.0f} s, less than "
                f"compile's warm-up (at least {COMPILE_WARMUP_FLOOR_S:.0f} s)")}
    if deadline_s is not None and deadline_s < COMPILE_WARMUP_FLOOR_S:
        return config, {**not_tried, "reason": (
            f"not tried: {max(0.0, deadline_s):.0f} s of the measuring budget left, less than "
            f"compile's warm-up (at least {COMPILE_WARMUP_FLOOR_S:.0f} s)")}
    if deadline_s is None:
        # Not dropped early: a compiled model's first steps after warm-up can still recompile.
        compiled, result = _challenge(current["probe"], dataclasses.replace(config, compile=True),
                                      num_classes, drop_slow=False)
    else:
        compiled, result = None, _race_compile_with_deadline(config, num_classes, deadline_s)
        if "error" not in result:
            compiled = current["probe"]  # the child's compiled model is gone with it
    if compiled is None:
        return config, {"choice": False,
                        "img_s": {"false": round(eager_img_s, 2), "true": result["error"]},
                        "reason": f"torch.compile failed here ({compile_failure(result['error'])})"}
    eager_img_s, compiled_img_s = result["img_s"]
    # Raced in a child, its eager figure is the child's: compared with its compiled one there,
    # but the parent's own measure stays the figure later knobs and the summary read.
    own_img_s = current["img_s"] if deadline_s is not None else eager_img_s
    figures = {"false": round(eager_img_s, 2), "true": round(compiled_img_s, 2)}
    warmup_extra = result["warmup_s"] - 2 * config.batch_size / eager_img_s  # 2 micro-steps
    step_s = config.effective_batch_size / eager_img_s
    saving_per_step = step_s - config.effective_batch_size / compiled_img_s
    horizon = "the planned run" if planned_steps is not None else "a long run"
    if saving_per_step <= 0 or compiled_img_s < MIN_GAIN * eager_img_s:
        current["img_s"] = own_img_s
        reason = (f"compiled {compiled_img_s:.1f} img/s is not faster than eager "
                  f"{eager_img_s:.1f} (after {result['warmup_s']:.0f} s of warm-up)")
        return config, {"choice": False, "img_s": figures, "reason": reason}
    payback_steps = math.ceil(max(0.0, warmup_extra) / saving_per_step)
    if planned_steps is not None and payback_steps > planned_steps:
        current["img_s"] = own_img_s
        reason = (f"compiled {compiled_img_s:.1f} vs eager {eager_img_s:.1f} img/s, but its "
                  f"{result['warmup_s']:.0f} s warm-up pays back only after {payback_steps} steps, "
                  f"more than the {planned_steps} planned")
        return config, {"choice": False, "img_s": figures, "reason": reason}
    current.update(probe=compiled, img_s=compiled_img_s)
    reason = (f"compiled {compiled_img_s:.1f} vs eager {eager_img_s:.1f} img/s; the "
              f"{result['warmup_s']:.0f} s warm-up pays back after {payback_steps} steps of {horizon}")
    return dataclasses.replace(config, compile=True), {"choice": True, "img_s": figures,
                                                        "reason": reason,
                                                        "payback_steps": payback_steps}


def _compile_pays_back(tuned: TrainConfig, findings: dict[str, Any], planned_steps: int | None,
                       time_capped: tuple[int, float] | None
                       ) -> tuple[TrainConfig, dict[str, Any]]:
    """A reused choice of compile, measured for a run long enough to pay its warm-up back,
    for this run: eager when this one plans fewer steps than that takes (a long run's choice
    reused by a --quick run into the same output dir paid minutes of warm-up for seconds)."""
    entry = (findings.get("knobs") or {}).get("compile") or {}
    payback = entry.get("payback_steps")
    if not tuned.compile or not isinstance(payback, int) or planned_steps is None:
        return tuned, findings
    now = _capped(planned_steps, time_capped, findings.get("compute_img_s"),
                  tuned.effective_batch_size)
    if now >= payback:
        return tuned, findings
    reason = (f"{entry.get('reason', '')}; not used here: this run plans {now} steps, fewer "
              f"than the {payback} its warm-up takes to pay back")
    log.info("autotune: compile = false (%s)", reason)
    return dataclasses.replace(tuned, compile=False), {
        **findings, "knobs": {**findings["knobs"], "compile": {**entry, "choice": False,
                                                               "reason": reason}}}


def _race_compile_with_deadline(config: TrainConfig, num_classes: int, deadline_s: float
                                ) -> dict[str, Any]:
    """race() of eager against compiled in a child process, or {"error": ...} when it failed
    or had not finished within deadline_s (then it is killed: a compile cannot be interrupted
    from inside the process that runs it)."""
    finished, result = run_with_deadline(_compile_race_child,
                                         (config.to_dict(), num_classes, MIN_S), deadline_s)
    if not finished:
        return {"error": f"abandoned: its warm-up had not finished within the {deadline_s:.0f} s "
                         "of measuring budget left"}
    return result


def _compile_race_child(config: dict[str, Any], num_classes: int, min_s: float, conn) -> None:
    """In the child: warm an eager probe, then race a compiled one against it."""
    try:
        config = TrainConfig(**config)
        eager, warm = _first_probe(dataclasses.replace(config, compile=False), num_classes,
                                   MIN_S_FLOOR)
        if eager is None:
            conn.send(warm)
            return
        compiled, result = _challenge(eager, dataclasses.replace(config, compile=True),
                                      num_classes, drop_slow=False, min_s=min_s)
        conn.send(result)
    except BaseException as exc:  # the parent must hear something rather than wait
        conn.send({"error": _error(exc)})


def measuring_time(planned_steps: int | None, samples_per_step: int, img_s: float | None,
                   candidates: int) -> float:
    """Seconds to measure each candidate: MIN_S, or less for a run so short that measuring
    would take more than MEASURE_SHARE of it (at least MIN_S_FLOOR)."""
    if not planned_steps or not img_s or candidates < 1:
        return MIN_S
    run_s = planned_steps * samples_per_step / img_s
    return max(MIN_S_FLOOR, min(MIN_S, MEASURE_SHARE * run_s / candidates))


def tune_workers(make_loader: Callable[[int], Any], compute_img_s: float,
                 candidates: list[int], batches: int = 6, deadline: float | None = None
                 ) -> tuple[int, dict[str, Any]]:
    """The fewest DataLoader workers whose loader outpaces the model; else the fewest within
    MIN_GAIN of the fastest count (a gain inside timing noise is not worth more processes).
    make_loader(num_workers) returns a fresh loader over the training data.
    deadline: a time.perf_counter() value (the measuring budget's end): no count is started
    after it, one still warming up then is abandoned, and one measuring then stops after its
    first timed batch. The first count is always measured."""
    def past_deadline() -> bool:
        return bool(figures) and deadline is not None and time.perf_counter() >= deadline

    figures: dict[str, float] = {}
    failed: dict[str, str] = {}  # counts whose workers the machine would not run, and why
    for n in candidates:
        if past_deadline():
            break
        try:
            rate = _loader_rate(make_loader(n), n, batches, deadline, past_deadline)
        except (RuntimeError, OSError) as exc:
            # workers the machine cannot give shared memory, files or threads: not a count
            # for this run; no workers at all is the fix
            if n == 0 or user_error(exc) is None:
                raise
            failed[str(n)] = first_line(worker_free(str(exc), exc))
            continue
        if rate is None:
            break
        figures[str(n)] = rate
    if not figures:
        raise UserError(f"the DataLoader workers could not run here ({failed}); pass "
                        "--num-workers 0.")
    measured = [n for n in candidates if str(n) in figures]
    enough = [n for n in measured if figures[str(n)] >= LOADER_HEADROOM * compute_img_s]
    fastest = max(figures[str(n)] for n in measured)
    choice = min(enough) if enough else \
        min(n for n in measured if MIN_GAIN * figures[str(n)] >= fastest)
    rates = ", ".join(f"{k} workers: {v:.0f} img/s" for k, v in figures.items())
    skipped = [str(n) for n in candidates if str(n) not in figures and str(n) not in failed]
    reason = (f"{choice} workers deliver {figures[str(choice)]:.0f} img/s against the model's "
              f"{compute_img_s:.0f} ({rates})"
              + "".join(f"; {k} workers could not run here ({why})" for k, why in failed.items())
              + (f"; {', '.join(skipped)} not measured: the measuring budget was spent"
                 if skipped else ""))
    return choice, {"choice": choice, "reason": reason, "img_s": figures}


def _loader_rate(loader, n: int, batches: int, deadline: float | None,
                 past_deadline: Callable[[], bool]) -> float | None:
    """Images per second `loader` (of n workers) delivers after its warm-up; None when the
    measuring budget ran out before it was timed."""
    it = iter(loader)
    # Worker start-up and the first decode are not steady state, nor are the batches the
    # workers decoded meanwhile: up to prefetch_factor (2) each, queued and then handed over
    # at once, would time the queue rather than the decoding.
    for _ in range(1 + 2 * n):
        try:
            next(it)
        except StopIteration:
            break
        if past_deadline():
            break
    if past_deadline():
        return None
    count, started = 0, time.perf_counter()
    for _ in range(batches):
        try:
            x, _ = next(it)
        except StopIteration:
            break
        count += len(x)
        if deadline is not None and time.perf_counter() >= deadline:
            break
    return round(count / max(1e-9, time.perf_counter() - started), 1)


def autotune(config: TrainConfig, num_classes: int, *, planned_steps: int | None = None,
             fixed: frozenset[str] = frozenset(), tune_batch: bool = True,
             loader_factory: Callable[[TrainConfig], Callable[[int], Any]] | None = None,
             budget_share: float | None = None, cache_path: str | Path | None = None,
             time_capped: tuple[int, float] | None = None, data_key: str | None = None,
             unbudgeted_steps: int = 0, run_id: str | None = None
             ) -> tuple[TrainConfig, dict[str, Any]]:
    """The fastest measured settings for `config` on its device, and why.

    planned_steps: optimizer steps the run will take (compile must pay back within them).
    unbudgeted_steps: that many of them (a final run that may be taken from another scenario
    rather than trained) count for compile's payback, not for the measuring budget.
    time_capped: (steps, seconds): that many of the planned steps belong to a part of the run
    bounded in time (a search with a time budget), so they count only as far as the seconds
    reach at the measured speed.
    fixed: knob names the user set explicitly; they are kept and not measured.
    loader_factory: for the streaming data path, config -> (num_workers -> loader).
    budget_share: all measuring stays within this share of the planned steps' time (estimated
    from the first measured step): knobs left when it is spent keep their starting value, and
    compile is tried only under a deadline taken from what is left. None: no bound.
    cache_path: a JSON file of earlier choices keyed by machine (CPU model and flags, GPU,
    torch version) and speed settings; a match is reused instead of measured, and said so.
    A choice made in this process for the same speed settings is reused too (a later scenario).
    A reused choice that left knobs unmeasured for lack of budget, for a shorter planned run
    than this one's, has those measured now, the others kept (a --quick run, then a full one).
    data_key: the data's fingerprint, part of the key on the streaming path, where the worker
    count measured depends on the images' decoding.
    run_id: the run measuring; a choice reused from another run in this process names it.
    Returns (config with the chosen knobs, {"knobs": {name: {choice, reason, img_s}}, ...})."""
    key = speed_key(config, num_classes, fixed, tune_batch, loader_factory is None, data_key)
    # Knobs measured before, kept while the rest are measured now; None: nothing to reuse.
    known: dict[str, dict[str, Any]] | None = None
    if key in _RESULTS:
        tuned, findings, _, _ = _RESULTS[key]
        source = _source(_RESULTS[key], run_id)
        known = _measure_rest(findings, planned_steps, time_capped, tuned, f"in {source}",
                              budget_share)
        if known is None:
            log.info("autotune: reusing the choice measured earlier in %s at %d px, batch %d",
                     source, config.image_size, config.batch_size)
            if cache_path and _cache_entry(cache_path, key) is None:  # another output dir's
                _to_cache(cache_path, key, tuned, findings)
            tuned, findings = _compile_pays_back(tuned, findings, planned_steps, time_capped)
            return _with_run_fields(tuned, config), {**findings, "reused_from": source,
                                                     "seconds": 0.0}
    cached = _from_cache(cache_path, key) if cache_path and known is None else None
    if cached is not None:
        tuned, findings = cached
        known = _measure_rest(findings, planned_steps, time_capped, tuned,
                              f"on this machine ({cache_path})", budget_share)
        if known is None:
            _RESULTS[key] = _Choice(tuned, findings, run_id, findings["reused_from"])
            apply_process_settings(tuned, resolve_device(tuned.device))
            tuned, findings = _compile_pays_back(tuned, findings, planned_steps, time_capped)
            return _with_run_fields(tuned, config), {**findings, "seconds": 0.0}
    known = known or {}
    if known:  # those measured before start where they were chosen, and are not raced again
        # compile is set at the end: the probes measuring the rest run eager
        config = dataclasses.replace(config, **{k: v["choice"] for k, v in known.items()
                                                if k not in ("batch_size", "num_workers",
                                                             "compile")})
        if "batch_size" in known:
            config = dataclasses.replace(config, batch_size=tuned.batch_size,
                                         grad_accum_steps=tuned.grad_accum_steps)
        if "num_workers" in known:
            config = dataclasses.replace(config, num_workers=tuned.num_workers,
                                         persistent_workers=tuned.persistent_workers,
                                         prefetch_factor=tuned.prefetch_factor)

    def given(knob: str) -> dict[str, Any]:
        """A knob not measured now: set by the user, or measured before (see known)."""
        if knob in known:
            return {**known[knob], "reason": known[knob]["reason"] + " (measured earlier)"}
        return _set_by_user(config, knob)
    fixed = fixed | frozenset(known)
    started = time.perf_counter()
    device = resolve_device(config.device)
    effective = config.effective_batch_size  # what the batch fitting must hold
    knobs: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    log.info("autotune: measuring the speed knobs on %s at %d px, batch %d", device,
             config.image_size, config.batch_size)
    plan: list[tuple[str, list[Any]]] = []
    if device.type == "cpu":
        plan.append(("cpu_threads", thread_candidates()))
    plan += [("channels_last", [config.channels_last, not config.channels_last]),
             ("amp", amp_candidates(device, config.amp)),
             ("optimizer_impl", optimizer_candidates(device))]
    if device.type == "cpu":  # last: whether freed memory is worth keeping depends on the others
        plan.append(("cpu_allocator", hostmem.candidates()))
    # A knob measured for these settings at another size in this run starts at that choice:
    # it is the one to beat, and the one kept when the budget runs out before its races (a
    # short run at a smaller size often cannot afford them).
    carried_px, carried, carried_from = _measured_at_other_size(key, plan, run_id)
    if carried:
        plan = [(k, [carried[k]] + [c for c in cands if c != carried[k]]) if k in carried
                else (k, cands) for k, cands in plan]
        log.info("autotune: starting from the choices measured at %d px in %s (%s)",
                 carried_px, carried_from, ", ".join(f"{k} {_label(v)}"
                                                     for k, v in carried.items()))
    # Every measured knob starts at its first candidate (the thread count in use; "auto" names
    # the same amp and kernels differently), so the probe a knob's choice leaves is its
    # successor's first candidate, raced again rather than built again. compile is decided
    # last, against eager.
    # A compile the user asked for is set at the end too: probes compiled, each would pay a
    # warm-up no deadline bounds (the first alone took 97 s against an 11 s budget).
    asked_compile = config.compile
    config = dataclasses.replace(config, compile=False,
                                 **{k: c[0] for k, c in plan if k not in fixed})
    phases: dict[str, float] = {}
    if has_bytemask_dropout(config.model):  # decided first: every probe then trains with it
        if "dropout_impl" in fixed:
            knobs["dropout_impl"] = given("dropout_impl")
        else:
            mark = time.perf_counter()
            knobs["dropout_impl"] = dropout_by_layer(config, num_classes, device)
            config = dataclasses.replace(config, dropout_impl=knobs["dropout_impl"]["choice"])
            phases["dropout"] = time.perf_counter() - mark
            log.info("autotune: dropout_impl = %s (%s)", config.dropout_impl,
                     knobs["dropout_impl"]["reason"])
    mark = time.perf_counter()
    first, warm = _first_probe(config, num_classes, MIN_S_FLOOR)
    if first is None and warm["out_of_memory"] and tune_batch and "batch_size" not in fixed:
        # The memory probe runs only when the starting batch does not fit: it costs several
        # fresh models' first steps (each new shape's kernel selection on a GPU), which a
        # short run's budget cannot pay; the batch is refitted for the final knobs below.
        config, _ = _fit_batch(config, num_classes, device, effective)
        first, warm = _first_probe(config, num_classes, MIN_S_FLOOR)
    # A batch that still does not fit (one the user fixed, a resumed run's, or on a CPU, which
    # has no memory probe) is measured in the micro-batches the trainer's out-of-memory
    # recovery would train it in; before, every knob's candidates failed alike and the run
    # ended with "no cpu_threads setting could train".
    split_from, accum_from = config.batch_size, config.grad_accum_steps
    while first is None and warm["out_of_memory"] and config.batch_size > 1:
        accum = 2 * config.grad_accum_steps
        config = dataclasses.replace(config, batch_size=math.ceil(effective / accum),
                                     grad_accum_steps=accum)
        log.info("autotune: batch %d does not fit in memory here; measuring %d x %d "
                 "accumulation", split_from, config.batch_size, accum)
        first, warm = _first_probe(config, num_classes, MIN_S_FLOOR)
    split = config.batch_size < split_from and first is not None
    phases["first_probe"] = time.perf_counter() - mark
    current.update(probe=first, img_s=warm.get("img_s"))
    del first  # `current` holds the best probe so far, and only that one
    def planned_at(img_s: float | None) -> int | None:
        return _capped(planned_steps, time_capped, img_s, config.effective_batch_size)

    def budgeted_at(img_s: float | None) -> int | None:
        planned = planned_at(img_s)
        return None if planned is None else max(1, planned - unbudgeted_steps)

    min_s = measuring_time(budgeted_at(warm.get("img_s")), config.effective_batch_size,
                           warm.get("img_s"), sum(len(c) for k, c in plan if k not in fixed))
    def budget_at(img_s: float) -> float:
        return budget_share * budgeted_at(img_s) * config.effective_batch_size / img_s

    budget_s, fastest, said_s = None, 0.0, None

    def budget_left() -> float | None:
        """What is left of the budget, which shrinks as faster settings are measured: the run
        trains at the fastest, and a first probe slowed by its warm-up must not widen it. It is
        set by the first probe that measured a speed: when the first probe failed (settings
        that do not fit), by the first candidate that trained, so that the rest stays bounded."""
        nonlocal budget_s, fastest, said_s
        if budget_s is None:
            if budget_share is None or not planned_steps or not current.get("img_s"):
                return None
            fastest = current["img_s"]
            budget_s = said_s = budget_at(fastest)
            budgeted = budgeted_at(fastest)
            log.info("autotune: measuring budget %.1f s (%.0f%% of the planned %d steps%s)",
                     budget_s, 100 * budget_share, budgeted,
                     f"; not of the {planned_at(fastest) - budgeted} of a final run that may be "
                     "taken from another scenario" if planned_at(fastest) > budgeted else "")
        if (current.get("img_s") or 0.0) > fastest:
            fastest = current["img_s"]
            budget_s = budget_at(fastest)
            if f"{budget_s:.1f}" != f"{said_s:.1f}":  # the "not measured" lines quote it
                said_s = budget_s
                log.info("autotune: measuring budget now %.1f s: the planned steps take less "
                         "at the %.0f img/s measured since", budget_s, fastest)
        return budget_s - (time.perf_counter() - started)
    budget_left()  # the budget, when the first probe measured a speed
    # A challenger's warm-up is about as long as the first probe's, and on a GPU at least
    # GPU_WARMUP_S (cuDNN's algorithm search for each new layout or dtype; the first probe's
    # may have been paid by an earlier one at these shapes).
    warmup_s = max(warm.get("warmup_s") or 0.0, GPU_WARMUP_S if device.type == "cuda" else 0.0)

    def races_s(knob: str, candidates: list[Any]) -> float:
        step_s = config.batch_size / current["img_s"] if current.get("img_s") else 0.0
        return race_cost(knob, step_s, min_s, warmup_s) * (len(candidates) - 1)

    def deadline() -> float | None:
        left = budget_left()
        return None if left is None else time.perf_counter() + left
    if min_s < MIN_S:
        log.info("autotune: a short planned run: %.1f s per candidate, to measure within %.0f%% "
                 "of its time", min_s, 100 * MEASURE_SHARE)
    for knob, candidates in plan:
        if knob in fixed:
            knobs[knob] = given(knob)
            continue
        # A knob whose races cannot finish within what is left of the budget is not started;
        # one that runs past it anyway (a candidate slower than estimated) is cut at its end.
        left = budget_left()
        if left is not None and left < races_s(knob, candidates):
            knobs[knob] = {"choice": getattr(config, knob), "img_s": {}, "reason": (
                f"not measured: {max(0.0, left):.1f} s left of the measuring budget "
                f"({budget_s:.1f} s), too little for its races"
                + (f"; as measured at {carried_px} px in {carried_from}" if knob in carried
                   else ""))}
            log.info("autotune: %s = %s (%s)", knob, _label(knobs[knob]["choice"]),
                     knobs[knob]["reason"])
            continue
        mark = time.perf_counter()
        config, knobs[knob] = _pick(knob, candidates, config, num_classes, current, min_s,
                                    deadline)
        knobs[knob]["seconds"] = round(time.perf_counter() - mark, 2)
        phases["knobs"] = phases.get("knobs", 0.0) + knobs[knob]["seconds"]
        log.info("autotune: %s = %s (%s)", knob, _label(knobs[knob]["choice"]),
                 knobs[knob]["reason"])
    if current["probe"] is None:  # every knob fixed, and these settings cannot train here
        raise UserError(f"these settings could not train on this device: {warm['error']}")
    if "compile" in fixed:
        knobs["compile"] = given("compile")
        config = dataclasses.replace(config, compile=known["compile"]["choice"]
                                     if "compile" in known else asked_compile)
        if config.compile and "compile" not in known:
            knobs["compile"]["reason"] += " (the other knobs were measured eager)"
    else:
        mark = time.perf_counter()
        config, knobs["compile"] = _tune_compile(config, num_classes, current,
                                                 planned_at(current["img_s"]), budget_left())
        phases["compile"] = time.perf_counter() - mark
        log.info("autotune: compile = %s (%s)", _label(config.compile), knobs["compile"]["reason"])
    compute_img_s = current["img_s"]
    del current["probe"]  # its memory is not the batch probe's to count
    _release()
    apply_process_settings(config, device)  # leave the process as chosen, not as last measured
    cached = config.cache_decoded and loader_factory is None
    if "num_workers" in fixed:
        knobs["num_workers"] = given("num_workers")
        if cached and config.num_workers:  # kept for a final run at a size the cache misses
            knobs["num_workers"]["reason"] += (
                "; for images streamed from disk only: the decoded-image cache starts none")
    elif cached:
        config = dataclasses.replace(config, **NO_WORKERS)
        knobs["num_workers"] = {"choice": 0, "img_s": {}, "reason": (
            "the decoded-image cache gathers and augments batches in the training process; "
            "worker processes would only copy them")}
    elif loader_factory is not None:
        cores = usable_cpus()
        candidates = sorted({0, *[n for n in (2, 4, 8) if n <= cores]})
        left = budget_left()
        if left is not None and left <= 0:
            knobs["num_workers"] = {"choice": config.num_workers, "img_s": {}, "reason": (
                f"not measured: the measuring budget ({budget_s:.1f} s) was spent")}
        else:
            mark = time.perf_counter()
            n, knobs["num_workers"] = tune_workers(loader_factory(config), compute_img_s,
                                                   candidates, deadline=deadline())
            phases["workers"] = time.perf_counter() - mark
            config = dataclasses.replace(config, num_workers=n, persistent_workers=n > 0,
                                         prefetch_factor=None)
        log.info("autotune: num_workers = %d (%s)", config.num_workers,
                 knobs["num_workers"]["reason"])
    if "batch_size" in fixed:
        knobs["batch_size"] = given("batch_size")
    elif tune_batch and budget_s is not None and device.type == "cuda" and \
            budget_left() < (len(PROBE_BATCHES) + 1) * GPU_WARMUP_S:  # each probe a new shape
        knobs["batch_size"] = {"choice": config.batch_size, "img_s": {}, "reason": (
            f"not refitted for the chosen knobs: too little of the measuring budget "
            f"({budget_s:.1f} s) left for the memory probe; batch {config.batch_size} x "
            f"{config.grad_accum_steps} accumulation, which trained in the measurements "
            "(out-of-memory recovery splits it if needed)")}
    elif tune_batch:
        mark = time.perf_counter()
        config, knobs["batch_size"] = _fit_batch(config, num_classes, device, effective)
        phases["batch_fit"] = time.perf_counter() - mark
        log.info("autotune: batch = %d x %d accumulation (%s)", config.batch_size,
                 config.grad_accum_steps, knobs["batch_size"]["reason"])
    if split and "batch_size" in fixed:
        # The user's batch stays what the run learns with (a resumed checkpoint's too); the
        # trainer splits it as measured when its first step runs out of memory.
        measured_as = f"{config.batch_size} x {config.grad_accum_steps}"
        config = dataclasses.replace(config, batch_size=split_from, grad_accum_steps=accum_from)
        knobs["batch_size"] = {**knobs["batch_size"], "choice": split_from, "reason": (
            f"{knobs['batch_size']['reason']}; it ran out of memory at these settings, so the "
            f"knobs were measured in micro-batches ({measured_as} accumulation), as the "
            "trainer's out-of-memory recovery will train it")}
    elif split and "fits" not in knobs.get("batch_size", {"fits": None}):
        knobs["batch_size"] = {
            "choice": config.batch_size, "grad_accum_steps": config.grad_accum_steps,
            "img_s": {}, "reason": (
                f"batch {split_from} ran out of memory at these settings: effective batch "
                f"{effective} = {config.batch_size} x {config.grad_accum_steps} accumulation")}
    findings = {"device": str(device), "image_size": config.image_size,
              "compute_img_s": round(compute_img_s, 2), "seconds": round(time.perf_counter() - started, 1),
              "seconds_per_candidate": round(min_s, 2),
              "budget_s": None if budget_s is None else round(budget_s, 1),
              "planned_steps": planned_at(compute_img_s),
              "phases_s": {k: round(v, 2) for k, v in phases.items()}, "knobs": knobs}
    log.info("autotune: %.1f img/s pure compute after %.1f s of measuring (%s)", compute_img_s,
             findings["seconds"], ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                            for k, v in phases.items()))
    _RESULTS[key] = _Choice(config, findings, run_id,
                            f"{cache_path or 'no cache file'}, {time.strftime('%Y-%m-%d %H:%M')}")
    if cache_path:
        _to_cache(cache_path, key, config, findings)
    return config, findings


def speed_key(config: TrainConfig, num_classes: int, fixed: frozenset[str] = frozenset(),
              tune_batch: bool = True, cached_data: bool = True, data_key: str | None = None
              ) -> str:
    """What an autotune choice depends on: the settings that change a step's speed (device,
    model, size, batch, the starting knobs), not what the run learns (lr, epochs ...); on the
    streaming path also the data, whose decoding the worker count is measured against."""
    speed = {k: v for k, v in config.to_dict().items() if k not in LEARNING_ONLY}
    key = {"config": speed, "classes": num_classes, "fixed": sorted(fixed),
           "tune_batch": tune_batch, "cached_data": cached_data}
    if not cached_data and data_key:
        key["data"] = data_key
    return json.dumps(key, sort_keys=True)


def _capped(planned_steps: int | None, time_capped: tuple[int, float] | None,
            img_s: float | None, effective_batch: int) -> int | None:
    """planned_steps, of which time_capped's (steps, seconds) count only as far as the seconds
    reach at img_s."""
    if planned_steps is None or time_capped is None or not img_s:
        return planned_steps
    steps, seconds = time_capped
    reach = int(seconds * img_s / effective_batch)
    return planned_steps - steps + min(steps, reach)


def _budget_skipped(entry: dict[str, Any]) -> bool:
    """Whether a knob was left unmeasured for lack of budget or of planned steps."""
    reason = str(entry.get("reason", ""))
    unraced = any(str(v).startswith("not measured") for v in (entry.get("img_s") or {}).values())
    return unraced or reason.startswith(("not measured", "not tried", "not refitted")) or \
        "abandoned" in reason


def _measure_rest(findings: dict[str, Any], planned_steps: int | None,
                  time_capped: tuple[int, float] | None, tuned: TrainConfig, where: str,
                  budget_share: float | None) -> dict[str, dict[str, Any]] | None:
    """None: reuse an earlier choice whole. Else the knobs it measured, to keep while those it
    left unmeasured for lack of budget are measured now: for a run planned so much longer
    that its budget holds a new first probe and a race more than the earlier one had, or,
    for compile, long enough that compile would be tried."""
    knobs = findings.get("knobs") or {}
    before, img_s = findings.get("planned_steps"), findings.get("compute_img_s")
    if planned_steps is None or not isinstance(before, int) or not img_s:
        return None
    now = _capped(planned_steps, time_capped, img_s, tuned.effective_batch_size)
    if now is None or now <= before:
        return None
    step_s = tuned.effective_batch_size / img_s
    old_budget = findings.get("budget_s") or 0.0
    more_budget = budget_share is None or budget_share * now * step_s > old_budget + (
        findings.get("phases_s") or {}).get("first_probe", 0.0) + 2 * (findings.get(
        "seconds_per_candidate") or MIN_S)
    skipped = [k for k, v in knobs.items() if isinstance(v, dict) and _budget_skipped(v) and (
        (now * step_s * COMPILE_BEST_GAIN >= COMPILE_WARMUP_FLOOR_S) if k == "compile" and
        str(v.get("reason", "")).startswith("not tried: the planned") else more_budget)]
    if not skipped:
        return None
    log.info("autotune: the choice measured %s, for %d planned steps, left %s unmeasured; this "
             "run plans %d: measuring those", where, before, ", ".join(skipped), now)
    return {k: v for k, v in knobs.items()
            if k not in skipped and isinstance(v, dict) and v.get("reason") != "set by the user"}


def _measured_at_other_size(key: str, plan: list[tuple[str, list[Any]]], run_id: str | None
                            ) -> tuple[int | None, dict[str, Any], str]:
    """The knobs of `plan` raced in this process for the settings of `key` at the nearest
    other input size where any was: (that size, {knob: choice}, the run that raced them);
    (None, {}, "") when none were. Only raced choices among the plan's candidates count, not
    those kept unmeasured, so no guess is passed on."""
    candidates = dict(plan)
    want = json.loads(key)
    size = want["config"].pop("image_size")
    best: tuple[int, int, dict[str, Any], str] | None = None
    for other, choice in _RESULTS.items():
        findings = choice.findings
        have = json.loads(other)
        other_size = have["config"].pop("image_size")
        if have != want or other_size == size:
            continue
        raced = {k: v["choice"] for k, v in findings["knobs"].items()
                 if v.get("img_s") and not _budget_skipped(v)
                 and v["choice"] in candidates.get(k, ())}
        if raced and (best is None or abs(other_size - size) < best[0]):
            best = (abs(other_size - size), other_size, raced, _source(choice, run_id))
    return (best[1], best[2], best[3]) if best else (None, {}, "")


def _source(choice: _Choice, run_id: str | None) -> str:
    """Where a choice made in this process came from, as a reuse names it: a notebook's
    kernel runs one run after another, each reusing the last one's. A choice this process
    took from a cache file names that file and when it was measured: it was not measured in
    this run, nor in the run that took it."""
    if choice.findings.get("reused_from"):
        return choice.findings["reused_from"]
    if choice.run_id == run_id:
        return "this run"
    return f"run {choice.run_id}, earlier in this process ({choice.origin})"


def _with_run_fields(tuned: TrainConfig, start: TrainConfig) -> TrainConfig:
    """A reused choice, with this run's own training settings (lr, epochs, seed ...)."""
    return dataclasses.replace(tuned, **{k: getattr(start, k) for k in LEARNING_ONLY})


@functools.lru_cache(maxsize=1)  # the machine does not change within a process
def machine_key() -> str:
    """The machine an autotune choice was measured on: CPU model and flags, the CPUs this
    process may use, GPU name and torch version. A change in any of them measures again."""
    try:
        cpu = cpu_identity(Path("/proc/cpuinfo").read_text())
    except OSError:  # macOS, Windows
        cpu = " ".join([platform.machine(), platform.processor(), _sysctl_cpu()])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no gpu"
    parts = [cpu, str(usable_cpus()), gpu, torch.__version__, *kernel_caps()]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def kernel_caps() -> list[str]:
    """What caps the CPU kernels PyTorch uses, whichever variable set it: ATen's capability in
    effect, whether oneDNN runs bf16 natively, every ONEDNN_/DNNL_/ATEN_CPU_ variable (oneDNN
    also reads its older DNNL_MAX_CPU_ISA name, which capped bf16 6x slower), and the thread
    count variables (a thread count left unmeasured keeps the one they set)."""
    try:
        bf16 = str(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        bf16 = "?"
    env = sorted(f"{k}={v}" for k, v in os.environ.items()
                 if k.startswith(("ONEDNN_", "DNNL_", "ATEN_CPU_"))
                 or k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
    return [torch.backends.cpu.get_cpu_capability(), bf16, *env]


# /proc/cpuinfo's fields that name a non-x86 CPU: Arm's core and features, RISC-V's ISA.
_OTHER_CPU_FIELDS = ("Features", "CPU implementer", "CPU architecture", "CPU variant",
                     "CPU part", "Hardware", "isa", "uarch", "cpu model")


def cpu_identity(cpuinfo: str) -> str:
    """The CPU's model and features, from /proc/cpuinfo's text."""
    lines = {k.strip(): v.strip() for k, v in
             (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)}
    cpu = " ".join(lines.get(k, "") for k in ("model name", "flags"))
    # Arm and others name the core and its features in fields x86 does not have
    return cpu + "".join(f" {k}={lines[k]}" for k in _OTHER_CPU_FIELDS if k in lines)


def _sysctl_cpu() -> str:
    """macOS, which has no /proc/cpuinfo: the CPU's name and features from sysctl ("" elsewhere)."""
    if platform.system() != "Darwin":
        return ""
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string", "machdep.cpu.features"],
                             capture_output=True, text=True, timeout=5)
        return " ".join(out.stdout.split())
    except (OSError, subprocess.SubprocessError):
        return ""


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache file's entries; {} when there is none. One that cannot be parsed (torn by a
    full disk, edited) is kept aside, said once, rather than written over with one entry."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError: not text
        log.info("autotune: cannot read %s (%s); measuring again", path, _error(exc))
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        return data
    aside = Path(path).with_name(Path(path).name + ".unreadable")
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    log.warning("autotune: %s is not a cache this version wrote; kept aside as %s, measuring "
                "again", path, aside.name)
    return {}


def _cache_entry(path: str | Path, key: str) -> dict[str, Any] | None:
    machine = _read_cache(Path(path)).get(machine_key())
    entry = machine.get(key) if isinstance(machine, dict) else None
    return entry or None


def _valid_report(report: Any) -> dict[str, Any]:
    """A cached report as this version reads it, else ValueError: its knobs a dict of knob
    dicts, its figures numbers (an edited or older file must not fail later, mid-run)."""
    report = dict(report)
    knobs = report.get("knobs")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if not isinstance(knobs, dict) or not all(
            k in fields and isinstance(v, dict) and "choice" in v
            and isinstance(v.get("img_s") or {}, dict) and isinstance(v.get("reason", ""), str)
            for k, v in knobs.items()):
        raise ValueError("its knobs are not this version's")
    phases = report.get("phases_s") or {}
    if not isinstance(phases, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in phases.values()):
        raise ValueError("phases_s is not this version's")
    for k, v in knobs.items():  # a choice TrainConfig refuses would fail mid-run (UserError)
        dataclasses.replace(TrainConfig(), **{k: v["choice"]})
    for name in ("compute_img_s", "budget_s", "planned_steps", "seconds_per_candidate"):
        value = report.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise ValueError(f"{name} is not a number of 0 or more")
    if report.get("compute_img_s") is not None and report["compute_img_s"] <= 0:
        raise ValueError("compute_img_s is not a speed")
    return report


def _valid_config(values: Any) -> TrainConfig:
    """A cached config, its switches booleans ("no" would be true)."""
    config = TrainConfig(**values)
    for f in dataclasses.fields(TrainConfig):
        if isinstance(f.default, bool) and not isinstance(getattr(config, f.name), bool):
            raise ValueError(f"{f.name} is not true or false")
    return config


def _from_cache(path: str | Path, key: str) -> tuple[TrainConfig, dict[str, Any]] | None:
    entry = _cache_entry(path, key)
    if entry is None:
        return None
    try:
        tuned = _valid_config(entry["config"])
        report = _valid_report(entry["report"])
    except (KeyError, TypeError, ValueError, UserError) as exc:  # another version's, or edited
        log.info("autotune: cannot reuse the entry in %s (%s); measuring again", path,
                 _error(exc))
        return None
    measured = entry.get("measured", "?")
    raced = any(sum(isinstance(x, (int, float)) for x in (v.get("img_s") or {}).values()) >= 2
                for v in report["knobs"].values())
    what = "the choice measured" if raced else "the settings kept unmeasured (no knob raced)"
    log.info("autotune: reusing %s on this machine on %s (%s)", what, measured, path)
    return tuned, {**report, "reused_from": f"{path} ({measured})"}


def _to_cache(path: str | Path, key: str, config: TrainConfig, findings: dict[str, Any]) -> None:
    data = _read_cache(Path(path))
    if not isinstance(data.get(machine_key()), dict):  # absent, or not this version's shape
        data[machine_key()] = {}
    data[machine_key()][key] = {
        "config": config.to_dict(), "report": findings,
        "measured": time.strftime("%Y-%m-%d %H:%M")}
    try:
        atomic_write_text(json.dumps(data, indent=1, default=str), Path(path))
    except (OSError, UserError) as exc:  # a cache that cannot be written (a read-only folder)
        log.warning("autotune: could not write %s (%s); the next run measures again", path,
                    first_line(exc))


def _fit_batch(config: TrainConfig, num_classes: int, device: torch.device,
               effective: int | None = None) -> tuple[TrainConfig, dict[str, Any]]:
    """Micro-batch and accumulation that hold the effective batch within the device's memory
    (micro x accumulation may round it up by less than one sample per micro-batch)."""
    effective = effective or config.effective_batch_size
    # as many probes as up to `effective` (the third, when the line says more fit, is larger)
    upto = max(effective, PROBE_UPTO)
    fits = max_batch_size(config, num_classes, device, upto=upto)
    if fits is None:
        return config, {"choice": config.batch_size, "img_s": {}, "reason": (
            "CPU: RAM, not device memory, bounds the batch here, and "
            f"{config.batch_size} samples take a small share of it; effective batch {effective}")}
    accum = math.ceil(effective / max(1, fits))
    micro = math.ceil(effective / accum)
    chosen = dataclasses.replace(config, batch_size=micro, grad_accum_steps=accum)
    reason = (f"the memory probe fits up to {fits} samples per step at {config.image_size} px; "
              f"effective batch {micro * accum} = {micro} x {accum}"
              + (f" (asked for {effective})" if micro * accum != effective else ""))
    return chosen, {"choice": micro, "grad_accum_steps": accum, "fits": fits,
                    "probed_upto": upto, "reason": reason, "img_s": {}}
