"""Smoke tests: the benchmarks run and write their figures (their targets are not tested here)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_module

ROOT = Path(__file__).resolve().parents[1]


def _benchmark_module(name: str):
    """benchmarks/<name>.py, whose main() runs in this process."""
    return load_module(ROOT / "benchmarks" / f"{name}.py")


def test_timing_overhead_benchmark_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ovh.json"
    monkeypatch.setattr(sys, "argv", ["timing_overhead.py", "--image-size", "32",
                                      "--batch-size", "4", "--rounds", "2", "--json", str(out)])
    _benchmark_module("timing_overhead").main()
    assert "overhead: " in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["instrumentation_us_per_step"] > 0 and result["bare_step_ms"] > 0
    assert 0 < result["overhead_frac"] < 1


def test_throughput_benchmark_runs_every_row_trace_and_time_to_accuracy(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--image-size", "32",
         "--batch-size", "8", "--images-per-class", "12", "--steps", "4", "--rounds", "1", "--no-compile",
         "--data-dir", str(tmp_path / "data"), "--json", str(out), "--time-to-accuracy",
         "--tta-epochs", "2", "--tta-per-class", "20", "--tta-val-per-class", "4",
         "--tta-image-size", "32",
         "--trace", str(tmp_path / "trace")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for row in ("pure_compute", "pipeline", "baseline", "lightning"):
        assert result[f"{row}_img_s"] > 0, row
        assert f"| {row} |" in proc.stdout
    assert set(result["ratios"]) == {"pipeline_over_pure_compute", "pipeline_over_baseline",
                                     "pipeline_over_lightning"}
    for row, (lo, hi) in result["ratio_ranges"].items():  # one round: the range is the ratio
        assert lo == hi == pytest.approx(result["ratios"][f"pipeline_over_{row}"], abs=2e-3)
    assert "pipeline / this, single rounds: pure_compute " in proc.stdout
    assert result["paired_pure_compute"] is True
    assert (result["model"], result["image_size"], result["batch_size"], result["device"]) == \
        ("squeezenet1_1", 32, 8, "cpu")
    assert result["autotune"]["knobs"]["amp"]["reason"]
    trace = result["trace"]  # one traced pass of each, and the pipeline's extra per step
    for row in ("pure_compute", "pipeline"):
        assert list((tmp_path / "trace" / row).glob("*.pt.trace.json")), row
        assert trace["wall_ms"][row] > 0 and trace["host_ops_ms"][row] > 0
        assert trace["device_ms"][row] is None and trace["kernel_launches"][row] is None  # no GPU
        assert trace["aten_calls"][row] > 0
    assert trace["aten_calls"]["pipeline"] > trace["aten_calls"]["pure_compute"]
    assert trace["extra_host_us"] and all(v > 0 for v in trace["extra_host_us"].values())
    assert "the pipeline's extra host time per step" in proc.stdout
    tta = result["time_to_accuracy"]
    assert tta["baseline_s"] > 0 and tta["optimized_s"] > 0 and 0 <= tta["target_val_acc"] <= 1
    assert tta["val_images"] == 6 * 4
    assert (tta["ratio"] is None) == (not tta["reached"]) and "(its whole run, 2 epochs)" in \
        proc.stdout
    lines = proc.stderr.splitlines()  # no log line twice (Lightning's handler beside ours did that)
    assert not [a for a, b in zip(lines, lines[1:]) if a == b and a.strip()]


def test_throughput_benchmark_refuses_too_few_images_in_one_line(tmp_path, capsys):
    code = _benchmark_module("throughput").main(["--device", "cpu", "--image-size", "32",
                                      "--images-per-class", "2",
                                      "--data-dir", str(tmp_path / "data")])  # no exception
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in err


def test_step_clock_waits_for_a_gpu_once_per_window_and_a_cpu_step_is_one_sample(monkeypatch):
    import torch
    tp = _benchmark_module("throughput")
    now, syncs = [0.0], []
    monkeypatch.setattr(tp.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))

    gpu = tp.StepClock(torch.device("cuda"), window=4, warmup=3)
    for k in range(3 + 12 + 2):  # warm-up, three whole windows, two steps of a partial one
        now[0] += 5.0 if k < 3 else 0.5  # slow warm-up steps are left out
        gpu.step()
    assert len(syncs) == 4  # after the warm-up, then at the end of each whole window
    assert gpu.img_s(16) == 16 * 4 / 2.0

    cpu = tp.StepClock(torch.device("cpu"), window=4, warmup=3)
    for k in range(3 + 5):
        now[0] += 5.0 if k < 3 else 0.25
        cpu.step()
    assert len(syncs) == 4 and cpu.window == 1  # nothing to wait for on a CPU
    assert cpu.img_s(8) == 8 / 0.25

    first = tp.StepClock(torch.device("cuda"), window=2, warmup=0)  # timed from the start
    for _ in range(4):
        now[0] += 0.5
        first.step()
    assert len(syncs) == 4 + 3 and first.img_s(8) == 8 * 2 / 1.0

    assert tp.gpu_window(75) == tp.GPU_WINDOW  # 2400 images of 32
    assert tp.gpu_window(18) == 5 and tp.gpu_window(4) == 1  # three windows after warm-up
    # a multiple of the augmentation pass: every window holds the same number of passes
    assert tp.gpu_window(75, pass_batches=8) == 8 and tp.gpu_window(75, pass_batches=16) == 16
    assert tp.gpu_window(75, pass_batches=3) == 9 and tp.gpu_window(18, pass_batches=2) == 4
    assert tp.gpu_window(10, pass_batches=8) == 8  # fewer than three windows, never a part pass


def test_paired_clock_alternates_pipeline_and_pure_compute_window_by_window(monkeypatch):
    """Pure compute runs in between the pipeline's windows, each timed on its own: a pipeline
    window from the end of the probe's window before it to its own end."""
    import torch
    tp = _benchmark_module("throughput")
    now, events = [0.0], []
    monkeypatch.setattr(tp.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))

    class Probe:
        def step(self):
            events.append("probe")
            now[0] += 0.25

    clock = tp.PairedClock(Probe(), torch.device("cpu"), window=4)
    assert events == ["probe"] and clock.window == 1  # one warm-up step on building; CPU: 1
    for k in range(3 + 6):  # three warm-up steps of the pipeline (0.5 s each), then six timed
        events.append("pipe")
        now[0] += 5.0 if k < 3 else 0.5
        clock.step()
    assert events == ["probe"] + ["pipe", "probe"] * 9  # alternating, warm-up included
    assert len(clock.pure_gaps) == 7 and len(clock.pipe_gaps) == 6  # no pipeline gap before the 1st
    assert clock.img_s_pair(8) == (8 / 0.25, 8 / 0.5)

    events.clear()
    gpu = tp.PairedClock(Probe(), torch.device("cuda"), window=2, warmup=1)
    for _ in range(1 + 4):
        events.append("pipe")
        now[0] += 0.5
        gpu.step()
    # a window of pipeline steps, a wait, as many probe steps, a wait
    assert events == ["probe", "pipe", "sync", "probe", "probe", "sync"] + \
        (["pipe"] * 2 + ["sync", "probe", "probe", "sync"]) * 2
    assert gpu.img_s_pair(8) == (8 * 2 / 0.5, 8 * 2 / 1.0)
    with pytest.raises(tp.UserError):
        tp.PairedClock(Probe(), torch.device("cpu")).img_s_pair(8)


