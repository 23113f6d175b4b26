"""The command line: `python pipeline.py --help`. The scenarios it runs are library code
(scenario.py); the notebook calls the same API with keyword arguments (`options`, `run`)."""
from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    def _quiet_interrupt(*_) -> None:
        # Ctrl-C while torch loads (seconds) ends without a traceback: nothing has started.
        # os._exit: a SystemExit raised while a weakref callback of the imports runs is
        # dropped by Python ("Exception ignored"), and the run went on (modules.interrupts).
        print("interrupted before the run started.", file=sys.stderr, flush=True)
        os._exit(130)
    signal.signal(signal.SIGINT, _quiet_interrupt)

import argparse
import contextlib
import dataclasses
import fnmatch
import functools
import logging
import math
import re
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from modules import distributed, hostmem
from modules.config import (CPU_ALLOCATORS, DROPOUT_IMPLS, MAX_IMAGE_SIZE, MAX_SEED, MIN_IMAGE_SIZE,
                            MODELS, SCHEDULERS, TrainConfig, UserError)
from modules.device import autocast_dtype
from modules.files import resolved, user_error
from modules.models import check_weights_file
from modules.results import run_rows  # noqa: F401  (the notebook's run cell)
from modules.storage import shown_argv
from optuna_optimizer import PRUNERS
# The library API the notebook and README call through this module.
from scenario import (FIDELITY_FROM, FIDELITY_SCALE, MAX_EPOCH_FACTOR, N_TRIALS,  # noqa: F401
                      QUICK_N_TRIALS, SCENARIOS, TIME_SHARE, RunOptions, estimate,
                      estimate_words, load_data,
                      prepare_output_dir, resolve_device, run, run_folder, scenario_config)

log = logging.getLogger("pipeline")

# ----------------------------------------------------------------------------- options

class _Parser(argparse.ArgumentParser):
    _argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # one line, no usage block
        option = message.removeprefix("argument ").split(":")[0].split("/")[-1]
        given = self._argv[self._argv.index(option) + 1:][:1] if option in self._argv else []
        if message.endswith("expected one argument") and given and given[0].startswith("-") \
                and given[0].split("=")[0] not in self._option_string_actions:
            # argparse reads a value starting with "-" (other than a plain negative number)
            # as the next option: "--lr -1e-3" would never reach the value's own check.
            message += f" (a value starting with '-' is written {option}={given[0]})"
        raise UserError(f"{message} (see python pipeline.py --help)")


