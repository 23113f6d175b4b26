"""The results schema and what a run leaves behind: each scenario's results.json row, the
rows of every run merged (none lost), the run's id and folders, and the best model per data
set, replaced only by a better one."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from modules import distributed, membership
from modules.config import NO_WORKERS, TrainConfig, UserError
from modules.dataset import DatasetIndex
from modules.device import native_bf16_cpu, usable_cpus
from modules.diagnosis import diagnose
from modules.fastdata import CachedLoader, total_ram
from modules.files import ReadFailed, atomic_write_text, io_failed
from modules.model_files import read_meta, save_model
from modules.models import (UNREACHABLE_START, keep_random_start, resolved_start,
                            start_weights)
from modules.report import finite_number
from modules.selection import accuracy_se
from modules.trainer import TrainResult

log = logging.getLogger("pipeline")

RUN_FILE = "latest_run.json"  # in the output dir: the newest run's id, data and command
RUN_RECORD = "run.json"  # the same record, kept in each run's checkpoints folder


CLOCK_SUFFIX = ".clock.json"  # checkpoint_file(..., CLOCK_SUFFIX): a scenario's tuning seconds


def checkpoint_file(output_dir: Path, scenario: str, suffix: str = ".pt",
                    run_id: str | None = None) -> Path:
    """Where a scenario of run `run_id` keeps what --resume continues from: its training
    state (.pt), the autotuner's choice (.autotune.json), the resolution tuning's results
    (.tuning.json)."""
    return run_folder(output_dir, "checkpoints", run_id) / f"{scenario}{suffix}"


def run_folder(output_dir: Path, kind: str, run_id: str | None) -> Path:
    """output_dir/kind/run_id: each run's checkpoints, TensorBoard scalars (runs) and traces
    (profiler) have their own folder, so no run overwrites or mixes with another's."""
    return Path(output_dir) / kind / (run_id or "")


def _run_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


def run_record_beside(path: Path | None) -> dict[str, Any] | None:
    """The record of the run whose checkpoints folder holds file `path` (a checkpoint, a
    trial's weights); None for a file anywhere else."""
    return None if path is None else _run_record(Path(path).parent / RUN_RECORD)


def _record_path(output_dir: Path, run_id: str) -> Path:
    return run_folder(output_dir, "checkpoints", run_id) / RUN_RECORD


def _has_progress(output_dir: Path, run_id: str) -> bool:
    """Whether a run left anything to continue: a checkpoint, a journal, weights or rows (a
    tuning clock or the record of what it trains on alone is not: a scenario refused at its
    start leaves them)."""
    folder = run_folder(output_dir, "checkpoints", run_id)
    return any(p.name not in (RUN_RECORD, membership.FILE_NAME) and
               not p.name.endswith(CLOCK_SUFFIX) for p in folder.glob("*")) or any(
        r.get("run_id") == run_id for r in earlier_rows(Path(output_dir) / "results.json"))


def _records(output_dir: Path) -> list[dict[str, Any]]:
    """Every run's record, newest first: latest_run.json's and each run's own."""
    records = [_run_record(Path(output_dir) / RUN_FILE)] + [
        _run_record(p) for p in (Path(output_dir) / "checkpoints").glob(f"*/{RUN_RECORD}")]
    mine = {r["run_id"]: r for r in records[1:] if r}  # a run's own record says if it was refused
    merged = {r["run_id"]: mine.get(r["run_id"], r) for r in records if r}
    return sorted(merged.values(), key=lambda r: (r.get("started") or "", r["run_id"]),
                  reverse=True)


def _runs(output_dir: Path) -> list[dict[str, Any]]:
    """Every run's record, newest first, but those refused before they made anything (an
    option checked once the run runs), so that one does not hide the interrupted run before it.
    Each run's record is also kept in its checkpoints folder, so a lost or damaged
    latest_run.json loses nothing."""
    return [r for r in _records(output_dir) if not r.get("refused")]


