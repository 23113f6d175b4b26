"""TrainConfig checks its values up front and names the bad one."""
import dataclasses

import numpy as np
import pytest
import torch

from modules.config import TrainConfig, UserError


@pytest.mark.parametrize("field, value", [
    ("lr", -1e-3), ("lr", 0.0), ("lr", float("nan")), ("batch_size", 0), ("epochs", -1),
    ("image_size", 8), ("model", "vgg99"), ("optimizer", "lion"), ("amp", "fp8"),
    ("grad_accum_steps", 0), ("max_grad_norm", 0.0), ("weight_decay", -1.0),
    ("num_workers", -2), ("batch_size", 2.5), ("batch_size", True),
])
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(UserError, match=field):
        TrainConfig(**{field: value})


def test_variants_come_from_replace_and_stay_checked():
    base = TrainConfig()
    assert dataclasses.replace(base, batch_size=64, grad_accum_steps=2).effective_batch_size == 128
    with pytest.raises(UserError):
        dataclasses.replace(base, lr=-1)


def test_worker_options_need_workers():
    with pytest.raises(UserError, match="prefetch_factor needs num_workers"):
        TrainConfig(prefetch_factor=2)


def test_a_tuning_trial_runs_without_cudnns_algorithm_search_or_early_stopping():
    base = TrainConfig(cudnn_benchmark=True, early_stopping_patience=2)
    trial = base.as_trial(image_size=64)
    assert (trial.cudnn_benchmark, trial.early_stopping_patience, trial.image_size) == \
        (False, None, 64)
    assert dataclasses.replace(trial, cudnn_benchmark=True, early_stopping_patience=2) == \
        dataclasses.replace(base, image_size=64)
    with pytest.raises(UserError):
        base.as_trial(lr=0)


def test_learning_settings_leave_out_only_the_speed_knobs():
    base = TrainConfig()
    assert base.learning_settings() == dataclasses.replace(
        base, amp="bf16", channels_last=True, dropout_impl="bytemask", num_workers=2).learning_settings()
    for change in ({"lr": 0.01}, {"batch_size": 64}, {"image_size": 64}, {"epochs": 3}):
        assert dataclasses.replace(base, **change).learning_settings() != base.learning_settings()


def test_every_field_is_placed_as_speed_learning_or_both():
    """The autotuner keeps a speed measured under other LEARNING_ONLY values, and a trial's
    weights continue under other SPEED_ONLY values: a field added to TrainConfig and to
    neither list is taken to change both, which must be said here, not left to chance."""
    from modules.config import LEARNING_ONLY, SPEED_ONLY
    both = {"model", "image_size", "batch_size", "grad_accum_steps", "optimizer",
            "max_grad_norm", "device"}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not SPEED_ONLY & LEARNING_ONLY and not both & (SPEED_ONLY | LEARNING_ONLY)
    assert fields == SPEED_ONLY | LEARNING_ONLY | both


def test_numpy_values_and_paths_are_kept_as_builtin_types_a_checkpoint_reads_back(tmp_path):
    # a checkpoint holds the config, read back with torch.load(weights_only=True)
    config = TrainConfig(lr=np.logspace(-3, -2, 2)[0], batch_size=np.int64(8),
                         model=np.str_("resnet18"), weights=tmp_path / "start.pt")
    assert config.to_dict() == {**TrainConfig().to_dict(), "lr": 1e-3, "batch_size": 8,
                                "model": "resnet18", "weights": str(tmp_path / "start.pt")}
    torch.save(config.to_dict(), tmp_path / "config.pt")
    assert torch.load(tmp_path / "config.pt", weights_only=True) == config.to_dict()


@pytest.mark.parametrize("field, value", [
    ("momentum", "0.9"), ("momentum", None), ("weights", 3), ("weights", b"w.pt"),
    ("channels_last", np.bool_(True)), ("cpu_threads", [2]),
])
def test_values_of_a_wrong_type_are_refused_by_name(field, value):
    with pytest.raises(UserError, match=field):
        TrainConfig(**{field: value})


def test_a_quoted_error_cut_short_says_so():
    """The offline Kaggle error ended mid-word ("... /v1/datasets.Da"), as if that were all."""
    from modules.config import first_line
    assert first_line(ValueError("x" * 200), 20) == "x" * 17 + "..."
    assert first_line(ValueError("\n  short\nmore"), 20) == "short"
    assert first_line(ValueError("")) == "ValueError"
