"""Course-wide settings: device choice, global seeding, and the switches `COURSE_SMOKE=1` (set by
CI: shrinks sizes only, never the code path) and `COURSE_RETRAIN=1` (train every model instead of
loading the shipped ones)."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

_TRUE = {"1", "true", "yes", "on"}


def _flag(*names: str) -> bool:
    """True when any of the environment variables `names` is set to 1/true/yes/on."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


def smoke_mode() -> bool:
    """True when COURSE_SMOKE asks for tiny sizes (CI, quick checks)."""
    return _flag("COURSE_SMOKE")


def retrain_mode() -> bool:
    """True when COURSE_RETRAIN asks to train every model instead of loading the shipped ones."""
    return _flag("COURSE_RETRAIN")


@contextmanager
def _environ(**values):
    """Within the block each os.environ[name] = value (None: unset); all restored after."""
    def put(items):
        for name, value in items:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    before = {name: os.environ.get(name) for name in values}
    put(values.items())
    try:
        yield
    finally:
        put(before.items())


def retraining(on: bool = True):
    """Within the block retrain_mode() is True if `on`: nested fits follow --retrain."""
    return _environ(COURSE_RETRAIN="1" if on else os.environ.get("COURSE_RETRAIN"))


def shipped_models_from(folder):
    """Within the block Method.fit loads `folder`'s shipped models, as at default size."""
    return _environ(COURSE_SHIPPED_MODELS=str(folder), COURSE_SMOKE=None, COURSE_RETRAIN=None)


def course_repository() -> Path:
    """The course copy whose data/ and shipped_models/ are read: COURSE_REPOSITORY, or ours."""
    named = os.environ.get("COURSE_REPOSITORY")
    return Path(named).resolve() if named else Path(__file__).resolve().parents[2]


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE forbid hub downloads; read at call time
    (huggingface_hub reads them at import), so a notebook can set them late."""
    return _flag("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_error(what: str, error: Exception, fix: str, offline: bool = False) -> OSError:
    """One clear error for a failed pretrained download (weights, tokenizer), naming the way out."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    searched = " (HF_HUB_OFFLINE is set, so only the local cache was searched)" if offline else ""
    return OSError(f"could not load {what}{searched}: {type(error).__name__}: {first_line}\n"
                   "Pretrained files are downloaded once, so they need internet the first time or "
                   "a local copy (the Hugging Face cache ~/.cache/huggingface or HF_HOME; or "
                   f"save_pretrained(DIR) on a machine with internet and pass DIR). {fix}")


def from_hub(load, what: str, fix: str):
    """`load(local_files_only=hub_offline())`, any failure raised as `hub_error`."""
    offline = hub_offline()
    try:
        return load(local_files_only=offline)
    except Exception as e:
        raise hub_error(what, e, fix, offline) from e


def pick(default, smoke):
    """Return `smoke` in smoke mode, else `default`: the one way a config cell chooses a size."""
    return smoke if smoke_mode() else default


class CourseConfig:
    """Mixin for a method's dataclass config: `smoke()` sizes, or `for_course()` (COURSE_SMOKE)."""

    SMOKE: ClassVar[dict] = {}  # the fields a smoke run shrinks (only sizes, never the code path)
    # the real-photo preset (Flickr8k-sized training on a frozen CNN's grid), chosen on val
    # (docs/tuning_notes.md); course_lib.real_benchmark.real_sizes adds real data's switches
    REAL_PHOTOS: ClassVar[dict] = {}

    @classmethod
    def smoke(cls, **overrides):
        """Tiny sizes for CI and quick checks; same code path."""
        return cls(**{**cls.SMOKE, **overrides})

    @classmethod
    def for_course(cls, **overrides):
        """smoke() when COURSE_SMOKE is set, else the defaults."""
        return cls.smoke(**overrides) if smoke_mode() else cls(**overrides)

    def check_choices(self, **choices) -> None:
        """ValueError unless each named field is one of its choices (a tuple)."""
        for name, options in choices.items():
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {options}, got {getattr(self, name)!r}")


class CourseNote(UserWarning):
    """A warning for a learner, shown by `plain_course_notes` as one line without a file path."""


def plain_course_notes() -> None:
    """Show each CourseNote once as "note: <message>" on stderr, not as "file.py:123: ..."."""
    import sys
    import warnings
    if getattr(warnings.showwarning, "_course_notes", False):
        return
    shown, default = set(), warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, CourseNote):
            if str(message) not in shown:
                shown.add(str(message))
                print(f"note: {message}", file=file or sys.stderr)
            return
        default(message, category, filename, lineno, file, line)

    show._course_notes = True
    warnings.showwarning = show


def get_device(prefer: str | None = None) -> torch.device:
    """CUDA, then Apple MPS, then CPU; `prefer` (e.g. "cpu") or COURSE_DEVICE overrides."""
    choice = prefer or os.environ.get("COURSE_DEVICE")
    if choice:
        return torch.device(choice)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("mps" if torch.backends.mps.is_available() else "cpu")


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch (all devices) so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator: CUDA's and MPS's too


def describe_environment() -> dict[str, str]:
    """Versions and device: what every notebook prints first and every result records."""
    import platform
    device = get_device()
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "device": str(device), "smoke": str(smoke_mode()),
        # where trained models come from (core.shipped): printed, so a learner sees the switch
        "models": ("trained (smoke sizes)" if smoke_mode()
                   else "trained (COURSE_RETRAIN=1)" if retrain_mode()
                   else "shipped where they match (COURSE_RETRAIN=1 trains them)")}
    info |= ({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda"
             else {"cpu_threads": str(torch.get_num_threads())})
    for name in ("timm", "transformers", "tokenizers", "faiss"):
        try:
            info[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            info[name] = "not installed"
    return info