def run_rows(output_dir: Path, run_id: str | None) -> list[dict[str, Any]]:
    """The rows results.json holds of run `run_id`: the scenarios it finished (none for
    None)."""
    rows = earlier_rows(Path(output_dir) / "results.json")
    return [r for r in rows if run_id is not None and r.get("run_id") == run_id]


def latest_run(output_dir: Path) -> dict[str, Any] | None:
    """The record of the newest run in output_dir (_runs), or None."""
    return next(iter(_runs(output_dir)), None)


def forget_refused_run(output_dir: Path, run_id: str) -> None:
    """A run stopped by a mistake before it made anything: marked refused in its own record,
    and latest_run.json points at the run before it again."""
    if _has_progress(output_dir, run_id):
        return
    record = _run_record(_record_path(output_dir, run_id))
    if record is None:
        return
    write_json(_record_path(output_dir, run_id), {**record, "refused": True})
    earlier = latest_run(output_dir)
    if earlier is not None:
        write_json(Path(output_dir) / RUN_FILE, earlier)


def start_run(output_dir: Path, index: DatasetIndex, *, resume: bool, command: str,
              seed: int | None = None, quick: bool | None = None,
              weights: str | None = None, model: str | None = None,
              scenarios: list[str] | None = None,
              settings: dict[str, Any] | None = None) -> str:
    """This run's id: with resume the newest run's, which must be on the same data and start
    from the same weights; else a new one (the UTC time), recorded as the newest. Earlier
    runs' files stay. `seed`, `quick`: the --seed the data was split with and whether --quick
    took a subset of it, recorded so that a refused resume can name the difference.
    `weights`: --weights (a file by its absolute path): a baseline resumed from its checkpoint
    would otherwise go on from the earlier start without a word, its row naming the new one.
    `model`: with --weights imagenet, what the run started from is recorded too ("start": the
    weights, or a random start where they were unreachable), and a resumed run keeps it (a
    random start again where the weights are reachable now), or is refused where they were
    fetched then and are unreachable now: trials from either start would be compared.
    `scenarios`: the scenarios the run trains, recorded; a finished run is resumed only with
    none it did not have (it trains nothing then: its study grows with --n-trials).
    `settings`: the learning options as given (None: the default), recorded; a resume with
    others is refused, since a scenario still tuning would train its trials again under them
    where its journal holds the run's own (a final run's checkpoint refuses them, later)."""
    keep_random_start(None)  # a start kept for a resumed run is that run's alone
    runs = _runs(output_dir)
    newest = runs[0] if runs else None
    # --resume continues the newest run that left something to continue, when one did: a run
    # stopped before its first checkpoint (Ctrl-C on one started without --resume) would hide
    # the one that has, and so would a newer run that finished (it has nothing left), the
    # interrupted one then never reachable again. One on this data first; with none left, the
    # newest run.
    fingerprint = index.fingerprint()
    if resume:
        left = [r for r in runs if not r.get("finished") and _has_progress(output_dir, r["run_id"])]
        latest = next((r for r in left if index.same_data(r.get("data_fingerprint"))),
                      left[0] if left else newest)
    else:
        latest = newest
    if resume and latest is not None:
        if not index.same_data(latest.get("data_fingerprint")):
            was_quick = latest.get("quick")
            if None not in (was_quick, quick) and was_quick != quick and \
                    latest.get("dataset") == index.name:
                raise UserError(
                    f"cannot resume: the newest run in {output_dir} ({latest['run_id']}) was "
                    f"started {'with' if was_quick else 'without'} --quick, which "
                    f"{'takes a subset of' if was_quick else 'trains on all of'} the data; "
                    f"{'add' if was_quick else 'drop'} --quick to continue it, or drop "
                    "--resume to start a new run beside it (nothing is deleted).")
            before, now = latest.get("seed"), seed
            # the same images split otherwise: only then is the seed the difference
            seeds = before is not None and now is not None and before != now and \
                (latest.get("dataset"), latest.get("n_images")) == (index.name, index.n_images())
            raise UserError(
                f"cannot resume: the newest run in {output_dir} ({latest['run_id']}) trained on "
                f"{latest.get('dataset')!r} ({latest.get('n_images')} images"
                + (f", split with --seed {before}" if seeds else "") + f"), this one is on "
                f"{index.name!r} ({index.n_images()} images"
                + (f", --seed {now}" if seeds else "") + "): "
                + (f"pass --seed {before} to continue it, or " if seeds else
                   "other images or another --seed's split"
                   + (f" (or the {len(index.copies)} copies of held-out images now left out, "
                      "which versions before be37e88 trained on)" if index.copies and
                      latest.get("n_images") == index.n_images() + len(index.copies) else "")
                   + "; ")
                + "drop --resume to start a new run beside it (nothing is deleted).")
        if None not in (latest.get("weights"), weights) and latest["weights"] != weights:
            raise UserError(
                f"cannot resume: the newest run in {output_dir} ({latest['run_id']}) started "
                f"from --weights {latest['weights']}, this one from --weights {weights}: pass "
                f"--weights {latest['weights']} to continue it, or drop --resume to start a new "
                "run beside it (nothing is deleted).")
        _same_settings(latest, output_dir, settings)
        _same_start(latest, output_dir, weights, model)
        had = latest.get("scenarios")
        added = [s for s in scenarios or [] if had is not None and s not in had]
        if latest.get("finished") and added:
            raise UserError(
                f"cannot resume: run {latest['run_id']} in {output_dir} finished with "
                f"{', '.join(had)}; {', '.join(added)} would be trained into it: drop --resume "
                f"and run only {', '.join(added)} (--scenarios {','.join(added)}), a new run "
                "beside it that takes its baseline and picked size from this folder, or resume "
                f"it without {', '.join(added)}.")
        if added and distributed.is_main():  # an unfinished run given more: it has them now
            latest = {**latest, "scenarios": had + added}
            write_json(_record_path(output_dir, latest["run_id"]), latest)
            if latest["run_id"] == newest["run_id"]:
                write_json(output_dir / RUN_FILE, latest)
        log.info("resuming run %s (%s)", latest["run_id"], latest.get("command") or "")
        if latest["run_id"] != newest["run_id"]:
            log.info("the newer run %s left nothing to continue", newest["run_id"])
            if distributed.is_main():  # the run being continued is the newest again
                write_json(output_dir / RUN_FILE, latest)
        return latest["run_id"]
    if not resume and newest is not None and _left_unfinished(output_dir, newest) and \
            distributed.is_main():
        # a disconnect, then Run all without RESUME: said, as the new run trains it all again
        log.warning("the newest run in %s (%s) did not finish; --resume continues it from where "
                    "it stopped. Starting a new run beside it (nothing is deleted).",
                    output_dir, newest["run_id"])
    if resume:
        # checkpoints/<scenario>.pt: a version's from before runs had ids, which this one
        # cannot continue
        older = sorted(p.name for p in (output_dir / "checkpoints").glob("*.pt"))
        log.info("--resume: %s in %s; starting a new one", (
            f"no run this version can continue (checkpoints/{', '.join(older)}: an earlier "
            "version's, whose runs had no ids)") if older else "no earlier run",
            output_dir)
    run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    taken = {newest["run_id"]} if newest else set()
    taken |= {p.name for p in (output_dir / "checkpoints").glob("*") if p.is_dir()}
    suffix = 1
    while run_id in taken:  # two runs started within one second
        suffix += 1
        run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{suffix}"
    if distributed.is_main():
        record = {"run_id": run_id, "dataset": index.name, "data_fingerprint": fingerprint,
                  "n_images": index.n_images(), "seed": seed, "quick": quick,
                  "weights": weights, "scenarios": scenarios, "settings": settings,
                  "start": resolved_start(model, weights) if model and weights else None,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "command": command}
        write_json(_record_path(output_dir, run_id), record)  # makes the run's folder
        write_json(output_dir / RUN_FILE, record)
    return run_id


