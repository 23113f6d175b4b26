"""A function run in a fresh Python process under a wall-clock deadline, killed with every
process it started when it has not answered by then: how the autotuner tries torch.compile,
whose warm-up can take minutes, without waiting for it (docs/speed.md)."""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable


def run_with_deadline(target: Callable[..., None], args: tuple, deadline_s: float
                      ) -> tuple[bool, Any]:
    """Run target(*args, conn) in a fresh Python process, which answers with conn.send().
    (True, its answer), or (False, None) when it has not answered within deadline_s seconds:
    then it is killed, with any process it started (a compiler's workers).

    Not multiprocessing: fork would copy this process's thread pools, and spawn runs the
    parent's __main__ file again first, which for a script that calls pipeline.run without
    an `if __name__ == "__main__"` guard starts a second run. The child imports only
    target's module."""
    if target.__module__ == "__main__":
        raise ValueError("run_with_deadline needs a target a fresh process can import")
    with tempfile.TemporaryDirectory(prefix="autotune-") as tmp:
        job, answer = Path(tmp) / "job.pkl", Path(tmp) / "answer.pkl"
        job.write_bytes(pickle.dumps((target.__module__, target.__qualname__, args, str(answer),
                                      os.getpid())))
        path = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        # This project first, before the working directory that `-c` puts first: a `modules`
        # package of the user's there must not stand in for ours.
        root = str(Path(__file__).resolve().parents[1])
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[2]); "
             "from modules.deadline import _child_main; _child_main(sys.argv[1])", str(job), root],
            env={**os.environ, "PYTHONPATH": path}, cwd=os.getcwd(),
            start_new_session=os.name == "posix")
        ends = time.perf_counter() + max(0.0, deadline_s)
        try:
            while not answer.exists() and proc.poll() is None and time.perf_counter() < ends:
                time.sleep(0.05)
            if answer.exists():
                return True, pickle.loads(answer.read_bytes())
            if proc.poll() is not None:  # it died without answering
                return True, {"error": f"the measuring process died (exit code {proc.returncode})"}
            return False, None
        finally:
            _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    # The group even when its leader has exited: a child that crashed (a segfault, the OOM
    # killer) leaves the compiler workers it started, whose watcher died with it.
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and its workers
        elif proc.poll() is None:
            proc.kill()
    except OSError:  # gone meanwhile
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


class _Answer:
    """The child's end of run_with_deadline: send() writes the answer where the parent looks."""

    def __init__(self, path: str):
        self.path = Path(path)

    def send(self, value: Any) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(value))
        partial.replace(self.path)  # whole, or not there


def _child_main(job: str) -> None:
    module, name, args, answer, parent = pickle.loads(Path(job).read_bytes())
    _exit_with_parent(parent, Path(job).parent)
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    target(*args, _Answer(answer))


def _exit_with_parent(parent: int, folder: Path) -> None:
    """In the child: end, removing the job's folder, once the parent (its pid, which may have
    gone while this process started) has gone. A parent killed by SIGTERM or SIGKILL (a
    notebook kernel restarted) runs no finally to kill it, and a compile left running holds
    the cores, or the GPU, for minutes."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)
        if os.name == "posix":  # its own session: the compiler's workers too
            with contextlib.suppress(OSError):
                os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
