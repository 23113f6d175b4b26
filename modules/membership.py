"""Which images a model trained on, so that a run starting from it can count the images it
would test or choose on that the model has already seen: a short digest of each training
image's bytes, kept with the run (checkpoints/<run>/trained_on.json) and in every file it
saves that --weights reads (its model file, checkpoints and trials' weights), so that a copy
elsewhere carries it. By content, not by name: a moved, renamed or re-split copy of an image is
the same image; a resized or re-encoded one is not counted."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.config import UserError
from modules.dataset import DatasetIndex, Sample, in_threads
from modules.files import atomic_write_text
from modules.model_files import FORMAT_NAME as MODEL_FORMAT
from modules.models import is_run_checkpoint, pinned_file

log = logging.getLogger(__name__)

DIGEST_BYTES = 8  # 2**-64 a chance that two different images share one
FILE_NAME = "trained_on.json"
# What a record says of the run behind it, as a model file's extra says it too
ABOUT = ("run_id", "seed", "quick", "images_fingerprint")
KEY = "membership"  # where a checkpoint or a trial's weights file keeps the run's record
_STAMP: dict[str, Any] = {}  # the record of the run now training (stamping)


def _digest(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(), digest_size=DIGEST_BYTES).digest()
    except OSError:
        return None  # gone since it was listed: training says so when it reads it


def digests(samples: Iterable[Sample]) -> list[bytes | None]:
    """Each image's digest, in order (None where the file cannot be read now)."""
    return list(in_threads(_digest, [path for path, _ in samples]).values())


def of_images(samples: Iterable[Sample]) -> set[bytes]:
    """The digests of the images that can be read."""
    return {d for d in digests(samples) if d is not None}


def encode(seen: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(sorted(set(seen)))).decode("ascii")