def _left_unfinished(output_dir: Path, record: dict[str, Any]) -> bool:
    """Whether run `record` stopped with scenarios left that it had begun on; a run recorded
    by a version that did not mark finished runs counts as finished when each has a row."""
    done = {r["scenario"] for r in run_rows(output_dir, record["run_id"])}
    return not record.get("finished") and bool(set(record.get("scenarios") or []) - done) \
        and _has_progress(output_dir, record["run_id"])


def _same_settings(latest: dict[str, Any], output_dir: Path,
                   settings: dict[str, Any] | None) -> None:
    """A resumed run goes on with the learning options it recorded (start_run)."""
    before = latest.get("settings")
    if not before or not settings:
        return  # a run of a version that did not record them
    changed = [k for k in settings if k in before and before[k] != settings[k]]
    if not changed:
        return

    def shown(value: Any) -> str:
        if value is None:
            return "not given"
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)
    diffs = ", ".join(f"--{k.replace('_', '-')} {shown(before[k])} -> {shown(settings[k])}"
                      for k in changed)
    command = latest.get("command") or "its run.log names its command"
    raise UserError(
        f"cannot resume: the newest run in {output_dir} ({latest['run_id']}) was started with "
        f"other options ({diffs}): give the options it was started with ({command}), or drop "
        "--resume to start a new run beside it (nothing is deleted).")


