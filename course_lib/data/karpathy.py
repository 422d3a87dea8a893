"""Karpathy split files (Flickr30k / COCO, or the synthetic benchmark in the same format) read
into a RetrievalSplit. A file is {"images": [...], "dataset": name}; each image has split,
filename, optional filepath (COCO), imgid, sentids and sentences ({raw, tokens, imgid, sentid})."""

import json
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from course_lib.data.datasets import read_image, size_hw
from course_lib.data.split import RetrievalSplit

_THREADS = min(8, os.cpu_count() or 2)  # for reading photos: JPEG decoding releases the GIL


def _load_json(json_path: Path) -> dict:
    if not json_path.is_file():
        raise FileNotFoundError(
            f"{json_path} not found. Download Karpathy's split files (caption_datasets.zip) and "
            "pass the path to dataset_flickr30k.json or dataset_coco.json, or run `python "
            "data_scripts/download_data.py flickr30k --out DIR` (or `coco`); for the built-in "
            "synthetic data run `python data_scripts/make_synthetic.py --out DIR`.")
    try:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{json_path} is not valid JSON ({e}); expected a Karpathy split "
                         "file") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(
            f"{json_path} is not a Karpathy split file: expected a JSON object with an 'images' "
            'list ({"images": [...], "dataset": ...}), as in dataset_flickr30k.json / '
            "dataset_coco.json from caption_datasets.zip")
    return data


def entry_path(img: dict) -> str:
    """An image entry's file relative to the image root: filepath / filename (a posix string)."""
    return (Path(img.get("filepath", "")) / img["filename"]).as_posix()


def _read(json_path, image_root, split, captions_per_image=5, regions_file=None, load_pixels=False,
          image_size=None, regions_dtype=np.float32, skip=()) -> tuple[RetrievalSplit, np.ndarray]:
    """read_karpathy, and the sentid of every caption (T,) (load_synthetic reorders by it)."""
    json_path, skip = Path(json_path), frozenset(skip)
    data = _load_json(json_path)
    wanted = (split,) if isinstance(split, str) else tuple(split)
    bad = next((i for i, img in enumerate(data["images"])
                if not isinstance(img, dict) or "split" not in img), None)
    if bad is not None:
        raise ValueError(f"{json_path}: image entry {bad} has no 'split' key (or is not an "
                         "object); every entry needs split, filename and sentences. Is the file "
                         "truncated or edited?")
    present = sorted({str(img["split"]) for img in data["images"]})
    unknown = [s for s in wanted if s not in present]
    if unknown:
        raise ValueError(
            f"{json_path} has no split {', '.join(map(repr, unknown))}; its splits are {present} "
            "(COCO's 113k training set is split=('train', 'restval'))")
    captions, txt2img, sentids, image_ids, rel_paths = [], [], [], [], []
    for index, img in enumerate(data["images"]):
        if img["split"] not in wanted or ("filename" in img and entry_path(img) in skip):
            continue
        for key in ("filename", "sentences"):
            if key not in img:
                raise ValueError(
                    f"{json_path}: image entry {index} (imgid {img.get('imgid', '?')}) has no "
                    f"'{key}' key; every entry needs split, filename and sentences. Is the file "
                    "truncated?")
        for j, sentence in enumerate(img["sentences"][:captions_per_image or None]):
            if not (isinstance(sentence, dict) and (sentence.get("tokens") or sentence.get("raw"))):
                raise ValueError(f"{json_path}: image entry {index}, sentence {j} has neither "
                                 "'tokens' nor 'raw'")
            # the reference code trains on tokens; raw, the fallback, is split the same way
            tokens = (sentence.get("tokens")
                      or re.findall(r"\w+", str(sentence.get("raw", "")).lower()))
            captions.append(" ".join(tokens).lower())
            txt2img.append(len(image_ids))
            sentids.append(sentence.get("sentid", -1))
        image_ids.append(str(img.get("image_id", Path(img["filename"]).stem)))
        rel_paths.append(Path(entry_path(img)))
    image_paths = None
    if image_root is not None:
        root = Path(image_root)
        image_paths = [str(root / p) for p in rel_paths]
        missing = [p for p in image_paths if not os.path.isfile(p)]  # ~2 us each: fail early
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(image_paths)} images listed in {json_path} are missing, "
                f"e.g. {missing[0]}. Check image_root={str(root)!r}: it must hold the images "
                "(Flickr30k: the flickr30k-images folder; COCO: the folder holding train2014/ and "
                "val2014/); `python data_scripts/download_data.py ... --check` checks the layout")
    if load_pixels and image_paths is None:
        raise ValueError("load_pixels=True needs image_root (the folder the image files are under)")
    split_name = "+".join(wanted)
    result = RetrievalSplit(
        name=split_name, captions=captions, txt2img=np.asarray(txt2img, dtype=np.int64),
        image_ids=image_ids, image_paths=image_paths,
        images=_read_all(image_paths, image_size, json_path) if load_pixels else None,
        info={"source": str(json_path), "dataset": data.get("dataset"), "split": split_name,
              "captions_per_image": captions_per_image})
    if regions_file is not None:
        _attach_regions(result, Path(regions_file), regions_dtype)
    return result, np.asarray(sentids, dtype=np.int64)


