"""The trained models that ship with the course: a learner loads in seconds what the default
benchmark trains in over an hour.

    shipped_models/        beside course_lib/, tracked in git
      manifest.json        per file: method, checkpoint prefix, config (the fields it reads), data
                           fingerprint, starts_from (the files of the models it starts from),
                           the method's format version,
                           MODEL_FORMAT, sha256, bytes, and `probe`: what the model computes on a
                           fixed batch of the validation split (course_lib.shipping)
      vsepp-<hash>.pt ...  weights (float16) and training history only (no optimizer state)

A shipped file is named as the cache names the model (`Method.stage`, a core.stages.Stage, whose
hash covers what it is trained from: the config fields it reads, training data, vocabulary, the
models it starts from, its format version; never its source code), so `Method.fit` loads it only
when all of these and its sha256 match. That the code still computes the same is checked by
behaviour: the probe (tests/test_shipped_models.py). Otherwise it trains (or loads its cache), with
a one-line note why when the folder ships a non-matching model of that method or has no manifest.
Smoke mode and COURSE_RETRAIN=1 never load shipped models (`shipped_folder`): CI exercises the
training path, and `--retrain` reproduces them with the same code.

`python -m course_lib.refresh_shipped` (REFRESH_COMMAND) trains the default models (or loads their
cache) and rewrites the folder (`write_shipped`); `check_shipped` lists what is stale, and
tests/test_shipped_models.py fails on it, naming that command."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from course_lib.core.checkpoints import SHIPPED_FORMAT, check_model_state
from course_lib.core.files import write_atomically
from course_lib.core.history import History
from course_lib.core.settings import CourseNote, course_repository, retrain_mode, smoke_mode
from course_lib.core.stages import Stage, fingerprint_hash

SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "shipped_models"
MANIFEST = "manifest.json"
REFRESH_COMMAND = "python -m course_lib.refresh_shipped"
MAX_BYTES = 25_000_000  # every shipped file together: a clone stays small


_OFF = []  # depth of without_shipped_models() blocks


@contextlib.contextmanager
def without_shipped_models():
    """Inside the block Method.fit looks for no shipped model: for data they were never trained on
    (real photographs), where a note about the synthetic ones would make no sense."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def shipped_folder() -> Path | None:
    """The folder Method.fit loads shipped models from: COURSE_SHIPPED_MODELS, else shipped_models/
    of the course's copy (settings.course_repository). None in smoke mode (its tiny models always
    train), with COURSE_RETRAIN=1 and inside without_shipped_models()."""
    if smoke_mode() or retrain_mode() or _OFF:
        return None
    named = os.environ.get("COURSE_SHIPPED_MODELS")
    return Path(named) if named else course_repository() / SHIPPED_MODELS.name


def manifest_entry(method: str, stage: Stage) -> dict:
    """What the manifest records of method's model, trained as `stage` (core.stages.Stage): its
    fingerprint, with the data and the vocabulary as one short hash (the long digest says nothing
    to a reader)."""
    fingerprint = stage.fingerprint
    return {"method": method, "prefix": stage.prefix, "config": fingerprint["config"],
            "data": fingerprint_hash([fingerprint["data"], fingerprint["vocab"]])[:16],
            "starts_from": fingerprint["starts_from"], "version": fingerprint["version"],
            "format": fingerprint["format"]}


def read_manifest(folder) -> dict:
    """The folder's manifest ({"files": {}} when there is none)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return {"format": SHIPPED_FORMAT, "files": {}}
    return json.loads(path.read_text(encoding="utf-8"))


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _plain(history):
    """A History (or a dict of them, one per stage) as plain lists and dicts, which
    torch.load(weights_only=True) loads (it refuses unknown classes)."""
    if isinstance(history, dict):
        return {stage: _plain(rows) for stage, rows in history.items()}
    return None if history is None else [dict(row) for row in history]


def _history(plain):
    if isinstance(plain, dict):
        return {stage: _history(rows) for stage, rows in plain.items()}
    return None if plain is None else History(plain)


def _half(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as shipped: float16 when floating point and within float16's range (half the
    bytes; the model still computes in float32: load_state_dict casts back), else unchanged."""
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype != torch.float16:
        half = tensor.to(torch.float16)
        if torch.equal(torch.isfinite(half), torch.isfinite(tensor)):  # nothing beyond +-65504
            return half
    return tensor.clone()  # no views of bigger storage