def _same_start(latest: dict[str, Any], output_dir: Path, weights: str | None,
                model: str | None) -> None:
    """A resumed run goes on from the start it recorded (start_run)."""
    before = latest.get("start")
    if not model or weights != "imagenet" or before is None:
        return  # another start is refused above; a run of a version that did not record it
    if before == UNREACHABLE_START:
        if start_weights(model, weights) != UNREACHABLE_START:
            log.info("the run being resumed started from random weights (the ImageNet weights "
                     "were unreachable then): its models keep that start")
        keep_random_start(model)
    # Rank 0's weights reach every rank when training starts: its session is the one to ask
    # (a refusal there stops the others, a peer gone, in one line each).
    elif distributed.is_main() and resolved_start(model, weights) == UNREACHABLE_START:
        raise UserError(
            f"cannot resume: the newest run in {output_dir} ({latest['run_id']}) started from "
            f"the ImageNet weights, which this session cannot fetch (above): resume where they "
            "can be fetched, or drop --resume to start a new run beside it (nothing is deleted).")


def footprint(output_dir: Path, run_id: str) -> str:
    """What run `run_id` keeps on disk, folder by folder ("checkpoints/<run> 35 MiB, ...")."""
    parts = []
    for kind in ("checkpoints", "runs", "profiler"):
        size = 0
        for path in run_folder(output_dir, kind, run_id).rglob("*"):
            with contextlib.suppress(OSError):  # gone meanwhile, or unreadable: not counted
                size += path.stat().st_size if path.is_file() else 0
        if size:
            mib = size / 2**20
            parts.append(f"{kind}/{run_id} {mib:.{1 if mib < 10 else 0}f} MiB")
    return ", ".join(parts)


def mark_finished(output_dir: Path, run_id: str) -> None:
    """Record that run `run_id` trained every scenario it was asked for (start_run)."""
    path = _record_path(output_dir, run_id)
    record = _run_record(path)
    if record is None or not distributed.is_main():
        return
    record = {**record, "finished": True}
    write_json(path, record)
    newest = _run_record(Path(output_dir) / RUN_FILE)
    if newest is not None and newest.get("run_id") == run_id:
        write_json(Path(output_dir) / RUN_FILE, record)


# results.json fields measured while a scenario trains: the step timing (the checkpoint
# carries it across a resume) and samples of the machine (results.json keeps them).
STEP_FIGURES = ("avg_step_ms", "samples_per_s", "data_wait_frac", "h2d_frac",
                "gpu_compute_frac", "cpu_exec_us")
