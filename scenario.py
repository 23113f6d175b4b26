"""The scenarios as library code: baseline, resolution and hpo, each a configuration, its
tuning (ResolutionTuner, OptunaTuner) and its final training, run in order by `run` from one
RunOptions. pipeline.py is their command line; the notebook calls `pipeline.options` and `run`."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from modules import distributed, interrupts, membership
from modules.autotune import (FIXED_PROBE_MS, MEASURE_SHARE, ComputeProbe, autotune,
                              fixed_step_cost, machine_key)
from modules.checkpoints import check_format, load_checkpoint, saved_config
from modules.clock import read_kept, ticking, write_clock
from modules.config import (DEFAULTS, DISPLAY_ONLY, SPEED_ONLY, TrainConfig, UserError,
                            first_line)
from modules.dataset import (COPIES_LIST, SKIPPED_LIST, DatasetIndex, data_path_of, index_dataset,
                             index_subset, load_rgb, make_loader, printable, resolve_source,
                             steps_per_epoch, subset, train_transform)
from modules.device import (apply_process_settings, autocast_dtype, process_settings_kept,
                            resolve_device, usable_cpus)
from modules.diagnosis import TUNING_CONTENDED, contention, tuning_contended_advice
from modules.evaluation import evaluate
from modules.fastdata import cache_fits, keep_sizes
from modules.final_runs import (COUNTED, EARLIER_ROW, default_if_better, earlier_if_better,
                                final_run_s, final_to_reuse, forget_replaced, keep_start_curve,
                                keep_timeline, log_row, own_run, pending_replaced,
                                replaced_record, resolution_final_row, reused_seconds,
                                row_tuning_s, same_final, show_in_tensorboard, taken_tuning_s)
from modules.files import (atomic_write_text, folder_lock, kept_file, name_folder, refuse_if_in_use,
                           resolved, run_log, Said)
from modules.hardware import max_batch_size
from modules.models import pinned_weights_file, possible_starts, start_weights, weights_file
from modules.monitor import SystemSampler
from modules.oom import is_out_of_memory, release
from modules.profiler import TorchProfiler
from modules.report import (REPORT_MD, baseline_source_lines, plot_comparison, results_table,
                            table_markdown, write_report)
from modules.results import (CLOCK_SUFFIX, RUN_FILE, checkpoint_file, compare_to_baseline,
                             forget_refused_run, footprint, json_safe, keep_best_model,
                             mark_finished, merge_results, previous_row, result_row, run_folder,
                             run_record_beside, start_run, write_json)
from modules.storage import check_storage, local_dir_unused, shown_argv
from modules.trainer import TIMING_WARMUP_STEPS, prepare, train
from optuna_optimizer import BATCH_SIZES, EarlierTrial, OptunaTuner, end_trials, follow_trials
from resolution_tuner import (CPU_RESOLUTIONS, GPU_RESOLUTIONS, QUICK_CPU_RESOLUTIONS,
                              ResolutionTuner, comparable_sizes, equal_compute_epochs)


log = logging.getLogger("scenario")

SCENARIOS = ("baseline", "resolution", "hpo")
# --quick: images per class and split, and epochs; small enough for minutes on a 2-core CPU.
# Validation and test are large enough to tell candidates apart: 360 validation images give a
# standard error of about 2.6 points at 50% accuracy, 1,200 test images about 1.4. With fewer
# classes than the default workload's QUICK_EVAL_CLASSES they keep those totals, spread over the
# classes there are (quick_per_class): two classes would otherwise validate on 120 images
# (+-4.6 points), too few to tell sizes or trials apart.
QUICK_PER_CLASS = {"train": 200, "val": 60, "test": 200}
QUICK_EVAL_CLASSES = 6
QUICK_EPOCHS = 12
QUICK_IMAGE_SIZE = {"cpu": 64, "cuda": 150}   # pixels; CPU time grows with the square
SYNTHETIC_PER_CLASS = (400, 100)              # train, test images per class when generated
QUICK_N_TRIALS = 4
N_TRIALS = 20
# A tuned scenario's final run fills this share of the baseline's total time with epochs, up to
# MAX_EPOCH_FACTOR times its own (fill_time).
TIME_SHARE, MAX_EPOCH_FACTOR = 0.8, 3
WARMUP_EPOCHS = 1.0  # of a final run that continues a trial's weights (warm_start)
# Without --n-trials or --time-budget the search stops starting trials once they have trained
# this share of the baseline's total time: on a CPU the preset's trials cost several times the
# baseline for the choice the first few had already made (docs/tuning.md), and a faster device
# fits more trials in the same share.
SEARCH_SHARE = 1.0
# From this size up the search's trials train at FIDELITY_SCALE of it (to a multiple of 16), a
# cheaper first look: 112 px ranked the search's configurations as 150 px did, for about half
# the trial seconds (docs/tuning.md). Below it the lower size is one the resolution tuner often
# picks for itself, and the saving is small against losing the reused default trial.
FIDELITY_FROM, FIDELITY_SCALE = 144, 0.75
AUTOTUNE_CACHE = "autotune_cache.json"  # in the output dir: choices by machine, reused by later runs
QUICK_SYNTHETIC_PER_CLASS = (QUICK_PER_CLASS["train"] + QUICK_PER_CLASS["val"],
                             QUICK_PER_CLASS["test"])


@dataclass
class RunOptions:
    """One run's options, checked and resolved: what `python pipeline.py ...` and
    `pipeline.options(**keywords)` give, field for field the command line's options (see
    `python pipeline.py --help`), plus the run's id and the equivalent command line."""
    dataset: str
    data_dir: str | None
    scenarios: list[str]
    quick: bool
    output_dir: str
    device: str
    resume: bool
    local_dir: str | None
    seed: int
    worker_seed: int | None
    profile: bool
    no_progress: bool
    resolutions: list[int] | None
    n_trials: int | None
    time_budget: float | None
    pruner: str
    storage: str | None
    search_size: int | str
    model: str
    weights: str
    epochs: int | None
    image_size: int | None
    batch_size: int | None
    lr: float | None
    scheduler: str | None
    momentum: float | None
    grad_accum_steps: int | None
    max_grad_norm: float | None
    match_time: bool
    early_stopping: int | None
    amp: str | None
    channels_last: bool | None
    compile: bool | None
    cudnn_benchmark: bool
    num_workers: int | None
    cpu_allocator: str | None
    dropout_impl: str | None
    pin_memory: bool | None
    autotune: bool
    run_id: str | None = None   # set by run(): a new run's, or with --resume the newest run's
    command: str | None = None  # the equivalent `python pipeline.py ...` line


def learning_options(args: RunOptions) -> dict[str, Any]:
    """The options that change what a run learns, as given (None: the default): a resume
    with others is refused (start_run). The data, seed, --quick and --weights are checked
    there by what they select; --n-trials and --time-budget may change to grow a search."""
    return {key: getattr(args, key) for key in (
        "model", "epochs", "image_size", "batch_size", "lr", "scheduler", "momentum",
        "grad_accum_steps", "max_grad_norm", "resolutions", "search_size")}


