"""Karpathy split files: read Flickr30k / COCO into a RetrievalSplit, and write the synthetic
benchmark to disk in the same format so that one reader serves both.

A Karpathy file (`dataset_flickr30k.json`, `dataset_coco.json`) is
`{"images": [...], "dataset": name}`; each image has `split` (train / val / test / restval),
`filename`, optional `filepath` (COCO: train2014 / val2014), `imgid`, `sentids` and `sentences`
(`{raw, tokens, imgid, sentid}`). The synthetic benchmark on disk (`write_karpathy`):

    out_dir/dataset_synthetic.json   every split in one Karpathy file (split field = split name)
    out_dir/images/<image_id>.png    lossless pixels (filepath "images", image_root = out_dir)
    out_dir/regions.npz              image_ids, regions, boxes, region_mask, region_classes
    out_dir/ground_truth.npz         "<split>__scenes__<key>", "<split>__meanings__<key>" (to_arrays)
                                     and "<split>__info__<key>" (array-valued split.info, e.g. twin_of)
    out_dir/info.json                config, seed, sizes and the rest of split.info per split

Real data gets its regions from `data_scripts/extract_features.py`; `course_lib.data.features` reads
its feature folder into the bench dict every method's `fit(bench, tokenizer)` reads.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from course_lib.data.datasets import read_image, size_hw
from course_lib.data.split import RetrievalSplit, concatenate

IMAGE_DIR = "images"  # the synthetic PNGs live in out_dir/IMAGE_DIR, the Karpathy `filepath`
_THREADS = min(8, os.cpu_count() or 2)  # for reading photos: JPEG decoding releases the GIL
_GT_SEP = "__"  # npz keys "<split>__scenes__<key>": no "/" so zip member names stay flat


def _load_json(json_path: Path) -> dict:
    if not json_path.is_file():
        raise FileNotFoundError(
            f"{json_path} not found. Download Karpathy's split files (caption_datasets.zip) and pass "
            "the path to dataset_flickr30k.json or dataset_coco.json, or run "
            "`python data_scripts/download_data.py flickr30k --out DIR` (or `coco`); for the built-in "
            "synthetic data run `python data_scripts/make_synthetic.py --out DIR`."
        )
    try:
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{json_path} is not valid JSON ({e}); expected a Karpathy split file") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ValueError(
            f"{json_path} is not a Karpathy split file: expected a JSON object with an 'images' list "
            '({"images": [...], "dataset": ...}), as in dataset_flickr30k.json / dataset_coco.json '
            "from caption_datasets.zip"
        )
    return data


def _caption(sentence: dict) -> str:
    # the reference code trains on the tokens field; raw is the fallback, split into words the same
    # way (lower case, punctuation dropped) so both kinds of caption look alike
    tokens = sentence.get("tokens") or re.findall(r"\w+", str(sentence.get("raw", "")).lower())
    return " ".join(tokens).lower()


def entry_path(img: dict) -> str:
    """An image entry's file, relative to the image root: filepath / filename (as a posix string)."""
    return (Path(img.get("filepath", "")) / img["filename"]).as_posix()