MACHINE_FIGURES = ("gpu_util_pct", "cpu_util_pct", "process_cpu_pct", "peak_mem_mb",
                   "gpu_mem_peak_mb", "energy_j")


def result_row(name: str, config: TrainConfig, result: TrainResult, test: dict[str, Any],
               index: DatasetIndex, device: torch.device, system: dict[str, Any],
               data_path: str, carried: dict[str, Any] | None = None,
               raced: dict[str, Any] | None = None,
               fixed_step: dict[str, Any] | None = None) -> dict[str, Any]:
    """The scenario's results.json object: accuracy, timing, hardware figures, diagnosis.
    carried: the earlier row of this same training, whose machine figures replace this
    process's (which trained nothing), and its step figures too when the checkpoint had none
    (one written before checkpoints carried them). raced: the autotuner's img/s per value of
    each knob on this machine, so the diagnosis does not advise what it measured slower.
    fixed_step: autotune.fixed_step_cost's timing of a short CPU step, for the diagnosis."""
    best = next((r for r in result.history if r["epoch"] == result.best_epoch), {})
    t = result.timing
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
        mem_limit_mb = torch.cuda.get_device_properties(device).total_memory / 2**20
        alloc_retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    else:  # resident memory of this process and its DataLoader workers, sampled
        peak_mb = system.get("ram_peak_mb")
        mem_limit_mb = total_ram() / 2**20
        alloc_retries = None
    row = {
        "scenario": name, "dataset": index.name, "data_fingerprint": index.fingerprint(),
        "model": config.model, "train_acc": best.get("train_acc"), "train_loss": best.get("train_loss"),
        "val_acc": best.get("val_acc"), "val_loss": best.get("val_loss"),
        "val_acc_se": accuracy_se(best.get("val_acc") or 0.0, len(index.val)),
        "n_val": len(index.val), "n_test": len(index.test),
        "test_acc": test["acc"], "test_loss": test["loss"],
        "test_acc_se": accuracy_se(test["acc"], len(index.test)),
        "per_class_test_acc": dict(zip(index.classes, test["per_class_acc"])),
        "confusion_matrix": test["confusion"],
        "best_resolution": config.image_size, "epochs": result.epochs_run,
        "best_epoch": result.best_epoch,
        "avg_step_ms": t.get("avg_step_ms"), "samples_per_s": t.get("samples_per_s"),
        "data_wait_frac": t.get("data_wait_frac"), "h2d_frac": t.get("h2d_frac"),
        "gpu_compute_frac": t.get("gpu_compute_frac"),  # CUDA-event time / step time
        "cpu_exec_us": t.get("cpu_exec_us"),
        "gpu_util_pct": system.get("gpu_util_pct"), "cpu_util_pct": system.get("cpu_util_pct"),
        "process_cpu_pct": system.get("process_cpu_pct"),
        "peak_mem_mb": peak_mb, "gpu_mem_peak_mb": system.get("gpu_mem_peak_mb"),
        "energy_j": system.get("energy_j"),
        "wall_s": result.wall_s, "time_to_best_s": result.time_to_best_s,
        "skipped_files": index.skipped_files, "ignored_files": sum(index.ignored.values()),
        "left_out_copies": len(index.copies),
        "nonfinite_steps": result.nonfinite_steps,
        "stopped_early": result.stopped_early, "resumed_from_epoch": result.resumed_from_epoch,
        "settings": {**config.to_dict(), **result.settings, "data_path": data_path,
                     # the cache's batches are made in the training process, whatever was asked
                     **(NO_WORKERS if data_path == CachedLoader.data_path else {})},
        "history": result.history,
    }
    if carried is not None:
        keys = MACHINE_FIGURES + (STEP_FIGURES if not t.get("steps") else ())
        row.update({k: carried[k] for k in keys if k in carried})
    elif result.resumed_from_epoch is not None and result.resumed_from_epoch >= result.epochs_run:
        # Resumed after it had finished, with no row of the session that trained it: this
        # process only evaluated the test set. Its CPU load, memory peak (no gradients or
        # optimizer state) and GPU use are not the training's: not measured, not the eval's.
        row.update(dict.fromkeys(MACHINE_FIGURES))
    row["diagnosis"] = diagnose({
        **{k: row[k] for k in ("data_wait_frac", "h2d_frac", "avg_step_ms", "samples_per_s",
                               "gpu_util_pct", "cpu_util_pct", "process_cpu_pct",
                               "peak_mem_mb")},
        "cpu_threads": result.settings.get("cpu_threads"),
        "batch_size": config.batch_size, "grad_accum_steps": config.grad_accum_steps,
        "device": device.type, "mem_limit_mb": mem_limit_mb,
        "alloc_retries": alloc_retries, "num_workers": config.num_workers,
        "cpu_count": usable_cpus(), "channels_last": config.channels_last,
        "pin_memory": config.pin_memory,
        # --compile that fell back to eager (compile_failed) trained eager: not "on already"
        "compile": config.compile and not result.settings.get("compile_failed"),
        "compile_failed": result.settings.get("compile_failed"),
        "amp_dtype": result.settings.get("amp_dtype"),
        "native_bf16": native_bf16_cpu() if device.type == "cpu" else None,
        "raced": raced,
        "cached_decode": data_path == CachedLoader.data_path,
        **({"fixed_step_ms": fixed_step["fixed_ms"], "probe_step_ms": fixed_step["step_ms"]}
           if fixed_step else {})})
    if fixed_step:
        row["fixed_step"] = fixed_step
    return row


