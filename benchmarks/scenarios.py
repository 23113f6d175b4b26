"""End to end: the three scenarios on one data set, each against the baseline.

Runs `pipeline.py` (baseline, resolution, hpo) on a folder, the synthetic set or a real set
exported offline (benchmarks/real_data.py), then prints one table: test accuracy with its
standard error, the difference to the baseline, total and tuning seconds, the share of each
scenario spent measuring (autotune), and the time until its validation first reached the
baseline's. The targets of issue 16 are checked under the table. `--compare-search` also runs
the Optuna search twice on the same data, ours (default first, successive halving) against
plain TPE without pruning, and prints how many trial seconds ours took to come within 0.5
points of plain TPE's best. `--compare-fidelity` trains the same configurations at the
search's input size and a lower one, and prints whether the lower size ranks them the same
way (a cheaper first look for the search) and what it saves. `--pretrain-on SET` starts every
run from weights trained here on another offline set, a stand-in for the ImageNet weights a
user's runs start from, which cannot be fetched offline.

  python benchmarks/scenarios.py --dataset synthetic --quick
  python benchmarks/scenarios.py --dataset digits --quick --json others/bench_digits.json
  pip install --no-deps animal-mnist==0.4   # its data only; its loader would pull TensorFlow
  python benchmarks/scenarios.py --dataset animals --quick
  pip install --no-deps elpv-dataset==1.0.0.post1   # solar cells at 300x300: size decides detail
  python benchmarks/scenarios.py --dataset elpv --quick
  python benchmarks/scenarios.py --dataset digits --quick --pretrain-on animals
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline  # noqa: E402
import scenario  # noqa: E402
from modules.final_runs import reused_seconds  # noqa: E402
from modules.results import latest_run  # noqa: E402
from modules.selection import informative, tie_margin, validation_chance  # noqa: E402
from throughput import OneLineParser, at_least_1  # noqa: E402

log = logging.getLogger("scenarios")


def provenance() -> str:
    """The machine and software the figures came from."""
    flags = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.startswith("model name"))
        have = set(next(line.split(":", 1)[1].split() for line in info.splitlines()
                        if line.startswith("flags")))
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
        flags = f"{model}, {', '.join(isa)}"
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{time.strftime('%Y-%m-%d')}: {os.cpu_count()} cores ({flags})"
            f"{f', capped to {capped}' if capped else ''}, {gpu}, torch {torch.__version__}")


def data_folder(name: str, root: Path) -> list[str]:
    """pipeline.py's data options for a benchmark data set name."""
    if name in ("synthetic", "intel"):
        return ["--dataset", name]
    if Path(name).is_dir():
        return ["--data-dir", name]
    known_set(name)
    from real_data import REAL_SETS  # beside this file
    folder = root / name
    if not folder.exists():
        # Written beside it and renamed when whole: an interrupted export is made again, not
        # taken as the set (Animal-MNIST is written class by class).
        partial = root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            REAL_SETS[name](partial)
        except ImportError as exc:  # scikit-learn for digits, when only requirements.txt is in
            raise SystemExit(f"error: the {name} set needs {exc.name or 'a package'}: pip "
                             f"install {PACKAGES.get(name, exc.name)}") from None
        except RuntimeError as exc:  # real_data's own line: animal-mnist, elpv-dataset
            raise SystemExit(f"error: {exc}") from None
        partial.rename(folder)
    return ["--data-dir", str(folder)]


# The pip packages a real set's export imports, where real_data does not say so itself.
PACKAGES = {"digits": "scikit-learn"}


def known_set(name: str) -> None:
    """One line for a data set name data_folder would refuse, said before any set is made."""
    if name in ("synthetic", "intel") or Path(name).is_dir():
        return
    from real_data import REAL_SETS  # beside this file
    if name not in REAL_SETS:
        raise SystemExit(f"error: unknown data set {name!r}: synthetic, intel, a folder, or one of "
                         f"{', '.join(REAL_SETS)}")


