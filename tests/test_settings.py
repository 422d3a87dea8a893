"""course_lib.core.settings: the smoke switch, device choice, seeding, hub switch, config mixin."""

import torch

from course_lib.core import settings


def test_smoke_switch_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert settings.smoke_mode() and settings.pick(100, 3) == 3
    monkeypatch.setenv("COURSE_SMOKE", "0")
    assert not settings.smoke_mode() and settings.pick(100, 3) == 100
    monkeypatch.delenv("COURSE_SMOKE")
    assert not settings.smoke_mode()


def test_device_choice_and_override(monkeypatch):
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    expected = "cuda" if torch.cuda.is_available() else None
    device = settings.get_device()
    if expected:
        assert device.type == expected
    assert settings.get_device("cpu").type == "cpu"
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert settings.get_device().type == "cpu"


def test_seed_everything_repeats_random_streams():
    import random

    import numpy as np

    settings.seed_everything(7)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    settings.seed_everything(7)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_describe_environment_names_versions_and_device():
    info = settings.describe_environment()
    for key in ("python", "torch", "device", "timm", "transformers", "faiss"):
        assert key in info and info[key]


def test_describe_environment_says_where_models_come_from(monkeypatch):
    monkeypatch.delenv("COURSE_SMOKE", raising=False)
    monkeypatch.delenv("COURSE_RETRAIN", raising=False)
    assert settings.describe_environment()["models"].startswith("shipped")
    monkeypatch.setenv("COURSE_RETRAIN", "1")
    assert (settings.retrain_mode()
            and settings.describe_environment()["models"] == "trained (COURSE_RETRAIN=1)")
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert settings.describe_environment()["models"] == "trained (smoke sizes)"


def test_hub_offline_flag_is_read_at_call_time(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "yes")
    assert settings.hub_offline()
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    assert not settings.hub_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert settings.hub_offline()


def test_from_hub_follows_the_offline_switch_and_explains_failures(monkeypatch):
    import pytest

    seen = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert settings.from_hub(lambda **kw: seen.append(kw) or "loaded", "x", "fix") == "loaded"
    assert seen == [{"local_files_only": True}]

    def failing(**kw):
        raise ConnectionError("no route to host\nlong traceback text")

    expected = (r"could not load the thing \(HF_HUB_OFFLINE.*ConnectionError: no route to host\n"
                r".*internet.*use the offline way")
    with pytest.raises(OSError, match=expected) as info:
        settings.from_hub(failing, "the thing", "use the offline way")
    assert (isinstance(info.value.__cause__, ConnectionError)
            and "long traceback" not in str(info.value))


def test_course_config_mixin_gives_smoke_sizes(monkeypatch):
    from dataclasses import dataclass
    from typing import ClassVar

    @dataclass
    class Toy(settings.CourseConfig):
        steps: int = 1000
        width: int = 64
        SMOKE: ClassVar[dict] = {"steps": 10}

    assert Toy.smoke() == Toy(steps=10) and Toy.smoke(width=8) == Toy(steps=10, width=8)
    monkeypatch.setenv("COURSE_SMOKE", "1")
    assert Toy.for_course() == Toy(steps=10)
    monkeypatch.setenv("COURSE_SMOKE", "0")
    assert Toy.for_course() == Toy()