def _bounded(kind, low, high=None, strict=False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < low or (strict and value == low) or (high is not None and value > high):
            rng = f"> {low}" if strict else f">= {low}"
            rng += f" and <= {high}" if high is not None else ""
            raise argparse.ArgumentTypeError(f"must be {rng}, got {text!r}")
        return value
    return parse


def _scenario_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names a scenario twice")
    if not names:
        raise argparse.ArgumentTypeError(
            f"no scenario named; name at least one of {', '.join(SCENARIOS)} (in the notebook: "
            "tick RUN_BASELINE, RUN_RESOLUTION_TUNING or RUN_OPTUNA_HP_TUNING)")
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown)}; available: "
            f"{', '.join(SCENARIOS)}")
    # Each builds on the one before (the hpo scenario searches at the resolution scenario's
    # size, from its trial, within the baseline's time): they run in that order as typed.
    return [s for s in SCENARIOS if s in names]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _search_size(text: str) -> int | str:
    if text in ("auto", "full"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, full or a size in pixels, got "
                                         f"{text!r}") from None
    if not 1 <= value <= MAX_IMAGE_SIZE:
        raise argparse.ArgumentTypeError(f"must be auto, full or 1..{MAX_IMAGE_SIZE}, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipeline.py", description="Train an image classifier on this machine's "
                "hardware and write results, plots, model and logs to --output-dir.")
    data = p.add_argument_group("data")
    data.add_argument("--dataset", choices=("synthetic", "intel"), default="synthetic",
                      help="synthetic: generated offline (default); intel: Kaggle's Intel Image "
                           "Classification via kagglehub")
    data.add_argument("--data-dir", metavar="PATH", help="any image folder: Intel's layout, "
                      "train/<class> + test/<class> (+ val/ or valid/), or <class>/ folders; overrides --dataset")
    run = p.add_argument_group("run")
    run.add_argument("--scenarios", type=_scenario_list, default=list(SCENARIOS),
                     help=f"comma-separated, run in order (default: {','.join(SCENARIOS)})")
    run.add_argument("--quick", action="store_true",
                     help="smoke preset: small subset, few epochs, device-sized images")
    run.add_argument("--output-dir", default="others", metavar="DIR")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument("--resume", action="store_true",
                     help="continue interrupted scenarios from their checkpoints")
    run.add_argument("--local-dir", metavar="DIR",
                     help="keep the SQLite study (and the generated synthetic set) here, on "
                          "a local disk, and copy the study to the output dir as every trial "
                          "starts and ends: for an output dir on a network drive such as "
                          "Google Drive, where SQLite is slow and unsafe; --resume restores it "
                          "from the output dir when DIR lost it")
    run.add_argument("--seed", type=_bounded(int, 0, MAX_SEED), default=42)
    run.add_argument("--worker-seed", type=_bounded(int, 0, MAX_SEED), metavar="N",
                     help="this worker's sampler seed on a shared --storage study (default: "
                          "from --seed, the host and the process, so workers differ)")
    run.add_argument("--profile", action="store_true",
                     help="write torch.profiler traces of a few steps to DIR/profiler/<run>/<scenario>")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    tune = p.add_argument_group("tuning")
    tune.add_argument("--resolutions", type=_int_list, metavar="LIST",
                      help="ResolutionTuner candidates, e.g. 144,160,176,192 (default: by device)")
    tune.add_argument("--n-trials", type=_bounded(int, 1, 100_000),
                      help=f"Optuna trials ({N_TRIALS}; {QUICK_N_TRIALS} with --quick; "
                           "without it or --time-budget the search also stops at the baseline's "
                           "total time)")
    tune.add_argument("--time-budget", type=_bounded(float, 0.0, strict=True), metavar="SECONDS",
                      help="stop starting new Optuna trials once the search's trials have "
                           "trained this long in all, resumed sessions included (default: the "
                           "baseline's total time, unless --n-trials is given)")
    tune.add_argument("--pruner", choices=PRUNERS, default="asha",
                      help="how the search stops trials that fall behind: asha (successive "
                           "halving, default), hyperband, median, or none (every trial trains "
                           "its whole budget: plain TPE)")
    tune.add_argument("--search-size", type=_search_size, default="auto", metavar="auto|full|N",
                      help=f"the size the search's trials train at: auto (default) trains "
                           f"them at {FIDELITY_SCALE:g}x the final run's size from "
                           f"{FIDELITY_FROM} px up, a cheaper look that ranks configurations "
                           "the same way; full at the final run's size; or N pixels")
    tune.add_argument("--storage", metavar="URL",
                      help="a database whose study every run given it joins (default: a "
                           "study of the run's own in sqlite:///DIR/optuna.db); e.g. "
                           "postgresql+psycopg://user@host/db, the password in PGPASSWORD")
    train_ = p.add_argument_group("training (override the scenario defaults)")
    train_.add_argument("--model", choices=MODELS, default="squeezenet1_1")
    train_.add_argument("--weights", default="imagenet", metavar="none|imagenet|PATH",
                        help="initial weights (default imagenet, random when unreachable)")
    train_.add_argument("--epochs", type=_bounded(int, 1, 100_000))
    train_.add_argument("--image-size", type=_bounded(int, min(MIN_IMAGE_SIZE.values()),
                                                      MAX_IMAGE_SIZE),
                        help="input side in pixels (at least %d for squeezenet1_1)"
                             % MIN_IMAGE_SIZE["squeezenet1_1"])
    train_.add_argument("--batch-size", type=_bounded(int, 1, 1 << 20))
    train_.add_argument("--lr", type=_bounded(float, 0.0, 10.0, strict=True))
    train_.add_argument("--scheduler", choices=SCHEDULERS,
                        help="learning-rate schedule per optimizer step (default: cosine)")
    train_.add_argument("--momentum", type=_bounded(float, 0.0, 0.999),
                        help="SGD momentum, Nesterov when > 0 (default 0.9; the hpo search "
                             "can choose SGD)")
    train_.add_argument("--grad-accum-steps", type=_bounded(int, 1, 1 << 16))
    train_.add_argument("--max-grad-norm", type=_bounded(float, 0.0, strict=True))
    train_.add_argument("--match-time", action=argparse.BooleanOptionalAction, default=True,
                        help=f"tuned scenarios train as many epochs as fit in "
                             f"{100 * TIME_SHARE:.0f}%% of the baseline's total time, tuning "
                             f"included (at least their own, at most {MAX_EPOCH_FACTOR}x; "
                             "default: on; --epochs fixes the count)")
    train_.add_argument("--early-stopping", type=_bounded(int, 1, 100_000), metavar="PATIENCE",
                        help="stop after PATIENCE epochs without a better val accuracy")
    train_.add_argument("--amp", choices=("auto", "off", "fp16", "bf16"))
    train_.add_argument("--channels-last", action=argparse.BooleanOptionalAction,
                        help="NHWC memory format for the model and inputs (default: off for "
                             "the baseline, measured for the tuned scenarios)")
    train_.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        help="torch.compile the model (default: off for the baseline, "
                             "measured for the tuned scenarios)")
    train_.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                        help="let cuDNN time its convolution algorithms for each input shape "
                             "and keep the fastest (GPU only; default: on)")
    train_.add_argument("--num-workers", type=_bounded(int, 0, 256),
                        help="DataLoader worker processes for images decoded as they are read "
                             "(the decoded-image cache of the tuned scenarios starts none)")
    train_.add_argument("--cpu-allocator", choices=CPU_ALLOCATORS,
                        help="retain: freed CPU memory stays in the process for reuse instead of "
                             "being returned to the system and faulted back in every step")
    train_.add_argument("--dropout-impl", choices=DROPOUT_IMPLS,
                        help="bytemask: dropout masks drawn from random bytes, the same "
                             "distribution as PyTorch's bernoulli_ and faster on a CPU")
    train_.add_argument("--pin-memory", action=argparse.BooleanOptionalAction,
                        help="page-locked batches for faster, asynchronous copies to the GPU "
                             "(default: off for the baseline, on for the tuned scenarios on a "
                             "GPU)")
    train_.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the speed knobs (threads, channels_last, AMP dtype, "
                             "optimizer kernels, dropout masks, CPU allocator, compile, "
                             "workers) and the batch that fits, and keep what is faster; for "
                             "the resolution and hpo scenarios (default: on)")
    return p


