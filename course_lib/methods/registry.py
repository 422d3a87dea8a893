"""The method registry: every benchmark method registers itself where it is defined.

    @register_method("scan", order=2)
    def _scan(build):  # build: a Build (seed, smoke, config(), method())
        return SCANMethod(build.config(SCANConfig))

    @register_method("lightningdot+rerank@20", order=3.2)
    def _rerank(build):  # a method built from others asks for them by name
        return TwoStageMethod(build.method("lightningdot"), build.method("cross_encoder"), 20)

`available_methods` imports every module here, then builds each registered method once, in order.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

_REGISTRY: dict[str, Registration] = {}


@dataclass(frozen=True)
class Registration:
    name: str
    order: float  # position in the course (the lesson number, with decimals inside a lesson)
    factory: Callable  # factory(build: Build) -> a Method named `name`


def register_method(name: str, order: float, *, replace: bool = False):
    """Decorator registering factory(build) -> Method under `name` (see the module docstring)."""
    def decorate(factory):
        if name in _REGISTRY and not replace and _REGISTRY[name].factory is not factory:
            raise ValueError(f"a method named {name!r} is already registered "
                             f"(by {_REGISTRY[name].factory.__module__}); pick another name")
        _REGISTRY[name] = Registration(name, float(order), factory)
        return factory
    return decorate


def unregister_method(name: str) -> None:
    """Remove a registration (tests that register a temporary method clean up with this)."""
    _REGISTRY.pop(name, None)


@dataclass
class Build:
    """What a factory gets: the run's seed and mode, configs in that mode, and the other methods."""

    seed: int = 0
    smoke: bool = False
    built: dict = field(default_factory=dict)
    # config class name -> fields set over the factory's (e.g. real_benchmark's real-data sizes)
    sizes: dict = field(default_factory=dict)
    real_photos: bool = False  # outside smoke mode, each config takes its class's REAL_PHOTOS

    def config(self, config_class, **overrides):
        """config_class in this run's mode with overrides, then REAL_PHOTOS, then sizes."""
        preset = config_class.REAL_PHOTOS if self.real_photos and not self.smoke else {}
        sizes = self.sizes.get(config_class.__name__, {})
        overrides = {"seed": self.seed, **overrides, **preset, **sizes}
        return config_class.smoke(**overrides) if self.smoke else config_class(**overrides)

    def method(self, name: str):
        """The method registered as `name`, built once per run (so its model is trained once)."""
        if name not in self.built:
            if name not in _REGISTRY:
                raise KeyError(f"no method named {name!r}; registered: {registered_names()}")
            method = _REGISTRY[name].factory(self)
            if getattr(method, "name", None) != name:
                raise ValueError(f"the factory registered as {name!r} built a method named "
                                 f"{getattr(method, 'name', None)!r}; the two must agree")
            self.built[name] = method
        return self.built[name]


def registered_names() -> list[str]:
    """Every registered method's name, in course order, once every module of course_lib.methods
    (where methods register) is imported."""
    import course_lib.methods

    for info in pkgutil.walk_packages(course_lib.methods.__path__, prefix="course_lib.methods."):
        importlib.import_module(info.name)
    return [r.name for r in sorted(_REGISTRY.values(), key=lambda r: (r.order, r.name))]


def available_methods(seed: int = 0, smoke: bool = False, names=None, sizes=None,
                      real_photos: bool = False) -> list:
    """The registered methods (all, or `names`), each built once for this seed and mode."""
    everything = registered_names()
    unknown = sorted(set(names or ()) - set(everything))
    if unknown:
        raise KeyError(f"unknown method(s) {unknown}; choose from {everything}")
    build = Build(seed, smoke, sizes=dict(sizes or {}), real_photos=real_photos)
    return [build.method(n) for n in everything if names is None or n in set(names)]
