"""torchrun with two CPU processes on gloo: data-parallel training and tuning, sharded data,
outputs from rank 0."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_module, make_folder, run_path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "pipeline.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_two_processes_train_one_model_and_run_all_three_scenarios(tmp_path):
    """Two processes train one model: one set of results, checkpoints, TensorBoard events and
    logs. Resolution and hpo tune data-parallel: rank 0 measures the speed knobs, runs the
    study and decides where a trial stops, every trial trains on both ranks, and one set of
    results and logs comes out.
    (One launch for both: each torchrun start costs three Python processes importing torch.)"""
    data = make_folder(tmp_path / "d", n_train=16, n_test=4)
    out = tmp_path / "out"
    proc = torchrun("--data-dir", str(data), "--epochs", "2", "--image-size", "32",
                    "--resolutions", "24,32", "--n-trials", "2", "--batch-size", "4",
                    "--weights", "none", "--no-progress", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[:3000] + "\n...\n" + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline", "resolution", "hpo"]
    assert all(r["settings"]["world_size"] == 2 for r in rows)
    assert all(r["settings"]["global_batch_size"] == 2 * r["settings"]["effective_batch_size"]
               for r in rows)
    # the baseline: one model trained by both processes, its outputs written once
    assert len(rows[0]["history"]) == 2 and 0 <= rows[0]["test_acc"] <= 1
    assert (run_path(out) / "baseline.pt").exists() and (out / "d_model.pt").exists()
    assert len(list((run_path(out, "runs") / "baseline").glob("events.out.tfevents.*"))) == 1
    # one set of logs: rank 0's (rank 1 logging too would double every line)
    for name in ("baseline", "resolution"):
        assert proc.stderr.count(f"info: == scenario {name}:") == 1, name
    # hpo's final run is the resolution final when it would learn the same (same_final)
    assert proc.stderr.count("info: == scenario hpo:") == (0 if rows[2].get("final_from") else 1)
    baseline_logs = proc.stderr.split("info: == scenario baseline:")[1].split("info: == ")[0]
    assert baseline_logs.count("info: epoch 2/2") == 1
    # the tuned scenarios
    # 24 px's 4 epochs are judged after 2 (stopped there or not, as rank 0 decides for both)
    assert {t["image_size"] for t in rows[1]["resolution_trials"]} == {24, 32}
    assert rows[2]["hpo"]["n_trials"] == 2
    threads = rows[1]["autotune"]["knobs"]["cpu_threads"]
    assert "torchrun" in threads["reason"]
    assert proc.stderr.count("autotune: measuring the speed knobs") == 1  # rank 0's alone
    assert proc.stderr.count("trial 1 ") == 1  # one study, on rank 0
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    """One process's training over whole batches, and two ranks' over halves of them, each
    without (case `none`) and with rank 1 running out of memory (case `1`): one torchrun launch
    serves both tests below. The one process, the same for both, is this one (never part of a
    process group): a Python process of its own would spend seconds importing torch for a
    training of a fraction of a second."""
    tmp = tmp_path_factory.mktemp("ddp")
    script = ROOT / "tests" / "helpers" / "ddp_same_as_one_process.py"
    helper = load_module(script)
    assert not torch.distributed.is_initialized()
    with torch.random.fork_rng():  # leaves this process's random stream as it was
        helper.train_case(str(tmp / "one"), 8, "none")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script), str(tmp / "two"), "4", "none", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    return tmp


def _two_ranks_against_one(runs: Path, case: str) -> list[dict]:
    """Both ranks' saved weights in `case`, after checking they equal each other and one
    process's."""
    single = torch.load(runs / "one.none.rank0.pt")
    ranks = [torch.load(runs / f"two.{case}.rank{r}.pt") for r in (0, 1)]
    for name, value in single["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        assert torch.allclose(ranks[0]["weights"][name], value, atol=1e-5), name
    assert ranks[0]["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert ranks[1]["val_loss"] == ranks[0]["val_loss"]
    return ranks


def test_data_parallel_training_matches_one_process_over_the_same_global_batch(ddp_runs):
    """Each rank trains on its half of every global batch, with gradient accumulation (averaged
    once per optimizer step) and sharded evaluation: the ranks end with identical weights, equal
    to one process's over the whole batches. Without gradient averaging the ranks would part
    ways; without the summed evaluation the validation losses would differ."""
    ranks = _two_ranks_against_one(ddp_runs, "none")
    assert [r["oom_recoveries"] for r in ranks] == [0, 0]


def test_one_rank_out_of_memory_recovers_and_the_ranks_stay_in_step(ddp_runs):
    """Rank 1 alone runs out of memory mid-step: it replays its micro-batches in halves, the
    other rank waits at the gradient average, and both still end as one process would."""
    ranks = _two_ranks_against_one(ddp_runs, "1")
    assert [r["oom_recoveries"] for r in ranks] == [0, 1]


def _broadcast_from_rank_0(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    from modules import distributed
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(rank)  # each rank starts elsewhere
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))
    model.to(memory_format=torch.channels_last)
    model[1].running_mean.fill_(rank + 1.0)
    model[1].num_batches_tracked.fill_(rank + 5)
    distributed.broadcast_state(model, buffers_only=True)
    buffers_only = {k: v.clone() for k, v in model.state_dict().items()}
    distributed.broadcast_state(model)
    torch.save({"buffers_only": buffers_only, "all": model.state_dict(),
                "channels_last": model[0].weight.is_contiguous(memory_format=torch.channels_last)},
               f"{out}.{rank}")
    dist.destroy_process_group()


def test_broadcast_state_gives_every_rank_rank_0s_tensors(tmp_path):
    """Grouped in one broadcast per dtype: BatchNorm's float statistics and integer counter,
    and channels_last weights, arrive as rank 0 has them."""
    import torch.multiprocessing as mp
    out = str(tmp_path / "state")
    mp.spawn(_broadcast_from_rank_0, args=(str(tmp_path / "init"), out), nprocs=2)
    zero, one = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert one["buffers_only"]["1.running_mean"].tolist() == [1.0] * 4
    assert one["buffers_only"]["1.num_batches_tracked"].item() == 5
    assert not torch.equal(one["buffers_only"]["0.weight"], zero["buffers_only"]["0.weight"])
    for key, value in zero["all"].items():
        assert torch.equal(one["all"][key], value), key
    assert one["channels_last"] and zero["channels_last"]


def test_a_folder_another_run_writes_to_stops_every_rank_in_one_line(tmp_path):
    """Rank 0 holds the output dir's lock under torchrun; when another run holds it, every
    rank stops with the same line, none waiting at a collective for a rank 0 that has left."""
    from modules.files import folder_lock
    data = make_folder(tmp_path / "d", n_train=8, n_test=2)
    out = tmp_path / "out"
    out.mkdir()
    with folder_lock(out):  # another run, writing there
        proc = torchrun("--data-dir", str(data), "--scenarios", "baseline", "--epochs", "1",
                        "--image-size", "32", "--weights", "none", "--no-progress",
                        "--output-dir", str(out))
    assert proc.returncode != 0
    assert proc.stderr.count("error: another run is writing to") == 2, proc.stderr[-3000:]
    assert not (out / "results.json").exists()


def _draws_after_prepare(rank: int, init_file: str, data: str, out: str) -> None:
    import torch.distributed as dist

    from modules.config import TrainConfig
    from modules.dataset import index_dataset
    from modules.trainer import prepare
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    config = TrainConfig(weights="none", image_size=32, batch_size=4, device="cpu", seed=3)
    model, *_ = prepare(index_dataset(data), config)
    torch.save({"draws": torch.rand(4), "weights": model.state_dict()}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_each_rank_draws_its_own_augmentation_and_dropout(tmp_path):
    """Under torchrun the ranks' random streams differ after prepare() (the streaming path's
    crops and flips, dropout masks, worker seeds), where the same seed gave every rank the
    same draws, position by position; rank 0's are one process's. The weights are drawn
    alike (and broadcast from rank 0 when training starts)."""
    import torch.multiprocessing as mp

    from modules.config import TrainConfig
    from modules.dataset import index_dataset
    from modules.trainer import prepare
    data = make_folder(tmp_path / "data", n_train=4, n_test=2)
    out = str(tmp_path / "draws")
    mp.spawn(_draws_after_prepare, args=(str(tmp_path / "init"), str(data), out), nprocs=2)
    zero, one = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert not torch.equal(zero["draws"], one["draws"])
    for key, value in zero["weights"].items():
        assert torch.equal(one["weights"][key], value), key
    with torch.random.fork_rng():
        prepare(index_dataset(data), TrainConfig(weights="none", image_size=32, batch_size=4,
                                                 device="cpu", seed=3))
        assert torch.equal(torch.rand(4), zero["draws"])


def test_a_users_error_on_rank_0_alone_stops_every_rank_in_one_line(tmp_path):
    """Rank 0 runs the study alone: when it refuses the study (here one of other data), the
    other rank, waiting for the first trial, printed a gloo traceback ("Connection closed by
    peer") where rank 0 printed one line."""
    import optuna
    data = make_folder(tmp_path / "d", n_train=8, n_test=2)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    study = optuna.create_study(storage=url, study_name="hpo-d", direction="maximize")
    study.set_user_attr("data_fingerprint", "other images")
    proc = torchrun("--data-dir", str(data), "--scenarios", "hpo", "--epochs", "1",
                    "--image-size", "32", "--weights", "none", "--no-progress", "--n-trials", "1",
                    "--no-autotune", "--storage", url, "--output-dir", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert proc.stderr.count("error: study 'hpo-d'") == 2, proc.stderr[-3000:]
    # torchrun's launcher prints its own summary of the exit codes; no rank a traceback
    assert "[rank1]" not in proc.stderr and "Connection closed" not in proc.stderr, \
        proc.stderr[-3000:]


def test_a_write_that_fails_on_rank_0_stops_the_others_in_one_line_too(tmp_path):
    """Rank 0 alone writes the outputs: a folder it cannot write stops it with one line, and
    the other rank at its next collective, where it printed gloo's traceback."""
    data = make_folder(tmp_path / "d", n_train=8, n_test=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "runs").write_text("")  # a file where the run's logs go
    proc = torchrun("--data-dir", str(data), "--scenarios", "baseline", "--epochs", "1",
                    "--image-size", "32", "--weights", "none", "--no-progress",
                    "--output-dir", str(out))
    assert proc.returncode != 0
    assert proc.stderr.count("error: cannot write") == 1, proc.stderr[-3000:]
    assert "error: rank 1: another process of this run stopped" in proc.stderr, \
        proc.stderr[-3000:]
    assert "[rank1]" not in proc.stderr and "Connection closed" not in proc.stderr, \
        proc.stderr[-3000:]


def _load_other_data(rank: int, init_file: str, folders: list[str], out: str) -> None:
    import torch.distributed as dist

    import scenario
    from modules.config import UserError
    from pipeline import parse_args
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    args = parse_args(["--data-dir", folders[rank], "--weights", "none", "--output-dir", out])
    try:
        scenario.load_data(args, Path(out))
        said = "loaded"
    except UserError as exc:
        said = str(exc)
    Path(f"{out}.{rank}").write_text(said)
    dist.destroy_process_group()


def test_ranks_that_read_different_data_stop_together_in_one_line(tmp_path):
    """Each machine reads its own copy of --data-dir: one with other images made the ranks'
    shards differ, and a collective failed on gloo's "Received data size doesn't match"."""
    import torch.multiprocessing as mp
    folders = [str(make_folder(tmp_path / "a", n_train=6, n_test=2)),
               str(make_folder(tmp_path / "b", n_train=9, n_test=2))]
    out = str(tmp_path / "out")
    mp.spawn(_load_other_data, args=(str(tmp_path / "init"), folders, out), nprocs=2)
    for rank in (0, 1):
        assert "read different images" in Path(f"{out}.{rank}").read_text()
    mp.spawn(_load_other_data, args=(str(tmp_path / "init2"), folders[:1] * 2, out), nprocs=2)
    assert Path(f"{out}.0").read_text() == Path(f"{out}.1").read_text() == "loaded"


def _resume_on_two_machines(rank: int, init_file: str, folder: str, out: str) -> None:
    import torch.distributed as dist
    from torch import nn

    from modules.checkpoints import CheckpointSaver, Progress
    from modules.config import TrainConfig
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    config = TrainConfig(weights="none", image_size=32, batch_size=4, device="cpu", epochs=3)

    def objects(seed: int):
        torch.manual_seed(seed)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        return model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False)
    # each rank's own disk: only rank 0 wrote a checkpoint, into its own folder
    path = f"{folder}/{rank}/baseline.pt"
    model, optimizer, scheduler, scaler = objects(0)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    progress = Progress(history=[{"epoch": 1, "val_acc": 0.5, "elapsed_s": 1.0}],
                        best={"acc": 0.5, "epoch": 1, "state": None})
    CheckpointSaver(path, config, 7).save(progress, False, model, optimizer, scheduler, scaler,
                                          {})
    dist.barrier()
    fresh = objects(rank + 10)  # each rank starts elsewhere
    restored = CheckpointSaver(path, config, 7).restore(*fresh)
    torch.save({"epoch": restored.resumed_from if restored else None,
                "weight": fresh[0].weight.detach().clone(),
                "momentum": fresh[1].state_dict()["state"][0]["momentum_buffer"],
                "lr": fresh[2].get_last_lr()}, f"{out}.{rank}")
    # both ranks done with the restore's collectives before either tears gloo down: one that
    # left first aborted the other at exit ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def test_a_resume_on_several_machines_continues_rank_0s_checkpoint_everywhere(tmp_path):
    """Only rank 0 writes checkpoints: another machine has none, and its rank started afresh
    while rank 0 resumed (its own optimizer state, then collectives out of step)."""
    import torch.multiprocessing as mp
    out = str(tmp_path / "state")
    mp.spawn(_resume_on_two_machines, args=(str(tmp_path / "init"), str(tmp_path), out),
             nprocs=2)
    assert not (tmp_path / "1" / "baseline.pt").exists()
    zero, one = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert zero["epoch"] == one["epoch"] == 1
    assert torch.equal(zero["weight"], one["weight"])
    assert torch.equal(zero["momentum"], one["momentum"]) and zero["lr"] == one["lr"]


def _nan_batches(rank: int, init_file: str, out: str, both: bool) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from modules.config import TrainConfig
    from modules.trainer import DivergedError, train
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 2, (32,))
    if rank == 1:
        x[9] = float("nan")  # batch 3 of the first window, each epoch
    if rank == 0 and both:
        x[1] = float("nan")  # batch 1 of the same window: another global batch
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 2))
    model.num_classes = 2
    config = TrainConfig(epochs=2, batch_size=4, grad_accum_steps=4, lr=0.01, optimizer="sgd",
                         scheduler="none", amp="off", device="cpu", progress=False, seed=0,
                         max_nonfinite_steps=3)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    try:
        result = train(model, loader, DataLoader(TensorDataset(x[:8], y[:8]), batch_size=4),
                       config)
        outcome = {"nonfinite_steps": result.nonfinite_steps, "epochs": len(result.history)}
    except DivergedError as exc:
        outcome = {"diverged": str(exc)}
    (Path(f"{out}.{rank}")).write_text(json.dumps(outcome))
    dist.destroy_process_group()


