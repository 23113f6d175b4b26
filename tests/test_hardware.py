"""The memory probe: None on CPU; on a GPU a batch that fits, from two probes."""
import pytest
import torch

from modules.config import TrainConfig
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