def test_the_lightning_row_takes_either_package_name(monkeypatch):
    """Lightning 2.x installs as `lightning`; many setups (Colab images among them) have only
    the older `pytorch_lightning`: the row uses whichever is there."""
    tp = _benchmark_module("throughput")
    present = {"pytorch_lightning"}
    monkeypatch.setattr(tp.importlib.util, "find_spec",
                        lambda name: object() if name in present else None)
    assert tp._lightning_package() == "pytorch_lightning"
    present.add("lightning")
    assert tp._lightning_package() == "lightning"  # the 2.x name first
    present.clear()
    assert tp._lightning_package() is None


def test_scenarios_benchmark_prints_the_table_and_the_targets(tmp_path, capsys):
    """In this process, as the pipeline's own end-to-end tests run pipeline.main (without
    --autotune nothing process-wide is changed)."""
    from conftest import make_folder
    data = make_folder(tmp_path / "data", n_train=10, n_test=4)
    out = tmp_path / "scen.json"
    code = _benchmark_module("scenarios").main(
        ["--dataset", str(data), "--device", "cpu", "--output-dir", str(tmp_path / "bench"),
         "--json", str(out), "--",
         "--epochs", "2", "--image-size", "24", "--resolutions", "24,32", "--n-trials", "2",
         "--weights", "none", "--no-autotune"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    result = json.loads(out.read_text())
    assert [r["scenario"] for r in result["rows"]] == ["baseline", "resolution", "hpo"]
    for name in ("baseline", "resolution", "hpo"):
        assert f"| {name} |" in captured.out
    for target in ("resolution at least as accurate", "reaches the baseline's val accuracy",
                   "hpo at least 3 points above", "test set:"):
        assert any(target in line for line in result["lines"]), target
    assert "torch " in result["lines"][1]  # the provenance line


def test_rank_agreement_of_a_lower_size():
    """Spearman over the configurations, the clearly-apart pairs kept in order, and the regret
    of picking at the lower size."""
    agree = _benchmark_module("scenarios").rank_agreement
    same = agree([0.5, 0.6, 0.7], [0.3, 0.4, 0.5], n_val=1000)
    assert same == {"spearman": pytest.approx(1.0), "pairs_apart": 3, "pairs_same_order": 3,
                    "regret": 0.0}
    flipped = agree([0.5, 0.6, 0.7], [0.5, 0.4, 0.3], n_val=1000)
    assert flipped["spearman"] == pytest.approx(-1.0) and flipped["pairs_same_order"] == 0
    assert flipped["regret"] == pytest.approx(0.2)  # the low size picks what scores 0.5
    # 100 images: 0.50 and 0.52 are within noise, so only the pairs with 0.70 count
    noisy = agree([0.50, 0.52, 0.70], [0.31, 0.30, 0.50], n_val=100)
    assert noisy["pairs_apart"] == 2 and noisy["pairs_same_order"] == 2
    assert noisy["spearman"] == pytest.approx(0.5)
    assert agree([0.5, 0.6], [0.4, 0.4], n_val=100)["spearman"] is None  # no order at all


def test_search_comparisons_print_their_verdicts(tmp_path, capsys):
    """--compare-search and --compare-fidelity on a tiny folder, without the scenarios."""
    from conftest import make_folder
    data = make_folder(tmp_path / "data", n_train=6, n_test=2)
    code = _benchmark_module("scenarios").main(
        ["--dataset", str(data), "--device", "cpu", "--output-dir", str(tmp_path / "bench"),
         "--search-only", "--compare-search", "--search-trials", "2", "--compare-fidelity",
         "--fidelity-configs", "2", "--fidelity-size", "24", "--",
         "--epochs", "3", "--image-size", "32", "--weights", "none"])
    out = capsys.readouterr().out
    assert code == 0
    assert "search: plain TPE best" in out
    assert "target <= 0.33x" in out or "never came within" in out or "left chance" in out
    assert "fidelity: 2 configurations, 2 epochs each, at 32 px" in out
    assert "| 0.001 | 32 | adam |" in out  # the default configuration is the first
    # two configurations of 2 epochs on 6 images a class: a verdict, or none when they tie
    assert ("the configurations the way 32 px does" in out or "has no order to keep" in out) \
        and "Spearman" in out
    assert not (tmp_path / "bench" / "fidelity" / "optuna.db").exists()  # no study there


def test_pretrain_on_another_set_trains_the_start_weights_once(tmp_path, capsys):
    """--pretrain-on: the stand-in for ImageNet weights is trained on the other set, passed to
    every run as --weights and reused by the next benchmark into the same output dir; the set
    under test itself, or a --weights of the user's beside it, is refused in one line."""
    from conftest import make_folder
    bench = _benchmark_module("scenarios")
    data = make_folder(tmp_path / "data", n_train=6, n_test=2)
    other = make_folder(tmp_path / "other", n_train=6, n_test=2)
    argv = ["--dataset", str(data), "--device", "cpu", "--output-dir", str(tmp_path / "bench"),
            "--search-only", "--compare-search", "--search-trials", "1", "--pretrain-on",
            str(other), "--", "--epochs", "2", "--image-size", "32"]
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    kept = list((tmp_path / "bench" / "pretrain" / "other-squeezenet1_1").glob("*_model.pt"))
    assert len(kept) == 1
    assert f"start weights: trained here on {other} ({kept[0]})" in captured.out
    assert f"tensors from {kept[0]}" in captured.err  # the search's trials started from them
    first = kept[0].stat().st_mtime_ns
    assert bench.main(argv) == 0  # reused, not trained again
    assert kept[0].stat().st_mtime_ns == first
    with pytest.raises(SystemExit, match="pretrain on another set than --dataset"):
        bench.main(["--dataset", str(tmp_path / "elsewhere" / "other")] + argv[2:])
    with pytest.raises(SystemExit, match="give one or the other"):
        bench.main(argv + ["--weights", "none"])
    with pytest.raises(SystemExit, match="give one or the other"):
        bench.main(argv + ["--weig=none"])  # as the pipeline's own parser reads it
    with pytest.raises(SystemExit, match="^error: argument --epochs"):  # one line, no traceback
        bench.main(argv + ["--epochs", "zero"])


def test_a_target_figure_never_prints_the_limit_it_missed():
    """0.502x of the baseline's time is MISSED against 0.5x: printed as 0.50x it read as met."""
    bench = _benchmark_module("scenarios")
    base = {"scenario": "baseline", "test_acc": 0.50, "total_s": 100.0, "n_test": 1200}
    res = {"scenario": "resolution", "test_acc": 0.4996, "total_s": 90.0,
           "time_to_baseline_acc_s": 50.2, "autotune": {"seconds": 8.996}}
    hpo = {"scenario": "hpo", "test_acc": 0.52996, "total_s": 90.0}
    lines = bench.targets([base, res, hpo])
    assert "MISSED: resolution at least as accurate as the baseline (-0.04 points)" in lines
    assert any(line.startswith("MISSED: resolution reaches") and line.endswith("(0.502x)")
               for line in lines)
    assert "MISSED: hpo at least 3 points above the baseline (+2.996 points)" in lines
    assert "met: resolution measuring at most 10% of its wall time (9.996%)" in lines
    assert bench.figure(0.34, 0.5, 2) == "0.34" and bench.figure(3.2, 3, 1, "+") == "+3.2"
    assert bench.figure(0.5, 0.5, 2) == "0.50"  # on the limit itself: met, as printed
    assert bench.figure(0.50004, 0.5, 2) == "0.50004"  # nearer than the first digits
    assert bench.figure(10.01 / 30, 1 / 3, 2) == "0.334"  # "0.33" would read as within a third
    assert bench.figure(10.0, 10, 1) == "10.0"  # measuring on the limit: at most 10%, met
    assert "met: resolution measuring at most 10% of its wall time (10.0%)" in bench.targets(
        [base, {**res, "autotune": {"seconds": 9.0}}])
    # a baseline slowed by other work stretched every ratio and, through --match-time, gave
    # the tuned final runs more epochs: no verdict stands
    shared = bench.targets([{**base, "diagnosis": {"bottleneck": "cpu-contended"}}, res, hpo])
    assert shared[0].startswith("UNRELIABLE: the CPU was shared with other work during "
                                "baseline")
    assert all(line.startswith(("UNRELIABLE", "test set")) for line in shared)
    # so did a tuning slowed so: its seconds, and the speed knobs it measured, were the load's
    slowed = bench.targets([base, {**res, "tuning_load": {"contended": "busy 99%"}}, hpo])
    assert slowed[0].startswith("UNRELIABLE: the CPU was shared with other work during "
                                "resolution's tuning")
    assert "cpu-contended" not in slowed[0], slowed[0]  # review: its final run's diagnosis was not
    assert all(line.startswith(("UNRELIABLE", "test set")) for line in slowed)
    assert not bench.targets([base, {**res, "tuning_load": {"contended": None}}, hpo])[
        0].startswith("UNRELIABLE")


def test_the_search_verdict_needs_a_best_clear_of_chance():
    """A plain TPE whose every trial is still at chance has no best to reach: its "best" is
    the luckiest noise (synthetic seed 1's 4-epoch trials, 20.0% against 16.7% on 360)."""
    verdict = _benchmark_module("scenarios").search_verdict
    at_chance = verdict([(10, 4, 0.19), (20, 8, 0.20)], [(10, 4, 0.19), (20, 8, 0.19)], 360, 1 / 6)
    assert at_chance[2].startswith("n/a: no trial of plain TPE left chance (16.7% on 360")
    plain = [(10, 4, 0.3), (20, 8, 0.5), (30, 12, 0.6)]
    met = verdict(plain, [(9, 4, 0.597), (15, 6, 0.6)], 360, 1 / 6)
    assert met[1] == ("search: within ours' 6 trial epochs plain TPE's best was 30.0% (ours "
                      "60.0%, +30.0 points)")
    assert met[2].startswith("met: ours within 0.5 points") and "(0.30x" in met[2]
    assert "0.33x its trial epochs" in met[2]
    missed = verdict(plain, [(9, 4, 0.4), (15, 8, 0.5)], 360, 1 / 6)
    assert missed[1].endswith("was 50.0% (ours 50.0%, +0.0 points)")
    assert missed[2] == "MISSED: ours never came within 0.5 points of plain TPE's best"
    late = verdict(plain, [(10.01, 4, 0.6)], 360, 1 / 6)
    assert late[2].startswith("MISSED") and "(0.334x its trial seconds" in late[2]
    # against plain TPE's seconds to its own best too, which its first trial (the default,
    # trained first by both) can make 0
    assert met[3] == ("search: plain TPE reached its best after 30 trial seconds; ours came "
                      "within 0.5 points after 0.30x that")
    # 3 images of 600 below plain TPE's best is 0.5 points exactly (0.500000000000006)
    exact = verdict([(10, 4, 301 / 600)], [(3, 4, 298 / 600)], 600, 1 / 6)
    assert exact[2].startswith("met: ours within 0.5 points")
    first = verdict([(10, 4, 0.6), (20, 8, 0.6)], [(10, 4, 0.6)], 360, 1 / 6)
    assert "after 10 trial seconds (its first trial, the default configuration" in first[3]


def test_targets_read_exact_points_borrowed_runs_and_a_difference_of_two_accuracies():
    """516 against 480 of 1,200 is 3 points exactly (2.9999999999999982 in floating point):
    met. An hpo row that took the resolution scenario's final run (final_from) ran only its
    tuning: measuring is a share of that. A 3-point claim compares two accuracies: the
    test-set line gives the standard error of their difference."""
    bench = _benchmark_module("scenarios")
    base = {"scenario": "baseline", "test_acc": 480 / 1200, "total_s": 100.0, "n_test": 1200}
    hpo = {"scenario": "hpo", "test_acc": 516 / 1200, "total_s": 90.0, "tuning_s": 30.0,
           "final_from": "resolution", "autotune": {"seconds": 4.5}}
    lines = bench.targets([base, hpo])
    assert "met: hpo at least 3 points above the baseline (+3.0 points)" in lines
    assert "MISSED: hpo measuring at most 10% of its wall time (15.0%)" in lines
    assert "test set: 1200 images, standard error of a 3-point difference 2.0 points " \
           "(3 points < 2 SE: too small)" in lines
    # the hpo scenario's GPU memory probe is measuring too
    probed = {**hpo, "hpo": {"memory_probe_s": 1.5}}
    assert "MISSED: hpo measuring at most 10% of its wall time (20.0%)" in bench.targets(
        [base, probed])
    # choices an earlier run's cache gave measured nothing here: no verdict, said so
    cached = {**hpo, "autotune": {"seconds": 0.0, "reused_from": "out/autotune_cache.json (x)"}}
    lines = bench.targets([base, cached])
    assert not any("measuring at most 10%" in line for line in lines)
    assert "not judged: hpo measuring reused the choices of an earlier run " \
           "(out/autotune_cache.json (x)); a fresh --output-dir measures them" in lines
    shown = {"test_acc_se": 0.01, "best_resolution": 64}
    assert "(cached)" in bench.rows_table([{**base, **shown}, {**cached, **shown}])[-1]


def test_the_scenarios_benchmark_reads_only_its_own_runs_rows(tmp_path, monkeypatch, capsys):
    """The output dir keeps every earlier run's rows, another data set's baseline among them:
    a run of the tuned scenarios alone is not judged against it."""
    bench = _benchmark_module("scenarios")
    from modules import results
    run = tmp_path / "bench" / "run"
    run.mkdir(parents=True)
    earlier = {"scenario": "baseline", "run_id": "old", "dataset": "synthetic", "test_acc": 0.4,
               "test_acc_se": 0.01, "total_s": 100.0, "best_resolution": 64}
    # the pipeline compared it with an earlier baseline; the benchmark judges by its own run's
    mine = {"scenario": "resolution", "run_id": "new", "dataset": "digits", "test_acc": 0.9,
            "test_acc_se": 0.01, "total_s": 300.0, "tuning_s": 10.0, "best_resolution": 48,
            "test_acc_vs_baseline": 50.0, "time_to_baseline_acc_s": 20.0,
            "baseline_acc_target": 0.4}
    (run / "results.json").write_text(json.dumps([earlier, mine]))
    monkeypatch.setattr(bench, "latest_run", lambda out: {"run_id": "new"})
    monkeypatch.setattr(bench.pipeline, "main", lambda argv: 0)
    from conftest import make_folder
    data = make_folder(tmp_path / "data", n_train=4, n_test=2)
    assert bench.main(["--dataset", str(data), "--output-dir", str(tmp_path / "bench"), "--",
                       "--scenarios", "resolution"]) == 0
    printed = capsys.readouterr().out
    assert "| baseline |" not in printed and "no baseline row: nothing to compare" in printed
    assert "| resolution | 90.0% +- 1.0 | n/a |" in printed and "| n/a | 48 |" in printed
    assert results.latest_run  # the real one, used when not replaced


def test_an_interrupted_export_of_a_real_set_is_made_again(tmp_path, monkeypatch):
    bench = _benchmark_module("scenarios")
    import real_data
    calls = []

    def export(root):
        calls.append(root)
        (root / "a").mkdir(parents=True)
        (root / "a" / "1.png").write_bytes(b"")
        if len(calls) == 1:
            raise KeyboardInterrupt  # stopped halfway through the set
        (root / "b").mkdir()
    monkeypatch.setitem(real_data.REAL_SETS, "fake", export)
    with pytest.raises(KeyboardInterrupt):
        bench.data_folder("fake", tmp_path)
    assert bench.data_folder("fake", tmp_path) == ["--data-dir", str(tmp_path / "fake")]
    assert len(calls) == 2 and (tmp_path / "fake" / "b").is_dir()


def test_benchmark_mistakes_are_one_line_before_any_run(tmp_path, capsys):
    """--rounds 0 ended the throughput benchmark in a StatisticsError after its measuring; a
    pipeline option the search comparison's setup refuses, and a --json in a folder that does
    not exist yet (which ended the scenarios benchmark after its whole run), are one line or
    made now."""
    from conftest import make_folder
    with pytest.raises(SystemExit) as exited:
        _benchmark_module("throughput").main(["--device", "cpu", "--rounds", "0"])
    assert exited.value.code == 2 and "--rounds: must be 1 or more" in capsys.readouterr().err
    # a row name that is not one, and a --json that cannot be written: before the measuring
    throughput = _benchmark_module("throughput")
    assert throughput.main(["--device", "cpu", "--skip", "pure-compute"]) == 2
    assert "no row named pure-compute" in capsys.readouterr().err
    every = "pure_compute,pipeline,baseline,lightning"
    assert throughput.main(["--device", "cpu", "--skip", every]) == 2
    assert "every row left out" in capsys.readouterr().err
    # ... which time to accuracy alone does not need: past the check (to the data, here)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(throughput, "dataset", lambda *a: (_ for _ in ()).throw(
            throughput.UserError("the data, reached")))
        assert throughput.main(["--device", "cpu", "--skip", every, "--time-to-accuracy"]) == 2
    assert "the data, reached" in capsys.readouterr().err
    (tmp_path / "a file").write_text("")
    assert throughput.main(["--device", "cpu", "--skip", "lightning", "--json",
                            str(tmp_path / "a file" / "x.json")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot make ")
    for argv in (["--rounds", "0"], ["--image-size", "5"]):  # a StatisticsError, a traceback
        with pytest.raises(SystemExit) as exited, pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", ["timing_overhead.py", *argv])
            _benchmark_module("timing_overhead").main()
        assert exited.value.code == 2 and "error: " in capsys.readouterr().err
    data = make_folder(tmp_path / "data", n_train=6, n_test=2)
    scenarios = _benchmark_module("scenarios")
    with pytest.raises(SystemExit, match=r"^error: .*"):
        scenarios.main(["--dataset", str(data), "--device", "cpu", "--output-dir",
                        str(tmp_path / "bench"), "--json", str(tmp_path / "new" / "s.json"),
                        "--search-only", "--compare-search", "--", "--image-size", "5"])
    assert (tmp_path / "new").is_dir()
    # an option the benchmark sets itself: a later --output-dir won, and the benchmark read an
    # earlier run's rows from its own folder as this run's
    for given, said in ((["--output-dir", str(tmp_path / "o")], "--output-dir"),
                        (["--data-dir", str(data)], "--dataset"), (["--quick"], "--quick")):
        with pytest.raises(SystemExit, match=f"^error: the benchmark sets the pipeline's "
                                             f"{given[0]}: give the benchmark's {said} before"):
            scenarios.main(["--dataset", str(data), "--device", "cpu", "--output-dir",
                            str(tmp_path / "bench"), "--", *given])
    # a lower size the model cannot train at, or the search's own: before any training
    for size, said in (("5", "too small"), ("32", "the search's own size")):
        with pytest.raises(SystemExit, match=f"^error: --fidelity-size {size}.*{said}"):
            scenarios.main(["--dataset", str(data), "--device", "cpu", "--output-dir",
                            str(tmp_path / "bench"), "--search-only", "--compare-fidelity",
                            "--fidelity-size", size, "--", "--image-size", "32"])


def test_throughput_rounds_put_every_pair_of_rows_in_both_orders():
    """Swapping neighbours left Lightning, the third row, last in every round."""
    order = _benchmark_module("throughput").round_order
    runs = ["pipeline", "baseline", "lightning"]
    rounds = [order(runs, r) for r in range(2)]
    for a in runs:
        for b in runs:
            if a != b:
                assert {o.index(a) < o.index(b) for o in rounds} == {True, False}, (a, b)


def test_the_measuring_share_is_of_the_seconds_the_scenario_itself_ran():
    """An hpo row counts the resolution scenario's trial it took, and the rest of that
    scenario's tuning where it took its model: that scenario ran (and measured) them, and the
    hpo row's own share of measuring read diluted (0.85% where its own was 1.7%)."""
    ran_s = _benchmark_module("scenarios").ran_s
    assert ran_s({"total_s": 50.0}) == 50.0
    assert ran_s({"total_s": 50.0, "tuning_s": 20.0, "final_from": "resolution"}) == 20.0
    took = {"total_s": 80.0, "tuning_s": 46.8, "final_from": "resolution",
            "hpo": {"default_reused_s": 7.9, "resolution_tuning_s": 15.0}}
    assert ran_s(took) == pytest.approx(23.9)
    assert ran_s({"total_s": 60.0, "hpo": {"default_reused_s": 10.0}}) == 50.0


def test_benchmark_options_that_would_be_ignored_or_fail_late_are_one_line(tmp_path, monkeypatch,
                                                                            capsys):
    """--search-only alone ran the whole three-scenario benchmark it says it skips; with
    --search-only the --json file was never written; a real set whose package is missing
    ended in a traceback; an unknown --pretrain-on set was refused only after the set under
    test was exported; timing_overhead's --json in a new folder failed after its measuring."""
    from conftest import make_folder
    bench = _benchmark_module("scenarios")
    import real_data  # beside it, on the path once it is loaded
    data = make_folder(tmp_path / "data", n_train=4, n_test=2)
    monkeypatch.setattr(bench.pipeline, "main", lambda argv: pytest.fail("the scenarios ran"))
    with pytest.raises(SystemExit) as exited:
        bench.main(["--dataset", str(data), "--output-dir", str(tmp_path / "b"), "--search-only"])
    assert exited.value.code == 2
    assert "--search-only skips the three scenarios" in capsys.readouterr().err
    monkeypatch.setattr(bench, "compare_search", lambda data, args, out: ["met: searched"])
    out = tmp_path / "new" / "s.json"
    assert bench.main(["--dataset", str(data), "--output-dir", str(tmp_path / "b"),
                       "--search-only", "--compare-search", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["lines"][-1] == "met: searched"

    exported = []

    def missing(root):
        exported.append(root)
        raise RuntimeError("Animal-MNIST needs its package: pip install --no-deps animal-mnist==0.4")
    monkeypatch.setitem(real_data.REAL_SETS, "fake", missing)
    with pytest.raises(SystemExit, match="^error: Animal-MNIST needs its package"):
        bench.data_folder("fake", tmp_path / "sets")

    def no_sklearn(root):
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")
    monkeypatch.setitem(real_data.REAL_SETS, "fake", no_sklearn)
    monkeypatch.setitem(bench.PACKAGES, "fake", "scikit-learn")
    with pytest.raises(SystemExit, match="^error: the fake set needs sklearn: pip install "
                                         "scikit-learn$"):
        bench.data_folder("fake", tmp_path / "sets")
    exported.clear()
    monkeypatch.setitem(real_data.REAL_SETS, "fake", missing)
    with pytest.raises(SystemExit, match="^error: unknown data set 'nosuchset'"):
        bench.main(["--dataset", "fake", "--output-dir", str(tmp_path / "b"),
                    "--pretrain-on", "nosuchset"])
    assert exported == []  # refused before the set under test was made

    with pytest.raises(SystemExit) as exited, pytest.MonkeyPatch.context() as mp:
        (tmp_path / "a file").write_text("")
        mp.setattr(sys, "argv", ["timing_overhead.py", "--image-size", "32", "--rounds", "1",
                                 "--json", str(tmp_path / "a file" / "x.json")])
        _benchmark_module("timing_overhead").main()
    assert exited.value.code == 2 and "error: cannot make" in capsys.readouterr().err


def test_the_fidelity_verdict_needs_a_pair_apart_and_a_lower_size(tmp_path, monkeypatch):
    """Every configuration within noise of the others (all still at chance) has no order to
    keep: "does NOT rank" claimed what nothing measured. A --fidelity-size above the search's
    was trained and reported as "the lower size"."""
    import types
    from conftest import make_folder
    import modules.trainer as trainer
    bench = _benchmark_module("scenarios")
    data = make_folder(tmp_path / "data", n_train=6, n_test=2)
    monkeypatch.setattr(trainer, "fit", lambda index, config, **kw: types.SimpleNamespace(
        best_val_acc=0.17 if config.image_size == 32 else 0.18, wall_s=1.0))

    def args(size):
        return types.SimpleNamespace(quick=False, device="cpu", fidelity_size=size,
                                     fidelity_configs=3, pipeline_args=[
                                         "--epochs", "3", "--image-size", "32", "--weights", "none"])
    lines = bench.compare_fidelity(["--data-dir", str(data)], args(24), tmp_path / "fid")
    assert lines[-1].startswith("n/a: no two configurations apart at 32 px"), lines[-1]
    assert not any("does NOT rank" in line for line in lines)
    with pytest.raises(SystemExit, match="^error: --fidelity-size 48 is above the search's 32 px"):
        bench.compare_fidelity(["--data-dir", str(data)], args(48), tmp_path / "fid")
