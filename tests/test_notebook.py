"""main_pipeline.ipynb: thin, self-sufficient in Colab, runnable headless, and showing what the
user came for (checked in a real browser)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import pipeline
from conftest import make_folder, run_path
from modules.config import UserError
from modules.utility import load_model

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "main_pipeline.ipynb"
# Command-line options the parameters cell spells differently from their upper-case name.
SPELLED = {"scenarios": ("RUN_BASELINE", "RUN_RESOLUTION_TUNING", "RUN_OPTUNA_HP_TUNING"),
           "profile": ("PERFORM_DETAILED_PROFILING",), "no_progress": ("SHOW_PROGRESS",),
           "local_dir": ("USE_DRIVE",)}
# The smallest run that still makes every chart: all three scenarios on a small image folder,
# two sizes, two trials.
TINY = {"QUICK": True, "EPOCHS": 2, "N_TRIALS": 2, "IMAGE_SIZE": 32, "RESOLUTIONS": "24",
        "OPEN_TENSORBOARD": False}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def cells():
    return json.loads(NOTEBOOK.read_text())["cells"]


def source(cell) -> str:
    return "".join(cell["source"])


def parameters_cell() -> str:
    tagged = [c for c in cells() if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1
    return source(tagged[0])


def printed(notebook: dict) -> str:
    """Everything the cells printed (stdout and stderr)."""
    return "".join("".join(o.get("text", "")) for c in notebook["cells"]
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def tracebacks(notebook: dict) -> list:
    """The error outputs that carry a traceback of more than one line."""
    return [o for c in notebook["cells"] for o in c.get("outputs", [])
            if o.get("output_type") == "error" and len(o.get("traceback", [])) > 1]


def test_notebook_is_thin_and_committed_without_outputs():
    code = [c for c in cells() if c["cell_type"] == "code"]
    assert all(not c["outputs"] and c["execution_count"] is None for c in code)
    lines = [line.lstrip() for c in code for line in source(c).splitlines()]
    assert not any(line.startswith(("def ", "class ")) for line in lines)


def test_parameters_cell_is_a_colab_form_with_every_command_line_option():
    text = parameters_cell()
    for action in pipeline.build_parser()._actions:
        if action.option_strings and action.dest != "help":
            for name in SPELLED.get(action.dest, (action.dest.upper(),)):
                assert f"\n{name} = " in f"\n{text}", f"--{action.dest} has no {name} parameter"
    assigned = [line for line in text.splitlines() if " = " in line and not line.startswith("#")]
    assert all("#@param" in line for line in assigned if not line.startswith("DRIVE_MOUNT"))


def test_notebook_asks_colab_for_a_gpu_runtime():
    meta = json.loads(NOTEBOOK.read_text())["metadata"]
    assert meta["accelerator"] == "GPU" and meta["colab"]["gpuType"]


def test_options_take_keywords_and_check_them_as_the_command_line_does():
    args = pipeline.options(quick=True, scenarios=["baseline", "hpo"], n_trials=None,
                            data_dir="", match_time=False, resolutions=[48, 64])
    assert (args.quick, args.scenarios, args.n_trials, args.match_time, args.resolutions) == \
        (True, ["baseline", "hpo"], None, False, [48, 64])
    assert args.command == ("python pipeline.py --quick --scenarios baseline,hpo "
                            "--no-match-time --resolutions 48,64")
    with pytest.raises(pipeline.UserError, match="n-trials"):
        pipeline.options(n_trials=0)
    with pytest.raises(pipeline.UserError, match="unknown option 'epoch'"):
        pipeline.options(epoch=3)
    # a word for a flag reads as said ("off" was a non-empty string: on), a value starting
    # with "-" stays a value, and the command line says so
    off = pipeline.options(quick="off", resume="no", channels_last="false")
    assert (off.quick, off.resume, off.channels_last) == (False, False, False)
    with pytest.raises(pipeline.UserError, match="channels_last='auto': give True or False"):
        pipeline.options(channels_last="auto")
    dashed = pipeline.options(output_dir="-out")
    assert dashed.output_dir == "-out" and dashed.command == "python pipeline.py --output-dir=-out"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook run headless as it is run locally: beside pipeline.py, on this machine."""
    papermill = pytest.importorskip("papermill")
    tmp = tmp_path_factory.mktemp("notebook")
    out = tmp / "out"
    data = make_folder(tmp / "colours", n_train=40, n_test=12)
    papermill.execute_notebook(str(NOTEBOOK), str(tmp / "executed.ipynb"), cwd=str(ROOT),
                               kernel_name="python3", progress_bar=False,
                               parameters={**TINY, "DATA_DIR": str(data), "OUTPUT_DIR": str(out)})
    return tmp / "executed.ipynb", out


