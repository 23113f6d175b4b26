"""Training throughput, side by side in one process on one machine:

  pure_compute_img_s  forward + backward + optimizer step on in-memory tensors, with the best
                      settings the autotuner finds: the limit for this model here
  pipeline_img_s      our optimized end-to-end training on an image folder (decoded cache,
                      batched augmentation, autotuned knobs), steady state
  baseline_img_s      the seed-style loop: fp32, NCHW, per-sample PIL decode every epoch,
                      num_workers=0
  lightning_img_s     PyTorch Lightning's Trainer with a conventional setup: ImageFolder,
                      torchvision transforms, DataLoader with workers and pin_memory, default
                      precision (what a user would pick instead)

Each figure is the median throughput after warm-up, per step on a CPU and, on a GPU, per window
of a few steps with one wait for the device at each window's end (StepClock).
`--time-to-accuracy` also trains the baseline and the optimized setup on the synthetic data and
reports how long each takes to reach the baseline's final validation accuracy.

  python benchmarks/throughput.py --device cpu --json others/throughput.json
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from modules import fastdata  # noqa: E402
from modules.autotune import ComputeProbe, autotune  # noqa: E402
from modules.config import MODELS, TrainConfig, UserError  # noqa: E402
from modules.dataset import index_dataset, subset  # noqa: E402
from modules.models import build_model  # noqa: E402
from modules.profiler import TorchProfiler  # noqa: E402
from modules.synthetic import ensure_synthetic  # noqa: E402
from modules.device import REGIONS, apply_process_settings, resolve_device  # noqa: E402
from modules.trainer import fit  # noqa: E402
from scenario import optimized_settings  # noqa: E402

log = logging.getLogger("throughput")

DEFAULT_THREADS = torch.get_num_threads()  # PyTorch's own choice, before anything tunes it
WARMUP_STEPS = 3  # steps left out of every median: allocator growth, cuDNN autotuning, caches


GPU_WINDOW = 8  # steps per timed window on a GPU (see StepClock)


class StepClock:
    """Passed to the trainer as its `profiler` (the trainer calls step() after every batch), and
    called after every step of the other rows: one clock times every row alike.

    The first `warmup` steps are left out. On a CPU every step is one sample. On a GPU the
    clock waits for the device only once per `window` steps: the trainer never waits between
    steps, and a wait after every step would keep the host from queueing the next batch while
    the device finishes the last one, a cost training does not pay and one that falls on the
    pipeline (with a batch to prepare) more than on pure compute."""

    def __init__(self, device: torch.device, window: int = 1, warmup: int = WARMUP_STEPS):
        self.device, self.warmup = device, warmup
        self.window = self.steps_per_sample(device, window)
        self.steps, self.stamps = 0, []
        if warmup == 0:  # the first window starts now
            self._stamp()

    @staticmethod
    def steps_per_sample(device: torch.device, window: int) -> int:
        """Steps between two stamps: `window` on a GPU, 1 on a CPU."""
        return max(1, window) if device.type == "cuda" else 1

    def _stamp(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())

    def _ends_window(self) -> bool:
        """Whether a stamp falls after the step just counted: the warm-up's end opens the first
        timed window, and every `window` steps after it one closes."""
        return self.steps >= self.warmup and (self.steps - self.warmup) % self.window == 0

    def step(self) -> None:
        self.steps += 1
        if self._ends_window():
            self._stamp()

    def img_s(self, batch_size: int) -> float:
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        if not gaps:
            raise UserError("too few steps to measure; raise --images-per-class.")
        return batch_size * self.window / statistics.median(gaps)


def gpu_window(steps: int, pass_batches: int = 1) -> int:
    """Steps per timed window on a GPU: GPU_WINDOW, or fewer when an epoch of `steps` would not
    leave three windows after the warm-up; always a multiple of the pipeline's batches per
    augmentation pass (fastdata.batches_per_pass), so that every window holds as many passes
    (a median over windows of which some held none would leave the augmentation out)."""
    passes = max(1, min(-(-GPU_WINDOW // pass_batches), (steps - WARMUP_STEPS) // 3 // pass_batches))
    return passes * pass_batches


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores"


def dataset(args, cache_dir: Path):
    root = ensure_synthetic(cache_dir / "synthetic", args.images_per_class + 10, 10)
    # The images generated for this size only: a cache another run grew holds more, and the
    # split would differ with them.
    index = index_dataset(root, "synthetic", seed=0, numbered_below={
        "train": args.images_per_class + 10, "test": 10})
    return subset(index, {"train": args.images_per_class, "val": 10, "test": 10})


def base_config(args, device: torch.device) -> TrainConfig:
    """The baseline scenario's setup at the benchmark's size and batch."""
    return TrainConfig(model=args.model, weights="none", image_size=args.image_size,
                       batch_size=args.batch_size, epochs=1, lr=1e-3, optimizer="adam",
                       scheduler="cosine", amp="off", channels_last=False, num_workers=0,
                       device=device.type, progress=False, seed=0, cpu_threads=DEFAULT_THREADS)


def optimized_start(args, device: torch.device, **overrides) -> TrainConfig:
    """The tuned scenarios' starting setup (scenario.optimized_settings) on the baseline's config."""
    return dataclasses.replace(base_config(args, device),
                               **{**optimized_settings(device), **overrides})


def optimized_config(args, device: torch.device, planned_steps: int | None):
    start = optimized_start(args, device, batch_size=args.batch_size)
    fixed = frozenset({"compile"}) if args.no_compile else frozenset()
    # The batch stays the benchmark's: every row is measured at the same batch size.
    return autotune(start, 6, planned_steps=planned_steps, fixed=fixed, tune_batch=False)


def trainer_img_s(index, config: TrainConfig, device: torch.device, window: int) -> float:
    clock = StepClock(device, window)
    fit(index, config, profiler=clock)  # every config here has weights="none"
    return clock.img_s(config.batch_size)


def pure_compute_img_s(config: TrainConfig, steps: int, window: int) -> float:
    """Training steps on one in-memory batch, timed by the same clock as the trainer's rows."""
    probe = ComputeProbe(config, 6)
    clock = StepClock(probe.device, window)
    for _ in range(WARMUP_STEPS + max(steps, 3 * clock.window)):
        probe.step()
        clock.step()
    return clock.img_s(probe.batch)