def _read(json_path, image_root=None, split="test", *, captions_per_image=5, regions_file=None,
          load_pixels=False, image_size=None, regions_dtype=np.float32,
          skip=frozenset()) -> tuple[RetrievalSplit, np.ndarray]:
    """read_karpathy, also returning the sentid of every caption (T,) (load_synthetic reorders by it)."""
    json_path = Path(json_path)
    skip = frozenset(skip)
    data = _load_json(json_path)
    wanted = (split,) if isinstance(split, str) else tuple(split)
    bad = next((i for i, img in enumerate(data["images"])
                if not isinstance(img, dict) or "split" not in img), None)
    if bad is not None:
        raise ValueError(f"{json_path}: image entry {bad} has no 'split' key (or is not an object); "
                         "every entry needs split, filename and sentences. Is the file truncated or edited?")
    present = sorted({str(img["split"]) for img in data["images"]})
    unknown = [s for s in wanted if s not in present]
    if unknown:
        raise ValueError(
            f"{json_path} has no split {', '.join(map(repr, unknown))}; its splits are {present} "
            "(COCO's 113k training set is split=('train', 'restval'))"
        )
    captions, txt2img, sentids, image_ids, rel_paths = [], [], [], [], []
    for index, img in enumerate(data["images"]):
        if img["split"] not in wanted or ("filename" in img and entry_path(img) in skip):
            continue
        for key in ("filename", "sentences"):
            if key not in img:
                raise ValueError(
                    f"{json_path}: image entry {index} (imgid {img.get('imgid', '?')}) has no "
                    f"'{key}' key; every entry needs split, filename and sentences. Is the file truncated?"
                )
        sentences = img["sentences"][:captions_per_image] if captions_per_image else img["sentences"]
        for j, sentence in enumerate(sentences):
            if not isinstance(sentence, dict) or not (sentence.get("tokens") or sentence.get("raw")):
                raise ValueError(
                    f"{json_path}: image entry {index}, sentence {j} has neither 'tokens' nor 'raw'"
                )
            captions.append(_caption(sentence))
            txt2img.append(len(image_ids))
            sentids.append(sentence.get("sentid", -1))
        image_ids.append(str(img.get("image_id", Path(img["filename"]).stem)))
        rel_paths.append(Path(entry_path(img)))

    image_paths = None
    if image_root is not None:
        root = Path(image_root)
        image_paths = [str(root / p) for p in rel_paths]
        missing = [p for p in image_paths if not os.path.isfile(p)]  # ~2 us each: fail early, not mid-epoch
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(image_paths)} images listed in {json_path} are missing, "
                f"e.g. {missing[0]}. Check image_root={str(root)!r}: it must hold the images "
                "(Flickr30k: the flickr30k-images folder; COCO: the folder holding train2014/ and "
                "val2014/); `python data_scripts/download_data.py ... --check` checks the layout"
            )
    if load_pixels and image_paths is None:
        raise ValueError("load_pixels=True needs image_root (the folder the image files are under)")
    images = _read_all(image_paths, image_size, json_path) if load_pixels else None

    split_name = "+".join(wanted)
    result = RetrievalSplit(
        name=split_name, captions=captions, txt2img=np.asarray(txt2img, dtype=np.int64),
        image_ids=image_ids, images=images, image_paths=image_paths,
        info={"source": str(json_path), "dataset": data.get("dataset"), "split": split_name,
              "captions_per_image": captions_per_image},
    )
    if regions_file is not None:
        _attach_regions(result, Path(regions_file), regions_dtype)
    return result, np.asarray(sentids, dtype=np.int64)


def read_karpathy(json_path, image_root=None, split="test", *, captions_per_image=5,
                  regions_file=None, load_pixels=False, image_size=None,
                  regions_dtype=np.float32, skip=()) -> RetrievalSplit:
    """One split (or several pooled, e.g. ("train", "restval")) of a Karpathy file as a RetrievalSplit.

    Captions are the lower-cased `tokens` joined by spaces, the first `captions_per_image` of each
    image (None keeps all). With `image_root`, `image_paths` = image_root / filepath / filename and
    every file must exist; `load_pixels` reads them all into `images` uint8 (N, H, W, 3), resized to
    `image_size` if given. `regions_file` (.npz with image_ids, regions, boxes, region_mask and
    optionally region_classes) fills the region fields, aligned by image id; `regions` comes back
    as regions_dtype (np.float16 halves the memory of big real-data files; datasets cast per item).
    `skip`: image files (entry_path: filepath/filename) left out, with their captions: the ones
    course_lib.data.photo_check found unusable and extract_features.py recorded.
    """
    return _read(json_path, image_root, split, captions_per_image=captions_per_image,
                 regions_file=regions_file, load_pixels=load_pixels, image_size=image_size,
                 regions_dtype=regions_dtype, skip=skip)[0]


def karpathy_subset(json_path, out_path, sizes: dict) -> Path:
    """Write a Karpathy file of the first sizes[split] image entries of each split (all of a split that
    sizes leaves out, or maps to None): smaller runs of the same commands on the same photos."""
    data = _load_json(Path(json_path))
    taken: dict = {}
    kept = []
    for img in data["images"]:
        split = img.get("split")
        limit = sizes.get(split)
        if limit is None or taken.get(split, 0) < limit:
            taken[split] = taken.get(split, 0) + 1
            kept.append(img)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**data, "images": kept}), encoding="utf-8")
    return out


def split_names(json_path) -> list[str]:
    """The splits a Karpathy file holds: train, restval, val, test (those present), then any others."""
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
            "read (and resize) them lazily"
        )
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
            "pass the regions file made from the same Karpathy file"
        )
    return np.asarray([row_of[i] for i in split.image_ids], dtype=np.int64)