def scenario_config(name: str, args: RunOptions, device: torch.device) -> TrainConfig:
    """The scenario's defaults, then the user's overrides."""
    if name not in SCENARIOS:
        raise UserError(f"unknown scenario {name!r}")
    # A plain, unoptimised PyTorch setup, the reference the tuned scenarios are judged by:
    # fp32, NCHW, batch 32, Adam 1e-3, cosine, per-sample PIL transforms every epoch, a
    # default single-process DataLoader.
    config = TrainConfig(model=args.model, weights=args.weights, image_size=150, epochs=10,
                         batch_size=32, lr=1e-3, optimizer="adam", scheduler="cosine", amp="off",
                         channels_last=False, num_workers=0, seed=args.seed,
                         device=device.type, progress=not args.no_progress)
    if name != "baseline":
        config = dataclasses.replace(config, **optimized_settings(device))
    if args.quick:
        config = dataclasses.replace(config, epochs=QUICK_EPOCHS,
                                     image_size=QUICK_IMAGE_SIZE[device.type])
    overrides = {"epochs": args.epochs, "image_size": args.image_size,
                 "batch_size": args.batch_size, "lr": args.lr, "scheduler": args.scheduler,
                 "momentum": args.momentum, "cudnn_benchmark": args.cudnn_benchmark,
                 "grad_accum_steps": args.grad_accum_steps, "max_grad_norm": args.max_grad_norm,
                 "early_stopping_patience": args.early_stopping, "amp": args.amp,
                 "compile": args.compile, "channels_last": args.channels_last,
                 "num_workers": args.num_workers, "pin_memory": args.pin_memory,
                 "cpu_allocator": args.cpu_allocator, "dropout_impl": args.dropout_impl}
    if args.num_workers == 0:  # no workers to keep alive between epochs, or to prefetch
        config = dataclasses.replace(config, persistent_workers=False, prefetch_factor=None)
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def optimized_settings(device: torch.device) -> dict[str, Any]:
    """The tuned scenarios' starting setup; with --autotune (the default) every speed knob in it
    is measured on this machine and kept only when it is faster."""
    cores = usable_cpus()
    settings = {"amp": "auto",           # bf16/fp16 on GPUs; off on CPUs until measured
                "channels_last": True,
                "cache_decoded": True}   # decode once; batched augmentation on the device
    if device.type == "cuda":
        # A GPU runs a batch of 64 far faster per image than one of 32. A CPU keeps the
        # baseline's 32: 64 is faster per image there too, but with half the optimizer steps
        # per epoch it reached the baseline's accuracy later, not sooner (docs/speed.md).
        settings.update(batch_size=64, pin_memory=True)
    elif cores > 2:  # only when the cache does not fit: streaming decodes in workers
        settings.update(num_workers=min(4, cores // 2), persistent_workers=True)
    return settings


USER_KNOBS = {"amp": "amp", "channels_last": "channels_last", "compile": "compile",
              "num_workers": "num_workers", "batch_size": "batch_size",
              "grad_accum_steps": "batch_size", "cpu_allocator": "cpu_allocator",
              "dropout_impl": "dropout_impl"}


def autotune_scenario(config: TrainConfig, args: RunOptions, index: DatasetIndex,
                      planned_steps: int, saved: Path, time_capped: tuple[int, float] | None = None,
                      unbudgeted_steps: int = 0, finished: bool = False
                      ) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The measured speed settings for an optimized scenario (options the user gave stay).
    time_capped: (steps, seconds) of the planned steps that a time budget bounds (autotune).
    unbudgeted_steps: planned steps outside the measuring budget (autotune).
    finished: the scenario had finished (resumed): what `saved` holds stands, measured on
    this machine or not.

    The choice is kept in `saved`; --resume takes it from there instead of measuring again, so
    a resumed run continues with the settings it started with (a fresh measurement can differ
    by noise: another optimizer kernel, an AMP dtype, on a GPU another batch that fits)."""
    if not args.autotune:
        return config, None
    # Under torchrun every rank must train with the same settings: rank 0 measures (on its
    # own, the others idle meanwhile) and hands its choice to the others.
    return distributed.main_computes(lambda: _measure_settings(
        config, args, index, planned_steps, saved, time_capped, unbudgeted_steps, finished))


def user_knobs(args: RunOptions) -> frozenset[str]:
    """The speed knobs the command line set, which the autotuner keeps as given (0 workers is
    a choice, as 2 is)."""
    return frozenset(knob for option, knob in USER_KNOBS.items()
                     if getattr(args, option, None) is not None)


def _measure_settings(config: TrainConfig, args: RunOptions, index: DatasetIndex,
                      planned_steps: int, saved: Path, time_capped: tuple[int, float] | None,
                      unbudgeted_steps: int = 0, finished: bool = False
                      ) -> tuple[TrainConfig, dict[str, Any]]:
    fixed = user_knobs(args)
    start = config
    if args.resume:
        reused = _saved_autotune(saved, config, finished)
        if reused is not None:
            measured, findings, here = reused
            if here or finished:
                return measured, findings
            # Resumed on another machine (Colab's next session can be another GPU): what was
            # measured there may not run well here (bf16 on a T4), so measure again, keeping
            # the batch, which the checkpoint resumes only with.
            log.info("autotune: %s was measured on another machine; measuring again, keeping "
                     "its batch (%d x %d)", saved, measured.batch_size, measured.grad_accum_steps)
            config = dataclasses.replace(config, batch_size=measured.batch_size,
                                         grad_accum_steps=measured.grad_accum_steps)
            fixed |= {"batch_size"}
    launcher_threads = distributed.world_size() > 1 and config.device == "cpu"
    if launcher_threads:  # torchrun gave each process its share of the cores (OMP_NUM_THREADS)
        config = dataclasses.replace(config, cpu_threads=torch.get_num_threads())
        fixed |= {"cpu_threads"}
    factory = None
    if not (config.cache_decoded and cache_fits(index, config.image_size)):
        def factory(cfg: TrainConfig):  # the streaming path: how many decoding workers keep up
            return lambda n: make_loader(
                index.train, train_transform(cfg.image_size),
                dataclasses.replace(cfg, num_workers=n, persistent_workers=False,
                                    prefetch_factor=None), train=True)
    tuned, findings = autotune(config, len(index.classes), planned_steps=planned_steps,
                             fixed=fixed, loader_factory=factory, budget_share=MEASURE_SHARE,
                             cache_path=Path(args.output_dir).expanduser() / AUTOTUNE_CACHE,
                             time_capped=time_capped, unbudgeted_steps=unbudgeted_steps,
                             data_key=index.fingerprint() if factory is not None else None,
                             run_id=args.run_id)
    if launcher_threads:
        findings["knobs"]["cpu_threads"]["reason"] = ("one share of the cores per process, as "
                                                     "torchrun set it (OMP_NUM_THREADS)")
    saved.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json.dumps({"start": start.to_dict(), "config": tuned.to_dict(),
                                  "report": findings, "machine": machine_key()}, indent=2), saved)
    return tuned, findings


def _saved_autotune(path: Path, start: TrainConfig, finished: bool = False
                    ) -> tuple[TrainConfig, dict[str, Any], bool] | None:
    """(the autotune result saved for the same starting settings, its report, whether it was
    measured on this machine: a file from before machines were recorded counts as this one),
    or None (none saved, another start, or a file this version cannot read: then it is
    measured again)."""
    try:
        saved = json.loads(path.read_text())
        if TrainConfig(**saved["start"]).run_settings() != start.run_settings():
            log.info("autotune: the settings changed since %s; measuring again", path)
            return None
        tuned = dataclasses.replace(TrainConfig(**saved["config"]),
                                    **{k: getattr(start, k) for k in DISPLAY_ONLY})
        # measured by this run in an earlier session: not "reused" (another run's, or the
        # cache's, as the saved report's reused_from may say)
        findings = dict(saved["report"], resumed_from=str(path))
        here = saved.get("machine") in (None, machine_key())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError) as exc:
        log.info("autotune: cannot reuse %s (%s); measuring again", path, exc)
        return None
    if here:
        log.info("autotune: resuming with the settings measured before (%s)", path)
    elif finished:
        log.info("autotune: %s was measured on another machine; the scenario had finished, "
                 "so they stand", path)
    return tuned, findings, here


def planned_steps(config: TrainConfig, n_train: int, epochs: int | None = None) -> int:
    """Optimizer steps a training of `epochs` (default config.epochs) will take."""
    return steps_per_epoch(config, n_train) * (epochs or config.epochs)


def tuned_resolutions(args: RunOptions, device: torch.device, default: int) -> list[int]:
    """The ResolutionTuner's candidates: the user's or the device's, and always the default
    size (the baseline's), so tuning can keep it."""
    if args.resolutions:
        sizes = args.resolutions
    elif device.type == "cuda":
        sizes = GPU_RESOLUTIONS
    else:
        sizes = QUICK_CPU_RESOLUTIONS if args.quick else CPU_RESOLUTIONS
    return sorted(set(sizes) | {default})


def trial_count(args: RunOptions) -> int:
    """The Optuna trials a run searches: --n-trials, else the preset's."""
    return args.n_trials or (QUICK_N_TRIALS if args.quick else N_TRIALS)


def search_budget(args: RunOptions, baseline_s: float | None) -> tuple[float | None, str]:
    """The seconds the search's trials may train in all (None: no bound), and why: the
    user's --time-budget; else, when the user set no --n-trials and searches no shared
    --storage (where every worker runs its --n-trials), SEARCH_SHARE of the baseline's total
    time, when known."""
    if args.time_budget is not None:
        return args.time_budget, "--time-budget"
    if args.n_trials is not None or args.storage is not None or not baseline_s:
        return None, ""
    return SEARCH_SHARE * baseline_s, (f"{SEARCH_SHARE:g}x the baseline's {baseline_s:.0f} s; "
                                       "--n-trials N or --time-budget S sets it")


def tuning_runs(name: str, args: RunOptions, config: TrainConfig, device: torch.device) -> int:
    """The short trainings a tuned scenario's search runs: one per candidate size, or trials."""
    if name == "resolution":  # the sizes ResolutionTuner can compare at equal compute
        return len(comparable_sizes(tuned_resolutions(args, device, config.image_size),
                                    config.image_size, short_budget(config)))
    return trial_count(args)


def least_tuning_epochs(name: str, args: RunOptions, config: TrainConfig, index: DatasetIndex,
                        device: torch.device, default_size: int | None = None) -> float:
    """The fewest epochs (at the scenario's size) its tuning can train: every trial that can
    be stopped stopped where it first can be; the search's, at a smaller size (search_size),
    counted as the epochs at the scenario's size that cost what they do, by their pixels."""
    if name == "resolution":
        return ResolutionTuner(index, config, tuned_resolutions(args, device, config.image_size),
                               epochs=short_budget(config)).least_compute()
    budget = search_epochs(config, default_size)
    epochs = budget + (trial_count(args) - 1) * OptunaTuner.shortest_trial(args.pruner, budget)
    return epochs * search_cost(args, config.image_size)


def search_size(args: RunOptions, size: int) -> int:
    """The size the search's trials train at, for a final run at `size`: --search-size N; the
    size itself with --search-size full or below FIDELITY_FROM; else FIDELITY_SCALE of it, to
    a multiple of 16 (a cheaper look that ranks configurations as the size itself does)."""
    if isinstance(args.search_size, int):
        return args.search_size
    if args.search_size == "full" or size < FIDELITY_FROM:
        return size
    return lower_size(size)


def search_cost(args: RunOptions, size: int) -> float:
    """What a trial's epoch costs against an epoch at `size`, by the pixels of search_size."""
    return (search_size(args, size) / size) ** 2


def lower_size(size: int) -> int:
    """FIDELITY_SCALE of `size`, to a multiple of 16 (at least 16, at most `size`)."""
    return min(size, max(16, round(size * FIDELITY_SCALE / 16) * 16))


def short_budget(config: TrainConfig) -> int:
    """Epochs for each tuning run: a third of the scenario's, at least 2."""
    return max(2, config.epochs // 3)


def search_epochs(config: TrainConfig, default_size: int | None = None) -> int:
    """Epochs for each of the search's trials at config.image_size: short_budget, and at a
    size other than the scenario's default (the baseline's) the epochs that cost what those
    do there. The resolution tuner's trial at that size trained as many, and the final run
    trains the default's compute (fill_time): so trials stay a third of the final run, and
    the resolution trial is the search's default trial as it is."""
    return epochs_at_size(short_budget(config), config.image_size, default_size)


def epochs_at_size(epochs: int, size: int, default_size: int | None) -> int:
    """`epochs` at the default size, as a run at `size` trains them: the epochs that cost the
    same there (equal_compute_epochs), as the resolution tuner compared the sizes; more at a
    smaller size, fewer at a larger one (then --match-time fills what the time allows)."""
    return equal_compute_epochs(epochs, default_size, size) if default_size else epochs


def quick_per_class(n_classes: int) -> dict[str, int]:
    """--quick's images per class and split for a set of n_classes: QUICK_PER_CLASS, with
    validation and test raised to what it gives QUICK_EVAL_CLASSES classes in all."""
    return {split: n if split == "train" else max(n, -(-n * QUICK_EVAL_CLASSES // n_classes))
            for split, n in QUICK_PER_CLASS.items()}


def load_data(args: RunOptions, output_dir: Path) -> DatasetIndex:
    on_main(lambda: refuse_if_in_use(output_dir))  # before any data is read or made
    per_class = QUICK_SYNTHETIC_PER_CLASS if args.quick else SYNTHETIC_PER_CLASS
    # The generated set is local with --local-dir (an output dir on Google Drive would serve
    # the baseline's every epoch from Drive); it is the same images wherever it is made.
    cache = Path(args.local_dir).expanduser() if args.local_dir else output_dir
    if (output_dir / "data" / "synthetic").is_dir():
        cache = output_dir  # a run made before this moved: its images' paths are its data's
    if args.data_dir is None and distributed.world_size() > 1:
        # kagglehub has no lock: torchrun's processes downloading into one cache at once
        # truncate and remove each other's archive. Rank 0 downloads (or generates the
        # synthetic set: rank 0 alone writes files); the others then find it.
        on_main(lambda: resolve_source(args.dataset, None, cache / "data", per_class))
    root, name = resolve_source(args.dataset, args.data_dir, cache / "data", per_class)
    numbered = _numbered(args)
    if args.quick:
        index = index_subset(root, name, quick_per_class, seed=args.seed,
                             numbered_below=numbered)
    else:
        index = index_dataset(root, name, seed=args.seed, numbered_below=numbered)
    if not distributed.same_on_every_rank(index.fingerprint()):
        # else the ranks' shards differ in length, and a collective fails on gloo's words
        raise UserError("the processes of this torchrun run read different images (another "
                        "copy of the data folder on each machine?): give every machine the "
                        "same data, or run on one.")
    processes = distributed.world_size()
    if processes > 1 and len(index.train) < 2 * processes:
        # a share of one image is a batch of one, which BatchNorm cannot train on
        raise UserError(f"{len(index.train)} training images for {processes} torchrun "
                        "processes: each trains on its own share and needs at least 2; run "
                        "fewer processes (--nproc-per-node) or add images.")
    log.info("data: %s", index.summary())
    if (imbalance := index.imbalance()) is not None:
        log.info("%s", imbalance)
    return index


def _numbered(args: RunOptions) -> dict[str, int] | None:
    """--quick and the full preset share the generated folder; each sees only its own counts."""
    if args.data_dir is not None or args.dataset != "synthetic":
        return None
    per_class = QUICK_SYNTHETIC_PER_CLASS if args.quick else SYNTHETIC_PER_CLASS
    return dict(zip(("train", "test"), per_class))


def split_with(args: RunOptions, index: DatasetIndex) -> Callable[[int], DatasetIndex]:
    """This run's images as another --seed splits them, as load_data would, for advice
    (membership.check_start): listed, not checked again, and nothing said of them twice."""
    def split(seed: int) -> DatasetIndex:
        said = logging.getLogger("modules.dataset")
        was, said.disabled = said.disabled, True
        try:
            listed = index_dataset(index.root, index.name, seed=seed, check=False,
                                   numbered_below=_numbered(args))
            return subset(listed, quick_per_class(len(listed.classes)), seed=seed) \
                if args.quick else listed
        finally:
            said.disabled = was
    return split


def tune_scenario(name: str, config: TrainConfig, args: RunOptions, index: DatasetIndex,
                  output_dir: Path, device: torch.device, tuned: dict[str, Any]
                  ) -> tuple[TrainConfig, dict[str, Any]]:
    """A tuned scenario's measuring and search: the final run's configuration and what the
    row records of them (the baseline: its configuration as it is)."""
    default_size = config.image_size  # the baseline's
    extra: dict[str, Any] = {TUNED_ANEW: False}
    budget: tuple[float | None, str] = (None, "")
    if name == "hpo":
        budget = search_budget(args, baseline_seconds(args, output_dir, index, tuned, device))
        if args.image_size is None:
            size = tuned.get("image_size")
            if size is None:
                size, run_id = distributed.from_main(
                    _previous_resolution(output_dir, args, index, device))
                if size is not None:
                    log.info("hpo: at %d px, the resolution scenario's pick in run %s (the same "
                             "data and settings)", size, run_id)
                    extra["resolution_from"] = run_id
            config = dataclasses.replace(config, image_size=size or config.image_size)
    if name != "baseline":
        # The measuring budget is a share of the least the scenario trains (the tuners may stop
        # trials early, and the search's time budget end it), so that it stays within that
        # share of what it does train.
        tuning = round(planned_steps(config, len(index.train), epochs=1) *
                       least_tuning_epochs(name, args, config, index, device, default_size))
        # the final run's own epochs at its size (fill_time): more below the baseline's size
        final = planned_steps(config, len(index.train), epochs=config.epochs if args.epochs
                              else epochs_at_size(config.epochs, config.image_size, default_size))
        # The hpo final run may be the resolution scenario's, taken rather than trained
        # (same_final): the budget is then a share of the search alone (as far as its time
        # budget reaches). compile still counts the final run's steps to pay back in, which it
        # has when it trains.
        unbudgeted = final if name == "hpo" and tuned.get("final") is not None else 0
        # A scenario this run finished (its row written) trains nothing more: its settings
        # stand, on whatever machine it resumes (but a search --n-trials may grow).
        finished = args.resume and not (name == "hpo" and args.n_trials is not None) and \
            previous_row(output_dir / "results.json", name, index.name, args.run_id) is not None
        config, findings = autotune_scenario(
            config, args, index, final + tuning,
            checkpoint_file(output_dir, name, ".autotune.json", args.run_id),
            None if budget[0] is None else (tuning, budget[0]), unbudgeted, finished=finished)
        if findings is not None:
            extra["autotune"] = findings
        extra[TUNED_ANEW] = findings is not None and not {"reused_from", "resumed_from"} & \
            findings.keys()
    if name == "resolution":
        config, tuning = tune_resolution(config, args, index, output_dir, device, tuned)
        tuned["image_size"] = config.image_size
        extra.update(tuning, **{TUNED_ANEW: extra.get(TUNED_ANEW) or tuning[TUNED_ANEW]})
    elif name == "hpo":
        config, tuning = tune_hyperparameters(config, args, index, output_dir, device,
                                              tuned.get("trial"), default_size, budget,
                                              probed=probed_fit(findings, config))
        extra.update(tuning, **{TUNED_ANEW: extra.get(TUNED_ANEW) or
                                tuning.get(TUNED_ANEW, True)})
    return config, extra


def run_scenario(name: str, args: RunOptions, index: DatasetIndex, output_dir: Path,
                 device: torch.device, tuned: dict[str, Any]) -> dict[str, Any]:
    """Tune (resolution, hpo), then train, test and describe one scenario."""
    started, started_at = time.perf_counter(), time.time()
    config = scenario_config(name, args, device)
    default_size = config.image_size  # the baseline's
    clock = checkpoint_file(output_dir, name, CLOCK_SUFFIX, args.run_id)
    resumed = args.resume and name != "baseline"
    earlier_s, sessions, earlier_loads = read_kept(clock) if resumed else (0.0, [], [])
    # This session's start on the scenario's clock, after the earlier sessions'.
    sessions = [*sessions, [started_at, earlier_s]]
    extra: dict[str, Any] = {}
    # another load on the CPU stretches the tuning's seconds as it does a final run's step
    watch = name != "baseline" and device.type == "cpu"
    load = this = None
    try:
        with (ticking(clock, earlier_s, started, sessions)
              if name != "baseline" and distributed.is_main() else contextlib.nullcontext()), \
                (SystemSampler() if watch else contextlib.nullcontext()) as load:
            config, extra = tune_scenario(name, config, args, index, output_dir, device, tuned)
    finally:  # Ctrl-C and errors too: --resume then adds this session's tuning to the next's
        # A final run a grown study set aside counts as tuning, as a candidate trained (before
        # this session's trials).
        replaced = extra.get("replaced_final") or {}
        set_aside_s = 0.0 if replaced.get(COUNTED) else replaced.get("seconds", 0.0)
        sessions[-1][1] += set_aside_s
        tuning_s = earlier_s + time.perf_counter() - started + set_aside_s
        # Every session's load, as its seconds, judged together; not a session that only read
        # back what was tuned (a resume: its moment's load says nothing of that tuning).
        if load is not None and extra.get(TUNED_ANEW, True):
            machine = load.summary()
            this = {"wall_s": time.perf_counter() - started,
                    **{k: machine.get(k) for k in LOAD_FIGURES}}
        if name != "baseline" and distributed.is_main():
            write_clock(clock, tuning_s, sessions, None if this is None else [*earlier_loads, this])
    if watch and (loads := [*earlier_loads, *([this] if this else [])]):
        extra["tuning_load"] = tuning_load(name, loads, config)
    anew = extra.pop(TUNED_ANEW, True)
    # private to the comparison with a set-aside final run (earlier_if_better), not the row's
    earlier_final = replaced.pop(EARLIER_ROW, None)
    replaced.pop(COUNTED, None)
    # The search's default trial taken from the resolution scenario trained there: the row
    # counts it as if trained here, first, as it counts a final run it takes (same_final).
    # Not in the clock, which is this scenario's own time (fill_time's): the row adds it.
    reused_s = reused_seconds(extra)
    lineage(extra.get("warm_start"), sessions, tuning_s + reused_s, reused_s,
            reused_start=bool((extra.get("hpo") or {}).get("keeps_default")))
    if name != "baseline":
        # the row's tuning: the reused trial counts as trained here
        config = fill_time(config, name, args, output_dir, index, tuned, tuning_s + reused_s,
                           _epoch_seconds(name, config, extra), default_size)
        config = distributed.from_main(config)  # under torchrun: rank 0's timing decides
    same = final_to_reuse(name, config, tuned)
    if same is not None:
        before = None if anew else previous_row(output_dir / "results.json", name, index.name,
                                                args.run_id)
        if before is not None and (before.get("final_from") != same["scenario"] or
                                   before.get("history") != same["row"].get("history")):
            before = None  # a row of another final run
        if before is not None:
            keep_start_curve(extra.get("warm_start"), before)
        if before is None:
            taken_s = taken_tuning_s(extra, same, reused_s)
        else:  # its row counted them: the clock is read back from it (row_tuning_s)
            taken_s = (before.get("hpo") or {}).get("resolution_tuning_s") or 0.0
            if taken_s and isinstance(extra.get("hpo"), dict):
                extra["hpo"]["resolution_tuning_s"] = taken_s
        tuning_s = row_tuning_s(tuning_s, reused_s + taken_s, before, clock)
        forget_replaced(output_dir, args.run_id)  # no trained final run to compare
        if args.profile and distributed.is_main():
            log.info("%s: no profiler trace of its own: it trains nothing the %s scenario's "
                     "trace does not show", name, same["scenario"])
        return advise_on_tuning_load(same_final(same, extra, args.run_id, args.weights,
                                                output_dir, tuning_s))
    log.info("== scenario %s: %s, %d px, batch %d, %d epochs on %s", name, config.model,
             config.image_size, config.batch_size, config.epochs, device)
    if config.cache_decoded:
        # the final run's size, and the hpo scenario's next in this run (its final run's, at
        # --image-size when given, and its search's)
        hpo_size = args.image_size or config.image_size
        keep_sizes({config.image_size} | ({hpo_size, search_size(args, hpo_size)}
                                          if name == "resolution" and "hpo" in args.scenarios
                                          else set()))
    kept = weights_file(config.weights)
    building = config
    if not distributed.is_main() and kept is not None and not kept.exists():
        # Under torchrun on another machine than rank 0's, a kept trial's weights are not
        # here: rank 0's weights reach every rank at the start of training all the same.
        # Only the model is built so: the config stays rank 0's, which the hpo scenario
        # compares with its own to reuse this run (final_to_reuse), as rank 0 does.
        building = dataclasses.replace(config, weights="none")
    elif args.resume and kept is not None and \
            checkpoint_file(output_dir, name, run_id=args.run_id).exists():
        # Its checkpoint holds the weights it goes on from (or refuses in one line): the start
        # weights are not read, and a trial's file damaged since cannot stop the resume.
        building = dataclasses.replace(config, weights="none")
    apply_process_settings(config, device)
    # Building the model and its start weights, and decoding the images into the cache when
    # the tuning did not at this size: before the training clock starts, but the run's time.
    preparing = time.perf_counter()
    model, train_loader, val_loader, test_loader = prepare(index, building)
    prepare_s = time.perf_counter() - preparing
    if device.type == "cuda":
        # The allocator's retry count is cumulative: the tuners' probes and out-of-memory
        # trials would read as this run's retries (diagnosis: memory-bound).
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    # The recorded steps come after those the step timing leaves out as unrepresentative, and
    # cover whole augmentation passes of the decoded cache (several batches each on a GPU).
    profiler = TorchProfiler(run_folder(output_dir, "profiler", args.run_id) / name,
                             enabled=args.profile and distributed.is_main(), device=device,
                             wait=TIMING_WARMUP_STEPS - 1,
                             active=max(3, getattr(train_loader, "pass_batches", 1)))
    with SystemSampler(cuda_device=_cuda_index(device)) as sampler, profiler:
        result = train(model, train_loader, val_loader, config,
                       run_dir=run_folder(output_dir, "runs", args.run_id) / name,
                       checkpoint_path=checkpoint_file(output_dir, name, run_id=args.run_id),
                       resume=args.resume, profiler=profiler)
        test = evaluate(result.model, test_loader, device=device,
                        amp_dtype=autocast_dtype(config.amp, device),
                        channels_last=config.channels_last, num_classes=len(index.classes),
                        progress="test" if config.progress and distributed.is_main() else None)
    system = sampler.summary()
    carried = None
    if result.resumed_from_epoch is not None and result.resumed_from_epoch >= result.epochs_run:
        # Resumed after it had finished: this process only evaluated, so the figures measured
        # while it trained stay (without results.json: the checkpoint's step timing, and no
        # machine figures: those of a test evaluation are not the training's).
        # None: a row of another run, not of the one in the checkpoint
        carried = own_run(previous_row(output_dir / "results.json", name, index.name,
                                       args.run_id), json.loads(json.dumps(json_safe(result.history))))
        log.info("%s had finished; %s", name, "keeping the figures measured while it trained"
                 if carried else "its machine figures are n/a (no row of the session that "
                 "trained it; this one only evaluated)")
    # Its row's pure-step timing too: measured again now, under another load, it would give
    # the row a diagnosis at odds with the step time carried beside it.
    fixed = carried.get("fixed_step") if carried else None
    step_ms = result.timing.get("avg_step_ms")
    # (not after an out-of-memory recovery: twice the batch that failed would fail again)
    if not carried and device.type == "cpu" and not config.compile and step_ms is not None and \
            step_ms < FIXED_PROBE_MS and not result.settings.get("oom_recoveries") and \
            distributed.is_main():
        fixed = fixed_step_cost(config, len(index.classes))
        if fixed is not None:
            log.info("%s: a step of %d images took %.1f ms, of %d %.1f ms (pure compute, timed "
                     "for the diagnosis in %.1f s): %.1f ms of it does not grow with the batch",
                     name, fixed["batch"], fixed["step_ms"], 2 * fixed["batch"],
                     fixed["double_step_ms"], fixed["seconds"], fixed["fixed_ms"])
    row = result_row(name, config, result, test, index, device, system,
                     data_path_of(train_loader), carried,
                     raced=measured_speeds(extra.get("autotune")), fixed_step=fixed)
    row["prepare_s"] = prepare_s  # the hpo scenario counts it when it takes this final run
    if result.resumed_from_epoch and not carried and row.get("energy_j") is not None:
        # Measured in this session only, while wall_s counts every session's training: no
        # total is better than a share read as one.
        row["energy_j"] = None
        log.info("%s: energy not recorded: this session measured only the epochs it trained",
                 name)
    if carried:
        keep_timeline(row, carried, extra.get("warm_start"))
    tuning_s = row_tuning_s(tuning_s, reused_s, None if anew else carried,
                            clock if name != "baseline" else None)
    if name == "resolution":
        tuned["final"] = {"scenario": name, "config": config, "row": copy.deepcopy(row),
                          "tuning_s": tuning_s}
    row.update(extra, run_id=args.run_id, tuning_s=tuning_s,
               total_s=tuning_s + final_run_s(row),
               start_weights=start_weights(config.model, args.weights))
    advise_on_tuning_load(row)
    if name == "hpo":
        kept = default_if_better(row, tuned.get("final") or resolution_final_row(
            output_dir, index, args.run_id))
        gave = "winner" if kept.get("winner_final") else "default" if kept.get(
            "default_final") else None
        if gave and distributed.is_main():
            runs = run_folder(output_dir, "runs", args.run_id)
            show_in_tensorboard(runs, aside=f"{gave}-{time.strftime('%Y%m%d-%H%M%S')}",
                                kept=runs / kept["final_from"], copy=True)
        kept = earlier_if_better(kept, extra.get("replaced_final"), earlier_final, output_dir,
                                 args.run_id)
        forget_replaced(output_dir, args.run_id)  # compared: a later --resume finds it done
        if kept is not row:
            advise_on_tuning_load(kept)  # this scenario's tuning, not the taken run's
            log_row(kept)  # that model was offered to keep_best_model in its own session
            return kept
    log_row(row)
    if distributed.is_main():
        keep_best_model(result, config, index, row, output_dir)
    return row


# Fewer seconds of tuning than this, over all sessions, say too little about the load: 10
# samples of the machine.
MIN_JUDGED_TUNING_S = 5.0


LOAD_FIGURES = ("cpu_util_pct", "process_cpu_pct")


def tuning_load(name: str, loads: list[dict[str, Any]], config: TrainConfig) -> dict[str, Any]:
    """A tuned scenario's tuning on a CPU as the machine saw it, over every session of a
    resumed run (each {"wall_s", *LOAD_FIGURES}, weighted by its seconds), and the facts when
    other processes slowed it (diagnosis.contention, said in the log): its seconds, the time
    ratios and --match-time's epochs are then the other load's, as is what it measured."""
    wall = sum(session["wall_s"] for session in loads)

    def mean(key: str) -> float | None:
        parts = [(s["wall_s"], s[key]) for s in loads if isinstance(s.get(key), (int, float))]
        seconds = sum(w for w, _ in parts)
        return sum(w * v for w, v in parts) / seconds if seconds > 0 else None
    load = {"wall_s": wall, "sessions": len(loads), **{k: mean(k) for k in LOAD_FIGURES},
            "contended": None}
    if wall >= MIN_JUDGED_TUNING_S:
        load["contended"] = contention({
            "device": "cpu", "cpu_util_pct": load["cpu_util_pct"],
            "process_cpu_pct": load["process_cpu_pct"], "cpu_count": usable_cpus(),
            # None: the count the tuning ran with (apply_process_settings'), not every core
            "cpu_threads": config.cpu_threads or torch.get_num_threads(),
            "num_workers": config.num_workers,
            "cached_decode": config.cache_decoded})
    if load["contended"] and distributed.is_main():
        log.warning("%s: %s", name, tuning_contended_advice(load["contended"]))
    return load


def advise_on_tuning_load(row: dict[str, Any]) -> dict[str, Any]:
    """The row, its diagnosis advising first to run again on an idle machine when its tuning
    was contended (tuning_load): its final run's own figures may read otherwise."""
    facts = (row.get("tuning_load") or {}).get("contended")
    diagnosis = row.get("diagnosis")
    if isinstance(diagnosis, dict):
        # a row taken from the resolution scenario may carry that scenario's, contended or not
        recs = [r for r in diagnosis.get("recommendations") or []
                if not r.startswith(TUNING_CONTENDED)]
        diagnosis["recommendations"] = [tuning_contended_advice(facts)] + recs[:2] if facts \
            else recs
    return row


# extra[TUNED_ANEW]: whether this session trained or measured anything in a scenario's tuning
# (a size, a trial, a speed knob); popped before the row is written.
TUNED_ANEW = "_tuned_anew"


def measured_speeds(autotune_report: dict[str, Any] | None) -> dict[str, Any]:
    """img/s per value of each knob the autotuner raced (a report reused from a cache file may
    be of another shape: what is not a knob's dict is left out)."""
    knobs = (autotune_report or {}).get("knobs")
    return {k: v["img_s"] for k, v in knobs.items()
            if isinstance(v, dict) and isinstance(v.get("img_s"), dict)} \
        if isinstance(knobs, dict) else {}


@process_settings_kept()  # its speed probe applies each scenario's thread count
def estimate(args: RunOptions, index: DatasetIndex) -> dict[str, Any]:
    """Before a run: about how long each scenario will take, from its planned steps and a
    speed measured now (training steps on one batch in memory, and decoding a few images for
    the per-epoch decode of the baseline and the one-time decode of the tuned scenarios),
    with --match-time's fill of the tuned final runs. "scenarios": every tuning run trained in
    full; "least": each stopped where it first can be (least_tuning_epochs), the fill then
    longer, and a search after the resolution scenario taking that scenario's trial and
    final run (as it does when it keeps the default and the fill gives both final runs the
    same epochs). The autotuner can make a tuned scenario's steps faster than the defaults
    timed here, and early stopping end runs sooner. Without a baseline in this run, an
    earlier run's in the output dir sets the search's time budget and the fill, as in the
    run."""
    device = resolve_device(args.device)
    n_train, n_val, n_test = len(index.train), len(index.val), len(index.test)
    paths = [s[0] for s in index.train[:9]]
    transform = train_transform(scenario_config("baseline", args, device).image_size)
    decodes = []
    for path in paths:  # the first decode loads PIL's codecs: 3-5x a later one, left out
        started = time.perf_counter()
        transform(load_rgb(path))
        decodes.append(time.perf_counter() - started)
    decode_s = statistics.median(decodes[1:] or decodes)
    scenarios: dict[str, float] = {}
    least: dict[str, float] = {}
    # an earlier run's until this run's baseline is estimated, as baseline_seconds decides
    baseline_s = baseline_seconds(args, Path(args.output_dir).expanduser(), index, {}, device)
    for name in args.scenarios:
        config = scenario_config(name, args, device)
        step_s = config.batch_size / _images_per_s(config, len(index.classes), device)
        epoch_s = planned_steps(config, n_train, epochs=1) * step_s * config.grad_accum_steps \
            + n_val / config.batch_size * step_s / 3  # validation: forward only
        test_s = n_test / config.batch_size * step_s / 3   # the test set, once at the end
        if name == "baseline":  # it decodes its training and validation images every epoch
            scenarios[name] = config.epochs * (epoch_s + (n_train + n_val) * decode_s) + \
                test_s + n_test * decode_s
            baseline_s = least[name] = scenarios[name]
            continue
        runs = tuning_runs(name, args, config, device)
        decode = (runs if name == "resolution" else 1) * (n_train + n_val + n_test) * decode_s
        tuning = runs * short_budget(config) * epoch_s
        fewest = epoch_s * least_tuning_epochs(name, args, config, index, device,
                                               config.image_size)
        # After the resolution scenario the search may take its trial as the default's and
        # its final run as its own (same_final): neither trained again.
        taken = name == "hpo" and "resolution" in args.scenarios
        if taken:
            fewest -= epoch_s * search_epochs(config, config.image_size) * \
                search_cost(args, config.image_size)
        if name == "hpo":  # its trials' size (search_size), and the time budget (search_budget)
            tuning *= search_cost(args, config.image_size)
            bound = search_budget(args, baseline_s)[0]
            # The budget stops only the start of new trials: the one under way when it runs
            # out (the default's, the first, at least) trains on to its end.
            trial_s = short_budget(config) * epoch_s * search_cost(args, config.image_size)
            tuning = tuning if bound is None else min(tuning, bound + trial_s)
        for into, spent in ((scenarios, tuning), (least, min(tuning, fewest))):
            spent += decode
            epochs = config.epochs
            if args.match_time and args.epochs is None and baseline_s:
                epochs = filled_epochs(epochs, TIME_SHARE * baseline_s - spent, epoch_s)
            into[name] = spent + (0.0 if taken and into is least else epochs * epoch_s) + test_s
        # Each fill lands within an epoch of the same share of the baseline's time, so the
        # shorter tuning's total can come out the larger: the range never runs backwards.
        least[name] = min(least[name], scenarios[name])
    return {"device": str(device), "n_train": n_train, "decode_ms": 1e3 * decode_s,
            "scenarios": scenarios, "total_s": sum(scenarios.values()),
            "least": least, "least_total_s": sum(least.values())}


def estimate_words(plan: dict[str, Any], resumed: bool = False) -> str:
    """The estimate as the notebook prints it: a range where the tuners' early stops make one
    (estimate's "least" to its "scenarios")."""
    def span(low: float, high: float) -> str:
        unit, scale = ("min", 60) if high >= 60 else ("s", 1)
        digits = 1 if unit == "min" else 0
        low_words, high_words = f"{low / scale:.{digits}f}", f"{high / scale:.{digits}f}"
        return f"{high_words} {unit}" if low_words == high_words else \
            f"{low_words}-{high_words} {unit}"
    least = plan.get("least", plan["scenarios"])
    ranged = any(least[n] < s for n, s in plan["scenarios"].items())
    # estimate's shorter hpo figure after the resolution scenario takes that one's final run
    taken = "resolution" in plan["scenarios"] and \
        least.get("hpo", 0.0) < plan["scenarios"].get("hpo", 0.0)
    return (f"about {span(plan.get('least_total_s', plan['total_s']), plan['total_s'])} on "
            f"{plan['device']}: " + ", ".join(f"{name} {span(least[name], seconds)}"
                                               for name, seconds in plan["scenarios"].items())
            + ("; the shorter figure if the tuners stop every trial they can early"
               + (" and the search keeps the resolution scenario's model" if taken else "")
               + ", before the autotuner's faster settings, which can shorten the tuned "
               "scenarios further" if ranged else "")
            + (" (the whole run: resumed, it trains only what is left)" if resumed else ""))


def _images_per_s(config: TrainConfig, n_classes: int, device: torch.device) -> float:
    """Training speed for the estimate; a batch too large for the GPU is timed at half the
    size, and so on (the run trains it in smaller passes, at about that speed per image)."""
    batch = config.batch_size
    while True:
        try:  # no name holds the probe: once the except block ends, nothing does
            return ComputeProbe(config, n_classes, batch_size=batch).measure(
                min_steps=2, max_steps=5, min_s=0.5)["img_s"]
        except RuntimeError as exc:  # torch's OutOfMemoryError, as hardware._probe catches it
            if not is_out_of_memory(exc) or batch == 1:
                raise
        release(device)  # outside the except block, whose traceback holds the tensors
        batch //= 2


def fill_time(config: TrainConfig, name: str, args: RunOptions, output_dir: Path,
              index: DatasetIndex, tuned: dict[str, Any], tuning_s: float,
              epoch_s: float | None, default_size: int | None = None) -> TrainConfig:
    """A tuned scenario's final run trains as many epochs as fit in TIME_SHARE of the
    baseline's total time, tuning included (at least its own epochs, at most MAX_EPOCH_FACTOR
    times them): the time the faster setup saves buys a better model. At a size below the
    scenario's default (`default_size`, the baseline's), its own epochs are the ones that cost
    what the default's do: the resolution tuner compared the sizes at equal compute, and a
    smaller size given only the default's epochs ended lower than the default where it had led
    at equal compute (docs/tuning.md); --no-match-time keeps those, without the fill. Kept as
    they are with --epochs, and on --resume of a final run that has started (its checkpoint
    fixes them, and its warm-up: 0 from a version without one)."""
    ckpt = checkpoint_file(output_dir, name, run_id=getattr(args, "run_id", None))
    if args.resume and ckpt.exists():
        try:
            saved = saved_config(load_checkpoint(ckpt))
            config = dataclasses.replace(config, warmup_epochs=saved["warmup_epochs"])
            if args.epochs is not None:
                return config
            return dataclasses.replace(config, epochs=int(saved["epochs"]))
        except (OSError, KeyError, TypeError, ValueError, RuntimeError, UserError):
            return config  # the trainer says what is wrong with it
    if args.epochs is not None:
        return config
    own = epochs_at_size(config.epochs, config.image_size, default_size)
    if own != config.epochs:
        log.info("%s: %d epochs at %d px, not %d: they cost what %d do at the default %d px",
                 name, own, config.image_size, config.epochs, config.epochs, default_size)
    if not args.match_time:
        return dataclasses.replace(config, epochs=own)
    baseline_s = baseline_seconds(args, output_dir, index, tuned, torch.device(config.device))
    if not baseline_s or not epoch_s:
        return dataclasses.replace(config, epochs=own)
    left = TIME_SHARE * baseline_s - tuning_s
    fit = int(left // epoch_s)
    epochs = filled_epochs(own, left, epoch_s)
    if epochs != own:
        log.info("%s: %d epochs instead of %d: %s in %.0f%% of the baseline's %.0f s with %.0f "
                 "s of tuning in this scenario, at %.1f s per epoch measured while tuning "
                 "(--epochs N or --no-match-time keeps the count)", name, epochs, own,
                 "they fit" if epochs == fit else
                 f"the most allowed ({MAX_EPOCH_FACTOR}x); {fit} would fit",
                 100 * TIME_SHARE, baseline_s, tuning_s, epoch_s)
    return dataclasses.replace(config, epochs=epochs)


def filled_epochs(own: int, left_s: float, epoch_s: float) -> int:
    """--match-time's epochs for a final run: as many as fit in the `left_s` seconds left,
    at least its own, at most MAX_EPOCH_FACTOR times them (fill_time, and the estimate)."""
    return min(MAX_EPOCH_FACTOR * own, max(own, int(left_s // epoch_s)))


def baseline_seconds(args: RunOptions, output_dir: Path, index: DatasetIndex,
                     tuned: dict[str, Any], device: torch.device) -> float | None:
    """The baseline's total seconds: this run's, else the newest of an earlier run in the
    output dir with this run's setup (same_setup); None when there is none."""
    baseline_s = tuned.get("baseline_total_s")
    if baseline_s is None:
        row = earlier_baseline(args, output_dir, index, device)
        baseline_s = (row or {}).get("total_s") or (row or {}).get("wall_s")
    return baseline_s or None


def earlier_baseline(args: RunOptions, output_dir: Path, index: DatasetIndex,
                     device: torch.device) -> dict[str, Any] | None:
    """The baseline row of this run (a --resume without the baseline scenario), else the
    newest of an earlier run in the output dir with this run's setup (same_setup)."""
    path = output_dir / "results.json"
    own = args.run_id and previous_row(path, "baseline", index.name, run_id=args.run_id)
    return own or previous_row(path, "baseline", index.name, match=same_setup(args, index, device))


def _epoch_seconds(name: str, config: TrainConfig, extra: dict[str, Any]) -> float | None:
    """Seconds per epoch of the final run's settings, as its tuning measured them."""
    if name == "resolution":
        return next((t["epoch_s"] for t in extra.get("resolution_trials", [])
                     if t["image_size"] == config.image_size), None)
    if name == "hpo":
        return (extra.get("hpo") or {}).get("chosen_epoch_s")
    return None


def tune_resolution(config: TrainConfig, args: RunOptions, index: DatasetIndex,
                    output_dir: Path, device: torch.device, tuned: dict[str, Any]
                    ) -> tuple[TrainConfig, dict[str, Any]]:
    """The picked size and its final run's start; tuned["trial"]: the picked size's trial,
    which the hpo search takes as its default trial when it trained the same settings."""
    # Each finished size is journaled: --resume trains only the sizes not yet done.
    tuner = ResolutionTuner(index, dataclasses.replace(config, progress=False),
                            tuned_resolutions(args, device, config.image_size),
                            epochs=short_budget(config), resume=args.resume,
                            journal=checkpoint_file(output_dir, "resolution", ".tuning.json",
                                                    args.run_id),
                            weights_dir=run_folder(output_dir, "checkpoints", args.run_id))
    log.info("== resolution tuning: %s px, %d epochs at the default %d px and about the same "
             "time at the others", ",".join(map(str, tuner.resolutions)), short_budget(config),
             config.image_size)
    size = tuner.run()  # under torchrun every rank trains each size, data-parallel
    if distributed.is_main():
        tuner.save_plot(output_dir / "resolution_tradeoff.png")
    weights, trial_epochs = tuner.weights_for(size)
    trial = next((t for t in tuner.trials if t.image_size == size), None)
    if trial is not None and trial.val_curve:
        tuned["trial"] = EarlierTrial(
            config=tuner.trial_config(size), val_curve=trial.val_curve, weights=weights,
            wall_s=trial.wall_s, samples_per_s=trial.samples_per_s,
            source=f"the resolution scenario's {size} px trial", epoch_end_at=trial.epoch_end_at)
    config, warm = warm_start(dataclasses.replace(config, image_size=size), "resolution",
                              f"the {size} px trial", weights, trial_epochs,
                              list(zip(trial.epoch_end_at, trial.val_curve)) if trial else [])
    return config, {"resolution_trials": tuner.tradeoff(), "warm_start": warm,
                    TUNED_ANEW: len(tuner.reused) < len(tuner.trials)}


def warm_start(config: TrainConfig, name: str, source: str, weights: Path | None,
               epochs: int, curve: list[tuple[float, float]] = ()
               ) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The final run starts from the weights its chosen trial ended with, so the epochs the
    tuning trained on the chosen configuration count towards the model rather than being
    trained again (from scratch, the first epochs of a run are the slowest to leave chance).
    Its learning-rate schedule starts afresh, after WARMUP_EPOCHS of linear warm-up (a fresh
    optimizer at the peak rate first undoes much of what the trial learned). `curve`:
    (time.time(), validation accuracy) at the end of each of that trial's epochs, when it was
    trained in this scenario (lineage)."""
    if weights is None:
        log.info("%s: no weights kept from %s: the final run starts from the beginning",
                 name, source)
        return config, None
    # The trial's model is its best validation epoch's (fit), which need not be its last.
    best = 1 + max(range(len(curve)), key=lambda i: curve[i][1]) if curve else None
    log.info("%s: the final run starts from the weights of %s's best validation epoch (%s%d)",
             name, source, f"{best} of " if best else "of its ", epochs)
    warmup = 0.0 if config.scheduler == "onecycle" else WARMUP_EPOCHS  # it ramps up already
    # The trial's seed: its first epochs replay the trial's draws. Drawing the epochs after
    # them measured no better (docs/tuning.md).
    return dataclasses.replace(config, weights=str(weights), warmup_epochs=warmup), {
        "from": source, "trial_epochs": epochs, "best_epoch": best, "weights": str(weights),
        "curve": [{"at": at, "val_acc": acc} for at, acc in curve]}


def lineage(warm: dict[str, Any] | None, sessions: list[list[float]], tuning_s: float,
            before_s: float = 0.0, reused_start: bool = False) -> None:
    """The start trial's curve as seconds on the scenario's clock, in place: compare_to_baseline
    counts these epochs as the final model's first. Each epoch's end (a time.time()) is placed
    in the tuning session it ended in (`sessions`: [its start, the clock's seconds then],
    oldest first), after `before_s` (a trial reused from the resolution scenario, counted as
    trained first). Epochs that ended before the first session are that reused trial's when
    it is the start trial (`reused_start`), placed to end at before_s; else (a trial of another
    run) they are left out: when they ended in the scenario's time is not known. None is later
    than the tuning's end (the wall clock may be set forward meanwhile)."""
    if warm is None:
        return
    curve, earlier = [], []
    for p in warm.get("curve", []):
        start = next(((at, clock) for at, clock in reversed(sessions) if p["at"] >= at), None)
        if start is not None:
            curve.append({"elapsed_s": min(tuning_s, before_s + start[1] + p["at"] - start[0]),
                          "val_acc": p["val_acc"]})
        elif reused_start and before_s > 0:
            earlier.append(p)
    last = max((p["at"] for p in earlier), default=0.0)
    warm["curve"] = [{"elapsed_s": min(tuning_s, max(0.0, before_s - (last - p["at"]))),
                      "val_acc": p["val_acc"]} for p in earlier] + curve


def probed_fit(findings: dict[str, Any] | None, config: TrainConfig) -> int | None:
    """The largest batch the autotuner's memory probe found to fit at config's size, when it
    probed as far as the search's largest batch; None: the search probes for itself (a CPU,
    a batch the user fixed, a probe the budget left out, a choice saved by a version that
    probed less far)."""
    knob = ((findings or {}).get("knobs") or {}).get("batch_size") or {}
    fits, upto = knob.get("fits"), knob.get("probed_upto")
    if not isinstance(fits, int) or not isinstance(upto, int) or upto < max(BATCH_SIZES) or \
            (findings or {}).get("image_size", config.image_size) != config.image_size:
        return None
    return fits


def tune_hyperparameters(config: TrainConfig, args: RunOptions, index: DatasetIndex,
                         output_dir: Path, device: torch.device,
                         earlier: EarlierTrial | None = None, default_size: int | None = None,
                         budget: tuple[float | None, str] = (None, ""),
                         probed: int | None = None) -> tuple[TrainConfig, dict[str, Any]]:
    """The search, then the final run's configuration: the search's winner only when it beat
    the default configuration (its first trial) on validation, else the default. `earlier`:
    a trial already trained (the resolution scenario's), the default trial when it matches.
    default_size: the baseline's size (search_epochs). budget: (seconds its trials may train
    in all, why), from search_budget. probed: the largest batch that fits at config's size,
    as the autotuner's memory probe found it (None: probed here)."""
    if not distributed.is_main():
        # Under torchrun rank 0 runs the study; every trial trains data-parallel on all ranks.
        follow_trials(index)
        return distributed.expect(distributed.from_main(None)), {}
    try:
        return _search(config, args, index, output_dir, device, earlier, default_size, budget,
                       probed)
    except UserError as exc:  # a study of other data, a storage refused ... (between trials)
        distributed.tell_the_others(exc)
        raise


def _search(config: TrainConfig, args: RunOptions, index: DatasetIndex, output_dir: Path,
            device: torch.device, earlier: EarlierTrial | None, default_size: int | None,
            budget: tuple[float | None, str], probed: int | None = None
            ) -> tuple[TrainConfig, dict[str, Any]]:
    """tune_hyperparameters on rank 0 (outside torchrun, the only one)."""
    n_trials = trial_count(args)
    trial_epochs = search_epochs(config, default_size)
    trial_size = search_size(args, config.image_size)
    # Once the final run has started, its checkpoint holds the parameters it trains with: more
    # trials (this process's, or another worker's on a shared --storage) could only change the
    # study's best, and the checkpoint would then refuse to resume. `--resume --n-trials N`
    # with N above the last N given grows it all the same: the final run is then trained
    # again only when the choice changed.
    final = checkpoint_file(output_dir, "hpo", run_id=args.run_id)
    begun = check_format(load_checkpoint(final), final) if args.resume and final.exists() \
        else None
    started = begun["config"] if begun is not None else None
    if started is not None and args.time_budget is None:
        # The automatic budget bounded the search that ran before; a growth after it (asked
        # for, or cut short and finished now) is bounded by its count.
        budget = (None, "")
    stopping = {"asha": "successive halving over epochs", "hyperband": "Hyperband over epochs",
                "median": "median stopping over epochs", "none": "no trial stopped early"}
    # Resumed without --n-trials, a study that exists keeps the count (and the automatic
    # budget) it was started with, which need not be the preset's; the tuner says what it has.
    kept = args.resume and args.n_trials is None
    auto_budget = budget[0] is not None and args.time_budget is None
    log.info("== hyperparameter search: %d trials of %d epochs at %d px%s (the default "
             "configuration first), %s%s%s", n_trials, trial_epochs, trial_size,
             "" if trial_size == config.image_size else
             f" for a final run at {config.image_size} px (--search-size)",
             stopping.get(args.pruner, args.pruner),
             "" if budget[0] is None else
             f"; no trial started after {budget[0]:.0f} s of trials ({budget[1]})",
             "; a study resumed keeps the count" + (" and budget" if auto_budget else "")
             + " it was started with" if kept else "")
    # Batch sizes are searched only up to what the GPU holds at this resolution.
    probing = time.perf_counter()
    if probed is not None:
        largest = probed
        log.info("memory probe at %d px: up to batch %d fits, as the autotuner's probe found "
                 "(not probed again)", config.image_size, largest)
    else:
        largest = max_batch_size(config, len(index.classes), device, upto=max(BATCH_SIZES))
    # measuring, as the autotuner's is (None on a CPU, where it probes nothing)
    probe_s = time.perf_counter() - probing if device.type == "cuda" else None
    # A study of its own for each run in the output dir's SQLite file; on a shared --storage
    # one study per dataset that every worker joins, each sampling from its own seed.
    shared = args.storage is not None
    if (unused := local_dir_unused(args.storage, args.local_dir)) is not None:
        log.info("hpo: %s", unused)
    tuner = OptunaTuner(index, dataclasses.replace(config, image_size=trial_size),
                        output_dir=output_dir, n_trials=n_trials, final_size=config.image_size,
                        keep_study_size=args.search_size == "auto",
                        timeout_s=budget[0], storage=args.storage, resume=args.resume,
                        epochs=trial_epochs, max_batch_size=largest, local_dir=args.local_dir,
                        pruner=args.pruner,
                        study_name=f"hpo-{index.name}" + ("" if shared else f"-{args.run_id}"),
                        seed=worker_seed(args) if shared else args.seed,
                        weights_dir=run_folder(output_dir, "checkpoints", args.run_id),
                        earlier=earlier, study_count=args.n_trials is None, shared=shared,
                        run_name=f"{Path(output_dir).resolve()}#{args.run_id}",
                        sole_user=not shared,  # run() holds the output dir's lock
                        auto_budget=auto_budget)
    if started is not None:
        log.info("hpo: the final run had %s (%s)%s; the study grows only with an --n-trials N "
                 "above the last one given", "finished" if begun.get("finished") else "started",
                 final, "" if begun.get("finished") else
                 ": resuming it with the parameters it started with")
    summary = tuner.run(ended=started is not None)
    # Grown in this session, or in an earlier one cut short before its final run was decided
    # again (trials another worker adds to a shared study do not make it train again).
    grow = started is not None and (tuner.new_trials > 0 or tuner.growth_pending())
    log.info("hpo: %s", summary["choice"])
    params = summary["chosen_params"] or OptunaTuner.searched(config)
    chosen = dataclasses.replace(config, **params)
    trained_anew, warm, replaced = True, None, None
    if started is not None:
        # The start weights too: the run continues from its checkpoint, which started there
        # (and its warm-up: fill_time).
        before = dataclasses.replace(config, **{k: started[k] for k in (*OptunaTuner.SEARCHED,
                                                                       "weights") if k in started})
        kept = kept_file(weights_file(before.weights),
                         run_folder(output_dir, "checkpoints", args.run_id))
        if kept is not None:  # the output dir may have moved since the checkpoint was written
            before = dataclasses.replace(before, weights=str(kept))
        if not grow or all(getattr(before, k) == getattr(chosen, k) for k in OptunaTuner.SEARCHED):
            if grow and tuner.new_trials > 0:
                log.info("hpo: the choice did not change: the final run is not trained again")
            chosen, trained_anew = before, False  # it continues from its checkpoint
            warm = resumed_start(output_dir, args, index.name, before.weights)
            replaced = pending_replaced(output_dir, args.run_id)
            summary = continued_summary(summary, before, tuner)
            tuner.save_plots(summary)
        else:
            tuner.save_plots(summary)  # before the set-aside, which the clock counts
            before_at = f"before-{time.strftime('%Y%m%d-%H%M%S')}"
            aside = final.with_name(f"hpo.{before_at}.pt")
            final.rename(aside)
            replaced = replaced_final(begun, aside, previous_row(
                output_dir / "results.json", "hpo", index.name, args.run_id))
            runs = run_folder(output_dir, "runs", args.run_id)
            if (runs / "hpo").is_dir():
                # its scalars too: the new final run's would be drawn over them as one run
                show_in_tensorboard(runs, aside=before_at, kept=None)
                replaced["scalars"] = str(runs / f"hpo.{before_at}")
            log.info("hpo: the choice changed with the new trials: training the final run "
                     "again (the earlier one is kept as %s; its %.0f s count as tuning)", aside,
                     replaced["seconds"])
            if distributed.is_main():
                try:
                    write_json(replaced_record(output_dir, args.run_id), replaced)
                except OSError as exc:  # costs only the comparison after a cut-short session
                    log.info("hpo: could not record the set-aside final run (%s)",
                             first_line(exc))
        if distributed.is_main():
            tuner.growth_settled()
    else:
        tuner.save_plots(summary)  # best_params.json: what the final run trains, and why
    if trained_anew:
        weights, epochs, source = tuner.start_for(summary["chosen_params"])
        chosen, warm = warm_start(chosen, "hpo", source, weights, epochs,
                                  tuner.curve_for(summary["chosen_params"]))
    if distributed.world_size() > 1:
        end_trials()
        distributed.from_main(chosen)
    return chosen, {"hpo": {**summary, "memory_probe_s": probe_s}, "warm_start": warm,
                    TUNED_ANEW: tuner.new_trials > 0
                    or bool(replaced and not replaced.get(COUNTED)),
                    **({"replaced_final": replaced} if replaced else {})}


def continued_summary(summary: dict[str, Any], before: TrainConfig, tuner: OptunaTuner
                      ) -> dict[str, Any]:
    """The search's summary for a final run continued from its checkpoint: what that run trains
    (its parameters, fixed when it started), where the study's choice has moved since (on a
    shared study, other workers' trials), so the row and best_params.json do not name a
    winner this run did not train."""
    trained = OptunaTuner.searched(before)
    default = OptunaTuner.searched(tuner.default_config())
    now = summary["chosen_params"] or default
    if trained == now:
        return summary
    log.info("hpo: the study's choice has moved since the final run started (%s); the run "
             "continues with the parameters it started with", summary["choice"])
    return {**summary, "chosen_params": None if trained == default else trained,
            "keeps_default": trained == default,
            "choice": f"the final run had started with {trained} and continues with them (the "
                      f"study's choice since: {summary['choice']})"}


def replaced_final(begun: dict[str, Any], aside: Path, row: dict[str, Any] | None
                   ) -> dict[str, Any]:
    """An hpo final run set aside when a grown study changed the choice: where it is kept, the
    seconds it took (its row's, when it had finished, as that row counted them; else its
    checkpoint's epochs), which the scenario counts as tuning, and the figures its row had,
    so the row that replaces it still says what it was."""
    history = json.loads(json.dumps(json_safe(begun.get("history") or [])))
    finished = row is not None and row.get("history") == history
    seconds = (row["total_s"] - row["tuning_s"]) if finished else \
        (history[-1]["elapsed_s"] if history else 0.0)
    return {"checkpoint": str(aside), "seconds": seconds, "finished": finished,
            "params": {k: begun["config"].get(k) for k in OptunaTuner.SEARCHED},
            **({k: row.get(k) for k in ("val_acc", "test_acc", "epochs")} if finished else
               {"epochs": len(history)}),
            **({EARLIER_ROW: row} if finished else {})}  # for earlier_if_better, not results


def resumed_start(output_dir: Path, args: RunOptions, dataset: str, weights: str
                  ) -> dict[str, Any] | None:
    """The warm start of an hpo final run resumed from its checkpoint: as this run's earlier
    row recorded it, else the weights the checkpoint started from. Its trial's epochs were
    trained in an earlier session, so they are not counted (lineage): no curve."""
    row = previous_row(output_dir / "results.json", "hpo", dataset, args.run_id)
    warm = dict((row or {}).get("warm_start") or {})
    if not warm and Path(weights).is_file():
        warm = {"from": "the weights its checkpoint started from", "weights": weights}
    return {**warm, "curve": []} if warm else None


def worker_seed(args: RunOptions) -> int:
    """The sampler seed of one worker on a shared study: --worker-seed, else --seed mixed with
    this host and process, so workers do not repeat each other's trials."""
    if args.worker_seed is not None:
        return args.worker_seed
    mixed = hashlib.sha256(f"{args.seed}:{socket.gethostname()}:{os.getpid()}".encode())
    seed = int.from_bytes(mixed.digest()[:4], "big")
    log.info("hpo: this worker samples with seed %d (--worker-seed %d repeats it)", seed, seed)
    return seed


def unfinished(results: list[dict[str, Any]], args: RunOptions) -> list[str]:
    """The scenarios asked for that have no row of this run yet: a resumed session's report
    shows the rows earlier sessions finished, which did finish, whether or not this session
    has reached them again."""
    done = {r.get("scenario") for r in results if r.get("run_id") == args.run_id}
    return [name for name in args.scenarios if name not in done]


def same_setup(args: RunOptions, index: DatasetIndex, device: torch.device
               ) -> Callable[[dict[str, Any]], bool]:
    """Whether an earlier run's row in the output dir was made with this run's data (its
    images and split, not only a folder of the same name), model, kind of device and baseline
    (its size and epochs): a --quick run's rows are no baseline, and no picked size, for a
    full run, nor a CPU run's for a GPU run."""
    @functools.cache  # once, and only when there are earlier rows to match
    def baseline() -> TrainConfig:
        return scenario_config("baseline", args, device)

    @functools.cache
    def resolution() -> TrainConfig:
        return scenario_config("resolution", args, device)

    @functools.cache  # the rows share a fingerprint or two
    def same_data(recorded: str) -> bool:
        return index.same_data(recorded)

    def match(row: dict[str, Any]) -> bool:
        base = baseline()
        settings = row.get("settings") or {}
        if (row.get("model"), row.get("n_val"), row.get("n_test"),
                str(settings.get("device", "")).split(":")[0], settings.get("world_size", 1)) != \
                (base.model, len(index.val), len(index.test), device.type,
                 distributed.world_size()):
            return False  # torchrun's processes: another global batch and steps per epoch
        recorded = row.get("data_fingerprint")
        if recorded is not None and not same_data(recorded):
            return False  # other images in a folder of the same name
        if row.get("scenario") == "baseline":
            # What it learned: the start weights, lr, batch, schedule ... (--weights none against
            # an ImageNet-weights baseline is another comparison); the seed is a draw, not a setup.
            # settings["weights"] says "imagenet" also where they could not be fetched and it
            # trained from random weights: start_weights says which it was.
            # (a setting a row's version did not have, at its default)
            # Its speed knobs too, those set rather than measured: a baseline given
            # --num-workers 2 is not the plain one this run's time is to be judged against.
            return all(settings.get(k, DEFAULTS[k]) == v
                       for k, v in base.learning_settings().items() if k != "seed") and \
                all(settings.get(k, DEFAULTS[k]) == v for k, v in base.run_settings().items()
                    if k in SPEED_ONLY and v not in (None, "auto")) and \
                row.get("start_weights") in ({None} | possible_starts(base.model, args.weights))
        # A picked size: from trials of this run's settings and compute (the baseline's size,
        # always among them, trained short_budget epochs), started from the same weights.
        tuned = resolution()
        default = next((t for t in row.get("resolution_trials") or []
                        if t.get("image_size") == base.image_size), None)
        return default is not None and len(default.get("val_curve") or []) == short_budget(
            tuned) and row.get("start_weights") == start_weights(tuned.model, args.weights) and \
            all(settings.get(k) == getattr(tuned, k) for k in PICK_SETTINGS)
    return match


# What the resolution tuner's trials learned with besides their size and epochs: a pick made
# with other values is not this run's (the start weights and trial epochs are checked too).
PICK_SETTINGS = ("lr", "optimizer", "weight_decay", "momentum", "scheduler", "max_grad_norm")


def _previous_resolution(output_dir: Path, args: RunOptions, index: DatasetIndex,
                         device: torch.device) -> tuple[int | None, str | None]:
    """The resolution scenario's pick from an earlier run of the same setup, and that run's
    id; (None, None) when there is none."""
    row = previous_row(output_dir / "results.json", "resolution", index.name,
                       match=same_setup(args, index, device))
    return (row.get("best_resolution"), row.get("run_id")) if row else (None, None)


def _cuda_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def write_outputs(results: list[dict[str, Any]], output_dir: Path, run_id: str | None = None,
                  unfinished: list[str] | None = None, show: bool = True
                  ) -> list[dict[str, Any]]:
    """Plots, report and table (printed when `show`) of run `run_id`'s rows in results.json
    (all rows when None); the report lists the earlier runs, and `unfinished`, the scenarios
    this run did not finish. Returns the run's rows."""
    current = [r for r in results if run_id is None or r.get("run_id") == run_id]
    plot_comparison({r["scenario"]: r["history"] for r in current}, output_dir)
    ran = {r["scenario"] for r in current}
    also = (("resolution_tradeoff.png",) if "resolution" in ran else ()) + ((
        "best_params.json", "optuna_history.png", "optuna_importance.png", "optuna_history.html",
        "optuna_importance.html") if "hpo" in ran else ())
    # The top level shows the newest run; its own copy stays in runs/<run>/report.
    write_report(current, output_dir, earlier=[r for r in results if r not in current],
                 unfinished=unfinished, also=also,
                 copy_to=output_dir / "runs" / run_id / "report" if run_id else None)
    if show:
        print("\n".join([table_markdown(results_table(current)),
                         *baseline_source_lines(current)]))
    return current


def prepare_output_dir(path: str, option: str = "--output-dir") -> Path:
    """The folder the user named with `option`, created and checked writable; a write that
    later fails under it names that option (files.write_error)."""
    out = Path(path).expanduser()
    resolved(option, out)  # a link loop: one line, where mkdir would say "File exists"
    try:  # TensorBoard's writer encodes its paths as UTF-8, and failed at the first scenario
        str(out.resolve()).encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{option} '{printable(str(out))}' has a name that is not UTF-8 (a "
                        "byte of another encoding, or a C locale with PYTHONUTF8=0), which "
                        "TensorBoard's files cannot be written under: rename it, or pass "
                        "another folder.") from None
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"{option} {str(out)!r} is a file, not a folder.")
        out.mkdir(parents=True, exist_ok=True)
        # A uniquely named probe: torchrun's processes check the same folder at once.
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write_test"):
            pass
    except OSError as exc:  # ENAMETOOLONG too: nothing was written yet
        raise UserError(f"cannot write to {option} {str(out)!r} ({exc.strerror or exc}).") \
            from None
    name_folder(out, option)
    return out


def run(args: RunOptions, index: DatasetIndex | None = None) -> list[dict[str, Any]]:
    """Every requested scenario in order; returns the results rows. `index`: the data as
    `load_data` gave it, to save a second scan."""
    device = resolve_device(args.device)
    device = distributed.init_from_env(device.type) or device  # under torchrun: this rank's
    if not distributed.is_main():  # under torchrun: one set of logs, rank 0's
        logging.getLogger().setLevel(logging.WARNING)
    output_dir = prepare_output_dir(args.output_dir)
    # A folder where the run writes its results would end it after training, its rows lost.
    for name in ("results.json", REPORT_MD, RUN_FILE):
        if (output_dir / name).is_dir():
            raise UserError(f"{str(output_dir / name)!r} is a folder where this run writes a "
                            "file: move it away, or pass another --output-dir.")
    if args.local_dir:
        prepare_output_dir(args.local_dir, "--local-dir")
    if args.storage and "hpo" in args.scenarios:
        on_main(lambda: check_storage(args.storage))  # a wrong URL stops it before training
    index = index or load_data(args, output_dir)
    with run_lock(output_dir), process_settings_kept(), interrupts.stoppable(), \
            pinned_weights_file(weights_file(args.weights)):
        start = weights_file(args.weights)
        # What the check says of the start (validation reads high ...) goes to run.log too,
        # which opens once start_run has named the run.
        checked = Said(membership.__name__)
        try:
            with checked:
                begun = membership.check_start(start, index, args.seed,
                                               run_record_beside(start), split_with(args, index))
        except UserError:
            if not args.resume:
                raise
            # A --resume with another start is refused for that (start_run) before the
            # images the start had seen are counted: advised another --seed here, it would
            # be refused for that.
            begun = None
        # Every process checks (so a refused --resume ends them all); rank 0's id is the run's.
        args.run_id = distributed.from_main(start_run(
            output_dir, index, resume=args.resume, seed=args.seed, quick=args.quick,
            weights=str(start.resolve()) if start else args.weights, model=args.model,
            scenarios=list(args.scenarios), settings=learning_options(args),
            command=args.command or shlex.join(launcher() + shown_argv(sys.argv))))
        runs = run_folder(output_dir, "runs", args.run_id)
        with (run_log(runs / "run.log", data_record(index, runs) + [
                f"start weights: {start_weights(args.model, args.weights)}", *checked.records])
              if distributed.is_main()
              else contextlib.nullcontext()):
            try:
                if begun is None:  # refused above, and start_run had nothing against it
                    begun = membership.check_start(start, index, args.seed,
                                                   run_record_beside(start),
                                                   split_with(args, index))
                record = distributed.main_computes(
                    lambda: record_trained_on(output_dir, args.run_id, index, args, begun))
                log.info("run %s: outputs in %s (earlier runs stay in results.json)",
                         args.run_id, output_dir)
                with membership.stamping(record):
                    rows = _run_scenarios(args, index, output_dir, device)
                mark_finished(output_dir, args.run_id)
                if distributed.is_main():
                    log.info("run %s keeps %s in %s: its checkpoints are what --resume and "
                             "--weights read; remove a finished run's folders when you no "
                             "longer need them", args.run_id,
                             footprint(output_dir, args.run_id), output_dir)
                return rows
            except UserError:
                if distributed.is_main():  # refused before it made anything: not a run to resume
                    with contextlib.suppress(OSError, UserError):  # the refusal is the news
                        forget_refused_run(output_dir, args.run_id)
                raise


def launcher() -> list[str]:
    """How this process was started, as the run's record shows it to rerun (--resume): under
    torchrun its processes, which a resume must have again (the checkpoints are per process
    count)."""
    if distributed.world_size() == 1:
        return ["python"]
    nodes = distributed.world_size() // max(1, distributed.local_world_size())
    return ["torchrun", *(["--standalone"] if nodes == 1 else [f"--nnodes={nodes}"]),
            f"--nproc-per-node={distributed.local_world_size()}"]


def record_trained_on(output_dir: Path, run_id: str, index: DatasetIndex, args: RunOptions,
                      begun: membership.Start) -> dict[str, Any]:
    """The run's membership record, which its saved models, checkpoints and trials' weights
    carry, to be checked by when a later run starts from them; the time reading the images
    takes is said when felt."""
    started = time.perf_counter()
    record = membership.record(run_folder(output_dir, "checkpoints", run_id), index, {
        "run_id": run_id, "seed": args.seed, "quick": args.quick,
        "images_fingerprint": index.images_fingerprint()}, begun)
    if (took := time.perf_counter() - started) >= 1:
        log.info("noted which of the images this run trains on (%d, in %.1f s), so that a run "
                 "starting from its models can tell the images they have seen", len(index.train),
                 took)
    return record


def data_record(index: DatasetIndex, folder: Path) -> list[str]:
    """What run.log says of the data, which was read before the log could be opened; every
    skipped file goes to folder/SKIPPED_LIST (the warning names three), every copy left out
    to folder/COPIES_LIST (it names two)."""
    lines = [f"data: {index.summary()} in {index.root}"
             + (f" (listed and checked in {index.read_s:.1f} s)" if index.read_s >= 1 else "")]
    lines += [imbalance] if (imbalance := index.imbalance()) is not None else []
    for listed, name, what in (
            (index.skipped_lines(), SKIPPED_LIST, "skipped {} undecodable image file(s)"),
            (index.copy_lines(), COPIES_LIST, "{} copies of validation or test images left out")):
        if not listed:
            continue
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text("".join(f"{line}\n" for line in listed), folder / name)
            lines.append(f"{what.format(len(listed))}: listed in {name}")
        except (OSError, UserError) as exc:  # the run goes on: the warning named some
            log.warning("could not write %s (%s)", folder / name, first_line(exc))
    return lines


def on_main(action: Callable[[], Any]) -> None:
    """`action` on rank 0 alone under torchrun (as it is outside), its value not sent: when it
    fails, every rank stops (distributed.main_computes)."""
    def done() -> None:
        action()
    distributed.main_computes(done)


@contextlib.contextmanager
def run_lock(output_dir: Path):
    """The output dir's lock (files.folder_lock), held by rank 0 under torchrun; a refusal
    stops every rank (on_main)."""
    with contextlib.ExitStack() as stack:
        on_main(lambda: stack.enter_context(folder_lock(output_dir)))
        yield


def _run_scenarios(args: RunOptions, index: DatasetIndex, output_dir: Path,
                   device: torch.device) -> list[dict[str, Any]]:
    tuned: dict[str, Any] = {}  # what one scenario hands the next (the picked resolution)
    rows: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    try:
        for name in args.scenarios:
            rows.append(run_scenario(name, args, index, output_dir, device, tuned))
            if name == "baseline":
                tuned["baseline_total_s"] = rows[-1]["total_s"]
            baseline = next((r for r in rows if r["scenario"] == "baseline"), None) or \
                earlier_baseline(args, output_dir, index, device)
            compare_to_baseline(rows, baseline)
            if distributed.is_main():  # as each scenario ends: a crash in the next loses no row
                path = output_dir / "results.json"
                results = merge_results(path, rows)
                write_json(path, results)
                if args.scenarios[len(rows):]:  # and its report, which a lost VM (no except
                    # below) leaves as it is
                    write_outputs(results, output_dir, args.run_id,
                                  unfinished=unfinished(results, args), show=False)
    except BaseException:  # Ctrl-C or a failure: the finished scenarios' table and report
        if distributed.is_main() and rows and results:
            try:
                write_outputs(results, output_dir, args.run_id,
                              unfinished=unfinished(results, args))
            except Exception as exc:  # the first error is the one to see
                log.warning("could not write the finished scenarios' report (%s)",
                            first_line(exc))
        raise
    return write_outputs(results, output_dir, args.run_id) if distributed.is_main() else rows


