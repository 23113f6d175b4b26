"""The memory probe: None on CPU; on a GPU a batch that fits, from two probes."""
from types import SimpleNamespace

import pytest
import torch

import modules.hardware
from modules.config import TrainConfig, UserError
from modules.hardware import max_batch_size, step_peak_bytes

CONFIG = TrainConfig(model="squeezenet1_1", image_size=64, amp="auto", channels_last=True)


def test_cpu_has_no_memory_bound():
    assert max_batch_size(CONFIG, 6, torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_predicts_a_batch_that_fits():
    device = torch.device("cuda")
    small = step_peak_bytes(CONFIG, 6, 4, device)
    assert step_peak_bytes(CONFIG, 6, 16, device) > small
    budget = 0.05 * torch.cuda.get_device_properties(device).total_memory
    largest = max_batch_size(CONFIG, 6, device, margin=0.05)
    assert largest >= 16
    assert step_peak_bytes(CONFIG, 6, largest, device) <= budget * 1.1
    assert max_batch_size(CONFIG, 6, device, upto=32, margin=0.05) <= 32
    # the probes run without cuDNN's algorithm search and leave the process as it was
    for searching in (True, False):
        torch.backends.cudnn.benchmark = searching
        max_batch_size(CONFIG, 6, device, upto=32, margin=0.05)
        assert torch.backends.cudnn.benchmark is searching


def test_a_probe_that_runs_out_of_memory_ends_in_one_line_or_a_smaller_batch(monkeypatch):
    """A size too large for the GPU: the first probes' out-of-memory errors are the user's to
    fix (one line naming --image-size) or bound the batch, not a traceback."""
    fits_up_to = {"n": 0}

    def probe(config, num_classes, batch_size, device):
        if batch_size > fits_up_to["n"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1000 * batch_size
    released = []
    monkeypatch.setattr(modules.hardware, "step_peak_bytes", probe)
    monkeypatch.setattr(modules.hardware, "release", released.append)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 16 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=16 * 2**30))
    cuda = torch.device("cuda")
    with pytest.raises(UserError, match=r"1 image at 64 px does not fit .*1024 MB free of "
                                        r"16384 MB.*--image-size"):
        max_batch_size(CONFIG, 6, cuda)
    assert len(released) == 3  # 4, 2 and 1 did not fit: each one's memory handed back
    fits_up_to["n"] = 4  # 16 does not fit: the search and autotune stay at 4
    assert max_batch_size(CONFIG, 6, cuda) == 4
    assert max_batch_size(CONFIG, 6, cuda, upto=2) == 2
    # never a probe past `upto`, and the largest that fits below a probe that did not
    fits_up_to["n"] = 10
    assert max_batch_size(CONFIG, 6, cuda, upto=8) == 8  # 16 was probed: 4 came back
    assert max_batch_size(CONFIG, 6, cuda) == 10
    fits_up_to["n"] = 2
    assert max_batch_size(CONFIG, 6, cuda, upto=3) == 2  # 3 did not fit, 2 does


def test_a_third_probe_that_overshoots_refits_the_line_with_its_fixed_part(monkeypatch):
    """1 GiB fixed, 10 MiB an image, and 4 GiB of workspace above 16 images: scaling the
    batch by the overshoot kept the fixed part's share over the budget (920, 13.98 GiB of a
    12.8 GiB budget)."""
    def peak(batch_size):
        return 2**30 + batch_size * 10 * 2**20 + (4 * 2**30 if batch_size > 16 else 0)
    monkeypatch.setattr(modules.hardware, "step_peak_bytes",
                        lambda config, num_classes, batch_size, device: peak(batch_size))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=16 * 2**30))
    fits = max_batch_size(CONFIG, 6, torch.device("cuda"), margin=0.8)
    assert peak(fits) <= 0.8 * 16 * 2**30 and fits > 16


@pytest.mark.parametrize("fixed_mb, per_image_mb", [(100, 2000), (9000, 500), (500, 20)])
def test_a_batch_found_by_bisection_also_keeps_to_the_margin(monkeypatch, fixed_mb,
                                                             per_image_mb):
    """The GPU has 16000 MB; steps over it run out of memory. A step that fits the GPU but
    not 80% of it (the rest is planned for the decoded-image cache) is too large: the
    bisection after a probe that ran out of memory returned 7 images (88%) and 14 (100%)."""
    mb = 2**20

    def step_peak(config, num_classes, batch_size, device):
        peak = (fixed_mb + per_image_mb * batch_size) * mb
        if peak > 16000 * mb:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return peak
    monkeypatch.setattr(modules.hardware, "step_peak_bytes", step_peak)
    monkeypatch.setattr(modules.hardware, "release", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=16000 * mb))
    fits = max_batch_size(CONFIG, 6, torch.device("cuda"), margin=0.8)
    assert fixed_mb + per_image_mb * fits <= 0.8 * 16000 < fixed_mb + per_image_mb * (fits + 1)