def read_karpathy(json_path, image_root=None, split="test", *, captions_per_image=5,
                  regions_file=None, load_pixels=False, image_size=None,
                  regions_dtype=np.float32, skip=()) -> RetrievalSplit:
    """One split (or several pooled, e.g. ("train", "restval")) of a Karpathy file: the first
    `captions_per_image` captions of each image (None: all), lower-cased tokens joined by spaces.
    image_root: every image file must exist; load_pixels reads them all into `images`.
    regions_file: an .npz (image_ids, regions, boxes, region_mask[, region_classes]) aligned by
    image id. skip: image files (entry_path) left out with their captions (unusable photos)."""
    return _read(json_path, image_root, split, captions_per_image, regions_file, load_pixels,
                 image_size, regions_dtype, skip)[0]


def karpathy_subset(json_path, out_path, sizes: dict) -> Path:
    """Write a Karpathy file of the first sizes[split] images of each split (None, absent: all)."""
    data = _load_json(Path(json_path))
    kept, taken = [], Counter()
    for img in data["images"]:
        split = img.get("split")
        if sizes.get(split) is None or taken[split] < sizes[split]:
            taken[split] += 1
            kept.append(img)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**data, "images": kept}), encoding="utf-8")
    return out


def split_names(json_path) -> list[str]:
    """The splits a Karpathy file holds: train, restval, val, test (those present), then others."""
    names = {str(img.get("split")) for img in _load_json(Path(json_path))["images"]}
    usual = [s for s in ("train", "restval", "val", "test") if s in names]
    return usual + sorted(names - set(usual))


def _read_all(paths, image_size, json_path) -> np.ndarray:
    read = lambda p: read_image(p, image_size)  # noqa: E731
    arrays = [read(p) for p in paths[:1]]
    if arrays and arrays[0].size >= 128 * 128 * 3:  # photos: decoding dominates and frees the GIL
        with ThreadPoolExecutor(_THREADS) as pool:
            arrays += list(pool.map(read, paths[1:], chunksize=16))
    else:  # tiny PNGs: per-call overhead dominates, threads only contend
        arrays += [read(p) for p in paths[1:]]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(
            f"images of {json_path} have different sizes ({sorted(shapes)[:3]} ...); pass "
            "image_size=... to resize them on load, or leave load_pixels=False and let the dataset "
            "read (and resize) them lazily")
    if not arrays:
        return np.zeros((0, *(size_hw(image_size) or (0, 0)), 3), dtype=np.uint8)
    return np.stack(arrays)  # (N, H, W, 3) uint8


def _rows(file_ids, split: RetrievalSplit, regions_file: Path) -> np.ndarray:
    """(N,) the row of each of the split's images in a regions file whose image_ids are file_ids."""
    row_of = {str(i): r for r, i in enumerate(file_ids)}
    missing = [i for i in split.image_ids if i not in row_of]
    if missing:
        raise ValueError(
            f"regions file {regions_file} lacks {len(missing)} of the {split.n_images} image ids "
            f"of split {split.name!r} (e.g. {missing[:3]}); extract features for this split or "
            "pass the regions file made from the same Karpathy file")
    return np.asarray([row_of[i] for i in split.image_ids], dtype=np.int64)


def _attach_regions(split: RetrievalSplit, regions_file: Path, regions_dtype=np.float32) -> None:
    if not regions_file.is_file():
        raise FileNotFoundError(f"regions file {regions_file} not found; make it with data_scripts/"
                                "extract_features.py or leave regions_file=None and use pixels")
    with np.load(regions_file, allow_pickle=False) as z:
        for key in ("image_ids", "regions", "boxes", "region_mask"):
            if key not in z:
                raise ValueError(f"regions file {regions_file} has no '{key}' array; it needs "
                                 "image_ids, regions, boxes, region_mask (region_classes optional)")
        rows = _rows(z["image_ids"], split, regions_file)
        whole = np.array_equal(rows, np.arange(len(z["image_ids"])))  # all, in order: no copy

        def take(key, dtype):
            return (z[key] if whole else z[key][rows]).astype(dtype, copy=False)

        split.regions = take("regions", regions_dtype)  # (N, R, D)
        split.boxes = take("boxes", np.float32)  # (N, R, 7)
        split.region_mask = take("region_mask", bool)  # (N, R)
        if "region_classes" in z:
            split.region_classes = take("region_classes", np.float32)  # (N, R, C)
