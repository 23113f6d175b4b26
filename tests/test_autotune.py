"""The autotuner: every knob decided by a measurement on this device, with the reason kept."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from modules import autotune as at, deadline, hostmem, models
from modules.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def quick_measurements(monkeypatch):
    monkeypatch.setattr(at, "MIN_STEPS", 2)
    monkeypatch.setattr(at, "MAX_STEPS", 3)
    monkeypatch.setattr(at, "MIN_S", 0.0)
    threads = torch.get_num_threads()  # no remembered choices either: conftest clears them
    yield
    torch.set_num_threads(threads)
    hostmem.apply("system")


def _config(**kw):
    base = dict(image_size=24, batch_size=4, device="cpu", weights="none", cache_decoded=True)
    return TrainConfig(**{**base, **kw})


def _fake_speeds(monkeypatch, img_s, warmup_s=None):
    """Every probe's steps take batch / img_s(config) seconds, as if measured; the first two
    steps of a probe take warmup_s(config) each when given (a compile's warm-up)."""
    def timed_step(self):
        self.fake_steps = getattr(self, "fake_steps", 0) + 1
        if warmup_s is not None and self.fake_steps <= 2:
            return warmup_s(self.config)
        return self.batch / img_s(self.config)
    monkeypatch.setattr(at.ComputeProbe, "timed_step", timed_step)


def test_every_knob_is_measured_and_explained_on_cpu():
    config, report = at.autotune(_config(), 3, planned_steps=10)
    knobs = report["knobs"]
    assert set(knobs) == {"cpu_threads", "cpu_allocator", "channels_last", "amp",
                          "optimizer_impl", "dropout_impl", "compile", "num_workers",
                          "batch_size"}
    measured = ["channels_last", "amp", "optimizer_impl"]
    if hostmem.candidates() != ["system"]:  # glibc: both allocator settings ran
        measured.append("cpu_allocator")
    for name in measured:
        figures = knobs[name]["img_s"]
        assert len(figures) >= 2, name   # at least two candidates actually ran
        assert "img/s" in knobs[name]["reason"]
    assert set(knobs["dropout_impl"]["layer_ms"]) == {"native", "bytemask"}
    assert "timed alone" in knobs["dropout_impl"]["reason"]
    assert config.amp == knobs["amp"]["choice"] and config.amp in ("off", "bf16")
    assert config.channels_last == knobs["channels_last"]["choice"]
    assert config.cpu_threads == torch.get_num_threads()
    assert config.cpu_allocator == knobs["cpu_allocator"]["choice"] == hostmem.current()
    assert knobs["compile"]["choice"] is False and "not tried" in knobs["compile"]["reason"]
    assert knobs["num_workers"]["choice"] == 0  # the decoded cache needs no workers
    assert report["compute_img_s"] > 0


def test_a_short_planned_run_is_measured_within_a_share_of_its_time(monkeypatch):
    monkeypatch.setattr(at, "MIN_S", 1.5)
    assert at.measuring_time(None, 64, 800.0, 10) == 1.5            # nothing planned: full time
    assert at.measuring_time(100_000, 64, 800.0, 10) == 1.5         # a long run
    assert at.measuring_time(1000, 64, 800.0, 10) == pytest.approx(0.8)  # 80 s run: 8 s in all
    assert at.measuring_time(270, 64, 800.0, 10) == at.MIN_S_FLOOR  # 22 s run: the floor
    seen = []
    race = at.race

    def spy(incumbent, challenger, **kw):
        seen.append(kw.get("min_s"))
        return race(incumbent, challenger, **kw)
    monkeypatch.setattr(at, "race", spy)
    _, report = at.autotune(_config(), 3, planned_steps=10)
    assert report["seconds_per_candidate"] == at.MIN_S_FLOOR
    assert len(seen) > 5 and set(seen) == {at.MIN_S_FLOOR}


def test_a_slower_dtype_is_rejected_by_its_measurement(monkeypatch):
    """bf16 on a CPU without bf16 units: the figure, not a rule, turns it down."""
    _fake_speeds(monkeypatch, lambda c: {"off": 200.0, "bf16": 31.0}[c.amp]
                 * (2.0 if c.channels_last else 1.0))
    config, report = at.autotune(_config(), 3, planned_steps=10)
    assert config.amp == "off" and config.channels_last
    amp = report["knobs"]["amp"]
    assert amp["img_s"] == {"off": 400.0, "bf16": 62.0}
    assert amp["reason"] == ("off measured 400.0 img/s; raced: bf16 62.0 vs off 400.0 "
                             "(dropped after its first steps)")


def test_a_faster_candidate_is_kept_and_a_marginal_one_is_not(monkeypatch):
    speeds = {"auto": 100.0, "forloop": 100.0, "foreach": 101.0, "fused": 150.0}
    _fake_speeds(monkeypatch, lambda c: speeds[c.optimizer_impl])
    config, report = at.autotune(_config(), 3, planned_steps=10)
    assert config.optimizer_impl == "fused"
    assert report["knobs"]["optimizer_impl"]["img_s"] == {"forloop": 100.0, "foreach": 101.0,
                                                          "fused": 150.0}
    speeds["fused"] = 101.5  # within MIN_GAIN of the default: not worth a change
    at._RESULTS.clear()
    config, _ = at.autotune(_config(), 3, planned_steps=10)
    assert config.optimizer_impl == "forloop"


def test_a_slow_candidate_stops_after_two_slow_steps_in_a_row(monkeypatch):
    speeds = {"off": 100.0, "bf16": 10.0}
    _fake_speeds(monkeypatch, lambda c: speeds[c.amp])
    fast, slow = at.ComputeProbe(_config(amp="off"), 3), at.ComputeProbe(_config(amp="bf16"), 3)
    result = at.race(fast, slow, warmup=1, min_steps=5, max_steps=5, min_s=0.0)
    assert result["steps"] == 2 and result["dropped"]  # a lone warm-up step does not count
    result = at.race(fast, slow, warmup=2, min_steps=5, max_steps=5, min_s=0.0)
    assert result["steps"] == 1  # the second warm-up step and the first timed one
    assert result["img_s"] == (100.0, 10.0)
    speeds["bf16"] = 90.0  # within ABORT_FACTOR: raced to the end
    result = at.race(fast, slow, warmup=2, min_steps=5, max_steps=5, min_s=0.0)
    assert result["steps"] == 6 and not result["dropped"]  # an even number of pairs


def test_a_race_takes_turns_and_alternates_who_goes_first(monkeypatch):
    """Two candidates timed in alternation (A B B A ...), so drift and the order fall on both
    alike; a process-wide knob switches in turns of TURN_STEPS, the first step not counted."""
    order = []

    def timed_step(self):
        order.append((self.config.amp, torch.get_num_threads()))
        return 0.01
    monkeypatch.setattr(at.ComputeProbe, "timed_step", timed_step)
    a, b = at.ComputeProbe(_config(amp="off"), 3), at.ComputeProbe(_config(amp="bf16"), 3)
    at.race(a, b, warmup=1, min_steps=4, max_steps=4, min_s=0.0)
    assert [amp for amp, _ in order] == ["bf16"] + ["off", "bf16", "bf16", "off"] * 2
    order.clear()
    threads = torch.get_num_threads()
    a = at.ComputeProbe(_config(cpu_threads=1), 3)
    b = at.ComputeProbe(_config(cpu_threads=2), 3)
    one_turn = at.TURN_STEPS - 1  # counted steps in one turn
    result = at.race(a, b, warmup=1, min_steps=one_turn, max_steps=one_turn, min_s=0.0)
    # two pairs (an even number: each goes second as often), the first of each turn not counted
    assert [n for _, n in order] == [2] + [1] * at.TURN_STEPS + [2] * (2 * at.TURN_STEPS) \
        + [1] * at.TURN_STEPS
    assert result["steps"] == 2 * one_turn
    assert torch.get_num_threads() == 1  # the process is left in the incumbent's settings
    torch.set_num_threads(threads)


def test_no_setting_is_measured_twice(monkeypatch):
    """Each knob's first candidate is the setting the previous knob chose ("auto" included):
    its probe is raced again, not built again."""
    _fake_speeds(monkeypatch, lambda c: 100.0)
    built = []
    init = at.ComputeProbe.__init__

    def spy(self, config, *a, **kw):
        built.append(config)
        init(self, config, *a, **kw)
    monkeypatch.setattr(at.ComputeProbe, "__init__", spy)
    start = _config(amp="auto", optimizer_impl="auto")
    at.autotune(start, 3, planned_steps=10)
    assert len(built) == len(set(built))
    # the first probe, then one per other candidate of each knob
    plan = [at.thread_candidates(), [True, False], at.amp_candidates(torch.device("cpu")),
            at.optimizer_candidates(torch.device("cpu")), hostmem.candidates()]
    assert len(built) == 1 + sum(len(c) - 1 for c in plan)


def test_dropout_is_decided_on_its_layers_not_by_a_race(monkeypatch):
    """The two implementations draw different masks: whichever a step race's noise favoured
    would decide the model trained. The choice is their layers' time alone, which here is a
    clock the layers advance (the real speeds, several-fold apart on a quiet CPU and the other
    way round on a loaded one, are the benchmark's to show, not a test's to assume)."""
    from types import SimpleNamespace
    start = _config(image_size=64, batch_size=32)
    clock = [0.0]
    cost = {}
    for impl, cls in (("native", torch.nn.Dropout), ("bytemask", models.ByteMaskDropout)):
        def timed(self, x, forward=cls.forward, impl=impl):
            clock[0] += cost[impl]
            return forward(self, x)
        monkeypatch.setattr(cls, "forward", timed)
    monkeypatch.setattr(at, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    for native_ms, bytemask_ms, expected in ((2.0, 0.9, "bytemask"), (2.0, 1.1, "native")):
        cost.update(native=native_ms / 1e3, bytemask=bytemask_ms / 1e3)
        entry = at.dropout_by_layer(start, 3, torch.device("cpu"))
        assert entry["choice"] == expected
        assert entry["layer_ms"] == {"native": native_ms, "bytemask": bytemask_ms}
    monkeypatch.undo()

    built = []
    init = at.ComputeProbe.__init__

    def spy(self, config, *a, **kw):
        built.append(config.dropout_impl)
        init(self, config, *a, **kw)
    monkeypatch.setattr(at.ComputeProbe, "__init__", spy)
    for choice in ("bytemask", "native"):
        monkeypatch.setattr(at, "dropout_by_layer", lambda *a, c=choice: {
            "choice": c, "img_s": {}, "layer_ms": {}, "reason": f"{c} timed faster"})
        for faster in ("native", "bytemask"):  # what a race would have measured
            _fake_speeds(monkeypatch, lambda c, f=faster: 120.0 if c.dropout_impl == f else 100.0)
            at._RESULTS.clear()
            built.clear()
            config, report = at.autotune(start, 3, planned_steps=10)
            assert config.dropout_impl == report["knobs"]["dropout_impl"]["choice"] == choice
            assert set(built) == {choice}  # every probe trained with the choice, none raced it
    at._RESULTS.clear()
    config, report = at.autotune(_config(dropout_impl="bytemask"), 3, planned_steps=10,
                                 fixed=frozenset({"dropout_impl"}))
    assert config.dropout_impl == "bytemask"
    assert report["knobs"]["dropout_impl"]["reason"] == "set by the user"


def test_workers_asked_for_the_decoded_cache_are_said_unused_there(monkeypatch):
    """The cache's batches are made in the training process: --num-workers 2 started no
    worker there, and the report said "num_workers = 2: set by the user". They are kept for
    a final run at a size whose images the cache cannot hold, which streams them."""
    _fake_speeds(monkeypatch, lambda c: 100.0)
    at._RESULTS.clear()
    config, report = at.autotune(_config(num_workers=2), 3, planned_steps=10,
                                 fixed=frozenset({"num_workers"}))
    assert config.num_workers == 2
    assert report["knobs"]["num_workers"]["reason"] == (
        "set by the user; for images streamed from disk only: the decoded-image cache starts "
        "none")


def test_unbudgeted_steps_count_for_compile_not_for_the_budget(monkeypatch, caplog):
    """A final run that may be taken from another scenario: the budget is a share of the
    rest, also when a time budget caps that rest (a share computed beforehand was not). The
    budget's line says which steps it counts: compile's line counts them all."""
    _fake_speeds(monkeypatch, lambda c: 100.0)  # batch 4: 0.04 s a step
    _, whole = at.autotune(_config(), 3, planned_steps=1000, budget_share=0.1)
    at._RESULTS.clear()
    with caplog.at_level(logging.INFO):
        _, rest = at.autotune(_config(), 3, planned_steps=1000, budget_share=0.1,
                              unbudgeted_steps=900)
    assert "measuring budget 0.4 s (10% of the planned 100 steps; not of the 900 of a final " \
        "run that may be taken from another scenario)" in caplog.text
    assert whole["budget_s"] == pytest.approx(4.0, rel=0.05)
    assert rest["budget_s"] == pytest.approx(0.4, rel=0.05)
    at._RESULTS.clear()
    # 100 search steps capped at 2 s (50 steps at 100 img/s) beside 900 unbudgeted ones
    _, capped = at.autotune(_config(), 3, planned_steps=1000, budget_share=0.1,
                            unbudgeted_steps=900, time_capped=(100, 2.0))
    assert capped["budget_s"] == pytest.approx(0.2, rel=0.05)


def test_user_set_knobs_are_kept_unmeasured():
    config, report = at.autotune(_config(amp="off", channels_last=False), 3, planned_steps=10,
                                 fixed=frozenset({"amp", "channels_last"}))
    assert report["knobs"]["amp"] == {"choice": "off", "reason": "set by the user", "img_s": {}}
    assert config.amp == "off" and config.channels_last is False


def test_compile_is_kept_only_when_it_pays_back(monkeypatch):
    monkeypatch.setattr(at.ComputeProbe, "__init__", _uncompiled_init(at.ComputeProbe.__init__))
    _fake_speeds(monkeypatch, lambda c: 200.0 if c.compile else 100.0,
                 warmup_s=lambda c: 15.0 if c.compile else 0.04)
    # batch 4 at 100 img/s: 0.04 s per step eager, 0.02 compiled; 30 s warm-up needs ~1500 steps
    config, report = at.autotune(_config(), 3, planned_steps=1000)
    assert config.compile is False and "pays back only after" in report["knobs"]["compile"]["reason"]
    at._RESULTS.clear()
    config, report = at.autotune(_config(), 3, planned_steps=100_000)
    assert config.compile is True and "pays back after" in report["knobs"]["compile"]["reason"]


def test_a_reused_compile_is_left_off_for_a_run_too_short_to_pay_it_back(tmp_path,
                                                                          monkeypatch):
    """Chosen for a long run, compile was reused whole by a shorter one into the same output
    dir (a --quick run after a full one), which then paid the warm-up it could not win back."""
    monkeypatch.setattr(at.ComputeProbe, "__init__", _uncompiled_init(at.ComputeProbe.__init__))
    _fake_speeds(monkeypatch, lambda c: 200.0 if c.compile else 100.0,
                 warmup_s=lambda c: 15.0 if c.compile else 0.04)
    cache = tmp_path / "autotune_cache.json"
    config, report = at.autotune(_config(), 3, planned_steps=100_000, cache_path=cache)
    payback = report["knobs"]["compile"]["payback_steps"]
    assert config.compile is True and 1000 < payback < 100_000

    def measure_again(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(at, "_first_probe", measure_again)
    for where in ("this run", str(cache)):
        short, reused = at.autotune(_config(), 3, planned_steps=1000, cache_path=cache)
        assert where in reused["reused_from"]
        assert short.compile is False and "not used here" in reused["knobs"]["compile"]["reason"]
        long, kept = at.autotune(_config(), 3, planned_steps=100_000, cache_path=cache)
        assert long.compile is True and "not used" not in kept["knobs"]["compile"]["reason"]
        at._RESULTS.clear()  # a new process: from the cache file


def _uncompiled_init(init, built: list | None = None):
    """ComputeProbe.__init__ that builds a compile=True probe without compiling (the speeds
    are faked; a real torch.compile would take minutes here); `built` records each probe's
    compile setting."""
    import dataclasses

    def build(self, config, *a, **kw):
        if built is not None:
            built.append(config.compile)
        init(self, dataclasses.replace(config, compile=False), *a, **kw)
        self.config = config
    return build


def test_worker_count_is_the_fewest_that_keep_up():
    import time

    class Slow:
        def __init__(self, per_batch_s):
            self.per_batch_s = per_batch_s

        def __iter__(self):
            while True:
                time.sleep(self.per_batch_s)
                yield torch.zeros(10, 1), torch.zeros(10)

    delays = {0: 0.05, 2: 0.01, 4: 0.005}   # 200, 1000, 2000 img/s
    n, entry = at.tune_workers(lambda k: Slow(delays[k]), compute_img_s=500.0,
                               candidates=[0, 2, 4], batches=3)
    assert n == 2 and "2 workers deliver" in entry["reason"]


def test_cpu_batch_is_kept_and_said_why():
    config, entry = at._fit_batch(_config(batch_size=8, grad_accum_steps=2), 3,
                                  torch.device("cpu"))
    assert (config.batch_size, config.grad_accum_steps) == (8, 2)
    assert "effective batch 16" in entry["reason"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_batch_holds_the_effective_batch_within_memory(monkeypatch):
    import modules.autotune
    monkeypatch.setattr(modules.autotune, "max_batch_size", lambda *a, **k: 24)
    config, entry = at._fit_batch(_config(device="cuda", batch_size=64), 3, torch.device("cuda"))
    assert config.batch_size * config.grad_accum_steps >= 64
    assert config.batch_size <= 24 and config.grad_accum_steps == 3


AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="needs an x86 CPU with AVX2")
def test_bf16_is_rejected_by_measurement_on_an_avx2_cpu(tmp_path):
    """A real rejection, not an injected one: with oneDNN and ATen capped at AVX2 (a CPU without
    bf16 units, like the one the speed targets were set on) bf16 autocast runs several times
    slower, and the autotuner turns it down by its own figures."""
    script = tmp_path / "tune.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch
        from modules import autotune as at
        from modules.config import TrainConfig
        print(json.dumps({"isa": torch.backends.cpu.get_cpu_capability()}))
        config = TrainConfig(image_size=64, batch_size=16, device="cpu", weights="none",
                             cache_decoded=True)
        fixed = frozenset({"cpu_threads", "cpu_allocator", "channels_last", "optimizer_impl",
                           "compile", "num_workers", "batch_size"})
        tuned, report = at.autotune(config, 6, planned_steps=10, fixed=fixed)
        print(json.dumps(report["knobs"]["amp"]))
    """))
    env = {**os.environ, **AVX2_ONLY, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    isa, amp = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert isa["isa"] == "AVX2"
    assert amp["choice"] == "off", amp
    assert amp["img_s"]["bf16"] < 0.5 * amp["img_s"]["off"], amp
    assert "off measured" in amp["reason"]


def _never_answers(seconds, conn):
    """A child that takes far longer than any deadline (a compile warm-up of minutes)."""
    import time
    time.sleep(seconds)
    conn.send("late")


def test_a_child_past_its_deadline_is_killed():
    import time
    started = time.perf_counter()
    finished, answer = deadline.run_with_deadline(_never_answers, (60,), 2.0)
    assert (finished, answer) == (False, None)
    assert time.perf_counter() - started < 15  # spawn start-up included, not the 60 s


def _crashes_leaving_a_worker(pid_file, conn):
    """A child that starts a worker (a compiler's, say) and dies without answering."""
    worker = subprocess.Popen(["sleep", "120"])
    with open(pid_file, "w") as f:
        f.write(str(worker.pid))
    os._exit(139)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is killed
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_child_that_dies_does_not_leave_its_workers_running(tmp_path):
    pid_file = tmp_path / "worker.pid"
    finished, answer = deadline.run_with_deadline(_crashes_leaving_a_worker, (str(pid_file),), 60)
    assert finished and "died (exit code 139)" in answer["error"]
    pid = int(pid_file.read_text())
    waits_until = time.monotonic() + 5
    while _running(pid) and time.monotonic() < waits_until:
        time.sleep(0.05)
    alive = _running(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive


def test_a_real_compile_warm_up_past_the_deadline_is_abandoned(monkeypatch):
    """torch.compile of the model takes far longer than 3 s here: the child is killed then and
    eager is kept, with the reason saying so."""
    import time
    monkeypatch.setattr(at, "COMPILE_WARMUP_FLOOR_S", 1.0)  # so that 3 s is tried at all
    probe = at.ComputeProbe(_config(), 3)
    current = {"probe": probe, "img_s": 100.0}
    started = time.perf_counter()
    config, entry = at._tune_compile(_config(), 3, current, planned_steps=None, deadline_s=3.0)
    assert config.compile is False and entry["reason"].startswith("torch.compile failed here")
    assert "abandoned" in entry["reason"] and "3 s" in entry["reason"]
    assert time.perf_counter() - started < 20


def test_measuring_stays_within_its_budget_share():
    """A planned run of 10 steps of batch 4 takes well under a second: 10% of it leaves no time
    for the knobs after the first probe, and none for compile. A knob left unmeasured keeps
    the starting value (bf16 here), not the first of its list."""
    config, report = at.autotune(_config(amp="bf16"), 3, planned_steps=10, budget_share=0.1)
    knobs = report["knobs"]
    # 10% of 10 steps of 4 images at the rate measured (well under a second, unless the
    # process's first bf16 steps were slow: the first probe is then the only measurement)
    assert report["budget_s"] == pytest.approx(4 / report["compute_img_s"], rel=0.1, abs=0.05)
    skipped = [k for k, v in knobs.items() if v["reason"].startswith("not measured: ")]
    assert "amp" in skipped and config.amp == "bf16" and config.compile is False
    assert knobs["compile"]["reason"].startswith("not tried")
    assert set(report["phases_s"]) >= {"first_probe", "compile"} and "knobs" not in report["phases_s"]
    for name in skipped:  # kept at its starting value (its first candidate), as reported
        assert knobs[name]["choice"] == getattr(config, name) and knobs[name]["img_s"] == {}


def test_the_budget_shrinks_to_the_fastest_rate_measured(monkeypatch, caplog):
    """A first probe slowed by its warm-up (here 10x) must not widen the budget: the run trains
    at the settings chosen, so the budget follows the fastest rate measured. At the first
    probe's 100 img/s, 10% of 10,000 steps of 4 images is 40 s; at the 1,000 img/s the races
    measure, 4 s."""
    _fake_speeds(monkeypatch, lambda config: 1000.0)
    real_first = at._first_probe

    def slow_first(config, num_classes, min_s):
        probe, result = real_first(config, num_classes, min_s)
        return probe, {**result, "img_s": result["img_s"] / 10}
    monkeypatch.setattr(at, "_first_probe", slow_first)
    with caplog.at_level(logging.INFO):
        config, report = at.autotune(_config(), 3, planned_steps=10_000, budget_share=0.1)
    assert report["budget_s"] == pytest.approx(4.0, rel=0.05)
    # said, so that "n s left of the measuring budget (4.0 s)" does not contradict the 40 s
    assert "measuring budget now 4.0 s" in caplog.text


def test_a_first_probe_that_fails_leaves_the_measuring_bounded(monkeypatch):
    """The first probe's settings do not fit (channels_last's copy, threads fixed as under
    torchrun): the budget was set only from the first probe, so every knob and compile's
    warm-up were measured without bound. It is now set by the first candidate that trains."""
    _fake_speeds(monkeypatch, lambda config: 1000.0)
    real_init = at.ComputeProbe.__init__

    def init(self, config, num_classes, batch_size=None):
        if config.channels_last:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real_init(self, config, num_classes, batch_size)
    monkeypatch.setattr(at.ComputeProbe, "__init__", init)
    deadlines = []

    def no_compile(config, num_classes, current, planned_steps, deadline_s=None):
        deadlines.append(deadline_s)
        return config, {"choice": False, "img_s": {}, "reason": "not tried here"}
    monkeypatch.setattr(at, "_tune_compile", no_compile)
    config, report = at.autotune(_config(channels_last=True), 3, planned_steps=10_000,
                                 budget_share=0.1, fixed=frozenset({"cpu_threads"}))
    assert not config.channels_last
    assert report["budget_s"] == pytest.approx(4.0, rel=0.05)  # 10% of 10,000 steps at 1,000/s
    assert deadlines[0] is not None and deadlines[0] <= 4.0


def test_steps_a_time_budget_bounds_count_only_as_far_as_its_seconds_reach(monkeypatch):
    """A search with a time budget trains at most its seconds, however many trials it was
    asked for: at 1,000 img/s and batch 4, 9,000 of 10,000 planned steps bounded to 6 s are
    1,500 steps, so 10% of 2,500 steps is 1 s, where 10,000 would have given 4 s."""
    _fake_speeds(monkeypatch, lambda config: 1000.0)
    config, report = at.autotune(_config(), 3, planned_steps=10_000, budget_share=0.1,
                                 time_capped=(9_000, 6.0))
    assert report["budget_s"] == pytest.approx(1.0, rel=0.05)
    at._RESULTS.clear()  # measure again, not reuse the choice made for the same settings
    _, within = at.autotune(_config(), 3, planned_steps=10_000, budget_share=0.1,
                            time_capped=(9_000, 1e6))
    assert within["budget_s"] == pytest.approx(4.0, rel=0.05)  # the steps end first


def test_amp_starts_at_what_auto_means_on_the_device(monkeypatch):
    """An unmeasured knob keeps its first candidate: on a GPU "auto" must stay mixed precision."""
    assert at.amp_candidates(torch.device("cpu"), "auto") == ["off", "bf16"]
    assert at.amp_candidates(torch.device("cpu"), "bf16") == ["bf16", "off"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(at, "autocast_dtype", lambda amp, device: torch.bfloat16)
    assert at.amp_candidates(torch.device("cuda"), "auto") == ["bf16", "off", "fp16"]
    # A T4: torch calls bf16 supported there (emulated, slowly); it is not raced
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(at, "autocast_dtype", lambda amp, device: torch.float16)
    assert at.amp_candidates(torch.device("cuda"), "auto") == ["fp16", "off"]


def test_a_failed_probe_hands_its_memory_back_outside_the_except_block(monkeypatch):
    """Inside it, the traceback still holds the failed probe's tensors: nothing to free."""
    handling = []
    incumbent, _ = at._first_probe(_config(), 3, min_s=0.01)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # _release frees CUDA's only
    monkeypatch.setattr(at, "release", lambda device: handling.append(sys.exc_info()[0]))

    def too_big(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(at, "race", too_big)
    assert at._challenge(incumbent, _config(channels_last=True), 3)[0] is None
    monkeypatch.setattr(at.ComputeProbe, "measure", too_big)
    probe, failed = at._first_probe(_config(), 3, min_s=0.01)
    assert probe is None and failed["out_of_memory"] and handling == [None, None]


def test_the_memory_probe_runs_only_when_the_starting_batch_does_not_fit(monkeypatch):
    fits, probes = [], []
    real_first = at._first_probe

    def first_probe(config, num_classes, min_s):
        probes.append(config.batch_size)
        if config.batch_size > 2:
            return None, {"error": "CUDA out of memory. Tried to allocate 2.00 GiB",
                          "out_of_memory": True}
        return real_first(config, num_classes, min_s)

    def fit(config, num_classes, device, effective=None):
        fits.append(config.batch_size)
        return dataclasses.replace(config, batch_size=2, grad_accum_steps=2), {
            "choice": 2, "img_s": {}, "reason": "fits 2"}
    monkeypatch.setattr(at, "_first_probe", first_probe)
    monkeypatch.setattr(at, "_fit_batch", fit)
    config, report = at.autotune(_config(batch_size=2), 3, planned_steps=10, budget_share=0.1)
    assert probes == [2] and fits == [2]  # it fitted: only the final refit, which is cheap on CPU
    at._RESULTS.clear()
    fits.clear(), probes.clear()
    config, report = at.autotune(_config(batch_size=4), 3, planned_steps=10, budget_share=0.1)
    assert probes[:2] == [4, 2] and fits[0] == 4 and config.batch_size == 2


def _fits_up_to(monkeypatch, largest):
    """Probes of more than `largest` samples per step run out of memory, as on a CPU's RAM."""
    real_init = at.ComputeProbe.__init__

    def init(self, config, num_classes, batch_size=None):
        if (batch_size or config.batch_size) > largest:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 4294967296 bytes")
        real_init(self, config, num_classes, batch_size)
    monkeypatch.setattr(at.ComputeProbe, "__init__", init)


def test_a_fixed_batch_that_does_not_fit_is_measured_in_micro_batches(monkeypatch):
    """Every knob's candidates failed alike, and the run ended with "no cpu_threads setting
    could train" where the trainer's out-of-memory recovery would have trained it."""
    _fake_speeds(monkeypatch, lambda config: 1000.0)
    _fits_up_to(monkeypatch, 2)
    config, report = at.autotune(_config(batch_size=8), 3, planned_steps=10_000,
                                 budget_share=0.1, fixed=frozenset({"batch_size"}))
    assert (config.batch_size, config.grad_accum_steps) == (8, 1)  # what the user set
    entry = report["knobs"]["batch_size"]
    assert entry["choice"] == 8 and "set by the user" in entry["reason"]
    assert "micro-batches (2 x 4 accumulation)" in entry["reason"]
    assert report["compute_img_s"] == pytest.approx(1000.0, rel=0.05)


def test_a_batch_that_does_not_fit_on_a_cpu_is_split_to_the_same_effective_batch(monkeypatch):
    """A CPU has no memory probe (_fit_batch keeps the batch there)."""
    _fake_speeds(monkeypatch, lambda config: 1000.0)
    _fits_up_to(monkeypatch, 3)
    config, report = at.autotune(_config(batch_size=8, grad_accum_steps=2), 3,
                                 planned_steps=10_000, budget_share=0.1)
    assert (config.batch_size, config.grad_accum_steps) == (2, 8)  # 16 = 2 x 8
    assert "effective batch 16 = 2 x 8" in report["knobs"]["batch_size"]["reason"]


@pytest.mark.parametrize("report", [
    {"knobs": {"amp": {"choice": "off", "img_s": 123.4, "reason": "r"}}},  # an older shape
    {"knobs": {"amp": {"choice": "off", "img_s": {}, "reason": "r"}}, "phases_s": [1, 2]},
    {"knobs": {"old_knob": {"choice": 1, "img_s": {"1": 2.0}, "reason": "r"}}},
    {"knobs": {"amp": {"choice": "off", "img_s": {}, "reason": 7}}},
    {"knobs": {}, "seconds_per_candidate": "2 s"},
    # not finite or below zero: later arithmetic (int(inf), a budget from it) failed mid-run
    {"knobs": {}, "compute_img_s": float("inf")},
    {"knobs": {}, "compute_img_s": float("nan")},
    {"knobs": {}, "compute_img_s": 0},
    {"knobs": {}, "budget_s": -3.0},
    {"knobs": {}, "phases_s": {"first_probe": float("nan")}},
])
def test_a_cache_entry_of_another_shape_is_measured_again_not_a_traceback(tmp_path, caplog,
                                                                          report):
    """_valid_report checked only that each knob had a choice: these failed later, mid-run."""
    import logging
    config = _config()
    cache = tmp_path / "autotune_cache.json"
    key = at.speed_key(config, 3)
    cache.write_text(json.dumps({at.machine_key(): {key: {
        "config": config.to_dict(), "report": {"compute_img_s": 100.0, **report}}}}))
    with caplog.at_level(logging.INFO):
        assert at._from_cache(cache, key) is None
    assert "cannot reuse the entry" in caplog.text and "measuring again" in caplog.text


def test_a_choice_is_reused_by_a_later_scenario_and_from_the_machine_cache(tmp_path, monkeypatch):
    cache = tmp_path / "autotune_cache.json"
    first, report = at.autotune(_config(), 3, planned_steps=10, cache_path=cache, run_id="r1")
    assert "reused_from" not in report and cache.exists()
    # a later scenario: other lr and epochs, same speed settings: reused, not measured
    def measure_again(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(at, "_first_probe", measure_again)
    later, again = at.autotune(_config(lr=0.05, epochs=7), 3, planned_steps=99, cache_path=cache,
                               run_id="r1")
    assert again["reused_from"] == "this run" and again["seconds"] == 0.0
    assert (later.lr, later.epochs) == (0.05, 7) and later.amp == first.amp
    # a second run in the same process (a notebook kernel) into another output dir: reused,
    # named as the run that measured it, and written to that dir's cache for its later runs
    other_dir = tmp_path / "other" / "autotune_cache.json"
    other_dir.parent.mkdir()
    _, second = at.autotune(_config(), 3, planned_steps=10, cache_path=other_dir, run_id="r2")
    assert second["reused_from"].startswith(f"run r1, earlier in this process ({cache}, 20")
    entries = [{k: e[k] for k in ("config", "report")} for path in (cache, other_dir)
               for machine in json.loads(path.read_text()).values() for e in machine.values()]
    assert len(entries) == 2 and entries[0] == entries[1]
    # a later run (a new process): from the cache file, keyed by this machine
    at._RESULTS.clear()
    _, cached = at.autotune(_config(), 3, planned_steps=10, cache_path=cache)
    assert str(cache) in cached["reused_from"] and cached["knobs"] == report["knobs"]
    # another machine (another CPU, GPU or torch): measured again
    at._RESULTS.clear()
    monkeypatch.undo()
    monkeypatch.setattr(at, "machine_key", lambda: "another machine")
    _, fresh = at.autotune(_config(), 3, planned_steps=10, cache_path=cache)
    assert "reused_from" not in fresh
    assert set(json.loads(cache.read_text())) == {"another machine", *[
        k for k in json.loads(cache.read_text()) if k != "another machine"]}
    # another size: measured again
    at._RESULTS.clear()
    _, other = at.autotune(_config(image_size=32), 3, planned_steps=10, cache_path=cache)
    assert "reused_from" not in other


def test_a_choice_taken_from_the_cache_is_named_so_by_the_later_scenarios_too(tmp_path):
    """The resolution scenario took the choice from an earlier run's cache file; the hpo
    scenario, at the same settings, reused it and said "this run", as if this run had
    measured it (and the benchmarks' table did not mark its row cached)."""
    cache = tmp_path / "autotune_cache.json"
    at.autotune(_config(), 3, planned_steps=10, cache_path=cache, run_id="earlier")
    at._RESULTS.clear()  # a new process
    _, first = at.autotune(_config(), 3, planned_steps=10, cache_path=cache, run_id="now")
    _, later = at.autotune(_config(), 3, planned_steps=10, cache_path=cache, run_id="now")
    assert str(cache) in first["reused_from"]
    assert later["reused_from"] == first["reused_from"]
    _, notebook = at.autotune(_config(), 3, planned_steps=10, cache_path=cache, run_id="next")
    assert notebook["reused_from"] == first["reused_from"]


def test_the_compute_probe_times_the_step_that_trains_clipping_included():
    """The probe's step is the trainer's (train_step): with --max-grad-norm its update is
    clipped as training's is, where a step of its own would not be."""
    config = _config(optimizer="sgd", lr=1.0, momentum=0.0, max_grad_norm=1e-6)
    probe = at.ComputeProbe(config, 3)
    before = [p.detach().clone() for p in probe.model.parameters()]
    probe.step()
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum()
                           for p, b in zip(probe.model.parameters(), before)))
    assert 0 < moved <= 1.01e-6  # lr x the clipped gradient norm


def test_a_knob_raced_at_another_size_in_the_run_is_where_the_next_size_starts(monkeypatch):
    """The resolution scenario measures at the default size; the hpo scenario's short trials
    at a smaller picked size then leave too little budget for the amp race. It starts from, and keeps, the choice raced at the
    other size (bf16 here, twice as fast), not fp32; a choice kept unmeasured is passed on to
    no one, and without a size measured before, the starting value stays."""
    _fake_speeds(monkeypatch, lambda config: 2000.0 if config.amp == "bf16" else 1000.0)
    alone, report = at.autotune(_config(image_size=20), 3, planned_steps=10, budget_share=0.1)
    assert alone.amp == "off" and report["knobs"]["amp"]["reason"].startswith("not measured: ")
    at._RESULTS.clear()

    measured, report = at.autotune(_config(image_size=32), 3, planned_steps=10)
    assert measured.amp == "bf16" and report["knobs"]["amp"]["img_s"]  # raced
    small, report = at.autotune(_config(image_size=20), 3, planned_steps=10, budget_share=0.1)
    amp = report["knobs"]["amp"]
    assert small.amp == "bf16" and amp["choice"] == "bf16" and amp["img_s"] == {}
    assert amp["reason"].startswith("not measured: ") and "as measured at 32 px in this run" in amp["reason"]
    # 24 px is nearer 20 px than 32 px, but nothing was raced at 20 px: 32 px's choice is taken
    _, report = at.autotune(_config(image_size=24), 3, planned_steps=10, budget_share=0.1)
    assert "as measured at 32 px" in report["knobs"]["amp"]["reason"]
    # another batch is other settings: nothing carried
    other, _ = at.autotune(_config(image_size=20, batch_size=8), 3, planned_steps=10, budget_share=0.1)
    assert other.amp == "off"


def _sleeping_steps(monkeypatch, step_s):
    """Every probe step takes step_s of wall time (the budget is kept by the clock)."""
    import time

    def timed_step(self):
        time.sleep(step_s)
        return step_s
    monkeypatch.setattr(at.ComputeProbe, "timed_step", timed_step)


def test_a_race_is_counted_by_the_steps_it_must_take_not_only_its_seconds(monkeypatch):
    """Slow steps (0.2 s here): a race times each candidate for MIN_STEPS steps over an even
    number of pairs, turns of TURN_STEPS for the thread count, whatever its seconds. 10% of
    100 such steps is 2 s; the first probe takes 0.8 of them, too little for any race."""
    _sleeping_steps(monkeypatch, 0.2)
    config, report = at.autotune(_config(), 3, planned_steps=100, budget_share=0.1)
    assert report["budget_s"] == pytest.approx(2.0, rel=0.05)
    assert report["seconds"] <= 1.1 * report["budget_s"]
    skipped = [k for k, v in report["knobs"].items() if v["reason"].startswith("not measured")]
    assert "cpu_threads" in skipped or len(at.thread_candidates()) == 1


def test_a_race_past_the_budget_is_cut_at_its_end(monkeypatch):
    import time
    _sleeping_steps(monkeypatch, 0.02)
    a, b = at.ComputeProbe(_config(amp="off"), 3), at.ComputeProbe(_config(amp="bf16"), 3)
    result = at.race(a, b, warmup=1, min_steps=50, max_steps=50, min_s=0.0,
                     deadline=time.perf_counter() + 0.05)
    assert result["cut"] and result["steps"] == 2  # the first even pair after the deadline
    assert not at.race(a, b, warmup=1, min_steps=2, max_steps=2, min_s=0.0)["cut"]


def test_a_challenger_warming_up_past_the_deadline_is_cut_there(monkeypatch):
    """A challenger 50x slower than the incumbent (race_cost assumes 1.5x): its two warm-up
    steps ran to 10 s on a deadline 1 s away before the deadline was looked at."""
    from types import SimpleNamespace
    clock = [0.0]
    monkeypatch.setattr(at, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Probe:
        def __init__(self, step_s):
            self.step_s, self.batch, self.config = step_s, 4, _config()

        def activate(self):
            pass

        def timed_step(self):
            clock[0] += self.step_s
            return self.step_s
    result = at.race(Probe(0.1), Probe(5.0), warmup=2, deadline=1.0)
    assert result["img_s"] is None and result["cut"] and clock[0] == 5.0


def test_a_knob_whose_challenger_was_cut_in_its_warm_up_keeps_its_setting(monkeypatch):
    probe = at.ComputeProbe(_config(), 3)
    monkeypatch.setattr(at, "_challenge", lambda *a, **k: (object(), {
        "img_s": None, "warmup_s": 5.0, "steps": 0, "dropped": False, "cut": True}))
    current = {"probe": probe, "img_s": 100.0}
    config, entry = at._pick("amp", ["off", "bf16"], _config(), 3, current, 0.0, 1e12)
    assert config.amp == "off" and entry["choice"] == "off" and current["img_s"] == 100.0
    assert "bf16 not measured: the measuring budget was spent in its warm-up" in entry["reason"]


def test_a_knob_none_of_whose_challengers_ran_is_said_unmeasured_and_measured_later(monkeypatch):
    """Every challenger cut in its warm-up: "only off runs here" said bf16 could not run, the
    diagnosis called bf16 measured slower, and a later, longer run reused the choice whole
    (and passed it on to other sizes as measured)."""
    from modules.diagnosis import _measured_slower
    probe = at.ComputeProbe(_config(), 3)
    monkeypatch.setattr(at, "_challenge", lambda *a, **k: (object(), {
        "img_s": None, "warmup_s": 5.0, "steps": 0, "dropped": False, "cut": True}))
    _, entry = at._pick("amp", ["off", "bf16"], _config(), 3,
                        {"probe": probe, "img_s": 100.0}, 0.0, 1e12)
    assert entry["reason"].startswith("not measured: off kept")
    assert "runs here" not in entry["reason"] and at._budget_skipped(entry)
    assert _measured_slower({"raced": {"amp": entry["img_s"]}}, "amp", "bf16", "off") is None
    findings = {"knobs": {"amp": entry}, "planned_steps": 10, "compute_img_s": 100.0,
                "budget_s": 1.0, "seconds_per_candidate": None}  # None: an edited cache
    assert at._measure_rest(findings, 100_000, None, _config(), "before", 0.1) == {}


def test_a_race_won_reports_the_losers_figure_from_that_race(monkeypatch):
    """The incumbent kept its first probe's 100 img/s beside the winner's 90 from the race it
    lost at 80: the figures said the setting turned off was the faster, and the diagnosis then
    advised turning it on."""
    from modules.diagnosis import _measured_slower
    probe = at.ComputeProbe(_config(channels_last=True), 3)
    monkeypatch.setattr(at, "_challenge", lambda *a, **k: (object(), {
        "img_s": (80.0, 90.0), "warmup_s": 0.0, "steps": 4, "dropped": False, "cut": False}))
    config, entry = at._pick("channels_last", [True, False], _config(channels_last=True), 3,
                             {"probe": probe, "img_s": 100.0}, 0.0, None)
    assert config.channels_last is False and entry["img_s"] == {"true": 80.0, "false": 90.0}
    assert _measured_slower({"raced": {"channels_last": entry["img_s"]}}, "channels_last")


def test_a_knobs_later_challengers_keep_to_the_budget_a_faster_winner_shrank(monkeypatch):
    """The deadline is read again before each challenger: after a 4x faster winner the budget
    (a share of the planned steps' time) is a quarter, and the third candidate was still
    raced against the first one's deadline."""
    probe = at.ComputeProbe(_config(), 3)
    raced = []

    def challenge(best, config, *a, **k):
        raced.append(config.optimizer_impl)
        return object(), {"img_s": (16.0, 64.0), "warmup_s": 0.0, "steps": 4,
                          "dropped": False, "cut": False}
    monkeypatch.setattr(at, "_challenge", challenge)
    ends = iter([float("inf"), 0.0])  # the budget is spent once the first race is won
    _, entry = at._pick("optimizer_impl", ["forloop", "foreach", "fused"], _config(), 3,
                        {"probe": probe, "img_s": 16.0}, 0.0, lambda: next(ends))
    assert raced == ["foreach"] and entry["choice"] == "foreach"
    assert entry["img_s"]["fused"] == "not measured: the measuring budget was spent"


def test_a_cached_entry_that_would_fail_mid_run_is_measured_again(tmp_path):
    cache = tmp_path / "cache.json"
    report = {"knobs": {"amp": {"choice": "fp64", "reason": "edited", "img_s": {}}},
              "phases_s": {}, "compute_img_s": 100.0}
    at._to_cache(cache, "k", _config(), report)
    assert at._from_cache(cache, "k") is None  # an amp TrainConfig refuses
    report["knobs"]["amp"]["choice"] = "off"
    report["phases_s"] = {"first_probe": None}
    at._to_cache(cache, "k", _config(), report)
    assert at._from_cache(cache, "k") is None
    report["phases_s"] = {"first_probe": 1.5}
    at._to_cache(cache, "k", _config(), report)
    assert at._from_cache(cache, "k") is not None


def test_the_worker_count_stops_measuring_at_the_deadline():
    import time
    made = []

    def make_loader(n):
        made.append(n)
        return [(torch.zeros(4, 3, 8, 8), None)] * 8
    choice, entry = at.tune_workers(make_loader, 10.0, [0, 2, 4], deadline=time.perf_counter())
    assert made == [0] and choice == 0  # the first count is measured, none after the deadline
    assert "2, 4 not measured: the measuring budget was spent" in entry["reason"]


def test_a_worker_count_warming_up_at_the_deadline_is_abandoned(monkeypatch):
    """Each batch takes 0.1 s (a fake clock): 8 workers' 17 warm-up batches ran on 1.7 s past
    a deadline 0.75 s away. They are now abandoned at the deadline."""
    from types import SimpleNamespace
    clock = [0.0]
    monkeypatch.setattr(at, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def make_loader(n):
        def batches():
            while True:
                clock[0] += 0.1
                yield torch.zeros(32, 1), None
        return batches()
    choice, entry = at.tune_workers(make_loader, 1e6, [0, 8], deadline=0.75)
    assert choice == 0 and list(entry["img_s"]) == ["0"]
    assert clock[0] <= 0.75 + 0.1 + 1e-9  # one batch past it at most


@pytest.mark.parametrize("rates, expected", [
    ({0: 318.0, 8: 320.0}, 0),             # 0.6% faster: noise, not worth 8 processes
    ({0: 318.0, 2: 330.0, 8: 320.0}, 2),   # 3.8% faster: a gain
])
def test_more_workers_are_not_taken_for_a_gain_inside_the_noise(monkeypatch, rates, expected):
    """No count keeps up with the model: the fastest was taken, 8 workers at 320 img/s over
    none at 318."""
    from types import SimpleNamespace
    clock = [0.0]
    monkeypatch.setattr(at, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def make_loader(n):
        def batches():
            while True:
                clock[0] += 10 / rates[n]  # a batch of 10 images at that rate
                yield torch.zeros(10, 1), None
        return batches()
    choice, entry = at.tune_workers(make_loader, 1e6, list(rates))
    assert entry["img_s"] == {str(n): rate for n, rate in rates.items()}
    assert choice == expected


def test_workers_the_machine_cannot_run_are_left_out_of_the_race(monkeypatch):
    """A container's 64 MB /dev/shm: the race's 2-worker loader raised the DataLoader's
    shared-memory error, with its traceback, and ended the run."""
    from types import SimpleNamespace
    clock = [0.0]
    monkeypatch.setattr(at, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def make_loader(n):
        def batches():
            if n:
                raise RuntimeError("Caught RuntimeError in DataLoader worker process 0.\n"
                                   "Original Traceback (most recent call last):\n...\n"
                                   "RuntimeError: unable to allocate shared memory(shm) for "
                                   "file </torch_1_2_3>: No space left on device (28)")
            while True:
                clock[0] += 0.1
                yield torch.zeros(10, 1), None
        return batches()
    choice, entry = at.tune_workers(make_loader, 1e6, [0, 2, 4])
    assert choice == 0 and entry["img_s"] == {"0": 100.0}
    assert "; 2 workers could not run here (unable to allocate shared memory(shm)" in \
        entry["reason"] and "not measured" not in entry["reason"]
    with pytest.raises(RuntimeError, match="a bug"):  # anything else is not the machine's
        at.tune_workers(lambda n: iter(()) if n == 0 else (_ for _ in ()).throw(
            RuntimeError("a bug")), 1e6, [0, 2])


def test_compile_pays_back_in_optimizer_steps_with_accumulation(monkeypatch):
    """planned_steps counts optimizer steps, each 4 micro-batches here: 1,000 of them at
    0.16 s eager and 0.08 s compiled pay back a 30 s warm-up after 374 (per micro-batch, the
    same warm-up would have needed 1,500 of what are only 4,000 micro-steps)."""
    monkeypatch.setattr(at.ComputeProbe, "__init__", _uncompiled_init(at.ComputeProbe.__init__))
    _fake_speeds(monkeypatch, lambda c: 200.0 if c.compile else 100.0,
                 warmup_s=lambda c: 15.0 if c.compile else 0.04)
    config, report = at.autotune(_config(grad_accum_steps=4), 3, planned_steps=1000)
    reason = report["knobs"]["compile"]["reason"]
    assert config.compile is True and "pays back after 374 steps" in reason, reason


def test_a_choice_left_unmeasured_by_a_short_run_is_measured_by_a_longer_one(tmp_path, monkeypatch):
    """A --quick run, then a full run into the same output dir: the short run's budget left
    the knobs unmeasured and compile untried; the longer run measures them rather than reuse
    the gaps, in the same process and from the cache file alike. As long or shorter: reused."""
    _fake_speeds(monkeypatch, lambda c: 2000.0 if c.amp == "bf16" else 1000.0)
    cache = tmp_path / "autotune_cache.json"
    short, report = at.autotune(_config(), 3, planned_steps=10, budget_share=0.1,
                                cache_path=cache)
    assert short.amp == "off" and report["knobs"]["amp"]["reason"].startswith("not measured")
    assert report["planned_steps"] == 10
    _, again = at.autotune(_config(), 3, planned_steps=10, budget_share=0.1, cache_path=cache)
    assert again["reused_from"] == "this run"
    for fresh_process in (False, True):
        if fresh_process:
            at._RESULTS.clear()
            at._RESULTS.clear()
            at._to_cache(cache, at.speed_key(_config(), 3), short, report)
        longer, report2 = at.autotune(_config(), 3, planned_steps=100_000, budget_share=0.1,
                                      cache_path=cache)
        assert "reused_from" not in report2 and longer.amp == "bf16"
        assert report2["knobs"]["amp"]["img_s"]  # raced this time
        at._RESULTS[at.speed_key(_config(), 3)] = at._Choice(short, report, None, "")  # back


def test_knobs_measured_before_are_kept_while_the_rest_are_measured(monkeypatch):
    """Only what the earlier choice left unmeasured is raced: its measured amp (bf16, slower
    now) stays, with the reason it was chosen for."""
    _fake_speeds(monkeypatch, lambda c: 500.0 if c.amp == "bf16" else 1000.0)
    key = at.speed_key(_config(), 3)
    earlier = at.dataclasses.replace(_config(), amp="bf16")
    knobs = {"amp": {"choice": "bf16", "reason": "bf16 measured 900 img/s", "img_s": {"bf16": 900}},
             "channels_last": {"choice": False, "img_s": {}, "reason": "not measured: 0.1 s left"}}
    at._RESULTS[key] = at._Choice(earlier, {"knobs": knobs, "planned_steps": 10,
                                            "compute_img_s": 900.0}, None, "")
    config, report = at.autotune(_config(), 3, planned_steps=100_000, budget_share=0.1)
    assert config.amp == "bf16" and report["knobs"]["amp"]["reason"] == \
        "bf16 measured 900 img/s (measured earlier)"
    assert report["knobs"]["channels_last"]["img_s"]  # measured now
    assert at._measure_rest({"knobs": knobs, "planned_steps": 10, "compute_img_s": 900.0}, 5,
                            None, earlier, "", 0.1) is None  # a shorter run: reused whole


def test_the_cpu_is_told_apart_on_arm_as_on_x86():
    graviton2 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes\n" \
                "CPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"
    graviton3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd bf16 sve\n" \
                "CPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert at.cpu_identity(graviton2) != at.cpu_identity(graviton3)
    assert "bf16" in at.cpu_identity(graviton3)
    x86 = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n"
    assert at.cpu_identity(x86) == "AMD EPYC 7B13 fpu avx2"  # as before: the cache keys stand


def test_the_streaming_paths_key_holds_the_data():
    """The worker count is measured against the images' decoding: another data set with the
    same classes measures again; the decoded cache's choice does not depend on it."""
    config = _config(cache_decoded=False)
    assert at.speed_key(config, 3, cached_data=False, data_key="a") != \
        at.speed_key(config, 3, cached_data=False, data_key="b")
    assert at.speed_key(config, 3, data_key="a") == at.speed_key(config, 3, data_key="b")


def test_a_damaged_cache_is_measured_again_not_a_traceback(tmp_path):
    cache = tmp_path / "autotune_cache.json"
    key = at.speed_key(_config(), 3)
    for damaged in ({at.machine_key(): {key: {"config": _config().to_dict()}}},  # no report
                    {at.machine_key(): ["not", "a", "dict"]},
                    {at.machine_key(): {key: {"config": {"image_size": "big"}, "report": {}}}}):
        cache.write_text(json.dumps(damaged))
        at._RESULTS.clear()
        _, report = at.autotune(_config(), 3, planned_steps=10, cache_path=cache)
        assert "reused_from" not in report
        assert key in json.loads(cache.read_text())[at.machine_key()]  # written over


def test_the_deadline_child_does_not_run_an_unguarded_script_again(tmp_path):
    """A user's script that calls the pipeline without an `if __name__ == "__main__"` guard:
    the measuring child imports only its target's module, where multiprocessing's spawn ran
    the whole script again (a second run) before the target."""
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests" / "helpers")!r}]
        import deadline_child
        from modules import deadline
        print("script body runs", flush=True)
        print(deadline.run_with_deadline(deadline_child.answer, ({{"img_s": 1.5}},), 60))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["script body runs", "(True, {'img_s': 1.5})"]


def test_the_deadline_child_imports_this_project_beside_a_users_modules_package(tmp_path):
    """A working directory with a `modules` package of its own came first on the child's
    path: the child could not import ours, and compile was recorded as failed here."""
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "__init__.py").write_text("")
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests" / "helpers")!r}]
        import deadline_child
        from modules import deadline
        print(deadline.run_with_deadline(deadline_child.answer, ({{"ok": True}},), 60))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["(True, {'ok': True})"], out.stderr[-2000:]


def test_a_compile_choice_measured_before_is_kept_and_the_rest_measured_eager(monkeypatch):
    """The earlier choice compiled; what it left unmeasured is raced on eager probes (a
    compiled first probe would pay the compile's warm-up unbounded), and compile stays on."""
    _fake_speeds(monkeypatch, lambda c: 1000.0)
    built = []
    monkeypatch.setattr(at.ComputeProbe, "__init__",
                        _uncompiled_init(at.ComputeProbe.__init__, built))
    key = at.speed_key(_config(), 3)
    knobs = {"compile": {"choice": True, "reason": "compiled 2000 vs eager 1000", "img_s": {}},
             "amp": {"choice": "off", "img_s": {}, "reason": "not measured: 0.1 s left"}}
    at._RESULTS[key] = at._Choice(dataclasses.replace(_config(), compile=True),
                                  {"knobs": knobs, "planned_steps": 10, "compute_img_s": 1000.0},
                                  None, "")
    config, report = at.autotune(_config(), 3, planned_steps=100_000, budget_share=0.1)
    assert built and not any(built) and config.compile is True
    assert report["knobs"]["compile"]["reason"].endswith("(measured earlier)")


def test_a_compile_the_user_asked_for_is_set_after_measuring_the_rest_eager(monkeypatch):
    """--compile: every probe compiled paid a warm-up no deadline bounds (97 s of measuring
    against an 11 s budget); the knobs are raced eager and compile is set at the end."""
    _fake_speeds(monkeypatch, lambda c: 1000.0)
    built = []
    monkeypatch.setattr(at.ComputeProbe, "__init__",
                        _uncompiled_init(at.ComputeProbe.__init__, built))
    config, report = at.autotune(_config(compile=True), 3, planned_steps=100,
                                 fixed=frozenset({"compile"}))
    assert built and not any(built) and config.compile is True
    assert report["knobs"]["compile"]["reason"].startswith("set by the user")


def test_a_process_narrowed_to_fewer_cpus_races_and_keys_by_those(monkeypatch):
    """Under taskset or a cpuset the autotuner raced thread counts it could not run and reused
    the unrestricted machine's choice: both followed os.cpu_count()."""
    at.machine_key.cache_clear()
    whole = at.machine_key()
    monkeypatch.setattr(at, "usable_cpus", lambda: 1)
    at.machine_key.cache_clear()
    try:
        assert at.thread_candidates() == [1]
        assert at.machine_key() != whole
    finally:
        at.machine_key.cache_clear()


def test_the_machine_key_follows_the_kernels_in_effect_whichever_variable_capped_them(
        tmp_path):
    """oneDNN also reads DNNL_MAX_CPU_ISA: capped that way, bf16 ran 6x slower, and a bf16
    choice cached uncapped was reused."""
    code = "from modules.autotune import machine_key; print(machine_key())"
    keys = {}
    for name, env in (("plain", {}), ("dnnl", {"DNNL_MAX_CPU_ISA": "AVX2"}),
                      ("onednn", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
                      # a thread count left unmeasured was reused under another OMP_NUM_THREADS
                      ("threads", {"OMP_NUM_THREADS": "1"})):
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith(("ONEDNN_", "DNNL_", "ATEN_CPU_"))
                 and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        keys[name] = out.stdout.strip()
    assert len(set(keys.values())) == 4, keys


def test_a_cache_that_cannot_be_parsed_or_written_costs_a_measurement_only(tmp_path, caplog):
    cache = tmp_path / "autotune_cache.json"
    cache.write_text('{"torn')
    _, report = at.autotune(_config(), 3, planned_steps=10, cache_path=cache)
    assert "reused_from" not in report
    assert (tmp_path / "autotune_cache.json.unreadable").read_text() == '{"torn'  # kept aside
    assert "kept aside" in caplog.text
    at._RESULTS.clear()
    folder = tmp_path / "is_a_folder.json"
    folder.mkdir()  # atomic_write_text raises UserError here, as for a read-only folder
    _, report = at.autotune(_config(), 3, planned_steps=10, cache_path=folder)
    assert report["knobs"] and "could not write" in caplog.text


def test_a_cache_entry_of_another_shape_is_measured_again(tmp_path):
    cache = tmp_path / "autotune_cache.json"
    key = at.speed_key(_config(), 3)
    good = {"knobs": {"amp": {"choice": "off", "img_s": {}, "reason": "r"}},
            "compute_img_s": 100.0, "planned_steps": 10}
    for config, report in ((_config().to_dict(), {**good, "knobs": "x"}),
                           (_config().to_dict(), {**good, "knobs": {"amp": "bf16"}}),
                           (_config().to_dict(), {k: v for k, v in good.items() if k != "knobs"}),
                           (_config().to_dict(), {**good, "compute_img_s": "fast"}),
                           ({**_config().to_dict(), "channels_last": "no"}, good)):
        cache.write_text(json.dumps({at.machine_key(): {key: {"config": config,
                                                              "report": report}}}))
        at._RESULTS.clear()
        _, found = at.autotune(_config(), 3, planned_steps=10, cache_path=cache)
        assert "reused_from" not in found, report
    cache.write_text(json.dumps({at.machine_key(): {key: {"config": _config().to_dict(),
                                                          "report": good}}}))
    at._RESULTS.clear()
    assert "reused_from" in at.autotune(_config(), 3, planned_steps=10, cache_path=cache)[1]


def test_the_worker_count_is_timed_past_the_batches_prefetched_meanwhile():
    """Four workers hand over their prefetched batches at once: timed from the first batch,
    they looked 5x faster than they decode."""
    import time

    class Prefetched:
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            yield torch.zeros(10, 1), torch.zeros(10)
            for _ in range(2 * self.n):  # ready at once
                yield torch.zeros(10, 1), torch.zeros(10)
            while True:  # then each worker's pace: n x 100 img/s
                time.sleep(0.1 / max(1, self.n))
                yield torch.zeros(10, 1), torch.zeros(10)

    n, entry = at.tune_workers(Prefetched, compute_img_s=500.0, candidates=[0, 4, 8], batches=4)
    assert entry["img_s"]["4"] < 500 <= entry["img_s"]["8"] and n == 8


def test_the_compile_child_ends_when_its_parent_is_killed(tmp_path):
    """SIGTERM or a restarted kernel runs no finally in the parent: the child, in a session of
    its own, went on compiling at 100% of a core."""
    import signal
    import time
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
        from modules import deadline
        from test_autotune import _never_answers
        deadline.run_with_deadline(_never_answers, (300,), 300)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        child = None
        for _ in range(600):
            found = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True)
            if found.stdout.strip():
                child = int(found.stdout.split()[0])
                break
            time.sleep(0.1)
        assert child is not None
        time.sleep(1.0)  # its watch has started
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        for _ in range(100):
            if not Path(f"/proc/{child}").exists() or \
                    Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the child outlived its parent")
    finally:
        parent.kill()


def test_a_child_race_lost_by_compile_keeps_this_process_s_own_speed(monkeypatch):
    """Raced in a child, compile lost against the child's eager figure: the figure later knobs
    and the summary read stays this process's own measure, not the child's (slower, cold)."""
    monkeypatch.setattr(at, "COMPILE_WARMUP_FLOOR_S", 1.0)
    monkeypatch.setattr(at, "_race_compile_with_deadline", lambda config, n, deadline_s: {
        "img_s": (600.0, 610.0), "warmup_s": 5.0})
    current = {"probe": object(), "img_s": 800.0}
    config, entry = at._tune_compile(_config(), 3, current, planned_steps=None, deadline_s=30.0)
    assert config.compile is False and "not faster" in entry["reason"]
    assert current["img_s"] == 800.0 and entry["img_s"] == {"false": 600.0, "true": 610.0}