# --pretrain-on: the input size and epochs the stand-in for ImageNet weights is trained at, once.
PRETRAIN_SIZE, PRETRAIN_EPOCHS = 64, 12


def pretrain_model(name: str, dataset: str, pipeline_args: list[str]) -> str:
    """The model --pretrain-on trains (the pipeline's, as its options after -- choose it),
    after its one-line refusals, before any data is made or trained."""
    known_set(name)  # before the set under test is exported
    if Path(name).name == Path(dataset).name:
        raise SystemExit(f"--pretrain-on {name}: pretrain on another set than --dataset, or "
                         "the scenarios are tested on images their start weights were trained on")
    parser = pipeline.build_parser()
    parser.set_defaults(weights=None)  # given or not, whatever its value
    try:
        options = parser.parse_args(pipeline_args)
    except pipeline.UserError as exc:  # the pipeline's own one line, as pipeline.main gives it
        raise SystemExit(f"error: {exc}") from None
    if options.weights is not None:
        raise SystemExit("--pretrain-on sets the pipeline's --weights: give one or the other")
    return options.model


# The pipeline's options this benchmark sets itself, and where it reads the run's rows from.
OWN_OPTIONS = {"output_dir": ("--output-dir", "--output-dir"), "device": ("--device", "--device"),
               "data_dir": ("--data-dir", "--dataset"), "dataset": ("--dataset", "--dataset"),
               "quick": ("--quick", "--quick")}


def refuse_own_options(pipeline_args: list[str]) -> None:
    """One line for an option after -- that the benchmark sets: a later --output-dir won,
    and the benchmark then read an earlier run's rows from its own folder as this run's."""
    parser = pipeline.build_parser()
    parser.set_defaults(**dict.fromkeys(OWN_OPTIONS))
    try:
        options = parser.parse_args(pipeline_args)
    except pipeline.UserError as exc:  # the pipeline's own one line, as pipeline.main gives it
        raise SystemExit(f"error: {exc}") from None
    given = [names for dest, names in OWN_OPTIONS.items() if getattr(options, dest) is not None]
    if given:
        (option, own), = given[:1]
        raise SystemExit(f"error: the benchmark sets the pipeline's {option}: give the "
                         f"benchmark's {own} before --, not {option} after it")


def pretrained_weights(name: str, model: str, out: Path, device: str) -> Path:
    """Weights trained here on all of another offline set: the benchmark's stand-in for
    ImageNet weights, which cannot be fetched offline, so that the scenarios can be measured
    starting as a user's do, from weights whose curves leave chance in the first epoch. The
    baseline's setup trains them once; they are kept in OUT/pretrain and reused."""
    folder = out / "pretrain" / f"{Path(name).name}-{model}"
    kept = sorted(folder.glob("*_model.pt"))
    if not kept:
        log.info("pretraining %s on %s (%d epochs at %d px): the start weights of every run",
                 model, name, PRETRAIN_EPOCHS, PRETRAIN_SIZE)
        code = pipeline.main(data_folder(name, out / "data") + [
            "--scenarios", "baseline", "--model", model, "--weights", "none",
            "--image-size", str(PRETRAIN_SIZE), "--epochs", str(PRETRAIN_EPOCHS),
            "--device", device, "--output-dir", str(folder), "--no-progress"])
        kept = sorted(folder.glob("*_model.pt"))
        if code != 0 or not kept:
            raise SystemExit(f"--pretrain-on {name}: pretraining failed (its log is above)")
    return kept[0]