def keep_best_model(result: TrainResult, config: TrainConfig, index: DatasetIndex,
                     row: dict[str, Any], output_dir: Path) -> None:
    """Save this scenario's model as <dataset>_model.pt only when it beats, on validation
    accuracy, the best model of the same data there (whichever run saved it, on the same data
    and so the same split). A model of other data under the same name (a --quick run's subset,
    another folder named alike) is kept aside as <stem>.other-data-<its data>.pt, and comes
    back when a run on its data does not beat it; a file that cannot be parsed is kept aside;
    one that cannot be read now (an I/O error) stays where it is, and this model is not saved."""
    path = output_dir / f"{index.name}_model.pt"
    fingerprint = row["data_fingerprint"]
    previous: dict[str, Any] = {}
    if path.exists():
        try:
            saved = read_meta(path)
        except ReadFailed as exc:
            log.warning("%s: it stays, and this %s model is not saved over it",
                        str(exc).rstrip("."), row["scenario"])
            return
        except UserError as exc:
            aside = set_aside(path, f"unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
            log.warning("%s; kept it as %s", str(exc).rstrip("."), aside)
        else:
            previous = saved.get("extra") or {}
            if not _of_this_data(saved, index):
                # validated (and tested) on other images: not comparable
                aside = set_aside(path, _other_data(previous.get("data_fingerprint")))
                log.warning("%s %s; kept it as %s%s", path, _how_other(previous, index), aside,
                            "" if previous.get("data_fingerprint") is None else
                            ", where a later run on that data compares with it")
                previous = {}
    mine = row.get("val_acc")
    mine_shown = "n/a" if mine is None else f"{100 * mine:.1f}%"
    kept_from = None
    if not previous:  # a model of this data set aside by a run on other data
        kept_from, previous = _best_aside(path, index)
    # Chosen by validation: a choice by test accuracy would make the test accuracy saved with
    # the model an optimistic one, and the test set no longer held out.
    if previous and not _beats(mine, previous.get("val_acc")):
        if kept_from is not None:
            kept_from.rename(path)
        log.info("%s %s (%s of run %s, validation accuracy %.1f%%): this %s model's %s is not "
                 "better", "kept" if kept_from is None else f"restored from {kept_from.name}",
                 path, previous.get("scenario"), previous.get("run_id"),
                 100 * previous["val_acc"], row["scenario"], mine_shown)
        return
    save_model(result.model, path, arch=config.model, class_names=index.classes,
               image_size=config.image_size,
               extra={"scenario": row["scenario"], "dataset": index.name,
                      "data_fingerprint": fingerprint, "run_id": row.get("run_id"),
                      "images_fingerprint": index.images_fingerprint(),
                      "seed": (row.get("settings") or {}).get("seed"),
                      # what it trained on, its start's included (membership)
                      **_trained_on(output_dir, row.get("run_id"), index),
                      "test_acc": row["test_acc"], "val_acc": row["val_acc"],
                      "per_class_test_acc": row["per_class_test_acc"],
                      "confusion_matrix": row["confusion_matrix"],
                      # how its test images were decoded, so predict decodes new ones alike
                      # (models saved before 2026-12-07 from the decoded cache say "draft")
                      "decode": "full"})
    log.info("saved %s: the best validation accuracy so far on %s (%s, %s; test %.1f%%)", path,
             index.name, mine_shown, row["scenario"], 100 * row["test_acc"])


def _trained_on(output_dir: Path, run_id: str | None, index: DatasetIndex) -> dict[str, Any]:
    """The images run `run_id` trains on, as its record says (the start's included, and
    counted), and whether it took them --quick; else as this index holds them."""
    kept = membership.read(run_folder(output_dir, "checkpoints", run_id)) if run_id else None
    return {k: kept.get(k) for k in ("trained_on", "quick", "carried", "carried_here",
                                     "unrecorded")} if kept else \
        {"trained_on": membership.encode(membership.of_images(index.train))}


def json_safe(value):
    """NaN and inf become null: a diverged number must never read as a score."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, data) -> None:
    """Atomic: readers see the old file or the new one, never half of one."""
    atomic_write_text(json.dumps(json_safe(data), indent=2, allow_nan=False), path)


def _parse_rows(data: bytes) -> list[dict[str, Any]] | None:
    """The rows of a results.json's content; None when it is not a list of results (each a
    dict naming its scenario: a hand-edited entry that is not one would fail the report, and
    dropping it would lose what the user wrote)."""
    try:
        rows = json.loads(data)
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("scenario"), str) for r in rows):
        return None
    return rows


def earlier_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an earlier results.json; none when it is missing or unreadable."""
    try:
        return (_parse_rows(path.read_bytes()) or []) if path.exists() else []
    except OSError as exc:
        if (failed := io_failed(path, exc)) is not None:
            raise failed from None  # a finished row's figures would be replaced
        return []