def _attach_regions(split: RetrievalSplit, regions_file: Path, regions_dtype=np.float32) -> None:
    if not regions_file.is_file():
        raise FileNotFoundError(
            f"regions file {regions_file} not found; make it with "
            "data_scripts/extract_features.py or leave regions_file=None and use pixels"
        )
    with np.load(regions_file, allow_pickle=False) as z:
        for key in ("image_ids", "regions", "boxes", "region_mask"):
            if key not in z:
                raise ValueError(f"regions file {regions_file} has no '{key}' array; it needs "
                                 "image_ids, regions, boxes, region_mask (region_classes optional)")
        rows = _rows(z["image_ids"], split, regions_file)
        whole = np.array_equal(rows, np.arange(len(z["image_ids"])))  # all, in order: take without a copy
        take = lambda key, dtype: (z[key] if whole else z[key][rows]).astype(dtype, copy=False)  # noqa: E731
        split.regions = take("regions", regions_dtype)  # (N, R, D)
        split.boxes = take("boxes", np.float32)  # (N, R, 7)
        split.region_mask = take("region_mask", bool)  # (N, R)
        if "region_classes" in z:
            split.region_classes = take("region_classes", np.float32)  # (N, R, C)


def _json_default(value):
    # json.dumps fallback for what split.info may hold: numpy scalars and arrays, anything else as str
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return str(value)


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def png_bytes(pixels: np.ndarray) -> bytes:
    """uint8 (H, W, 3) as a lossless PNG file's bytes. A minimal encoder (8-bit RGB, no filter,
    zlib level 1): 3x faster than PIL's save for tiny images, whose cost is per-call overhead."""
    h, w, _ = pixels.shape
    rows = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # (H, 1 + 3W): filter byte 0, then RGB
    rows[:, 1:] = pixels.reshape(h, 3 * w)
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, colour type 2 = RGB
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + _png_chunk(b"IEND", b""))