class PairedClock(StepClock):
    """The pipeline's clock, with pure compute timed in between: after every window of pipeline
    steps the probe takes as many steps of its own, so the two rows alternate window by window
    and the machine's drift (5-10% within seconds on a shared VM) falls on both alike. Measured
    one after the other, single rounds of the ratio ranged 0.79-1.06 on a 2-core CPU.

    Each pipeline window is timed from the end of the probe's window before it, so it holds
    everything a training step does: the next batch's gather and augmentation, the step, the
    trainer's bookkeeping. The probe also takes a step after each of the first warm-up steps."""

    def __init__(self, probe: ComputeProbe, device: torch.device, window: int = 1,
                 warmup: int = WARMUP_STEPS):
        probe.step()  # the probe's first step: allocations, as the pipeline's first step has
        super().__init__(device, window, warmup)
        self.probe = probe
        self.pure_gaps: list[float] = []
        self.pipe_gaps: list[float] = []
        self._end = self.stamps[-1] if self.stamps else None  # warmup 0: timed from now

    def step(self) -> None:
        self.steps += 1
        if self.steps < self.warmup:
            self.probe.step()
            return
        if not self._ends_window():
            return
        self._stamp()
        if self._end is not None:
            self.pipe_gaps.append(self.stamps[-1] - self._end)
        for _ in range(self.window):
            self.probe.step()
        self._stamp()
        self._end = self.stamps[-1]
        self.pure_gaps.append(self._end - self.stamps[-2])

    def img_s_pair(self, batch_size: int) -> tuple[float, float]:
        """(pure compute img/s, pipeline img/s): medians of their windows."""
        if not self.pipe_gaps:
            raise UserError("too few steps to measure; raise --images-per-class.")
        per = batch_size * self.window
        return per / statistics.median(self.pure_gaps), per / statistics.median(self.pipe_gaps)


def paired_img_s(index, config: TrainConfig, device: torch.device, window: int
                 ) -> tuple[float, float]:
    """(pure compute, pipeline) img/s, measured window by window in alternation (PairedClock)."""
    clock = PairedClock(ComputeProbe(config, 6), device, window)
    fit(index, config, profiler=clock)
    return clock.img_s_pair(config.batch_size)


class _SyncedProfiler:
    """The trainer's `profiler`: waits for the device after every step (StepClock waits once
    per window), so that each traced step's device work falls within its own step."""

    def __init__(self, prof: TorchProfiler, device: torch.device):
        self.prof, self.device = prof, device

    def step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.step()


