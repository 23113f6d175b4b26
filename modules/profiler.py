"""The torch.profiler trace of a few training steps (TorchProfiler). The machine's sampler
(modules.monitor) and the bottleneck diagnosis (modules.diagnosis) keep their old names here."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from modules.config import UserError, first_line
from modules.device import native_bf16_cpu  # noqa: F401  (its old home)
from modules.diagnosis import BOTTLENECKS, THRESHOLDS, Thresholds, diagnose  # noqa: F401
from modules.files import atomic_write_text
from modules.monitor import SystemSampler  # noqa: F401

log = logging.getLogger(__name__)


KEY_AVERAGES_TXT = "key_averages.txt"
PARTIAL_TRACE = "*.pt.trace.json.tmp"  # Kineto's trace while it is written


# ----------------------------------------------------------------------------- torch.profiler

class TorchProfiler:
    """`torch.profiler.profile` over a few training steps; call `step()` once per step.

    Writes a `*.pt.trace.json` (TensorBoard's profiler plugin, Perfetto, chrome://tracing) and
    `key_averages.txt` (the 40 costliest ops) to trace_dir. enabled=False makes it a no-op.
    """

    def __init__(self, trace_dir: str | os.PathLike, *, enabled: bool = True, wait: int = 1,
                 warmup: int = 1, active: int = 3, repeat: int = 1,
                 device: str | torch.device | None = None):
        """device: the one the steps train on, whose time the ops table is sorted by (a CPU
        run on a GPU machine: by CPU time, not by a column of zeros); None: CUDA when
        present."""
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
        self._cuda = torch.cuda.is_available() if device is None else \
            torch.device(device).type == "cuda"

    def __enter__(self) -> TorchProfiler:
        if not self.enabled:
            return self
        activities = [ProfilerActivity.CPU]
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        elif not torch.cuda.is_available():
            # Kineto's console lines where there is no GPU: "ERROR: gpuGetDeviceCount failed"
            # (it looks for one) and a USDT marker at each start and stop, read as failures.
            # A GPU run keeps them (CUPTI's errors say why a GPU trace is empty); the user's
            # own setting stands. Read at the process's first trace.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        try:  # as at its end: the trace is a side product, never worth the run
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            self._handler = torch.profiler.tensorboard_trace_handler(str(self.trace_dir))
            prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup,
                                                 active=self.active, repeat=self.repeat),
                record_shapes=True, profile_memory=True, on_trace_ready=self._trace_ready)
            prof.__enter__()
        except Exception as err:  # a folder it cannot make, a profiler that cannot start
            log.warning("profiler: could not start a trace in %s (%s: %s); training without it",
                        self.trace_dir, type(err).__name__, first_line(err))
            return self
        self._prof = prof
        return self

    @property
    def recording(self) -> bool:
        """Whether the step now running is profiled (warm-up or recorded): slower than others."""
        return self._prof is not None and self._prof.current_action != ProfilerAction.NONE

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
            if self.traces_written == 0 and self._steps == 0:  # a finished run, resumed
                earlier = any(self.trace_dir.glob("*.pt.trace.json*"))
                log.info("profiler: no training step in this session; %s", (
                    f"{self.trace_dir} keeps an earlier session's trace" if earlier else
                    f"no trace written to {self.trace_dir}"))
            elif self.traces_written == 0:
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
        before = set(self.trace_dir.glob(PARTIAL_TRACE))
        try:
            self._handler(prof)
            # Kineto writes the trace to <name>.tmp and renames it when whole; a write that
            # failed (a full disk) raises nothing and leaves the .tmp, as large as the trace
            partial = set(self.trace_dir.glob(PARTIAL_TRACE)) - before
            if partial:
                for path in partial:
                    path.unlink(missing_ok=True)
                raise OSError("the trace file was not written whole: is the disk full?")
            self.traces_written += 1
            sort_by = "self_cuda_time_total" if self._cuda else "self_cpu_time_total"
            self.averages = prof.key_averages()
            table = self.averages.table(sort_by=sort_by, row_limit=40)
            atomic_write_text(table + "\n", self.trace_dir / KEY_AVERAGES_TXT)
            log.info("profiler: trace of steps up to %d written to %s", self._steps,
                     self.trace_dir)
        except Exception as err:  # the first clause of a UserError: its advice is a run's
            log.warning("profiler: could not write the trace to %s (%s); training goes on "
                        "without it", self.trace_dir, first_line(err).split("; ")[0])