def rows_table(rows: list[dict]) -> list[str]:
    lines = ["| scenario | test acc | vs baseline | total s | tuning s | measuring share | "
             "to baseline val acc | best size |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base_total = next((r["total_s"] for r in rows if r["scenario"] == "baseline"), None)
    for r in rows:
        measuring = measuring_s(r) or 0.0
        # Compared with this run's baseline only: the pipeline may compare with an earlier
        # run's, which the targets below do not judge by.
        reached = r.get("time_to_baseline_acc_s") if base_total else None
        ratio = f" ({reached / base_total:.2f}x)" if reached and base_total else ""
        vs = r.get("test_acc_vs_baseline") if base_total else None
        compared = base_total is not None and "baseline_acc_target" in r  # None is "never"
        lines.append(
            f"| {r['scenario']} | {100 * r['test_acc']:.1f}% +- {100 * r['test_acc_se']:.1f} | "
            f"{'n/a' if vs is None else f'{vs:+.1f}'} | {r['total_s']:.0f} | "
            f"{r.get('tuning_s') or 0:.0f} | {100 * measuring / ran_s(r):.1f}%"
            f"{' (cached)' if cached_from(r) else ''} | "
            f"{('never' if compared else 'n/a') if reached is None else f'{reached:.0f} s'}"
            f"{ratio} | {r['best_resolution']} |")
    return lines


def measuring_s(row: dict) -> float | None:
    """A row's measuring seconds: the autotuner's, and the hpo scenario's GPU memory probe
    (None: nothing measured)."""
    parts = [(row.get("autotune") or {}).get("seconds"),
             (row.get("hpo") or {}).get("memory_probe_s")]
    parts = [p for p in parts if isinstance(p, (int, float))]
    return sum(parts) if parts else None


def cached_from(row: dict) -> str | None:
    """Where a row's speed choices came from when an earlier run's cache gave them (None: this
    run measured them, or its resolution scenario did)."""
    reused = (row.get("autotune") or {}).get("reused_from")
    return reused if reused and reused != "this run" else None


def ran_s(row: dict) -> float:
    """Seconds the scenario itself ran: a row that took another scenario's final run
    (final_from) counts that run in total_s, as if trained here, but measured only in its
    tuning; an hpo row counts the resolution scenario's trial it took, and where it took that
    scenario's model the rest of its tuning, which that scenario ran (and measured in)."""
    taken = reused_seconds(row)
    own = (row.get("tuning_s") or row["total_s"]) if row.get("final_from") else row["total_s"]
    return own - taken if own > taken else own


def figure(value: float, limit: float, decimals: int, sign: str = "") -> str:
    """`value` to `decimals`, or to more where that rounding would put it on the limit or the
    limit's other side, so that the figure beside "met" or "MISSED" says which side of the
    limit it is on (0.502x is not 0.50x; 0.334x is not 0.33x against a third)."""
    def side(x: float) -> int:
        return (x > limit) - (x < limit)
    for d in range(decimals, decimals + 9):
        text = f"{value:{sign}.{d}f}"
        if side(float(text)) == side(value):
            return text
    return f"{value:{sign}}"  # nearer the limit than 9 decimals: every digit


def targets(rows: list[dict]) -> list[str]:
    """Issue 16's targets, each met or missed, with the figure; UNRELIABLE for every one when
    a scenario's diagnosis read its CPU as shared with other work (cpu-contended), or its
    tuning did (tuning_load): a slowed baseline stretches the time ratios and, through
    --match-time, gives the tuned final runs more epochs, so the accuracy figures move too; a
    slowed tuning stretches them the other way and measures the speed knobs under the load."""
    by = {r["scenario"]: r for r in rows}
    base = by.get("baseline")
    if base is None:
        return ["no baseline row: nothing to compare"]
    finals = [r["scenario"] for r in rows
              if ((r.get("diagnosis") or {}).get("bottleneck")) == "cpu-contended"]
    tunings = [f"{r['scenario']}'s tuning" for r in rows
               if (r.get("tuning_load") or {}).get("contended")]
    contended = finals + tunings
    why = "; ".join((["diagnosis: cpu-contended"] if finals else []) +
                    (["tuning_load: contended"] if tunings else []))
    out = [f"UNRELIABLE: the CPU was shared with other work during {', '.join(contended)} "
           f"({why}); rerun on a quiet machine"] if contended else []

    def verdict(ok: bool) -> str:
        return "UNRELIABLE" if contended else "met" if ok else "MISSED"
    if "resolution" in by:
        r = by["resolution"]
        diff = 100 * (r["test_acc"] - base["test_acc"])
        out.append(f"{verdict(diff >= 0)}: resolution at least as accurate as the "
                   f"baseline ({figure(diff, 0, 1, '+')} points)")
        reached = r.get("time_to_baseline_acc_s")
        ratio = None if reached is None else reached / base["total_s"]
        out.append(f"{verdict(ratio is not None and ratio <= 0.5)}: resolution "
                   f"reaches the baseline's val accuracy in <= 0.5x its time "
                   f"({'never' if ratio is None else figure(ratio, 0.5, 2) + 'x'})")
    if "hpo" in by:
        # rounded: 43% - 40% is 2.9999999999999982 points in floating point
        diff = round(100 * (by["hpo"]["test_acc"] - base["test_acc"]), 9)
        out.append(f"{verdict(diff >= 3)}: hpo at least 3 points above the "
                   f"baseline ({figure(diff, 3, 1, '+')} points)")
    for r in rows:
        measuring = measuring_s(r)
        cached = cached_from(r)
        if cached:  # its 0 s measured nothing: no verdict on what this run did not do
            out.append(f"not judged: {r['scenario']} measuring reused the choices of an "
                       f"earlier run ({cached}); a fresh --output-dir measures them")
        elif measuring is not None:
            share = measuring / ran_s(r)
            out.append(f"{verdict(share <= 0.1)}: {r['scenario']} measuring at "
                       f"most 10% of its wall time ({figure(100 * share, 10, 1)}%)")
    n_test = base.get("n_test")
    if n_test:
        # a 3-point claim compares two accuracies: the standard error of their difference
        se = 100 * tie_margin(base["test_acc"], min(1.0, base["test_acc"] + 0.03), n_test)
        out.append(f"test set: {n_test} images, standard error of a 3-point difference "
                   f"{figure(se, 1.5, 1)} points "
                   f"({'3 points >= 2 SE' if 3 >= 2 * se else '3 points < 2 SE: too small'})")
    return out


def search_setup(data: list[str], args, out: Path):
    """(the parsed pipeline options, the data, the hpo scenario's configuration) that the
    search comparisons train with."""
    try:
        ns = pipeline.parse_args(data + (["--quick"] if args.quick else []) + [
            "--no-progress", "--device", args.device] + args.pipeline_args)
        index = pipeline.load_data(ns, out)
        config = pipeline.scenario_config("hpo", ns, pipeline.resolve_device(ns.device))
    except pipeline.UserError as exc:  # the pipeline's own one line, as pipeline.main gives it
        raise SystemExit(f"error: {exc}") from None
    return ns, index, scenario.dataclasses.replace(config, progress=False)


def compare_search(data: list[str], args, out: Path) -> list[str]:
    """Our search (default first, successive halving) against plain TPE without pruning,
    same data, trials and seed: trial seconds for ours to come within 0.5 points of plain
    TPE's best validation accuracy."""
    import optuna

    from optuna_optimizer import OptunaTuner
    from modules import fastdata
    ns, index, config = search_setup(data, args, out)
    epochs = scenario.short_budget(config)
    results = {}
    for name, pruner in (("ours", "asha"), ("plain TPE", "none")):
        fastdata.clear_cache()  # each search decodes the images itself, inside its first trial
        tuner = OptunaTuner(index, config, output_dir=out / name.replace(" ", "_"),
                            n_trials=args.search_trials, epochs=epochs, seed=ns.seed,
                            pruner=pruner, study_name=f"compare_{pruner}",
                            overwrite=True)  # the benchmark's own: a rerun starts again
        tuner.run()
        trials = [t for t in tuner.study.trials if t.state in (
            optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]
        # Epochs beside seconds: a busy machine stretches seconds, not epochs.
        curve, spent, epochs_so_far, best = [], 0.0, 0, 0.0  # none completed: 0%, not -100%
        for t in trials:
            spent += (t.datetime_complete - t.datetime_start).total_seconds()
            epochs_so_far += len(t.intermediate_values)
            if t.state == optuna.trial.TrialState.COMPLETE:
                best = max(best, t.value)
            curve.append((spent, epochs_so_far, best))
        results[name] = curve
    return search_verdict(results["plain TPE"], results["ours"], len(index.val),
                          validation_chance(index))


def search_verdict(plain: list[tuple[float, int, float]], ours: list[tuple[float, int, float]],
                   n_val: int, chance: float) -> list[str]:
    """The search comparison's lines from each search's (trial seconds so far, trial epochs so
    far, best so far), one point per trial; `chance` as modules.selection.chance_level."""
    plain_s, plain_epochs, plain_best = plain[-1]
    ours_s, ours_epochs, ours_best = ours[-1]
    # rounded: 3 images of 600 below is 0.500000000000006 points in floating point
    reach = next(((s, e) for s, e, b in ours if round(plain_best - b, 9) <= 0.005), None)
    lines = [f"search: plain TPE best {100 * plain_best:.1f}% in {plain_s:.0f} trial seconds "
             f"({plain_epochs} epochs); ours best {100 * ours_best:.1f}% in {ours_s:.0f} s "
             f"({ours_epochs} epochs)"]
    # The other way round: what plain TPE had found by the time ours had trained all it did.
    plain_then = max((b for _, e, b in plain if e <= ours_epochs), default=None)
    if plain_then is not None:
        lines.append(f"search: within ours' {ours_epochs} trial epochs plain TPE's best was "
                     f"{100 * plain_then:.1f}% (ours {100 * ours_best:.1f}%, "
                     f"{100 * (ours_best - plain_then):+.1f} points)")
    if not informative(plain_best, n_val, chance):
        # Every trial still at chance: "the best" is the luckiest noise, nothing to reach.
        lines.append(f"n/a: no trial of plain TPE left chance ({100 * chance:.1f}% on "
                     f"{n_val} validation images), so its trials rank nothing")
    elif reach is None:
        lines.append("MISSED: ours never came within 0.5 points of plain TPE's best")
    else:
        lines.append(f"{'met' if reach[0] <= plain_s / 3 else 'MISSED'}: ours within 0.5 points "
                     f"of plain TPE's best after {reach[0]:.0f} s "
                     f"({figure(reach[0] / plain_s, 1 / 3, 2)}x its trial seconds, "
                     f"{reach[1] / plain_epochs:.2f}x its trial epochs; target <= 1/3)")
    # Both searches train the default configuration first, with the same seed: where plain
    # TPE's best came early the target (a third of all its trial seconds) is easy to meet, and
    # its seconds to its own best are the sterner measure.
    plain_to_best = next((s for s, _, b in plain if b >= plain_best), plain_s)
    lines.append(f"search: plain TPE reached its best after {plain_to_best:.0f} trial seconds"
                 + (" (its first trial, the default configuration: the comparison shows "
                    "little)" if plain_to_best == plain[0][0] else "")
                 + (f"; ours came within 0.5 points after {reach[0] / plain_to_best:.2f}x that"
                    if reach is not None and plain_to_best > 0 and
                    informative(plain_best, n_val, chance) else ""))
    return lines


def rank_agreement(high: list[float], low: list[float], n_val: int) -> dict:
    """How the accuracies of the same configurations at a lower input size (`low`) order them
    against the search's own size (`high`): Spearman's rank correlation; among the pairs that
    are apart at the high size by more than one standard error of their difference, the share
    the low size orders the same way; and what picking at the low size costs at the high size
    (regret, in accuracy)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):  # equal values share their mean rank
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rh, rl = ranks(high), ranks(low)
    mh, ml = sum(rh) / len(rh), sum(rl) / len(rl)
    cov = sum((a - mh) * (b - ml) for a, b in zip(rh, rl))
    norm = (sum((a - mh) ** 2 for a in rh) * sum((b - ml) ** 2 for b in rl)) ** 0.5
    apart = [(i, j) for i in range(len(high)) for j in range(i + 1, len(high))
             if abs(high[i] - high[j]) > tie_margin(high[i], high[j], n_val)]
    same = sum((high[i] - high[j]) * (low[i] - low[j]) > 0 for i, j in apart)
    pick = max(range(len(low)), key=lambda i: low[i])
    return {"spearman": cov / norm if norm else None, "pairs_apart": len(apart),
            "pairs_same_order": same, "regret": max(high) - high[pick]}


def compare_fidelity(data: list[str], args, out: Path) -> list[str]:
    """Does a lower input size rank the search's configurations as the search's own size
    does? The default configuration and `--fidelity-configs` - 1 others drawn at random from
    the search space (seeded), each trained for the search's trial budget at both sizes."""
    import optuna

    from optuna_optimizer import OptunaTuner
    from modules.trainer import fit
    ns, index, config = search_setup(data, args, out)
    # Only the search space and the default configuration are used: no study file is written.
    tuner = OptunaTuner(index, config, output_dir=out, epochs=scenario.short_budget(config),
                        storage="sqlite:///:memory:")
    low_size = args.fidelity_size or scenario.lower_size(config.image_size)
    if low_size >= config.image_size:
        raise SystemExit(f"error: --fidelity-size {low_size} is "
                         + ("the search's own size" if low_size == config.image_size else
                            f"above the search's {config.image_size} px")
                         + ": give a lower one")
    try:  # the model's limits, said before any configuration trains
        scenario.dataclasses.replace(config, image_size=low_size)
    except pipeline.UserError as exc:
        raise SystemExit(f"error: --fidelity-size {low_size}: {exc}") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    draw = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=ns.seed))
    configs = [tuner.default_config()] + [
        scenario.dataclasses.replace(tuner.default_config(),
                                     **draw.ask(tuner.distributions()).params)
        for _ in range(args.fidelity_configs - 1)]
    acc = {config.image_size: [], low_size: []}
    seconds = {size: 0.0 for size in acc}
    for c in configs:
        for size in acc:
            result = fit(index, scenario.dataclasses.replace(c, image_size=size))
            acc[size].append(result.best_val_acc)
            seconds[size] += result.wall_s
            log.info("fidelity: %d px lr %.2g batch %d %s: val %.1f%%", size, c.lr,
                     c.batch_size, c.optimizer, 100 * result.best_val_acc)
    high, low = acc[config.image_size], acc[low_size]
    n_val = len(index.val)
    agree = rank_agreement(high, low, n_val)
    lines = [f"fidelity: {len(configs)} configurations, {tuner.epochs} epochs each, at "
             f"{config.image_size} px (the search's size) and {low_size} px, {n_val} validation "
             "images", f"| lr | batch | optimizer | val at {config.image_size} px | "
             f"val at {low_size} px |", "|---:|---:|---|---:|---:|"]
    lines += [f"| {c.lr:.2g} | {c.batch_size} | {c.optimizer} | {100 * h:.1f}% | {100 * lo:.1f}% |"
              for c, h, lo in zip(configs, high, low)]
    rho = agree["spearman"]
    regret = 100 * agree["regret"]
    margin = 100 * tie_margin(max(high), max(high), n_val)
    lines.append(
        f"Spearman {'n/a' if rho is None else f'{rho:.2f}'}; pairs apart at "
        f"{config.image_size} px by more than one SE: {agree['pairs_same_order']} of "
        f"{agree['pairs_apart']} in the same order at {low_size} px; picking at {low_size} px "
        f"costs {regret:.1f} points at {config.image_size} px (one SE of a difference: "
        f"{margin:.1f}); trial seconds {seconds[low_size]:.0f} against "
        f"{seconds[config.image_size]:.0f} ({seconds[low_size] / seconds[config.image_size]:.2f}x)")
    # Spearman also ranks the configurations still at chance, whose order is noise; the
    # verdict asks only about the pairs whose order at the search's size is real.
    apart, kept = agree["pairs_apart"], agree["pairs_same_order"]
    if apart == 0:  # every configuration within noise of the others: no order to keep
        lines.append(f"n/a: no two configurations apart at {config.image_size} px by more "
                     f"than one SE, so {low_size} px has no order to keep")
        return lines
    same = kept >= 0.9 * apart and regret <= margin
    lines.append(f"{low_size} px {'ranks' if same else 'does NOT rank'} the configurations the "
                 f"way {config.image_size} px does (at least 90% of the pairs apart kept in "
                 "order, and its pick within one SE of the best)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic",
                   help="synthetic, intel, a folder, or a real set of benchmarks/real_data.py")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--output-dir", default="others/bench_scenarios")
    p.add_argument("--json", help="also write the rows and the target lines here")
    p.add_argument("--compare-search", action="store_true")
    p.add_argument("--search-trials", type=at_least_1, default=8)
    p.add_argument("--search-only", action="store_true",
                   help="with --compare-search or --compare-fidelity: skip the three scenarios")
    p.add_argument("--compare-fidelity", action="store_true",
                   help="does a lower input size rank the search's configurations the same way")
    p.add_argument("--fidelity-size", type=at_least_1,
                   help="the lower size (default: 3/4 of the search's, to a multiple of 16, "
                        "as the search's --search-size auto)")
    p.add_argument("--fidelity-configs", type=at_least_1, default=8)
    p.add_argument("--pretrain-on", metavar="SET",
                   help="start every run from weights trained here on all of another set (a "
                        "stand-in for ImageNet weights, unreachable offline), e.g. animals")
    p.add_argument("pipeline_args", nargs="*", help="more pipeline.py options, after --")
    args = p.parse_args(argv)
    if args.search_only and not (args.compare_search or args.compare_fidelity):
        p.error("--search-only skips the three scenarios: give it with --compare-search or "
                "--compare-fidelity")
    pipeline.setup_logging()
    out = Path(args.output_dir)
    try:  # before the runs: a --json that cannot be written is said now, not after them
        out.mkdir(parents=True, exist_ok=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"error: cannot make {exc.filename!r} ({exc.strerror})") from None
    refuse_own_options(args.pipeline_args)
    if args.pretrain_on:
        model = pretrain_model(args.pretrain_on, args.dataset, args.pipeline_args)
    data = data_folder(args.dataset, out / "data")  # first: an unknown set stops here
    start = []
    if args.pretrain_on:
        weights = pretrained_weights(args.pretrain_on, model, out, args.device)
        args.pipeline_args = args.pipeline_args + ["--weights", str(weights)]
        start = [f"start weights: trained here on {args.pretrain_on} ({weights})"]
    started = time.perf_counter()
    if args.search_only and (args.compare_search or args.compare_fidelity):
        lines = [f"# search on {args.dataset}", provenance()] + start
        if args.compare_search:
            lines += compare_search(data, args, out / "search")
        if args.compare_fidelity:
            lines += compare_fidelity(data, args, out / "fidelity")
        print("\n".join(lines))
        if args.json:
            Path(args.json).write_text(json.dumps({"lines": lines, "rows": []}, indent=1))
        return 0
    code = pipeline.main(data + ["--device", args.device, "--output-dir", str(out / "run"),
                                 "--no-progress"] + (["--quick"] if args.quick else [])
                         + args.pipeline_args)
    if code != 0:
        return code
    # This run's rows only: the output dir keeps every earlier run's (other data sets' too).
    run_id = (latest_run(out / "run") or {}).get("run_id")
    latest = {r["scenario"]: r for r in json.loads((out / "run" / "results.json").read_text())
              if r.get("run_id") == run_id}
    rows = [latest[name] for name in pipeline.SCENARIOS if name in latest]
    lines = [f"# scenarios on {args.dataset}{' --quick' if args.quick else ''}",
             provenance(), *start, f"whole run {time.perf_counter() - started:.0f} s", ""]
    lines += rows_table(rows) + [""] + targets(rows)
    if args.compare_search:
        lines += [""] + compare_search(data, args, out / "search")
    if args.compare_fidelity:
        lines += [""] + compare_fidelity(data, args, out / "fidelity")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"lines": lines, "rows": rows}, indent=1,
                                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