# options that only one scenario reads
UNUSED_WITHOUT = {"resolutions": "resolution", "n_trials": "hpo", "time_budget": "hpo",
                  "pruner": "hpo", "storage": "hpo", "worker_seed": "hpo",
                  "search_size": "hpo", "momentum": "hpo"}  # SGD: only a search candidate


def parse_args(argv: list[str] | None = None) -> RunOptions:
    parser = build_parser()
    args = RunOptions(**vars(parser.parse_args(argv)))
    if args.data_dir is not None and not _path_is("is_dir", "--data-dir", args.data_dir):
        raise UserError(f"--data-dir {args.data_dir!r} does not exist or is not a folder.")
    if not args.output_dir.strip():
        raise UserError("--output-dir is empty; name a folder (default: others).")
    for option, value in (("--data-dir", args.data_dir), ("--local-dir", args.local_dir)):
        if value is not None and not value.strip():
            raise UserError(f"{option} is empty; name a folder.")
    if args.storage is not None and not args.storage.strip():
        raise UserError("--storage is empty; give a database URL (sqlite:///path/optuna.db), "
                        "or leave it out for a study of the run's own.")
    for option, folder in (("--output-dir", args.output_dir), ("--local-dir", args.local_dir)):
        if args.data_dir is not None and folder is not None and \
                resolved(option, folder).is_relative_to(resolved("--data-dir", args.data_dir)):
            raise UserError(f"{option} {folder!r} is inside --data-dir {args.data_dir!r}: its "
                            "files would be read as data (a class of their own); put it "
                            "elsewhere.")
    if args.local_dir is not None and Path(args.local_dir).expanduser().exists() and \
            not Path(args.local_dir).expanduser().is_dir():
        raise UserError(f"--local-dir {args.local_dir!r} is a file, not a folder.")
    if args.weights not in ("none", "imagenet"):
        if not args.weights.strip():  # Path("") is ".", which the message would quote
            raise UserError(f"--weights must be none, imagenet or an existing file, but got "
                            f"{args.weights!r}.")
        args.weights = str(Path(args.weights).expanduser())
        if not _path_is("is_file", "--weights", args.weights):
            raise UserError(f"--weights must be none, imagenet or an existing file, but got "
                            f"{args.weights!r}.")
        check_weights_file(args.model, Path(args.weights))
        _not_an_output("--weights", Path(args.weights), args.output_dir)
    for dest, needs in UNUSED_WITHOUT.items():  # a mistake worth a line, not a refusal
        if needs not in args.scenarios and getattr(args, dest) != parser.get_default(dest) \
                and distributed.launched_main():  # once, not once per torchrun process
            log.warning("--%s does nothing here: only the %s scenario uses it, and this run's "
                        "scenarios are %s", dest.replace("_", "-"), needs,
                        ", ".join(args.scenarios))
    if args.worker_seed is not None and args.storage is None and "hpo" in args.scenarios \
            and distributed.launched_main():  # without hpo, the line above said it already
        log.warning("--worker-seed does nothing here: it seeds a worker of a shared --storage "
                    "study; without one the search is seeded by --seed")
    if args.cpu_allocator not in (None, *hostmem.candidates()):
        raise UserError(f"--cpu-allocator {args.cpu_allocator} needs glibc (Linux); this "
                        f"machine offers {', '.join(hostmem.candidates())}.")
    device = resolve_device(args.device)  # --device cuda without a GPU fails here
    for name in args.scenarios:  # so does any value TrainConfig refuses, before any work
        config = scenario_config(name, args, device)
        if config.amp == "fp16":
            autocast_dtype(config.amp, device)  # refuses it on a CPU
        for size in (args.resolutions or []) if name == "resolution" else []:
            _check_size("--resolutions", config, size)
        if name == "hpo" and isinstance(args.search_size, int):
            _check_size("--search-size", config, args.search_size)
    if argv is not None:  # given from Python (a notebook, a script): sys.argv is its host's
        args.command = shlex.join(["python", "pipeline.py", *shown_argv(list(argv))])
    return args