def decode(text: Any) -> set[bytes] | None:
    """The digests `encode` wrote; None for anything else (a file of an older version)."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error
        return None
    if len(raw) % DIGEST_BYTES:
        return None
    return {raw[i:i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)}


@dataclass
class Start:
    """What a run's start model had seen (check_start), which the run's models carry on."""
    seen: set[bytes] = field(default_factory=set)
    # an earlier version's file of this data split otherwise, somewhere in the start's
    # lineage, which noted no images: {"dataset", "what"}, said again for every descendant
    unrecorded: dict[str, str] | None = None
    # the digests of this run's validation and test images, where check_start read them
    held_out: list[bytes | None] | None = None


def record(folder: Path, index: DatasetIndex, about: dict[str, Any],
           start: Start | None = None) -> dict[str, Any]:
    """Write what a run trains on into its folder (kept when there already: a resumed run's)
    and return it: its training images, and what the model it starts from had trained on,
    which its weights carry on."""
    path = Path(folder) / FILE_NAME
    kept = read(path.parent)
    if kept is not None:
        return kept
    start = start or Start()
    mine = of_images(index.train)
    carried = start.seen - mine
    held_out = start.held_out
    if held_out is None and carried:  # a Start check_start did not make
        held_out = digests(index.val + index.test)
    written = {**{k: about.get(k) for k in ABOUT}, "images": len(mine | carried),
               "carried": len(carried),
               # of those, images of this folder: no --seed gives back the split they had
               "carried_here": count_seen(held_out or [], carried),
               "unrecorded": start.unrecorded, "trained_on": encode(mine | carried)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json.dumps(written), path)
    return written


def read(folder: Path) -> dict[str, Any] | None:
    """The record in a run's folder; None when there is none that reads."""
    try:
        return _valid(json.loads((Path(folder) / FILE_NAME).read_text()))
    except (OSError, ValueError):
        return None


def _valid(kept: Any) -> dict[str, Any] | None:
    return kept if isinstance(kept, dict) and decode(kept.get("trained_on")) is not None \
        else None


@contextlib.contextmanager
def stamping(kept: dict[str, Any] | None) -> Iterator[None]:
    """While a run trains, every checkpoint and trial's weights it saves carries its record
    (stamp): a copy of one, given as --weights elsewhere, is checked as its run's model is."""
    _STAMP.clear()
    _STAMP.update(kept or {})
    try:
        yield
    finally:
        _STAMP.clear()


def stamp() -> dict[str, Any]:
    """{KEY: the record of the run now training}, to save beside a file's tensors; {} outside
    a run (a library caller's own training)."""
    return {KEY: dict(_STAMP)} if _STAMP else {}


def of_start(path: Path, state: Any) -> tuple[set[bytes], dict] | None:
    """What a --weights file records of the images behind it, and of their run: a model file
    this tool saved says it in its extra, a checkpoint or a trial's weights under KEY, and
    one of a run that began before they did, in the run's folder. None: nothing recorded
    (another tool's file, or an older version's)."""
    for kept in (_model_extra(state), state.get(KEY) if isinstance(state, dict) else None):
        if _valid(kept) is not None:
            return decode(kept["trained_on"]), kept
    kept = read(Path(path).parent)
    return None if kept is None else (decode(kept["trained_on"]), kept)


def _model_extra(state: Any) -> dict[str, Any] | None:
    """What a model file this tool saved says of its run; None for any other file."""
    extra = state.get("extra") if isinstance(state, dict) and \
        state.get("format") == MODEL_FORMAT else None
    return extra if isinstance(extra, dict) else None


def count_seen(held: list[bytes | None], seen: set[bytes]) -> int:
    """How many of the images of digests `held` (digests()) are images in `seen`."""
    return sum(d in seen for d in held)


def check_start(path: Path | None, index: DatasetIndex, seed: int | None = None,
                beside: dict[str, Any] | None = None,
                split_with: Callable[[int], DatasetIndex] | None = None) -> Start:
    """A --weights model that trained on some of the images this run tests on would have its
    test accuracy count them as new: refused. One that trained on some of its validation
    images (another split of the same folder, a --quick run's model, a run's own checkpoint)
    is said, as validation then reads high. Returns what the start had trained on, which this
    run's models carry on (record). `beside`: the record of the run whose checkpoints folder
    holds the file, if one does (an older version's run, which recorded no images).
    `split_with(seed)`: this run's images as that --seed splits them, to advise the start's
    --seed where its split holds none of the start's images among those it validates and
    tests on."""
    state = pinned_file(path)
    recorded = of_start(path, state) if path is not None else None
    if recorded is None:
        return Start(unrecorded=_check_unrecorded_start(path, state, index, seed, beside))
    seen, about = recorded
    unrecorded = about.get("unrecorded")
    if isinstance(unrecorded, dict) and unrecorded.get("dataset") == index.name:
        log.warning("--weights %s was trained from %s, which an earlier version made without "
                    "noting the images it trained on, of this data split otherwise: test "
                    "accuracy reads high if those included this run's test images", path,
                    unrecorded.get("what"))
    run = _run_words(about)
    test, val = digests(index.test), digests(index.val)  # record counts the carried in them
    if n := count_seen(test, seen):
        theirs = _seed_that_helps(about, seed, seen, split_with)
        raise UserError(f"--weights {str(path)!r} trained on {n} of this run's {len(index.test)} "
                        f"test images ({run}): their accuracy would read high; "
                        + (f"pass --seed {theirs}, or " if theirs is not None else "")
                        + "start from other weights.")
    if n := count_seen(val, seen):
        theirs = _seed_that_helps(about, seed, seen, split_with)
        log.warning("--weights %s trained on %d of this run's %d validation images (%s): "
                    "validation, which picks epochs and settings, reads high; the test images "
                    "are new to it.%s", path, n, len(index.val), run,
                    f" --seed {theirs} splits them as it did." if theirs is not None else "")
    return Start(seen, unrecorded if isinstance(unrecorded, dict) else None, val + test)


def _seed_that_helps(about: dict[str, Any], seed: int | None, seen: set[bytes],
                     split_with: Callable[[int], DatasetIndex] | None) -> int | None:
    """The start's --seed, where this run's images split with it hold none of the start's
    images among validation and test: found by splitting them so, since neither the folder's
    fingerprint (a --quick run's subset, a renamed copy) nor the start's record (images it
    carried from a start of its own) tells."""
    theirs = about.get("seed")
    if split_with is None or type(theirs) is not int or theirs == seed:
        return None
    try:
        other = split_with(theirs)
    except (UserError, OSError):
        return None
    return None if count_seen(digests(other.val + other.test), seen) else theirs


def _run_words(about: dict[str, Any]) -> str:
    """A run as a record names it: "run <id>, --seed <seed>[, --quick]"."""
    return f"run {about.get('run_id')}" + (
        f", --seed {about['seed']}" if about.get("seed") is not None else "") + (
        ", --quick" if about.get("quick") else "")


def _check_unrecorded_start(path: Path | None, state: Any, index: DatasetIndex,
                            seed: int | None, beside: dict[str, Any] | None
                            ) -> dict[str, str] | None:
    """check_start for a file of a version that recorded the images' split, not the images it
    trained on: for a model file another --seed's split of the same images is known; a
    checkpoint's run recorded only its split, which can be told to differ, and a checkpoint
    copied out of its run's folder only its seed. Returns what was said of the file, for its
    descendants (Start.unrecorded)."""
    extra = _model_extra(state)
    config = state["config"] if is_run_checkpoint(state) else None
    what = None
    if extra is None and beside is not None and beside.get("dataset") == index.name and \
            not index.same_data(beside.get("data_fingerprint")):
        what = f"{path} ({_run_words(beside)})"
    elif extra is None and beside is None and isinstance(config, dict) and \
            config.get("seed") not in (None, seed):
        what = f"{path} (a checkpoint, --seed {config['seed']})"
    if what is not None:
        log.warning("--weights %s, which an earlier version made without noting the images "
                    "it trained on, was split otherwise than this run's data: test accuracy "
                    "reads high if those included this run's test images", what)
        return {"dataset": index.name, "what": what}
    if extra is None or index.same_data(extra.get("data_fingerprint")) or \
            extra.get("images_fingerprint") != index.images_fingerprint():
        return None
    same_seed = extra.get("seed") is not None and extra.get("seed") == seed
    trained = (f"--seed {extra['seed']}" if extra.get("seed") is not None else "the --seed") \
        + f" of run {extra.get('run_id')}"
    if index.layout == "class folders":
        raise UserError(f"--weights {str(path)!r} is a model of these images split "
                        + ("otherwise (with --quick, or before a file was added, removed or "
                           "found undecodable)" if same_seed else "with another --seed")
                        + ": it trained on some of this run's test images, whose accuracy "
                        "would read high; " + ("" if same_seed else f"pass {trained}, or ")
                        + "start from other weights.")
    if same_seed:
        return None  # test/ is the folder's; validation differs by the files, not the seed
    log.warning("--weights %s is a model of these images with another validation split: it "
                "trained on some of this run's validation images, so validation (which picks "
                "epochs and settings) reads high; test/ is unchanged. %s splits them as it did.",
                path, trained[0].upper() + trained[1:])
    return None
