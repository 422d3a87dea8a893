"""The synthetic benchmark on disk in Karpathy's format, so read_karpathy serves real and
synthetic data alike: dataset_synthetic.json, images/<image_id>.png, regions.npz, ground_truth.npz
(scenes, meanings and array-valued info per split) and info.json (config, seed, sizes)."""

import json
import struct
import time
import zlib
from pathlib import Path

import numpy as np

from course_lib.data.karpathy import _read
from course_lib.data.scenes import Meanings, Scenes
from course_lib.data.split import RetrievalSplit, concatenate

IMAGE_DIR = "images"  # the synthetic PNGs live in out_dir/IMAGE_DIR, the Karpathy `filepath`
_GT_SEP = "__"  # npz keys "<split>__scenes__<key>": no "/" so zip member names stay flat


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def png_bytes(pixels: np.ndarray) -> bytes:
    """uint8 (H, W, 3) as PNG bytes: a minimal encoder, 3x faster than PIL for tiny images."""
    h, w, _ = pixels.shape
    rows = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # (H, 1 + 3W): filter byte 0, then RGB
    rows[:, 1:] = pixels.reshape(h, 3 * w)
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8 bits, colour type 2 = RGB
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1)) + _png_chunk(b"IEND", b""))


def write_karpathy(splits: dict[str, RetrievalSplit], out_dir, dataset_name="synthetic",
                   progress=False) -> dict:
    """Write splits with in-memory pixels under out_dir ("full" skipped); returns a summary."""
    from tqdm.auto import tqdm

    start, out = time.perf_counter(), Path(out_dir)
    splits = {k: s for k, s in splits.items() if k != "full"}
    seen: dict[str, str] = {}
    for key, s in splits.items():
        if _GT_SEP in key:
            raise ValueError(f"split name {key!r}: no {_GT_SEP!r} (it separates ground-truth keys)")
        if s.images is None:
            raise ValueError(f"split {key!r} has no pixels in memory; write_karpathy writes PNGs")
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
        for i, (image_id, own) in enumerate(zip(s.image_ids, s.img2txt(), strict=True)):
            sentences = [{"tokens": s.captions[t].split(), "raw": s.captions[t], "imgid": imgid,
                          "sentid": sentid + int(t)} for t in own]
            entries.append({"filepath": IMAGE_DIR, "filename": f"{image_id}.png", "imgid": imgid,
                            "split": key, "sentids": [x["sentid"] for x in sentences],
                            "sentences": sentences})
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
        tables["info"] = {k: v for k, v in s.info.items() if isinstance(v, np.ndarray)}  # twin_of
        for part, arrays in tables.items():
            for name, array in arrays.items():
                gt[_GT_SEP.join((key, part, name))] = np.asarray(array)

    json_path = out / f"dataset_{dataset_name}.json"
    # dumps, not dump: dump streams through the pure-Python encoder, 5x slower on 150k sentences
    json_path.write_text(json.dumps({"images": entries, "dataset": dataset_name},
                                    separators=(",", ":")), encoding="utf-8")
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
    first = next(iter(splits.values())).info if splits else {}
    info = {"dataset": dataset_name, "config": first.get("config"), "seed": first.get("seed"),
            "splits": {k: {"n_images": s.n_images, "n_texts": s.n_texts,
                           "has_regions": s.has_regions, "image_shape": list(s.images.shape[1:]),
                           "info": {k: v for k, v in s.info.items()
                                    if not isinstance(v, np.ndarray)}}
                       for k, s in splits.items()}}
    numpy_as_list = lambda v: v.tolist() if isinstance(v, (np.generic, np.ndarray)) else str(v)  # noqa: E731
    (out / "info.json").write_text(json.dumps(info, indent=1, default=numpy_as_list),
                                   encoding="utf-8")
    return {"out_dir": str(out), "json": str(json_path), "n_images": imgid, "n_texts": sentid,
            "seconds": time.perf_counter() - start,
            "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}  # as `du` says


def load_synthetic(out_dir, split="test", *, load_pixels=True) -> RetrievalSplit:
    """A split written by write_karpathy, exactly as in memory; "full" pools train, val, test."""
    out = Path(out_dir)
    info_path = out / "info.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path} not found: {out} holds no synthetic benchmark. Make "
                                f"one with `python data_scripts/make_synthetic.py --out {out}`")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    if split == "full":
        parts = [load_synthetic(out, s, load_pixels=load_pixels) for s in ("train", "val", "test")]
        full = concatenate(parts, "full")
        full.info.update({"config": info["config"], "seed": info["seed"], "split": "full"})
        return full
    if split not in info["splits"]:
        raise ValueError(f"{out} has no split {split!r}; it has {sorted(info['splits'])} "
                         "(and 'full')")
    meta = info["splits"][split]
    regions_file = out / "regions.npz" if meta["has_regions"] else None
    result, sentids = _read(out / f"dataset_{info['dataset']}.json", out, split, None, regions_file,
                            load_pixels)  # None: every caption of each image
    order = np.argsort(sentids, kind="stable")  # back to the writer's caption order
    result.captions = [result.captions[t] for t in order]
    result.txt2img = result.txt2img[order]
    result.name, result.info = split, meta["info"]
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
    for part, table in (("scenes", Scenes), ("meanings", Meanings)):
        if arrays[part]:
            setattr(result, part, table.from_arrays(arrays[part]))
