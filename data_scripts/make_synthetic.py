"""Generate the synthetic image-caption benchmark and write it to disk in Karpathy's format.

    python data_scripts/make_synthetic.py --out data/synthetic               # the course's size
    python data_scripts/make_synthetic.py --scenes 12000 --seed 0 --out DIR  # 10:1:1 splits
    python data_scripts/make_synthetic.py --smoke --out DIR                  # tiny, for CI

Read it back with `course_lib.data.synthetic_files.load_synthetic(DIR, "test")` (or "train",
"val", "pretrain", "compositional", "full"). Layout: see course_lib/data/synthetic_files.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

OUTPUTS = ("info.json", "regions.npz", "ground_truth.npz")  # besides dataset_*.json and images/


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path,
                   help="directory to write (created if missing)")
    p.add_argument("--scenes", type=int, default=None,
                   help="train+val+test scenes, split 10:1:1 (default: the course's size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=None,
                   help="pixels per side (default: config's, 32)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI, quick checks)")
    p.add_argument("--no-pretrain", action="store_true", help="skip the pre-training corpus")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a synthetic benchmark already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.scenes is not None and args.scenes < 12:
        p.error(f"--scenes {args.scenes}: need at least 12 (train/val/test are split 10:1:1)")
    if args.smoke and args.scenes is not None:
        p.error("give --smoke or --scenes, not both")
    problem = _check_out(args.out, args.overwrite)
    if problem:
        p.error(problem)
    return args


def _check_out(out: Path, overwrite: bool) -> str | None:
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; give a directory"
    if out.is_dir() and any(out.iterdir()):
        if not (out / "info.json").is_file():
            return (f"--out {out} is not empty and holds no synthetic benchmark; give a new or "
                    "empty directory")
        if not overwrite:
            return (f"--out {out} already holds a synthetic benchmark; pass --overwrite to "
                    "replace it")
    parent = out if out.exists() else next((q for q in out.parents if q.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        return f"--out {out}: cannot write under {parent}; pick a directory you can write to"
    return None


def _clear(out: Path) -> None:
    """Delete a previous benchmark's files (only those this script writes): no stale PNG stays."""
    for path in list(out.glob("dataset_*.json")) + [out / name for name in OUTPUTS]:
        path.unlink(missing_ok=True)
    images = out / "images"
    if images.is_dir():
        for png in images.glob("*.png"):
            png.unlink()


def make_config(args):
    from course_lib.data.synthetic import SyntheticConfig

    if args.smoke:
        cfg = SyntheticConfig.smoke()
    elif args.scenes is not None:
        cfg = SyntheticConfig.scaled(args.scenes)
    else:
        cfg = SyntheticConfig.for_course()
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    if args.image_size is not None:
        changes["image_size"] = args.image_size
    if args.no_pretrain and "n_pretrain" in fields:
        changes["n_pretrain"] = 0
    unknown = set(changes) - fields
    if unknown:
        raise SystemExit(f"SyntheticConfig has no field(s) {sorted(unknown)}; this script is out "
                         "of date")
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _human(n_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n_bytes < 1024 or unit == "GB":
            return f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024


def main(argv=None) -> dict:
    """Parse argv, generate, write; returns the writer's summary plus generation seconds."""
    args = parse_args(argv)  # first, so a bad command line fails before the heavy imports
    from course_lib.data.synthetic import make_benchmark
    from course_lib.data.synthetic_files import write_karpathy

    cfg = make_config(args)
    start = time.perf_counter()
    bench = make_benchmark(cfg, seed=args.seed, progress=not args.quiet)
    gen_seconds = time.perf_counter() - start
    if args.no_pretrain:
        bench.pop("pretrain", None)
    if args.out.is_dir():
        _clear(args.out)
    summary = write_karpathy(bench, args.out, progress=not args.quiet)
    summary["generate_seconds"] = gen_seconds
    for name, split in bench.items():
        if name != "full":
            print(f"  {split.summary()}")
    print(f"wrote {summary['n_images']} images and {summary['n_texts']} captions to {args.out} "
          f"({_human(summary['bytes'])}): generated in {gen_seconds:.1f} s, written in "
          f"{summary['seconds']:.1f} s")
    print("read it with: course_lib.data.synthetic_files.load_synthetic("
          f"{str(args.out)!r}, 'test')")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