def test_a_single_image_over_the_margin_still_trains_with_a_warning(monkeypatch, caplog):
    """1 image takes 90% of the GPU: it fits, so the batch is 1, and the log says the cache
    has little room."""
    monkeypatch.setattr(modules.hardware, "step_peak_bytes",
                        lambda config, num_classes, batch_size, device: (
                            900 * batch_size if batch_size == 1 else
                            (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("CUDA oom"))))
    monkeypatch.setattr(modules.hardware, "release", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=1000))
    with caplog.at_level("WARNING", logger="modules.hardware"):
        assert max_batch_size(CONFIG, 6, torch.device("cuda"), margin=0.8) == 1
    assert "a step of 1 image takes more than 80% of the GPU" in caplog.text


def test_the_search_reads_its_batch_bound_from_the_autotuners_probe(tmp_path, monkeypatch):
    """The hpo scenario's autotune probes memory up to the search's largest batch, so the
    search takes its bound from that probe instead of probing the same size again (three
    more fresh models' first steps, outside the measuring budget)."""
    import pipeline
    import scenario
    from modules import autotune
    from optuna_optimizer import BATCH_SIZES
    from conftest import Recorded, make_folder, record_tuner
    probes = []

    def step_peak(config, num_classes, batch_size, device):
        probes.append(batch_size)
        return 2**30 + batch_size * 40 * 2**20
    monkeypatch.setattr(modules.hardware, "step_peak_bytes", step_peak)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=16 * 2**30))
    cuda = torch.device("cuda")
    config = TrainConfig(image_size=64, batch_size=64, weights="none")
    fitted, knob = autotune._fit_batch(config, 6, cuda)
    assert (fitted.batch_size, fitted.grad_accum_steps) == (64, 1) and len(probes) == 3
    findings = {"image_size": 64, "knobs": {"batch_size": knob}}
    probed = scenario.probed_fit(findings, config)
    assert probed == max_batch_size(config, 6, cuda, upto=max(BATCH_SIZES)) == 256
    # not when the probe stopped short of the search's largest batch (an older choice), nor
    # at another size
    assert scenario.probed_fit({**findings, "knobs": {"batch_size": {
        **knob, "probed_upto": 64}}}, config) is None
    assert scenario.probed_fit({**findings, "image_size": 48}, config) is None
    assert scenario.probed_fit({"knobs": {"batch_size": {"choice": 32}}}, config) is None

    def no_probe(*a, **k):
        raise AssertionError("probed again")
    seen = record_tuner(monkeypatch)
    monkeypatch.setattr(scenario, "max_batch_size", no_probe)
    args = pipeline.parse_args(["--output-dir", str(tmp_path)])
    index = pipeline.load_data(pipeline.parse_args(["--data-dir", str(make_folder(
        tmp_path / "d"))]), tmp_path)
    with pytest.raises(Recorded):
        scenario.tune_hyperparameters(config, args, index, tmp_path, torch.device("cpu"),
                                      probed=probed)
    assert seen["max_batch_size"] == 256


def test_the_fp16_probe_step_allocates_the_optimizer_state_it_counts(monkeypatch):
    """At GradScaler's default scale (65536) SqueezeNet's first fp16 step from random weights
    overflowed and was skipped, so the AdamW state the probe means to count was never made.
    Run on the CPU: the GPU's fp16 decision and a CPU scaler, the CUDA memory calls stubbed."""
    made = {}
    real_optimizer = modules.hardware.make_optimizer

    def optimizer(model, config, device):
        made["optimizer"] = real_optimizer(model, config, device)
        return made["optimizer"]

    class CpuScaler(torch.amp.GradScaler):
        def __init__(self, device, **kwargs):
            super().__init__("cpu", **kwargs)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 0)
    monkeypatch.setattr(modules.hardware, "autocast_dtype", lambda amp, device: torch.float16)
    monkeypatch.setattr(modules.hardware, "make_optimizer", optimizer)
    monkeypatch.setattr(torch.amp, "GradScaler", CpuScaler)
    torch.manual_seed(0)
    step_peak_bytes(CONFIG, 6, 4, torch.device("cpu"))
    params = [p for group in made["optimizer"].param_groups for p in group["params"]]
    assert len(made["optimizer"].state) == len(params)


def test_a_third_probe_out_of_memory_bisects_to_a_batch_that_fits(monkeypatch):
    """500 MB fixed and 50 MB an image on a 15,800 MB GPU, out of memory from 100 images
    (a workspace the line through 4 and 16 does not see): halving the line's 231 gave 115,
    which does not fit either."""
    mb = 2**20

    def step_peak(config, num_classes, batch_size, device):
        if batch_size >= 100:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return (500 + 50 * batch_size) * mb
    monkeypatch.setattr(modules.hardware, "step_peak_bytes", step_peak)
    monkeypatch.setattr(modules.hardware, "release", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=15800 * mb))
    assert max_batch_size(CONFIG, 6, torch.device("cuda"), margin=0.8) == 99