def _step_figures(averages, steps: int, cuda: bool) -> tuple[dict[str, float | None], dict, dict]:
    """(wall / host-op / device milliseconds and ATen calls / kernel launches per step,
    {op: host us/step}, {kernel: device us/step}) from one trace's key_averages. Host ops are
    ATen operators' own time; the rest of the wall is Python and dispatch between them (and, on
    a GPU, waiting for it). On a launch-bound GPU every call and launch costs host time."""
    host, device, wall, calls, launches = {}, {}, 0.0, 0, 0
    for e in averages:
        if e.key.startswith("ProfilerStep"):  # on a GPU also a device-side entry, 0 on the host
            wall = max(wall, e.cpu_time_total / max(1, e.count))
        elif e.key.startswith("aten::"):
            host[e.key] = e.self_cpu_time_total / steps
            calls += e.count
        elif e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            launches += e.count
        own = getattr(e, "self_device_time_total", None)
        if own is None:
            own = getattr(e, "self_cuda_time_total", 0.0)
        if cuda and own and not e.key.startswith(("aten::", "ProfilerStep")) \
                and e.key not in REGIONS:
            device[e.key] = own / steps  # kernels and memcpys
    figures = {"wall_ms": wall / 1000, "host_ops_ms": sum(host.values()) / 1000,
               "device_ms": sum(device.values()) / 1000 if cuda else None,
               "aten_calls": round(calls / steps, 1),
               "kernel_launches": round(launches / steps, 1) if cuda else None}
    return figures, host, device


def trace_gap(index, config: TrainConfig, device: torch.device, trace_dir: Path,
              steps_per_epoch: int) -> dict:
    """One traced pass of pure compute and of the pipeline (torch.profiler, TensorBoard traces
    under trace_dir) and where the pipeline's extra time per step goes."""
    active = max(1, min(10, steps_per_epoch - WARMUP_STEPS))
    cuda = device.type == "cuda"
    with TorchProfiler(trace_dir / "pure_compute", wait=0, warmup=WARMUP_STEPS,
                       active=active) as prof:
        probe, synced = ComputeProbe(config, 6), _SyncedProfiler(prof, device)
        for _ in range(WARMUP_STEPS + active):
            probe.step()
            synced.step()
    pure = _step_figures(prof.averages, active, cuda)
    with TorchProfiler(trace_dir / "pipeline", wait=0, warmup=WARMUP_STEPS,
                       active=active) as prof:
        fit(index, config, profiler=_SyncedProfiler(prof, device))
    if prof.averages is None:
        raise UserError("the pipeline's trace recorded no steps; raise --images-per-class.")
    pipe = _step_figures(prof.averages, active, cuda)

    def extra(ours: dict, theirs: dict) -> dict[str, float]:
        gaps = {k: round(v - theirs.get(k, 0.0), 1) for k, v in ours.items()}
        return dict(sorted(((k, v) for k, v in gaps.items() if v > 0), key=lambda kv: -kv[1])[:8])

    result = {"steps": active, "trace_dir": str(trace_dir)}
    for key in ("wall_ms", "host_ops_ms", "device_ms", "aten_calls", "kernel_launches"):
        a, b = pure[0][key], pipe[0][key]
        result[key] = {"pure_compute": None if a is None else round(a, 3),
                       "pipeline": None if b is None else round(b, 3)}
    result["extra_host_us"] = extra(pipe[1], pure[1])
    if cuda:
        result["extra_device_us"] = extra(pipe[2], pure[2])
    return result


def print_trace(trace: dict) -> None:
    print(f"\ntraced steps ({trace['steps']} each; TensorBoard: tensorboard --logdir "
          f"{trace['trace_dir']}), milliseconds per step:\n")
    print("| | pure_compute | pipeline | extra |\n| --- | ---: | ---: | ---: |")
    labels = {"wall_ms": "wall", "host_ops_ms": "host: ATen ops",
              "device_ms": "device: kernels and copies", "aten_calls": "ATen calls (count)",
              "kernel_launches": "kernel launches (count)"}
    for key, label in labels.items():
        a, b = trace[key]["pure_compute"], trace[key]["pipeline"]
        if a is not None and b is not None:
            digits = 0 if key in ("aten_calls", "kernel_launches") else 2
            print(f"| {label} | {a:.{digits}f} | {b:.{digits}f} | {b - a:+.{digits}f} |")
    for key, label in (("extra_host_us", "host"), ("extra_device_us", "device")):
        if trace.get(key):
            print(f"\nthe pipeline's extra {label} time per step, microseconds: " + ", ".join(
                f"{name} +{us:.0f}" for name, us in trace[key].items()))


LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning")  # the 2.x name, and the older one


def _lightning_package() -> str | None:
    """The name PyTorch Lightning is installed under here, or None."""
    return next((n for n in LIGHTNING_PACKAGES if importlib.util.find_spec(n) is not None), None)


def lightning_img_s(index, args, device: torch.device, window: int) -> float:
    """Lightning's Trainer as a user would set it up: ImageFolder and torchvision transforms."""
    package = _lightning_package()
    L = importlib.import_module(package)
    # Lightning gives its logger a handler of its own and lets it propagate to ours as well,
    # so each of its lines came out twice; and its banner (accelerators, a product tip) is
    # not the benchmark's business. Its warnings still reach our handler, once.
    lightning_log = logging.getLogger(package)
    lightning_log.handlers.clear()
    lightning_log.setLevel(logging.WARNING)
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms as T

    from modules.config import IMAGENET_MEAN, IMAGENET_STD

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(args.model, len(index.classes), "none")

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Clock(L.Callback):
        def __init__(self):
            self.clock = StepClock(device, window)

        def on_train_batch_end(self, *_):
            self.clock.step()

    folder = Path(index.train[0][0]).parents[1]
    transform = T.Compose([T.RandomResizedCrop(args.image_size, scale=(0.6, 1.0)),
                           T.RandomHorizontalFlip(), T.ToTensor(),
                           T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    images = datasets.ImageFolder(str(folder), transform=transform)
    train_paths = {str(Path(p).resolve()) for p, _ in index.train}  # the same images as ours
    images.samples = [s for s in images.samples if str(Path(s[0]).resolve()) in train_paths]
    images.targets = [label for _, label in images.samples]
    workers = min(4, os.cpu_count() or 1)
    loader = DataLoader(images, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=workers, pin_memory=device.type == "cuda",
                        persistent_workers=True)
    clock = Clock()
    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=1, accelerator="gpu" if device.type == "cuda" else "cpu",
                        devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[clock], num_sanity_val_steps=0)
    # The process-wide knobs as the baseline's setup has them (our trainer does this for the
    # baseline from its config): a Lightning user's process has not had them tuned.
    apply_process_settings(base_config(args, device), device)
    trainer.fit(Classifier(), train_dataloaders=loader)
    return clock.clock.img_s(args.batch_size)


def round_order(runs: list[str], r: int) -> list[str]:
    """The rows' order in round r: reversed every other round, so that each pair of rows swaps
    order (swapping neighbours left the last row always last)."""
    return list(runs) if r % 2 == 0 else list(runs)[::-1]


def time_to_accuracy(args, device: torch.device, cache_dir: Path) -> dict:
    """Wall time of baseline and optimized training to the baseline's final val accuracy."""
    per_class = args.tta_per_class + args.tta_val_per_class
    root = ensure_synthetic(cache_dir / "synthetic", per_class, 40)
    index = subset(index_dataset(root, "synthetic", seed=0,
                                 val_fraction=args.tta_val_per_class / per_class,
                                 numbered_below={"train": per_class, "test": 40}),
                   {"train": args.tta_per_class, "val": args.tta_val_per_class, "test": 40})
    base = dataclasses.replace(base_config(args, device), image_size=args.tta_image_size,
                               batch_size=32, epochs=args.tta_epochs)
    started = time.perf_counter()
    result = fit(index, base)
    baseline_s = time.perf_counter() - started  # what it took to end with its model
    # The model it ends with is its best epoch's (restored), as a scenario row's val_acc.
    target = result.best_val_acc

    class Reached(Exception):
        pass

    reached: dict = {}

    def stop_when_reached(epoch: int, row: dict) -> None:
        if row["val_acc"] >= target:
            reached.update(epoch=epoch, val_acc=row["val_acc"],
                           wall_s=time.perf_counter() - started)
            raise Reached

    started = time.perf_counter()  # the optimized clock includes autotune and decoding
    start = optimized_start(args, device, image_size=base.image_size, epochs=base.epochs)
    steps = base.epochs * max(1, len(index.train) // start.batch_size)
    opt, findings = autotune(start, len(index.classes), planned_steps=steps,
                             fixed=frozenset({"compile"}) if args.no_compile else frozenset())
    try:
        result = fit(index, opt, on_epoch=stop_when_reached)
        final = result.history[-1]
    except Reached:
        final = None
    optimized_s = reached.get("wall_s", time.perf_counter() - started)
    return {"target_val_acc": target, "baseline_s": round(baseline_s, 1),
            "baseline_epochs": base.epochs, "optimized_s": round(optimized_s, 1),
            "optimized_epochs": reached.get("epoch"), "reached": bool(reached),
            "optimized_final_val_acc": reached.get("val_acc", final and final["val_acc"]),
            "ratio": round(optimized_s / baseline_s, 3) if reached else None,
            "image_size": base.image_size,
            "val_images": len(index.val),
            "autotune_s": findings["seconds"], "optimized_settings": {
                k: getattr(opt, k) for k in ("amp", "channels_last", "batch_size",
                                             "optimizer_impl", "dropout_impl", "cpu_threads",
                                             "compile")}}


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes are one line (no usage block), as pipeline.py's."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see python {self.prog} --help)\n")


def at_least_1(text: str) -> int:
    """An argparse type: a whole number of 1 or more (0 rounds left no median to print)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


ROWS = ("pure_compute", "pipeline", "baseline", "lightning")


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--model", choices=MODELS, default="squeezenet1_1")
    p.add_argument("--image-size", type=at_least_1, default=150)
    p.add_argument("--batch-size", type=at_least_1, default=32)
    p.add_argument("--images-per-class", type=at_least_1, default=100,
                   help="training images per class (6 classes); one epoch is measured")
    p.add_argument("--steps", type=at_least_1, default=20,
                   help="timed pure-compute steps when the pipeline row is skipped (else pure "
                        "compute is timed in alternation with the pipeline, window by window)")
    p.add_argument("--rounds", type=at_least_1, default=5,
                   help="every row is measured once per round; medians over rounds")
    p.add_argument("--no-compile", action="store_true",
                   help="do not let the autotuner try torch.compile (its warm-up is minutes on a CPU)")
    p.add_argument("--skip", default="", help="comma-separated rows to leave out: "
                   + ",".join(ROWS))
    p.add_argument("--time-to-accuracy", action="store_true",
                   help="also run baseline and optimized training to the baseline's accuracy")
    p.add_argument("--tta-epochs", type=at_least_1, default=15)
    p.add_argument("--tta-per-class", type=at_least_1, default=200)
    p.add_argument("--tta-val-per-class", type=at_least_1, default=100,
                   help="validation images per class: the target is read off them (600 read "
                        "an accuracy to about +-2%%; 120 to +-4.5%%, more than a few epochs "
                        "of progress)")
    p.add_argument("--tta-image-size", type=at_least_1, default=64)
    p.add_argument("--data-dir", default="others/bench_data",
                   help="where the synthetic images are generated (once)")
    p.add_argument("--trace", metavar="DIR",
                   help="also trace one pass of pure compute and of the pipeline with "
                        "torch.profiler (TensorBoard traces in DIR) and print where the "
                        "pipeline's extra time per step goes")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        device = resolve_device(args.device)
        TrainConfig(model=args.model, image_size=args.image_size, batch_size=args.batch_size)
        if args.time_to_accuracy:
            TrainConfig(model=args.model, image_size=args.tta_image_size)
        skip = {s.strip() for s in args.skip.split(",") if s.strip()}
        unknown = sorted(skip - set(ROWS))
        if unknown or (skip >= set(ROWS) and not (args.time_to_accuracy or args.trace)):
            raise UserError(f"--skip {args.skip}: " + (
                f"no row named {', '.join(unknown)}" if unknown else "every row left out")
                + f" (the rows: {', '.join(ROWS)})")
        try:  # before the measuring: a --json or --data-dir that cannot be written is said now
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot make {exc.filename!r} ({exc.strerror})") from None
        if "lightning" not in skip and _lightning_package() is None:
            raise UserError("the lightning row needs PyTorch Lightning: pip install -r "
                            "benchmarks/requirements.txt, or pass --skip lightning.")
        cache_dir = Path(args.data_dir)
        index = dataset(args, cache_dir)
        steps = len(index.train) // args.batch_size
        if steps <= WARMUP_STEPS + 2:
            raise UserError(f"{len(index.train)} images make only {steps} steps of "
                            f"{args.batch_size}; raise --images-per-class.")
        results = {"model": args.model, "image_size": args.image_size,
                   "batch_size": args.batch_size, "device": device.type,
                   "machine": machine(device), "torch": torch.__version__}
        optimized, findings = optimized_config(args, device, None)
        results["autotune"] = findings
        # one wait for the GPU per `window` steps, in every row
        window = gpu_window(steps, fastdata.batches_per_pass(args.batch_size, args.image_size, device))
        results["timed_window_steps"] = StepClock.steps_per_sample(device, window)
        rows = {
            "pure_compute": lambda: pure_compute_img_s(optimized, args.steps, window),
            "pipeline": lambda: trainer_img_s(index, optimized, device, window),
            "baseline": lambda: trainer_img_s(index, base_config(args, device), device, window),
            "lightning": lambda: lightning_img_s(index, args, device, window),
        }
        # Rounds: a shared machine's speed drifts within seconds, so each ratio is taken within
        # a round and the median over rounds is kept. Pure compute and the pipeline, whose
        # ratio is the finest, are measured together, window by window (PairedClock); the other
        # rows run one after the other, their order alternating between rounds.
        names = [n for n in rows if n not in skip]
        paired = {"pure_compute", "pipeline"} <= set(names)
        if paired:
            rows["pipeline"] = lambda: paired_img_s(index, optimized, device, window)
        per_round: dict[str, list[float]] = {n: [] for n in names}
        runs = [n for n in names if not (paired and n == "pure_compute")]
        for r in range(args.rounds):
            for name in round_order(runs, r):
                together = paired and name == "pipeline"  # pure compute's figure comes with it
                log.info("round %d/%d: measuring %s", r + 1, args.rounds,
                         "pure compute and pipeline, in alternation" if together else name)
                figure = rows[name]()
                if together:
                    per_round["pure_compute"].append(round(figure[0], 2))
                    figure = figure[1]
                per_round[name].append(round(figure, 2))
        results["paired_pure_compute"] = paired
        for name in names:
            results[f"{name}_img_s"] = round(statistics.median(per_round[name]), 2)
        results["rounds"] = per_round
        if args.trace:
            log.info("tracing pure compute and the pipeline")
            results["trace"] = trace_gap(index, optimized, device, Path(args.trace), steps)
        if args.time_to_accuracy:
            log.info("time to accuracy")
            results["time_to_accuracy"] = time_to_accuracy(args, device, cache_dir)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        fastdata.clear_cache()
    ratios, spreads = {}, {}
    pipe = results.get("rounds", {}).get("pipeline")
    for other in ("pure_compute", "baseline", "lightning"):
        theirs = results.get("rounds", {}).get(other)
        if pipe and theirs:
            by_round = [a / b for a, b in zip(pipe, theirs)]
            ratios[f"pipeline_over_{other}"] = round(statistics.median(by_round), 3)
            spreads[other] = [round(min(by_round), 3), round(max(by_round), 3)]
    results["ratios"] = ratios
    results["ratio_ranges"] = spreads  # the spread of single rounds: how far a median can be off
    print(f"\n{args.model} at {args.image_size} px, batch {args.batch_size}, on "
          f"{results['machine']} (torch {torch.__version__})\n")
    print(f"medians of {args.rounds} rounds; ratios are medians of per-round ratios\n")
    print("| measurement | img/s | pipeline / this |\n| --- | ---: | ---: |")
    for name in rows:
        value = results.get(f"{name}_img_s")
        if value is not None:
            ratio = ratios.get(f"pipeline_over_{name}", 1.0 if name == "pipeline" else None)
            print(f"| {name} | {value:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} |")
    if spreads:
        print("\npipeline / this, single rounds: " + ", ".join(
            f"{name} {lo:.2f}-{hi:.2f}" for name, (lo, hi) in spreads.items()))
    chosen = {k: v["choice"] for k, v in findings["knobs"].items()}
    print(f"\nautotuned: {chosen}")
    if results.get("trace"):
        print_trace(results["trace"])
    tta = results.get("time_to_accuracy")
    if tta:
        # the baseline's time is its whole run, as the scenarios' time ratios take it: it
        # ends with that accuracy (its best epoch's model) only when its run has ended
        print(f"\ntime to {100 * tta['target_val_acc']:.1f}% val accuracy at {tta['image_size']} "
              f"px: the baseline ended with it after {tta['baseline_s']} s (its whole run, "
              f"{tta['baseline_epochs']} epochs); " + (
                  f"optimized {tta['optimized_s']} s ({tta['optimized_epochs']} epochs): "
                  f"{tta['ratio']:.2f}x the time" if tta["reached"] else
                  f"optimized never reached it ({tta['optimized_s']} s, {tta['baseline_epochs']} "
                  "epochs)"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