def shipped_weights(model: nn.Module) -> dict:
    """The state dict a shipped file holds: every weight through `_half`."""
    return {k: _half(v) for k, v in model.state_dict().items()}


def _payload(model: nn.Module, history) -> bytes:
    buffer = io.BytesIO()
    state = shipped_weights(model)
    torch.save({"format": SHIPPED_FORMAT, "model": state, "history": _plain(history)}, buffer)
    return buffer.getvalue()


def load_shipped(path, model: nn.Module):
    """Load a shipped file's weights into `model`; returns its training history."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != SHIPPED_FORMAT:
        raise ValueError(f"{path} is not a shipped model (format {SHIPPED_FORMAT!r})")
    check_model_state(model, ckpt["model"], f"shipped model {str(path)!r}")
    model.load_state_dict(ckpt["model"])
    return _history(ckpt["history"])


def stale_reasons(expected: dict, entry: dict | None) -> list[str]:
    """Why a manifest entry is not the model `expected` (a manifest_entry): [] when it is."""
    if entry is None:
        return ["nothing is shipped for it"]
    reasons = []
    # the manifest is JSON: compare the config as JSON gives it back (a tuple reads back a list)
    old, new = entry.get("config", {}), json.loads(json.dumps(expected["config"]))
    changed = sorted(k for k in set(old) | set(new)
                     if old.get(k, "<absent>") != new.get(k, "<absent>"))
    if changed:
        reasons.append("config differs in " + ", ".join(
            f"{k} (shipped {old.get(k, '<absent>')!r}, now {new.get(k, '<absent>')!r})"
            for k in changed))
    if entry.get("data") != expected["data"]:
        reasons.append("its training data or vocabulary changed")
    if entry.get("starts_from") != expected["starts_from"]:
        reasons.append(f"a model it starts from changed (shipped {entry.get('starts_from')}, now "
                       f"{expected['starts_from']})")
    if entry.get("version") != expected["version"]:
        reasons.append(f"its format version changed ({entry.get('version')}, now "
                       f"{expected['version']})")
    if entry.get("format") != expected["format"]:
        reasons.append(f"MODEL_FORMAT changed ({entry.get('format')}, now {expected['format']})")
    return reasons


def file_problems(folder, name: str, entry: dict) -> list[str]:
    """What is wrong with a listed file on disk: missing, or not the bytes the manifest recorded
    (a git-lfs pointer, a truncated download, a file overwritten by hand)."""
    path = Path(folder) / name
    if not path.exists():
        return [f"{name} is listed in {MANIFEST} but missing"]
    if file_sha256(path) != entry.get("sha256"):
        return [f"{name} does not match the sha256 in {MANIFEST}"]
    return []


def find_shipped(folder, method: str, stage: Stage) -> Path | None:
    """The shipped file to load for `method`'s model trained as `stage`, or None; a CourseNote says
    why when the folder ships an unusable model of the same method, or has no manifest."""
    if folder is None:
        return None
    name, expected = stage.file_name, manifest_entry(method, stage)
    if not (Path(folder) / MANIFEST).exists():  # deleted to retrain, or course_lib without them
        warnings.warn(f"no shipped models in {folder} (no {MANIFEST}): models are trained, or "
                      "loaded from the cache", CourseNote, stacklevel=3)
        return None
    files = read_manifest(folder)["files"]
    if name in files and not stale_reasons(expected, files[name]):
        problems = file_problems(folder, name, files[name])
        if not problems:
            return Path(folder) / name
        reasons = problems
    else:
        same = [(other, entry) for other, entry in files.items()
                if entry.get("method") == expected["method"]]
        if not same:
            return None  # that method ships nothing (an ablation, a notebook's variant): silence
        name, entry = same[0]
        reasons = stale_reasons(expected, entry)
    warnings.warn(f"the shipped model of {expected['method']} ({name}) is not this one: "
                  f"{'; '.join(reasons)}. Training it (or loading it from the cache) instead; "
                  f"`{REFRESH_COMMAND}` refreshes the shipped models", CourseNote, stacklevel=3)
    return None


def write_shipped(folder, models, not_shipped=(), keep=None) -> dict:
    """Rewrite `folder` with `models`: (file name, manifest_entry, model, history) each, weights
    only. keep: {file name: its manifest entry} of files in the folder that stay as they are;
    other unlisted files are removed. Refuses, before writing anything, more than MAX_BYTES in
    all. not_shipped: methods deliberately left out (check_shipped accepts their absence).
    Returns the manifest."""
    folder = Path(folder)
    keep = dict(keep or {})
    payloads = {name: (entry, _payload(model, history)) for name, entry, model, history in models}
    sizes = ({name: len(data) for name, (_, data) in payloads.items()}
             | {name: e["bytes"] for name, e in keep.items()})
    total = sum(sizes.values())
    if total > MAX_BYTES:
        listing = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in sizes.items())
        raise ValueError(f"the shipped models would take {total / 1e6:.1f} MB, more than "
                         f"{MAX_BYTES / 1e6:.0f} MB: {listing}")
    folder.mkdir(parents=True, exist_ok=True)
    files = {name: entry for name, entry in keep.items() if name not in payloads}
    for name, (entry, data) in sorted(payloads.items()):
        # atomically: a reader never finds half a model
        write_atomically(folder / name, lambda temporary, data=data: temporary.write_bytes(data))
        files[name] = {**entry, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    for old in folder.glob("*.pt"):
        if old.name not in files:
            old.unlink()
    manifest = {"format": SHIPPED_FORMAT, "refresh": REFRESH_COMMAND, "torch": torch.__version__,
                "files": files, "not_shipped": sorted(not_shipped)}
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    write_atomically(folder / MANIFEST, lambda temp: temp.write_text(text, encoding="utf-8"))
    return manifest


def check_shipped(folder, expected: dict) -> list[str]:
    """Every problem of a shipped folder against `expected` ({file name: manifest_entry} of the
    models that should ship): a model missing or stale, a listed file missing or altered, an
    unlisted file, more than MAX_BYTES. [] when the folder is current."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    files, left_out = manifest["files"], set(manifest.get("not_shipped", ()))
    problems = []
    for name, entry in expected.items():
        same = [(other, e) for other, e in files.items() if e.get("method") == entry["method"]]
        if not same and name not in files and entry["method"] in left_out:
            continue  # left out on purpose by `refresh(only=...)`: trained on first use
        listed, shipped = ((name, files[name]) if name in files
                           else (same[0] if same else (None, None)))
        reasons = stale_reasons(entry, shipped)  # a listed name's too: a manifest edited by hand
        if reasons:
            problems.append(f"{entry['method']}: {'; '.join(reasons)}"
                            + (f" ({listed})" if listed else ""))
    for name, entry in files.items():
        if name not in expected:
            if not any(e["method"] == entry.get("method") for e in expected.values()):
                problems.append(f"{name} ships {entry.get('method')!r}, which is no longer a "
                                "method that ships")
            continue
        problems += file_problems(folder, name, entry)
    unlisted = sorted(p.name for p in folder.glob("*.pt") if p.name not in files)
    if unlisted:
        problems.append(f"files not in {MANIFEST}: {unlisted}")
    total = sum(entry.get("bytes", 0) for entry in files.values())
    if total > MAX_BYTES:
        problems.append(f"the shipped models take {total / 1e6:.1f} MB, more than "
                        f"{MAX_BYTES / 1e6:.0f} MB")
    return problems


__all__ = ["SHIPPED_MODELS", "MANIFEST", "REFRESH_COMMAND", "MAX_BYTES", "shipped_folder",
           "without_shipped_models", "manifest_entry", "read_manifest", "shipped_weights",
           "load_shipped", "stale_reasons", "find_shipped", "write_shipped", "check_shipped",
           "file_sha256"]
