"""Real-data features as the course's bench dict: a feature folder that
data_scripts/extract_features.py wrote (regions.npz, features.json), read as make_benchmark's."""

import json
from pathlib import Path

import numpy as np

from course_lib.data.karpathy import _attach_regions, _rows, read_karpathy
from course_lib.data.split import RetrievalSplit, concatenate


def read_pooled(regions_file, split: RetrievalSplit) -> np.ndarray:
    """float32 (N, D): the backbone's pooled vector of each image (VSE++'s own input)."""
    regions_file = Path(regions_file)
    with np.load(regions_file, allow_pickle=False) as z:
        if "pooled" not in z:
            raise ValueError(f"regions file {regions_file} has no 'pooled' array; only "
                             "data_scripts/extract_features.py writes one")
        rows = _rows(z["image_ids"], split, regions_file)
        return z["pooled"][rows].astype(np.float32, copy=False)


def load_feature_bench(features_dir, *, captions_per_image=5, regions_dtype=np.float32,
                       karpathy_json=None, image_root=None) -> dict[str, RetrievalSplit]:
    """The bench dict of a feature folder: "train" (COCO: train + restval), "val", "test", "full"
    when all three were extracted, and "pretrain" = "train" (LightningDOT pre-trains in-domain).
    The regions are read once; every split's arrays are views into them. image_root adds
    image_paths; karpathy_json overrides the Karpathy file that features.json names."""
    folder = Path(features_dir)
    manifest_path = folder / "features.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found: make the feature folder with "
                                f"`python data_scripts/extract_features.py ... --out {folder}`")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if not manifest.get("complete"):
        raise ValueError(f"the extraction into {folder} has not finished; run the same "
                         "extract_features.py command again: it resumes where it stopped")
    groups = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}
    json_path, bench = karpathy_json or manifest["karpathy_json"], {}
    for name, group in groups.items():  # one Karpathy split at a time, as extract_features wrote
        parts = [read_karpathy(json_path, image_root, split=s, skip=manifest.get("skipped", {}),
                               captions_per_image=captions_per_image)
                 for s in group if s in manifest["splits"]]
        if parts:
            bench[name] = parts[0] if len(parts) == 1 else concatenate(parts, name)
    everything, splits = list(bench) == ["train", "val", "test"], list(bench.values())
    pooled = concatenate(splits, "full", queries_from=splits[-1] if everything else None)
    _attach_regions(pooled, folder / "regions.npz", regions_dtype)
    start = 0
    for name, split in bench.items():
        rows, start = slice(start, start + split.n_images), start + split.n_images
        for field in ("regions", "boxes", "region_mask", "region_classes"):
            if getattr(pooled, field) is not None:
                setattr(split, field, getattr(pooled, field)[rows])  # a view: no second copy
        split.name = name
    if everything:
        bench["full"] = pooled
    features = {k: manifest[k] for k in ("backbone", "pretrained", "grid", "image_size")}
    for split in bench.values():
        split.info["features"] = dict(features)
    if "train" in bench:
        bench["pretrain"] = bench["train"]
    return bench


def extracted_images(features_dir) -> Path | None:
    """The photo folder a feature folder was extracted from, if it still exists (same image paths,
    so the same trained-model names)."""
    manifest = json.loads((Path(features_dir) / "features.json").read_text(encoding="utf-8"))
    images = Path(manifest.get("images", ""))
    return images if manifest.get("images") and images.is_dir() else None
