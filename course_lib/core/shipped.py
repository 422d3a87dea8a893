"""The trained models that ship with the course (shipped_models/, beside course_lib/, in git): a
learner loads in seconds what the default benchmark trains in over an hour. A shipped file (float16
weights and training history) is named as the cache names the model (core.stages.Stage), so
`Method.fit` loads it only when what it is trained from and its sha256 match the manifest, whose
probes check that the code still computes the same (tests/test_shipped_models.py); else the model
trains, with a one-line note why. Smoke mode and COURSE_RETRAIN=1 never load shipped models."""

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
_OFF = []  # one entry per open without_shipped_models() block


@contextlib.contextmanager
def without_shipped_models():
    """Inside the block Method.fit looks for no shipped model (data they were not trained on)."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def shipped_folder() -> Path | None:
    """COURSE_SHIPPED_MODELS, or ours; None in smoke mode, with COURSE_RETRAIN=1 or turned off."""
    if smoke_mode() or retrain_mode() or _OFF:
        return None
    named = os.environ.get("COURSE_SHIPPED_MODELS")
    return Path(named) if named else course_repository() / SHIPPED_MODELS.name


def manifest_entry(method: str, stage: Stage) -> dict:
    """The manifest's record of a model: its stage's fingerprint, data and vocabulary hashed."""
    fingerprint = stage.fingerprint
    return {"method": method, "prefix": stage.prefix, "config": fingerprint["config"],
            "data": fingerprint_hash([fingerprint["data"], fingerprint["vocab"]])[:16],
            **{k: fingerprint[k] for k in ("starts_from", "version", "format")}}


def read_manifest(folder) -> dict:
    """The folder's manifest ({"files": {}} when there is none)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return {"format": SHIPPED_FORMAT, "files": {}}
    return json.loads(path.read_text(encoding="utf-8"))


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _each_history(history, convert):
    """convert(rows) of a history, or of each in a dict of them (one per stage); None stays."""
    if isinstance(history, dict):
        return {stage: _each_history(rows, convert) for stage, rows in history.items()}
    return None if history is None else convert(history)


def _half(tensor: torch.Tensor) -> torch.Tensor:
    """A weight as shipped: float16 when floating point and within its range, else unchanged."""
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
    out = io.BytesIO()
    plain = _each_history(history, lambda rows: [dict(row) for row in rows])  # weights_only loads
    torch.save({"format": SHIPPED_FORMAT, "model": shipped_weights(model), "history": plain}, out)
    return out.getvalue()


def load_shipped(path, model: nn.Module):
    """Load a shipped file's weights into `model`; returns its training history."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != SHIPPED_FORMAT:
        raise ValueError(f"{path} is not a shipped model (format {SHIPPED_FORMAT!r})")
    check_model_state(model, ckpt["model"], f"shipped model {str(path)!r}")
    model.load_state_dict(ckpt["model"])
    return _each_history(ckpt["history"], History)


def stale_reasons(expected: dict, entry: dict | None) -> list[str]:
    """Why a manifest entry is not the model `expected` (a manifest_entry); [] when it is."""
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
    for key, what in (("starts_from", "a model it starts from changed (shipped "),
                      ("version", "its format version changed ("),
                      ("format", "MODEL_FORMAT changed (")):
        if entry.get(key) != expected[key]:
            reasons.append(f"{what}{entry.get(key)}, now {expected[key]})")
    return reasons


def file_problems(folder, name: str, entry: dict) -> list[str]:
    """A listed file that is missing or not the bytes the manifest recorded (a git-lfs pointer)."""
    path = Path(folder) / name
    if not path.exists():
        return [f"{name} is listed in {MANIFEST} but missing"]
    if file_sha256(path) != entry.get("sha256"):
        return [f"{name} does not match the sha256 in {MANIFEST}"]
    return []


def find_shipped(folder, method: str, stage: Stage) -> Path | None:
    """The shipped file to load, or None (a CourseNote says why when one is unusable)."""
    if folder is None:
        return None
    name, expected = stage.file_name, manifest_entry(method, stage)
    if not (Path(folder) / MANIFEST).exists():  # deleted to retrain, or course_lib without them
        warnings.warn(f"no shipped models in {folder} (no {MANIFEST}): models are trained, or "
                      "loaded from the cache", CourseNote, stacklevel=3)
        return None
    files = read_manifest(folder)["files"]
    if name in files and not stale_reasons(expected, files[name]):
        reasons = file_problems(folder, name, files[name])
        if not reasons:
            return Path(folder) / name
    else:
        same = [(n, entry) for n, entry in files.items() if entry.get("method") == method]
        if not same:
            return None  # that method ships nothing (an ablation, a notebook's variant): silence
        name, entry = same[0]
        reasons = stale_reasons(expected, entry)
    warnings.warn(f"the shipped model of {expected['method']} ({name}) is not this one: "
                  f"{'; '.join(reasons)}. Training it (or loading it from the cache) instead; "
                  f"`{REFRESH_COMMAND}` refreshes the shipped models", CourseNote, stacklevel=3)
    return None


def write_shipped(folder, models, not_shipped=(), keep=None) -> dict:
    """Rewrite `folder` with `models`, (file name, manifest_entry, model, history) each, and keep
    (file name -> manifest entry) as they are; other .pt files are removed. Refuses more than
    MAX_BYTES before writing. not_shipped: methods left out on purpose. Returns the manifest."""
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
    """Every problem of a shipped folder against `expected` ({file name: manifest_entry})."""
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
            if (gone := entry.get("method")) not in {e["method"] for e in expected.values()}:
                problems.append(f"{name} ships {gone!r}, which is no longer a method that ships")
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