def _not_an_output(option: str, path: Path, output_dir: str) -> None:
    """Refuse a start file that this run may replace: the best model kept in --output-dir
    (<data set>_model.pt, or one set aside as <data set>_model.other-data-<id>.pt, which a run
    may move back) or a checkpoint. It is read again for every model built, and the later
    scenarios would start from what the baseline saved there."""
    out, file = resolved("--output-dir", output_dir), resolved(option, str(path))
    if (file.parent == out and fnmatch.fnmatch(file.name, "*_model*.pt")) or \
            file.is_relative_to(out / "checkpoints"):
        raise UserError(f"{option} {str(path)!r} is a file this run may replace (its best "
                        "model or a checkpoint, in --output-dir): the later scenarios would "
                        "start from the baseline's result; copy it elsewhere first and pass "
                        "the copy.")


def _path_is(test: str, option: str, path: str) -> bool:
    """Path(path).<test>(), where a folder on the way that cannot be entered is the user's to
    fix in one line, not a traceback (or, caught later, a "cannot write")."""
    try:
        return getattr(Path(path).expanduser(), test)()
    except OSError as exc:
        raise UserError(f"cannot read {option} {path!r} "
                        f"({exc.strerror or type(exc).__name__}).") from None


def _check_size(option: str, config: TrainConfig, size: int) -> None:
    """Refuse, in one line naming `option`, a size `config`'s model cannot train at."""
    try:
        dataclasses.replace(config, image_size=size)
    except UserError as exc:
        raise UserError(f"{option}: {size} px is refused ({str(exc).rstrip('.')}).") from None