def previous_row(path: Path, scenario: str, dataset: str, run_id: str | None = None,
                 match: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any] | None:
    """The scenario's last row on `dataset` (of run `run_id`, and for which `match` holds,
    when given) in results.json."""
    rows = [r for r in earlier_rows(path)
            if r.get("scenario") == scenario and r.get("dataset") == dataset
            and (run_id is None or r.get("run_id") == run_id) and (match is None or match(r))]
    return rows[-1] if rows else None


def compare_to_baseline(rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> None:
    """Each row against the baseline of its dataset, in place: test accuracy difference
    (points), total time ratio, and time_to_baseline_acc_s: seconds, tuning included, until
    its validation accuracy first reached the baseline's (None when it never did). The final
    model's validation includes the epochs of the trial its final run continued from, when
    that trial trained in the scenario (`warm_start.curve`: seconds since it started)."""
    if baseline is None:
        return
    target = baseline.get("val_acc")
    for row in rows:
        reached = None if target is None else next(
            (p["elapsed_s"] for p in (row.get("warm_start") or {}).get("curve") or []
             if (p.get("val_acc") or 0) >= target), None)
        where = "start trial" if reached is not None else None
        if reached is None and target is not None:
            final = next((h["elapsed_s"] for h in row.get("history") or []
                          if (h.get("val_acc") or 0) >= target), None)
            reached = None if final is None else \
                (row.get("tuning_s") or 0.0) + (row.get("prepare_s") or 0.0) + final
            where = None if final is None else "final run"
        row["time_to_baseline_acc_s"], row["baseline_acc_reached_in"] = reached, where
        # An earlier baseline's NaN accuracy was written as null (json_safe).
        mine, theirs = finite_number(row.get("test_acc")), finite_number(baseline.get("test_acc"))
        row["test_acc_vs_baseline"] = None if mine is None or theirs is None else \
            100 * (mine - theirs)
        base_total = baseline.get("total_s") or baseline.get("wall_s")
        total = row.get("total_s") or row.get("wall_s")
        row["total_vs_baseline"] = total / base_total if total and base_total else None
        row["baseline_acc_target"] = target
        # an earlier run's, when this run trained none (same data, model and kind of device)
        row["baseline_run_id"] = baseline.get("run_id")


def _beats(mine: float | None, best: Any) -> bool:
    """Whether a model of validation accuracy `mine` replaces the best so far (none: it does)."""
    return not isinstance(best, (int, float)) or (mine is not None and mine > best)


def _of_this_data(saved: dict[str, Any], index: DatasetIndex) -> bool:
    """Whether a saved model was validated on this data's split (a file of a version that did
    not record its data is not known to be)."""
    extra = saved.get("extra") or {}
    return index.same_data(extra.get("data_fingerprint")) and \
        list(saved["class_names"]) == list(index.classes)


def _how_other(extra: dict[str, Any], index: DatasetIndex) -> str:
    """What differs between the data a saved model was validated on and this run's."""
    run = f"(run {extra.get('run_id')})"
    if extra.get("data_fingerprint") is None:
        return f"was saved by an earlier version, which did not record its data {run}"
    if extra.get("images_fingerprint") == index.images_fingerprint():
        return (f"was validated on another split of the same images {run}: another --seed "
                "splits them otherwise, so the accuracies do not compare")
    return f"was trained on other data named {index.name!r} {run}"


def _other_data(fingerprint: str | None) -> str:
    """The label of a model of other data kept aside: named by its data, so that a run on
    that data finds it."""
    return f"other-data-{hashlib.sha1(str(fingerprint).encode()).hexdigest()[:10]}"


def set_aside(path: Path, label: str) -> Path:
    """Rename `path` to <stem>.<label><suffix>, or with -2, -3 ... after the label: a file kept
    aside never overwrites another. Returns where it went."""
    aside = path.with_name(f"{path.stem}.{label}{path.suffix}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.stem}.{label}-{n}{path.suffix}")
    path.rename(aside)
    return aside


def _best_aside(path: Path, index: DatasetIndex) -> tuple[Path | None, dict[str, Any]]:
    """The best model of this data kept aside next to `path` (its file, its extra)."""
    best: tuple[Path | None, dict[str, Any]] = (None, {})
    for aside in sorted(path.parent.glob(f"{path.stem}.other-data-*.pt")):
        try:
            saved = read_meta(aside)
        except UserError:
            continue
        extra = saved.get("extra") or {}
        if _of_this_data(saved, index) and \
                isinstance(extra.get("val_acc"), (int, float)) and \
                (best[0] is None or extra["val_acc"] > best[1]["val_acc"]):
            best = (aside, extra)
    return best


def merge_results(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every earlier run's rows stay; within one run (resumed) a scenario's new row replaces
    its old one."""
    new = {(r.get("run_id"), r["scenario"]) for r in rows}
    # A read that fails (a network drive's hiccup) stops here: it is not damage.
    earlier = _parse_rows(path.read_bytes()) if path.exists() else []
    if earlier is None:  # hand-edited or damaged: kept for the user, never overwritten
        aside = set_aside(path, f"unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        log.warning("%s could not be read as a list of results; kept it as %s and started a "
                    "new one (its rows can be copied back once mended)", path, aside)
        earlier = []
    kept = [r for r in earlier if (r.get("run_id"), r.get("scenario")) not in new]
    return kept + rows