def write_karpathy(splits: dict[str, RetrievalSplit], out_dir, dataset_name="synthetic",
                   progress=False) -> dict:
    """Write splits (with in-memory pixels) as a Karpathy-format dataset under out_dir.

    A "full" entry (the pool of train/val/test) is skipped: load_synthetic rebuilds it. Image ids
    must be unique across the splits, since every PNG lives in out_dir/images. Returns a summary
    dict (paths, sizes, seconds, bytes on disk).
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    out = Path(out_dir)
    splits = {k: s for k, s in splits.items() if k != "full"}
    seen: dict[str, str] = {}
    for key, s in splits.items():
        if _GT_SEP in key:
            raise ValueError(f"split name {key!r}: no {_GT_SEP!r} please (it separates ground-truth keys)")
        if s.images is None:
            raise ValueError(f"split {key!r} has no pixels in memory; write_karpathy writes images as PNG")
        for image_id in s.image_ids:
            if image_id in seen:
                raise ValueError(f"image id {image_id!r} appears in splits {seen[image_id]!r} and "
                                 f"{key!r}; ids must be unique since all PNGs share out_dir/images")
            seen[image_id] = key
    (out / IMAGE_DIR).mkdir(parents=True, exist_ok=True)

    entries, jobs, regions, gt = [], [], {}, {}
    imgid = sentid = 0
    for key, s in splits.items():
        # sentids follow caption order, so load_synthetic restores it even if captions interleave
        first_sentid = sentid
        by_image = s.img2txt()
        for i, image_id in enumerate(s.image_ids):
            sentences = [{"tokens": s.captions[t].split(), "raw": s.captions[t], "imgid": imgid,
                          "sentid": first_sentid + int(t)} for t in by_image[i]]
            entries.append({"filepath": IMAGE_DIR, "filename": f"{image_id}.png", "imgid": imgid,
                            "split": key, "sentids": [x["sentid"] for x in sentences], "sentences": sentences})
            jobs.append((out / IMAGE_DIR / f"{image_id}.png", s.images[i]))
            imgid += 1
        sentid += s.n_texts
        if s.has_regions:
            regions.setdefault("image_ids", []).append(np.asarray(s.image_ids))
            for name in ("regions", "boxes", "region_mask", "region_classes"):
                if getattr(s, name) is not None:
                    regions.setdefault(name, []).append(getattr(s, name))
        tables = {part: getattr(s, part).to_arrays() for part in ("scenes", "meanings")
                  if getattr(s, part) is not None}
        tables["info"] = {k: v for k, v in s.info.items() if isinstance(v, np.ndarray)}  # e.g. twin_of
        for part, arrays in tables.items():
            for name, array in arrays.items():
                gt[_GT_SEP.join((key, part, name))] = np.asarray(array)

    json_path = out / f"dataset_{dataset_name}.json"
    # dumps, not dump: dump streams through the pure-Python encoder, 5x slower on 150k sentences
    json_path.write_text(json.dumps({"images": entries, "dataset": dataset_name}, separators=(",", ":")),
                         encoding="utf-8")
    for path, pixels in tqdm(jobs, disable=not progress, desc="writing PNGs", unit="img",
                             mininterval=0.5):
        path.write_bytes(png_bytes(np.ascontiguousarray(pixels)))
    if regions:
        lengths = {len(v) for v in regions.values()}
        if len(lengths) > 1:
            raise ValueError("some splits have region_classes and others not; give all or none")
        try:
            np.savez(out / "regions.npz", **{k: np.concatenate(v) for k, v in regions.items()})
        except ValueError as e:
            raise ValueError(f"region arrays of the splits differ in shape ({e}); use one "
                             "detector config (same R, D, C) for every split") from e
    np.savez(out / "ground_truth.npz", **gt)

    first = next(iter(splits.values()), None)
    info = {
        "dataset": dataset_name,
        "config": first.info.get("config") if first else None,
        "seed": first.info.get("seed") if first else None,
        "splits": {k: {"n_images": s.n_images, "n_texts": s.n_texts, "has_regions": s.has_regions,
                       "image_shape": list(s.images.shape[1:]),
                       "info": {k: v for k, v in s.info.items() if not isinstance(v, np.ndarray)}}
                   for k, s in splits.items()},
    }
    (out / "info.json").write_text(json.dumps(info, indent=1, default=_json_default), encoding="utf-8")
    return {"out_dir": str(out), "json": str(json_path), "n_images": imgid, "n_texts": sentid,
            "seconds": time.perf_counter() - start, "bytes": disk_size(out)}


def disk_size(path) -> int:
    """Bytes used by the files under path (what `du` would roughly say)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def load_synthetic(out_dir, split="test", *, load_pixels=True) -> RetrievalSplit:
    """Read a split written by write_karpathy back into exactly the in-memory RetrievalSplit.

    `split="full"` pools train + val + test (the papers' full setting).
    """
    out = Path(out_dir)
    info_path = out / "info.json"
    if not info_path.is_file():
        raise FileNotFoundError(
            f"{info_path} not found: {out} does not hold a synthetic benchmark. Make one with "
            f"`python data_scripts/make_synthetic.py --out {out}`"
        )
    with open(info_path, encoding="utf-8") as f:
        info = json.load(f)
    if split == "full":
        parts = [load_synthetic(out, s, load_pixels=load_pixels) for s in ("train", "val", "test")]
        full = concatenate(parts, "full")
        full.info.update({"config": info["config"], "seed": info["seed"], "split": "full"})
        return full
    if split not in info["splits"]:
        raise ValueError(f"{out} has no split {split!r}; it has {sorted(info['splits'])} (and 'full')")
    meta = info["splits"][split]
    regions_file = out / "regions.npz" if meta["has_regions"] else None
    result, sentids = _read(out / f"dataset_{info['dataset']}.json", out, split, captions_per_image=None,
                            regions_file=regions_file, load_pixels=load_pixels)
    order = np.argsort(sentids, kind="stable")  # back to the writer's caption order
    result.captions = [result.captions[t] for t in order]
    result.txt2img = result.txt2img[order]
    result.name = split
    result.info = meta["info"]
    _attach_ground_truth(result, out / "ground_truth.npz", split)
    return result


def _attach_ground_truth(result: RetrievalSplit, path: Path, split: str) -> None:
    if not path.is_file():
        return
    with np.load(path, allow_pickle=False) as z:
        arrays = {"scenes": {}, "meanings": {}, "info": {}}
        for key in z.files:
            name, part, field = key.split(_GT_SEP, 2)
            if name == split:
                arrays[part][field] = z[key]
    result.info.update(arrays["info"])
    if arrays["scenes"] or arrays["meanings"]:
        from course_lib.data.synthetic import (  # only synthetic data has ground truth
            Meanings,
            Scenes,
        )

        if arrays["scenes"]:
            result.scenes = Scenes.from_arrays(arrays["scenes"])
        if arrays["meanings"]:
            result.meanings = Meanings.from_arrays(arrays["meanings"])


__all__ = ["read_karpathy", "entry_path", "karpathy_subset", "write_karpathy", "load_synthetic", "split_names", "png_bytes", "disk_size",
           "IMAGE_DIR"]