def options(**values: Any) -> RunOptions:
    """The command line's options from keyword arguments, checked as the command line checks
    them: the notebook's way in. Names are the long options with '_' for '-' (`n_trials=4`);
    None or "" leaves an option at its default; True or False (or "on" or "off") switches a
    flag; a list joins with commas. `.command` holds the equivalent `python pipeline.py ...`
    line, as parse_args(argv) sets it."""
    actions = {a.dest: a for a in build_parser()._actions if a.option_strings}
    argv: list[str] = []
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            raise UserError(f"unknown option {key!r}; see python pipeline.py --help")
        if value is None or value == "":
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if _switch(key, value) else f"--no-{flag[2:]}")
        elif action.nargs == 0:  # store_true
            argv += [flag] if _switch(key, value) else []
        else:
            text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) \
                else str(value)
            # "--output-dir -out" would read -out as an option
            argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return parse_args(argv)


SWITCH_WORDS = {"on": True, "true": True, "yes": True, "1": True,
                "off": False, "false": False, "no": False, "0": False}


def _switch(key: str, value: Any) -> bool:
    """A flag's value given to options(): a bool, or a word for one ("off" is not on)."""
    if not isinstance(value, str):
        return bool(value)
    word = value.strip().lower()
    if word not in SWITCH_WORDS:
        raise UserError(f"{key}={value!r}: give True or False (or on/off)")
    return SWITCH_WORDS[word]


LOG_FORMAT = "%(levelname)s: %(message)s"