@pytest.mark.parametrize("both", [False, True])
def test_one_ranks_nan_batch_counts_once_on_every_rank(tmp_path, both):
    """A NaN in one batch of rank 1's window of 4 skips the window's update on both ranks, and
    both count one bad batch, as one process would: not the window's 4, which stopped the run
    as diverged after a single NaN (max_nonfinite_steps 3). NaNs in two batches of the window,
    one on each rank, are two bad global batches on both (the larger rank's count was 1)."""
    import torch.multiprocessing as mp
    out = str(tmp_path / "outcome")
    mp.spawn(_nan_batches, args=(str(tmp_path / "init"), out, both), nprocs=2)
    outcomes = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    assert outcomes == [{"nonfinite_steps": 4 if both else 2, "epochs": 2}] * 2, outcomes


def test_more_processes_than_gpus_stop_in_one_line_before_joining(monkeypatch):
    """The extra ones failed on "invalid device ordinal" with a traceback, and the others
    waited for them to join."""
    from modules import distributed
    from modules.config import UserError
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def join(*a, **k):
        raise AssertionError("joined the process group")
    monkeypatch.setattr(distributed.dist, "init_process_group", join)
    with pytest.raises(UserError, match="4 processes on this machine, which has 2 GPU.*"
                                        "--nproc-per-node 2"):
        distributed.init_from_env("cuda")