def test_notebook_runs_headless_and_shows_every_result(executed):
    path, out = executed
    rows = json.loads((out / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline", "resolution", "hpo"]
    notebook = json.loads(path.read_text())
    text = printed(notebook)
    assert "python pipeline.py --scenarios baseline,resolution,hpo" in text
    assert "warning: running on the CPU" in text or "device: " in text
    # the estimate, a range where the tuners' early stops or the fill's whole epochs make one
    assert re.search(r"about [\d.]+(-[\d.]+)? (s|min) on cpu: baseline \d", text)
    assert "points against the baseline" in text and "hpo: " in text
    images = [o for c in notebook["cells"] for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    made = ["training_loss_comparison.png", "training_accuracy_comparison.png",
            "confusion_matrix.png", "sample_predictions.png", "resolution_tradeoff.png",
            "optuna_history.png", "step_time_breakdown.png"]
    assert all((out / name).exists() for name in made)
    assert len(images) >= len(made)
    assert any("table" in "".join(o.get("data", {}).get("text/html", ""))
               for c in notebook["cells"] for o in c.get("outputs", []))


def test_a_later_run_into_the_same_folder_shows_its_own_results(executed, tmp_path):
    """Baseline only, into the folder of a full run: no tuner chart of the earlier run shown as
    this run's, the saved model's run named, every column of the table shown."""
    papermill = pytest.importorskip("papermill")
    path, earlier = executed
    out = tmp_path / "out"
    shutil.copytree(earlier, out)
    before = json.loads((earlier / "results.json").read_text())
    papermill.execute_notebook(str(NOTEBOOK), str(tmp_path / "again.ipynb"), cwd=str(ROOT),
                               kernel_name="python3", progress_bar=False,
                               parameters={**TINY, "DATA_DIR": str(earlier.parent / "colours"),
                                           "OUTPUT_DIR": str(out), "RUN_RESOLUTION_TUNING": False,
                                           "RUN_OPTUNA_HP_TUNING": False})
    notebook = json.loads((tmp_path / "again.ipynb").read_text())
    text = printed(notebook)
    for chart in ("resolution_tradeoff.png", "optuna_history.png", "optuna_importance.png"):
        assert f"{chart}: not made by this run" in text
    rows = json.loads((out / "results.json").read_text())
    this_run = rows[-1]["run_id"]
    assert this_run != before[-1]["run_id"] and rows[-1]["scenario"] == "baseline"
    saved = load_model(out / "colours_model.pt").meta["extra"]
    assert ("from this run" in text) == (saved["run_id"] == this_run)
    assert f"from run {saved['run_id']}, another run" in text or saved["run_id"] == this_run
    tables = "".join("".join(o.get("data", {}).get("text/html", ""))
                     for c in notebook["cells"] for o in c.get("outputs", []))
    assert "Throughput (img/s)" in tables and "Step (ms)" in tables


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (.ci/run installs it)")
def test_executed_notebook_shows_the_table_charts_and_image_grid_in_a_browser(executed, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    exporter = pytest.importorskip("nbconvert").HTMLExporter(template_name="classic")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    from PIL import Image, ImageStat

    html, _ = exporter.from_notebook_node(nbformat.read(str(executed[0]), as_version=4))
    page_file = tmp_path / "executed.html"
    page_file.write_text(html)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(page_file.as_uri(), wait_until="load")
        table = page.locator("table.dataframe").first.bounding_box()
        images = [page.locator("img").nth(i) for i in range(page.locator("img").count())]
        boxes = [img.bounding_box() for img in images if img.evaluate("e => e.naturalWidth") > 0]
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        browser.close()
    shot = Image.open(tmp_path / "page.png").convert("RGB")

    def region(box):
        return shot.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["width"]),
                          int(box["y"] + box["height"])))

    assert table is not None and table["width"] > 400 and table["height"] > 60
    dark = sum(region(table).convert("L").histogram()[:100])
    assert dark > 500  # the table's text was drawn, not an empty frame
    assert len(boxes) >= 7  # loss, accuracy, confusion, predictions, trade-off, history, breakdown
    for box in boxes:
        assert box["width"] > 200 and box["height"] > 150
        assert max(ImageStat.Stat(region(box)).stddev) > 10  # drawn, not blank
    # The prediction grid: sixteen test images' worth of colours, drawn at a readable size.
    grid = max(boxes, key=lambda b: len(region(b).getcolors(maxcolors=1 << 22)))
    assert len(region(grid).reduce(2).getcolors(maxcolors=1 << 22)) > 2000
    assert grid["width"] > 600 and grid["height"] > 600


def test_a_mistake_in_the_parameters_is_one_line_without_a_traceback(tmp_path):
    papermill = pytest.importorskip("papermill")
    with pytest.raises(papermill.PapermillExecutionError):
        papermill.execute_notebook(
            str(NOTEBOOK), str(tmp_path / "executed.ipynb"), cwd=str(ROOT),
            kernel_name="python3", progress_bar=False,
            parameters={"RUN_BASELINE": False, "RUN_RESOLUTION_TUNING": False,
                        "RUN_OPTUNA_HP_TUNING": False, "OPEN_TENSORBOARD": False,
                        "OUTPUT_DIR": str(tmp_path / "out")})
    notebook = json.loads((tmp_path / "executed.ipynb").read_text())
    text = printed(notebook)
    assert "error: " in text and "tick RUN_BASELINE, RUN_RESOLUTION_TUNING or" in text
    assert "Traceback" not in text and not (tmp_path / "out").exists()
    # Google Drive asked for outside Colab
    with pytest.raises(papermill.PapermillExecutionError):
        papermill.execute_notebook(
            str(NOTEBOOK), str(tmp_path / "drive.ipynb"), cwd=str(ROOT), kernel_name="python3",
            progress_bar=False, parameters={"USE_DRIVE": True, "OPEN_TENSORBOARD": False,
                                            "OUTPUT_DIR": str(tmp_path / "out")})
    # one line, as the run's own errors: no SystemExit and "To exit: use 'exit'" warning
    text = printed(json.loads((tmp_path / "drive.ipynb").read_text()))
    assert "error: USE_DRIVE needs Google Colab (its Drive)" in text
    assert "Traceback" not in text and "SystemExit" not in text and "To exit" not in text


def test_drive_folders_are_checked_before_anything_is_written(tmp_path, monkeypatch):
    """The options cell, up to the options: in Colab, an OUTPUT_DIR or DATA_DIR on Drive with
    Drive not mounted, or USE_DRIVE with an OUTPUT_DIR of the machine, would keep the outputs
    where a disconnect loses them (or read an empty folder): one line, before any is made. A
    relative DATA_DIR is where the notebook started, not inside the clone."""
    cell = source(cells()[4])
    checks = cell[:cell.index("args = pipeline.options(")]
    mount = tmp_path / "drive"
    (tmp_path / "start" / "uploaded").mkdir(parents=True)

    def run(**params):
        names = {"IN_COLAB": True, "USE_DRIVE": False, "OUTPUT_DIR": "others", "DATA_DIR": "",
                 "WEIGHTS": "imagenet", "DRIVE_MOUNT": str(mount), "START": tmp_path / "start",
                 "Path": Path, **params}
        exec(checks, names)
        return names
    for params, said in (
            ({"OUTPUT_DIR": str(mount / "MyDrive" / "runs")}, "OUTPUT_DIR is on Google Drive"),
            ({"DATA_DIR": str(mount / "MyDrive" / "data")}, "DATA_DIR is on Google Drive"),
            ({"USE_DRIVE": True, "OUTPUT_DIR": "/content/results"},
             "USE_DRIVE keeps the outputs on Drive, but OUTPUT_DIR '/content/results'")):
        with pytest.raises(UserError, match=re.escape(said)):
            run(**params)
    assert not mount.exists()
    assert run(DATA_DIR="uploaded")["DATA_DIR"] == str(tmp_path / "start" / "uploaded")
    (tmp_path / "start" / "w.pt").write_bytes(b"")  # uploaded with the Files panel
    assert run(WEIGHTS="w.pt")["WEIGHTS"] == str(tmp_path / "start" / "w.pt")
    assert run(WEIGHTS="imagenet")["WEIGHTS"] == "imagenet"
    # Drive is mounted before a relative DATA_DIR is looked up: drive/MyDrive/photos, relative
    # to /content, was read inside the clone on the first Run all and found on the second
    import types
    colab = types.ModuleType("google.colab")
    colab.drive = types.SimpleNamespace(
        mount=lambda folder: (Path(folder) / "MyDrive" / "photos").mkdir(parents=True))
    try:
        import google  # noqa: F401  (a namespace package, there with protobuf)
    except ImportError:
        monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    inside = tmp_path / "start" / "drive"
    mounted = run(USE_DRIVE=True, DRIVE_MOUNT=str(inside), DATA_DIR="drive/MyDrive/photos")
    assert mounted["DATA_DIR"] == str(inside / "MyDrive" / "photos")
    assert mounted["OUTPUT_DIR"] == str(inside / "MyDrive" / "hwtrain" / "others")
    monkeypatch.undo()
    assert run(DATA_DIR="elsewhere")["DATA_DIR"] == "elsewhere"  # left to the run's own check
    (mount / "MyDrive").mkdir(parents=True)  # mounted by the user: the folders are Drive's
    assert run(OUTPUT_DIR=str(mount / "MyDrive" / "runs"))["OUTPUT_DIR"] == \
        str(mount / "MyDrive" / "runs")


def test_a_relative_output_dir_is_where_the_notebook_started(tmp_path, monkeypatch):
    """In Colab the set-up cell moves into the clone: a relative OUTPUT_DIR was made inside it,
    unlike DATA_DIR and WEIGHTS. drive/MyDrive/results (as DATA_DIR's drive/MyDrive/photos)
    was then a folder of the VM, lost with it, without a word, and the set-up cell's "delete
    its folder" advice deleted the outputs (others/) with the clone."""
    cell = source(cells()[4])
    checks = cell[:cell.index("args = pipeline.options(")]
    start, clone = tmp_path / "content", tmp_path / "content" / "hwtrain"
    clone.mkdir(parents=True)
    monkeypatch.chdir(clone)  # the set-up cell's %cd

    def run(**params):
        names = {"IN_COLAB": True, "USE_DRIVE": False, "OUTPUT_DIR": "others", "DATA_DIR": "",
                 "WEIGHTS": "imagenet", "DRIVE_MOUNT": str(start / "drive"), "START": start,
                 "Path": Path, **params}
        exec(checks, names)
        return names["OUTPUT_DIR"]
    assert run() == str(start / "others")
    with pytest.raises(UserError, match="OUTPUT_DIR is on Google Drive"):
        run(OUTPUT_DIR="drive/MyDrive/results")  # Drive not mounted: said, not made here
    (start / "drive" / "MyDrive").mkdir(parents=True)
    assert run(OUTPUT_DIR="drive/MyDrive/results") == str(start / "drive" / "MyDrive" / "results")
    assert run(OUTPUT_DIR="/elsewhere/out") == "/elsewhere/out"
    assert run(OUTPUT_DIR="") == ""  # left to the options' own one-line refusal


def kaggle_cell_with_fake_secrets(monkeypatch) -> tuple[str, dict[str, str]]:
    """The Kaggle cell's source, and the dict a fake google.colab.userdata reads secrets
    from (a name not in it raises SecretNotFoundError, as Colab's does)."""
    import types
    cell = next(source(c) for c in cells() if "KAGGLE_API_TOKEN" in source(c)
                and c["cell_type"] == "code")
    secrets: dict[str, str] = {}

    def get(name):
        if name not in secrets:
            raise type("SecretNotFoundError", (Exception,), {})(name)
        return secrets[name]
    colab = types.ModuleType("google.colab")
    colab.userdata = types.SimpleNamespace(get=get)
    try:
        import google  # noqa: F401  (a namespace package, there with protobuf)
    except ImportError:
        monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    return cell, secrets


def test_kaggle_secrets_reach_kagglehub_a_token_or_the_legacy_pair(monkeypatch, capsys):
    """The Kaggle cell copies Colab's secrets into the environment kagglehub reads: the API
    token Kaggle generates now, or the legacy username and key; it names the ones it could not
    read, and never prints a value."""
    cell, secrets = kaggle_cell_with_fake_secrets(monkeypatch)
    for given, said in (({"KAGGLE_API_TOKEN": "KGAT_secret"}, ""),
                        ({"KAGGLE_USERNAME": "me", "KAGGLE_KEY": "secret"}, ""),
                        ({"KAGGLE_KEY": "secret"}, "Colab secrets not read (KAGGLE_API_TOKEN: "
                                                   "SecretNotFoundError, KAGGLE_USERNAME: "
                                                   "SecretNotFoundError)")):
        for name in ("KAGGLE_API_TOKEN", "KAGGLE_USERNAME", "KAGGLE_KEY"):
            monkeypatch.delenv(name, raising=False)
        secrets.clear()
        secrets.update(given)
        exec(cell, {"DATASET": "intel", "DATA_DIR": "", "IN_COLAB": True})
        out = capsys.readouterr().out
        assert out.startswith(said) and "secret" not in out.replace("secrets", "")
        assert {k: os.environ[k] for k in given} == given
    # a secret fixed after a refused login (the cell run again in the same session) is read
    # again, and a pasted line break is dropped, as kagglehub drops it from one it reads
    secrets.update({"KAGGLE_API_TOKEN": "KGAT_fixed\n"})
    exec(cell, {"DATASET": "intel", "DATA_DIR": "", "IN_COLAB": True})
    assert os.environ["KAGGLE_API_TOKEN"] == "KGAT_fixed"


def test_a_kaggle_secret_deleted_since_is_not_kept(monkeypatch, capsys):
    """Run all again after swapping a refused KAGGLE_API_TOKEN secret for the legacy
    KAGGLE_USERNAME and KAGGLE_KEY: the token the cell copied before stayed in the
    environment, where kagglehub reads a token first, and the refused one was sent again.
    A variable the user set otherwise (%env) is left alone."""
    cell, secrets = kaggle_cell_with_fake_secrets(monkeypatch)
    for name in ("KAGGLE_API_TOKEN", "KAGGLE_USERNAME", "KAGGLE_KEY"):
        monkeypatch.delenv(name, raising=False)
    session = {"DATASET": "intel", "DATA_DIR": "", "IN_COLAB": True}  # one kernel's names
    secrets.update(KAGGLE_API_TOKEN="KGAT_refused")
    exec(cell, session)
    secrets.clear()
    secrets.update(KAGGLE_USERNAME="me", KAGGLE_KEY="key")
    exec(cell, session)
    assert "KAGGLE_API_TOKEN" not in os.environ
    assert (os.environ["KAGGLE_USERNAME"], os.environ["KAGGLE_KEY"]) == ("me", "key")
    # set by the user in the session, not from a secret: kept
    monkeypatch.setenv("KAGGLE_API_TOKEN", "KGAT_typed")
    exec(cell, session)
    assert os.environ["KAGGLE_API_TOKEN"] == "KGAT_typed"
    capsys.readouterr()


def test_the_stop_button_says_how_to_continue(monkeypatch, capsys):
    """Stop (a KeyboardInterrupt) in a run cell: one line naming RESUME, not a traceback."""
    handlers = {}
    shell = type("Shell", (), {"set_custom_exc": lambda self, kinds, handler:
                               handlers.update(kinds=kinds, handler=handler)})()
    monkeypatch.setattr(pipeline, "get_ipython", lambda: shell, raising=False)
    pipeline.quiet_user_errors()
    assert KeyboardInterrupt in handlers["kinds"]
    handlers["handler"](shell, KeyboardInterrupt, KeyboardInterrupt(), None)  # no options yet
    assert capsys.readouterr().err.startswith("interrupted before the run started")
    shell.user_ns = {"args": pipeline.parse_args(["--quick"])}
    shell.user_ns["args"].run_id = "20261206-120000"  # the run had started
    handlers["handler"](shell, KeyboardInterrupt, KeyboardInterrupt(), None)
    assert capsys.readouterr().err == ("interrupted: tick RESUME (resume=True) and run the "
                                       "cells again to continue where it stopped.\n")
    # Stop while the data is read or the estimate runs: no run to resume
    shell.user_ns["args"].run_id = None
    handlers["handler"](shell, KeyboardInterrupt, KeyboardInterrupt(), None)
    assert capsys.readouterr().err.startswith("interrupted before the run started: nothing to "
                                              "resume; run the cells again")
    shell.user_ns["args"].resume = True
    handlers["handler"](shell, KeyboardInterrupt, KeyboardInterrupt(), None)
    assert "(with RESUME ticked) to continue the run it was resuming" in capsys.readouterr().err


def test_messages_in_the_notebook_name_its_form_fields(monkeypatch, capsys):
    """The notebook has no --resume or --scenarios: a refusal said "drop --resume", and a
    warning "--n-trials does nothing here", where the user unticks RESUME or sets N_TRIALS.
    Info lines keep the command line (the equivalent command is one of them)."""
    handlers = {}
    shell = type("Shell", (), {"set_custom_exc": lambda self, kinds, handler:
                               handlers.update(kinds=kinds, handler=handler)})()
    monkeypatch.setattr(pipeline, "get_ipython", lambda: shell, raising=False)
    pipeline.setup_logging()
    pipeline.quiet_user_errors()
    refused = pipeline.UserError(
        "cannot resume: run r finished with baseline; hpo would be trained into it: drop "
        "--resume and run only hpo (--scenarios hpo), a new run beside it; pass --seed 3 or "
        "add --quick")
    handlers["handler"](shell, pipeline.UserError, refused, None)
    assert capsys.readouterr().err == (
        "error: cannot resume: run r finished with baseline; hpo would be trained into it: "
        "untick RESUME and run only hpo (the RUN_* flags hpo), a new run beside it; set SEED "
        "to 3 or tick QUICK\n")
    with pytest.raises(pipeline.UserError) as bad:
        pipeline.parse_args(["--epochs", "-3"])
    handlers["handler"](shell, pipeline.UserError, bad.value, None)
    assert capsys.readouterr().err.startswith("error: argument EPOCHS: must be >= 1")
    pipeline.parse_args(["--scenarios", "baseline", "--n-trials", "8"])
    pipeline.log.info("python pipeline.py --n-trials 8")
    assert capsys.readouterr().err == (
        "warning: N_TRIALS does nothing here: only the hpo scenario uses it, and this run's "
        "scenarios are baseline\ninfo: python pipeline.py --n-trials 8\n")
    assert pipeline.notebook_words("use --no-compile, or --epochs N with --no-match-time") == \
        "use COMPILE unticked, or EPOCHS N with MATCH_TIME unticked"
    pipeline.setup_logging()  # the command line's words again, for the tests after this one


# ----------------------------------------------------------------------------- simulated Colab

FAKE_COLAB = {
    "google/colab/__init__.py": "",
    # Drive "mounts" by linking the mount point to a folder the test chose.
    "google/colab/drive.py": (
        "import os\n"
        "def mount(mountpoint, force_remount=False):\n"
        "    os.makedirs(os.path.dirname(mountpoint), exist_ok=True)\n"
        "    if not os.path.exists(mountpoint):\n"
        "        os.symlink(os.environ['FAKE_DRIVE'], mountpoint)\n"
        "    print('Mounted at', mountpoint)\n"),
}


def project_repository(tmp_path: Path) -> Path:
    """A git repository of the working tree as it is (committed or not), as a clone source."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    repo = tmp_path / "hwtrain"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "snapshot"]):
        subprocess.run(git + command, cwd=repo, check=True)
    return repo


def papermill_colab(notebook: Path, out: Path, cwd: Path, env: dict, params: dict):
    """papermill in its own process (so it can be killed like a disconnected session); its
    log goes to out + '.log'."""
    command = [sys.executable, "-m", "papermill", str(notebook), str(out), "-k", "python3",
               "--no-progress-bar", "--cwd", str(cwd), "-y", json.dumps(params)]
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def tail(path: Path) -> str:
    return Path(f"{path}.log").read_text()[-3000:]


def test_simulated_colab_clones_mounts_drive_and_resumes_after_a_disconnect(tmp_path):
    pytest.importorskip("papermill")
    fake = tmp_path / "fake"
    for name, text in FAKE_COLAB.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    repo = project_repository(tmp_path)
    content, drive, home = tmp_path / "content", tmp_path / "drive", tmp_path / "home"
    for folder in (content, drive, home):
        folder.mkdir()
    notebook = content / "main_pipeline.ipynb"  # opened alone: nothing of the project beside it
    shutil.copy2(NOTEBOOK, notebook)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
           "FAKE_DRIVE": str(drive), "HOME": str(home), "PIP_NO_INPUT": "1"}
    # Epochs of about a second: the session is cut well before the last one. The data was
    # uploaded beside the notebook and named relatively, as the Files panel shows it.
    make_folder(content / "colours", n_train=150, n_test=10)
    params = {"REPO_URL": str(repo), "REPO_REF": "main", "USE_DRIVE": True,
              "DRIVE_MOUNT": str(content / "drive"), "DATA_DIR": "colours", "QUICK": False,
              "EPOCHS": 6, "IMAGE_SIZE": 32, "WEIGHTS": "none",
              "RUN_RESOLUTION_TUNING": False, "RUN_OPTUNA_HP_TUNING": False,
              "OPEN_TENSORBOARD": False}
    outputs = drive / "MyDrive" / "hwtrain" / "others"

    # The first session disconnects once the baseline has checkpointed an epoch.
    first = papermill_colab(notebook, tmp_path / "first.ipynb", content, env, params)
    deadline = time.monotonic() + 600
    while not (run_path(outputs) / "baseline.pt").exists() and first.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (run_path(outputs) / "baseline.pt").exists(), tail(tmp_path / "first.ipynb")
    for process in psutil.Process(first.pid).children(recursive=True) + [psutil.Process(first.pid)]:
        process.kill()
    first.wait()
    assert not (outputs / "results.json").exists()
    assert (content / "hwtrain" / "pipeline.py").exists()  # cloned into the session's folder

    # Run all again with RESUME: it continues where it stopped. (The study's local copy is
    # tested in test_optuna_optimizer.) Meanwhile the user picked another REPO_REF: the clone
    # the first session made is moved to it.
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "MARKER").write_text("the other branch\n")
    for command in (["checkout", "-qb", "other"], ["add", "MARKER"], ["commit", "-qm", "other"]):
        subprocess.run(git + command, cwd=repo, check=True)
    second = papermill_colab(notebook, tmp_path / "second.ipynb", content, env,
                             {**params, "RESUME": True, "REPO_REF": "other"})
    assert second.wait(timeout=900) == 0, tail(tmp_path / "second.ipynb")
    assert (content / "hwtrain" / "MARKER").exists()
    rows = json.loads((outputs / "results.json").read_text())
    assert [r["scenario"] for r in rows] == ["baseline"]
    assert 1 <= rows[0]["resumed_from_epoch"] < 6 and rows[0]["epochs"] == 6
    assert (outputs / "colours_model.pt").exists()
    text = printed(json.loads((tmp_path / "second.ipynb").read_text()))
    assert "Mounted at" in text and "warning: running on the CPU" in text


def test_the_set_up_cell_without_the_project_or_repo_url_is_one_line(tmp_path):
    papermill = pytest.importorskip("papermill")
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("REPO_URL = ''\nREPO_REF = 'main'"),
        nbformat.v4.new_code_cell(source(cells()[3]))])
    nbformat.write(notebook, tmp_path / "alone.ipynb")
    with pytest.raises(papermill.PapermillExecutionError) as raised:
        papermill.execute_notebook(str(tmp_path / "alone.ipynb"), str(tmp_path / "out.ipynb"),
                                   cwd=str(tmp_path), kernel_name="python3", progress_bar=False)
    assert raised.value.cell_index == 1
    ran = json.loads((tmp_path / "out.ipynb").read_text())
    said = printed(ran)
    assert said.startswith("UsageError: the project's files are not beside this notebook; set "
                           "REPO_URL") and said.count("\n") == 1
    assert not tracebacks(ran) and "To exit" not in said


def test_a_token_in_repo_url_is_not_printed_when_the_clone_fails(tmp_path):
    """The failed clone's line showed REPO_URL verbatim, user:token@ included, into the
    notebook's saved outputs (git's own message hides it)."""
    papermill = pytest.importorskip("papermill")
    nbformat = pytest.importorskip("nbformat")
    url = "https://alice:ghp_SECRET123@127.0.0.1:9/alice/hwtrain.git"
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(f"REPO_URL = {url!r}\nREPO_REF = 'main'"),
        nbformat.v4.new_code_cell(source(cells()[3]))])
    nbformat.write(notebook, tmp_path / "token.ipynb")
    with pytest.raises(papermill.PapermillExecutionError):
        papermill.execute_notebook(str(tmp_path / "token.ipynb"), str(tmp_path / "out.ipynb"),
                                   cwd=str(tmp_path), kernel_name="python3", progress_bar=False)
    said = printed(json.loads((tmp_path / "out.ipynb").read_text()))
    assert "UsageError: git clone https://127.0.0.1:9/alice/hwtrain.git failed" in said
    assert "SECRET" not in said


def test_the_set_up_cell_run_again_in_one_session_follows_repo_ref(tmp_path):
    """Run all again in the same session, after changing REPO_REF: the working folder is by
    then the clone, and the cell still moves it to the new ref; as the session still runs the
    code it imported, it asks for a restart instead of running old code on new files. A branch
    rewritten on the remote (a force-push) is said, not silently left behind."""
    papermill = pytest.importorskip("papermill")
    nbformat = pytest.importorskip("nbformat")
    repo = project_repository(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "MARKER").write_text("the other branch\n")
    for command in (["checkout", "-qb", "other"], ["add", "MARKER"], ["commit", "-qm", "other"],
                    ["checkout", "-q", "main"]):
        subprocess.run(git + command, cwd=repo, check=True)
    content = tmp_path / "content"
    content.mkdir()
    setup = source(cells()[3])
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(f"REPO_URL = {str(repo)!r}\nREPO_REF = 'main'\n"
                                  "PERFORM_DETAILED_PROFILING = False"),
        nbformat.v4.new_code_cell(setup),
        nbformat.v4.new_code_cell("import pipeline\nassert not Path('MARKER').exists()"),
        nbformat.v4.new_code_cell(f"subprocess.run({git + ['commit', '-q', '--amend', '-m', 'rewritten']!r}, cwd={str(repo)!r}, check=True)"),
        nbformat.v4.new_code_cell(setup),
        nbformat.v4.new_code_cell("REPO_REF = 'other'"),
        nbformat.v4.new_code_cell(setup)])
    nbformat.write(notebook, content / "rerun.ipynb")
    with pytest.raises(papermill.PapermillExecutionError) as raised:
        papermill.execute_notebook(str(content / "rerun.ipynb"), str(tmp_path / "out.ipynb"),
                                   cwd=str(content), kernel_name="python3", progress_bar=False)
    assert raised.value.cell_index == 6
    assert (content / "hwtrain" / "MARKER").exists()
    ran = json.loads((tmp_path / "out.ipynb").read_text())
    said = printed(ran)
    # one line, no traceback and no "To exit: use 'exit'" warning (a SystemExit's)
    assert "UsageError: the project moved to" in said and "Restart session" in said
    assert not tracebacks(ran) and "To exit" not in said
    assert said.count("warning: git merge failed") == 1 and "delete its folder" in said


def test_the_run_cell_keeps_its_run_id_and_finished_rows_when_stopped(tmp_path):
    """Stopped (or failed) after the run had started, the later cells showed an earlier run's
    traces and model (or failed on a name never set), and the rows of the run before it in
    this session beside this run's charts: the run cell keeps the id, the scenarios it
    finished and its own report folder however it ends."""
    import types
    cell = next(source(c) for c in cells() if "pipeline.run(args, index)" in source(c))
    (tmp_path / "results.json").write_text(json.dumps(
        [{"scenario": "baseline", "run_id": "20261206-160000"},
         {"scenario": "baseline", "run_id": "20261206-170000"},
         {"scenario": "resolution", "run_id": "20261206-170000"}]))

    def stopped(args, index):
        args.run_id = "20261206-170000"
        raise KeyboardInterrupt
    names = {"pipeline": types.SimpleNamespace(run=stopped, run_rows=pipeline.run_rows,
                                               run_folder=pipeline.run_folder),
             "index": None, "output_dir": tmp_path, "args": types.SimpleNamespace(run_id=None),
             "RUN_ID": "20261206-160000", "rows": [{"scenario": "baseline",
                                                    "run_id": "20261206-160000"}]}
    with pytest.raises(KeyboardInterrupt):
        exec(cell, names)
    assert names["RUN_ID"] == "20261206-170000"
    assert [(r["scenario"], r["run_id"]) for r in names["rows"]] == [
        ("baseline", "20261206-170000"), ("resolution", "20261206-170000")]
    assert names["REPORT_DIR"] == tmp_path / "runs" / "20261206-170000" / "report"

    def refused(args, index):  # before the run started: no rows, none of an earlier run
        raise pipeline.UserError("another run is writing to ...")
    names.update(pipeline=types.SimpleNamespace(run=refused, run_rows=pipeline.run_rows,
                                                run_folder=pipeline.run_folder),
                 args=types.SimpleNamespace(run_id=None))
    with pytest.raises(pipeline.UserError):
        exec(cell, names)
    assert names["rows"] == [] and names["RUN_ID"] is None


def test_a_result_cell_run_before_any_run_is_one_line(monkeypatch, capsys):
    """In a new session, to see a finished run, a result cell run first failed with
    NameError's traceback: one line says which cells to run. A NameError in a module (a bug)
    keeps its traceback."""
    handlers = {}
    shown = []
    shell = type("Shell", (), {
        "set_custom_exc": lambda self, kinds, handler: handlers.update(kinds=kinds,
                                                                       handler=handler),
        "showtraceback": lambda self, exc_tuple, tb_offset=None: shown.append(exc_tuple)})()
    shell.user_ns = {}
    monkeypatch.setattr(pipeline, "get_ipython", lambda: shell, raising=False)
    pipeline.quiet_user_errors()
    assert NameError in handlers["kinds"]
    try:
        exec("print(rows)", shell.user_ns)
    except NameError:
        handlers["handler"](shell, *sys.exc_info())
    said = capsys.readouterr().err
    assert said.startswith("error: no run in this session yet (rows is set by the cells that "
                           "load the data") and "with RESUME ticked" in said and not shown
    try:  # a name the cells do not set: Python's own traceback, as before
        exec("print(row)", shell.user_ns)
    except NameError:
        handlers["handler"](shell, *sys.exc_info())
    assert len(shown) == 1 and capsys.readouterr().err == ""
    # raised inside a function, whose globals are not the notebook's: a bug's traceback
    namespace = {}
    exec("def f():\n    return rows\n", namespace)
    try:
        namespace["f"]()
    except NameError:
        handlers["handler"](shell, *sys.exc_info())
    assert len(shown) == 2


def test_the_result_cells_take_from_earlier_cells_only_what_the_run_cells_set():
    """A name a result cell reads from the data or run cells is one the handler of a result
    cell run first names (SET_BY_RUN_CELLS); anything else it reads comes from the
    parameters and options cells (run before the handler exists) or from itself."""
    import ast
    code = [source(c) for c in cells() if c["cell_type"] == "code"]
    options = next(i for i, text in enumerate(code) if "pipeline.options(" in text)
    data = next(i for i, text in enumerate(code) if "pipeline.load_data(" in text)
    defined_early: set[str] = set()
    defined_late: dict[str, int] = {}
    for i, text in enumerate(code):
        tree = ast.parse(re.sub(r"^(\s*)%.*$", r"\1pass", text, flags=re.M))
        loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Load)}
        own = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
               and isinstance(n.ctx, ast.Store)}
        own |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        if i > data:
            taken = {name for name in loaded - own if name in defined_late}
            assert taken <= set(pipeline.SET_BY_RUN_CELLS), (i, taken)
        (defined_early.update(own) if i <= options else
         defined_late.update(dict.fromkeys(own - defined_early, i)))


def test_tensorboard_is_started_on_folders_every_run_shares(tmp_path, capsys):
    """Jupyter's %tensorboard reuses a server only for the same arguments: the profiler cell
    gave it this run's folder, so every profiled run in one session started one more server
    (about 120 MB each), none of them ever stopped."""
    import re
    import types
    import pipeline
    started = {}
    for run_id in ("20260101-000000", "20260101-000100"):
        trace = pipeline.run_folder(tmp_path, "profiler", run_id) / "baseline" / "x.pt.trace.json"
        trace.parent.mkdir(parents=True)
        trace.write_text("{}")
        for cell in cells():
            text = source(cell)
            if cell["cell_type"] != "code" or "%tensorboard" not in text:
                continue
            logdirs = []
            code = re.sub(r'%tensorboard --logdir "(.*)"', r'_logdir(f"\1")', text)
            code = re.sub(r"^(\s*)%load_ext .*$", r"\1pass", code, flags=re.M)
            exec(code, {"pipeline": pipeline, "output_dir": tmp_path, "RUN_ID": run_id,
                        "OPEN_TENSORBOARD": True, "_logdir": logdirs.append,
                        "args": types.SimpleNamespace(output_dir=str(tmp_path), profile=True)})
            assert logdirs, cell["id"]
            started.setdefault(cell["id"], set()).update(logdirs)
    capsys.readouterr()
    assert len(started) == 2 and all(len(dirs) == 1 for dirs in started.values()), started