def setup_logging() -> None:
    """Library logs to stderr as 'info: ...' / 'warning: ...' lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.ours = True
    logging.addLevelName(logging.WARNING, "warning")
    logging.addLevelName(logging.INFO, "info")
    logging.addLevelName(logging.ERROR, "error")  # run.log's line for how a session ended
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def interrupted_message(args: RunOptions | None, notebook: bool = False) -> str:
    """What Ctrl-C (the notebook's Stop button) leaves to do: nothing before a run started,
    else resume it."""
    again = "run the cells again" if notebook else "rerun the same command"
    if getattr(args, "run_id", None) is None and getattr(args, "resume", False):
        return (f"interrupted while reading the data: {again} (with "
                f"{'RESUME ticked' if notebook else '--resume'}) to continue the run it was "
                "resuming.")
    if getattr(args, "run_id", None) is None:  # still reading the options or the data
        return "interrupted before the run started: nothing to resume" + (
            f"; {again} to start it." if notebook else ".")
    # Stopped in a first epoch, no checkpoint exists yet: what to do, not what was kept
    return ("interrupted: tick RESUME (resume=True) and run the cells again to continue "
            "where it stopped." if notebook else
            "interrupted: rerun the same command with --resume to continue.")


# The notebook's form fields where they are not the option's name in capitals.
NOTEBOOK_FIELDS = {"--scenarios": "the RUN_* flags", "--profile": "PERFORM_DETAILED_PROFILING",
                   "--no-progress": "SHOW_PROGRESS unticked", "--local-dir": "USE_DRIVE"}


@functools.cache
def _notebook_fields() -> dict[str, str]:
    """Each option's form field: --epochs is EPOCHS, --no-compile COMPILE unticked."""
    def field(flag: str) -> str:
        name = flag.removeprefix("--no-").removeprefix("--").replace("-", "_").upper()
        return f"{name} unticked" if flag.startswith("--no-") else name
    return {flag: field(flag) for action in build_parser()._actions
            for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"} | NOTEBOOK_FIELDS


def notebook_words(message: str) -> str:
    """A message's command-line options as the notebook's form names them: RESUME, not
    --resume; "untick RESUME", not "drop --resume"."""
    fields = _notebook_fields()
    message = message.replace(" (see python pipeline.py --help)", "")
    message = message.replace("with --resume", "with RESUME ticked")
    for verb, done in (("drop", "untick"), ("add", "tick")):
        for flag in ("--resume", "--quick"):
            message = message.replace(f"{verb} {flag}", f"{done} {fields[flag]}")
    message = re.sub(r"\bpass (--[a-z-]+) (?=[\d/'\"~.])", r"set \1 to ", message)
    message = re.sub(r"\bpass (--[a-z-]+)", r"set \1", message)
    message = re.sub(r"(?<![\w-])--[a-z][a-z-]*\b",
                     lambda m: fields.get(m.group(0), m.group(0)), message)
    return message


class _NotebookWords(logging.Formatter):
    """Warnings and errors in the notebook's words (notebook_words); info lines keep theirs,
    among them the equivalent command line."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return notebook_words(text) if record.levelno >= logging.WARNING else text


# What the notebook's data and run cells set for the result cells after them: a result cell
# run first (a new session, to see a finished run) names them in one line.
SET_BY_RUN_CELLS = ("output_dir", "index", "plan", "rows", "RUN_ID", "REPORT_DIR")


def quiet_user_errors() -> None:
    """In IPython (the notebook): a UserError, or a folder the run cannot write, prints as the
    command line prints it, one line without a traceback, and the Stop button says how to
    continue; the cell still fails, so "Run all" stops there."""
    try:
        shell = get_ipython()  # type: ignore[name-defined]  # noqa: F821  (IPython's builtin)
    except NameError:
        return
    def one_line(shell, etype, value, tb, tb_offset=None):
        if isinstance(value, NameError):
            name = getattr(value, "name", None)
            frame = tb
            while frame is not None and frame.tb_next is not None:
                frame = frame.tb_next
            # a cell's own line (its globals are the notebook's), not a bug in a module
            if name in SET_BY_RUN_CELLS and frame is not None and \
                    frame.tb_frame.f_globals is getattr(shell, "user_ns", None):
                print(f"error: no run in this session yet ({name} is set by the cells that load "
                      "the data and run the scenarios): run the cells from the top (Runtime > "
                      "Run all); with RESUME ticked, a finished run shows its results without "
                      "training again.", file=sys.stderr)
                return
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
            return
        if isinstance(value, KeyboardInterrupt):
            print(interrupted_message(getattr(shell, "user_ns", {}).get("args"), notebook=True),
                  file=sys.stderr)
            return
        said = user_error(value)
        if said is None:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        else:
            print(f"error: {notebook_words(said)}", file=sys.stderr)
    shell.set_custom_exc((UserError, OSError, RuntimeError, MemoryError, KeyboardInterrupt,
                          NameError), one_line)
    for handler in logging.getLogger().handlers:
        if getattr(handler, "ours", False):  # setup_logging's, not another library's
            handler.setFormatter(_NotebookWords(LOG_FORMAT))


class ReaderSafe:
    """A console stream whose reader may go away (`| head`, a `tee` or `less` that ended): the
    run trains on and writes its files; what it would have printed is dropped. The stream's
    descriptor then writes to the null device, so that Python's flush at exit (and a C
    library's own writes) find no closed pipe either."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # no descriptor: a capture in tests
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    if "_quiet_interrupt" in globals() and \
            signal.getsignal(signal.SIGINT) is globals()["_quiet_interrupt"]:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here: resume hints
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = ReaderSafe(sys.stdout), ReaderSafe(sys.stderr)
    try:
        return _main(argv)
    finally:
        sys.stdout, sys.stderr = streams


def _main(argv: list[str] | None) -> int:
    setup_logging()
    started = time.perf_counter()
    args = None
    try:
        args = parse_args(argv)
        run(args)
    except (UserError, OSError, RuntimeError, MemoryError) as exc:
        said = user_error(exc)
        if said is None and isinstance(exc, RuntimeError) and distributed.peer_left(exc):
            # Rank 0 alone writes the outputs, so a folder it cannot write (say) stops it
            # there, and the others at their next collective: one line each, beside its own.
            said = (f"rank {distributed.rank()}: another process of this run stopped; its "
                    "error, above, says why (a process the system killed, out of memory say, "
                    "says nothing: torchrun's summary gives its exit code).")
        if said is None:
            raise  # not the user's mistake nor the machine's limit: a bug, with its traceback
        print(f"error: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted_message(args), file=sys.stderr)
        return 130
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    log.info("done in %.0f s; outputs in %s", time.perf_counter() - started, args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