def test_too_few_training_images_for_the_processes_is_one_line(tmp_path, monkeypatch):
    """Two training images under two processes: each shard a batch of one, and BatchNorm's
    "Expected more than 1 value per channel" traceback on every rank."""
    import scenario
    from modules import distributed
    from modules.config import UserError
    from pipeline import parse_args
    data = make_folder(tmp_path / "d", n_train=3, n_test=1)
    args = parse_args(["--data-dir", str(data), "--weights", "none"])
    index = scenario.load_data(args, tmp_path / "out")
    monkeypatch.setattr(distributed, "world_size", lambda: len(index.train) // 2 + 1)
    monkeypatch.setattr(distributed, "same_on_every_rank", lambda value: True)
    monkeypatch.setattr(scenario, "on_main", lambda action: action())  # no process group here
    with pytest.raises(UserError, match=rf"^{len(index.train)} training images for "
                                        r"\d+ torchrun processes: .*\(--nproc-per-node\)"):
        scenario.load_data(args, tmp_path / "out")


def test_the_run_record_names_torchrun_as_its_command(monkeypatch):
    """run.json's command is what a --resume reruns: under torchrun it said `python
    pipeline.py ...`, which a checkpoint of two processes refuses."""
    import scenario
    from modules import distributed
    assert scenario.launcher() == ["python"]
    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert scenario.launcher() == ["torchrun", "--nnodes=2", "--nproc-per-node=2"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert scenario.launcher() == ["torchrun", "--standalone", "--nproc-per-node=4"]


def test_the_other_ranks_stop_with_rank_0s_whole_line(monkeypatch):
    """The other ranks printed rank 0's error cut at 120 characters, losing what it says to
    do at its end ("resume with the settings it started with ...")."""
    from modules import distributed
    sent = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "from_main", sent.append)
    message = ("cannot resume study 'hpo-d' in sqlite:///x.db: its trials trained processes=1, "
               "this run's would train processes=2 (resume with the settings it started with, "
               "or give this run its own study; nothing was deleted).")
    distributed.tell_the_others(distributed.UserError(message))
    with pytest.raises(distributed.UserError) as raised:
        distributed.expect(sent[0])
    assert str(raised.value) == message
