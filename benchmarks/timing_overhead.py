"""What the trainer's always-on step timing costs: the instrumentation of one step (timers and
record_function regions) measured alone, and a bare training step with and without it."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from modules.config import TrainConfig, UserError  # noqa: E402
from modules.device import resolve_device  # noqa: E402
from modules.models import build_model  # noqa: E402
from throughput import OneLineParser, at_least_1  # noqa: E402
from modules.device import REGIONS, region  # noqa: E402


def instrumentation(timing: dict) -> None:
    """Exactly the per-step bookkeeping modules/trainer.py adds around a step."""
    t0, c0 = time.perf_counter(), time.process_time()
    for name in REGIONS:
        with region(name):
            pass
    t1 = t2 = t3 = time.perf_counter()
    timing["data_wait_s"] += t1 - t0
    timing["h2d_s"] += t2 - t1
    timing["step_s"] += t3 - t0
    timing["cpu_s"] += time.process_time() - c0
    timing["steps"] += 1


def step(model, optimizer, x, y, timed: bool, timing: dict) -> None:
    if timed:
        instrumentation(timing)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = OneLineParser(description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--image-size", type=at_least_1, default=64)
    p.add_argument("--batch-size", type=at_least_1, default=32)
    p.add_argument("--rounds", type=at_least_1, default=30,
                   help="interleaved A/B pairs of steps")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    try:  # the model's limits, and a device that is not here, in one line
        TrainConfig(model="squeezenet1_1", image_size=args.image_size)
        resolve_device(args.device)
        if args.json:  # before the measuring, as the other benchmarks make theirs
            try:
                args.json.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserError(f"cannot make {exc.filename!r} ({exc.strerror})") from None
    except UserError as exc:
        p.exit(2, f"error: {exc}\n")
    device = torch.device(args.device)
    model = build_model("squeezenet1_1", 6).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 6, (args.batch_size,), device=device)
    timing = dict.fromkeys(("data_wait_s", "h2d_s", "step_s", "cpu_s", "steps"), 0.0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        instrumentation(timing)
    cost_us = 1e6 * (time.perf_counter() - start) / n

    for _ in range(5):  # warm-up
        step(model, optimizer, x, y, False, timing)
    times = {False: [], True: []}
    for _ in range(args.rounds):
        for timed in (False, True):  # interleaved, so drift hits both alike
            sync()
            t = time.perf_counter()
            step(model, optimizer, x, y, timed, timing)
            sync()
            times[timed].append(time.perf_counter() - t)
    bare_ms = 1000 * statistics.median(times[False])
    timed_ms = 1000 * statistics.median(times[True])
    result = {"device": str(device), "image_size": args.image_size, "batch_size": args.batch_size,
              "instrumentation_us_per_step": cost_us, "bare_step_ms": bare_ms,
              "timed_step_ms": timed_ms, "overhead_frac": cost_us / 1000 / bare_ms,
              "ab_ratio": timed_ms / bare_ms}
    print(f"instrumentation alone: {cost_us:.1f} us/step")
    print(f"median step: bare {bare_ms:.2f} ms, timed {timed_ms:.2f} ms "
          f"(A/B ratio {result['ab_ratio']:.3f}, noisy)")
    print(f"overhead: {100 * result['overhead_frac']:.3f}% of step time (target < 2%)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
