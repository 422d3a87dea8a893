"""Where the course finds real photographs: a Karpathy-format folder (images/ and dataset_*.json),
named by COURSE_PHOTOS, else data/flickr8k in the repository, else ../shared/data/flickr8k. The
photos are never part of the course (docs/real_data.md)."""

import os
from pathlib import Path

from course_lib.core.settings import course_repository


def places() -> tuple[Path, Path]:
    """Where photos are looked for when COURSE_PHOTOS names none, in this order."""
    repository = course_repository()
    return repository / "data" / "flickr8k", repository.parent / "shared" / "data" / "flickr8k"


def split_file(folder) -> Path | None:
    """The Karpathy split file of a photo folder (`dataset_*.json`), or None."""
    folder = Path(folder)
    return next(iter(sorted(folder.glob("dataset_*.json"))), None) if folder.is_dir() else None


def find_photos(environ=None) -> Path | None:
    """The photo folder (COURSE_PHOTOS, else the first of places()) with images/, or None."""
    named = (os.environ if environ is None else environ).get("COURSE_PHOTOS")
    for folder in [Path(named)] if named else places():
        if split_file(folder) is not None and (folder / "images").is_dir():
            return folder.resolve()
    return None


def no_photos_message(environ=None) -> str:
    """What to do when find_photos finds nothing: where it looked and how to get Flickr8k."""
    named = (os.environ if environ is None else environ).get("COURSE_PHOTOS")
    looked = (f"COURSE_PHOTOS={named} holds no images/ folder and dataset_*.json file" if named
              else "no photos in " + " or ".join(str(p) for p in places()))
    return (f"{looked}. Real photographs are not part of the course: get Flickr8k with `python "
            "data_scripts/download_data.py flickr8k --out data/flickr8k` (about 1 GB), or set "
            "COURSE_PHOTOS to a Karpathy-format folder (images/ and its dataset_*.json); "
            "docs/real_data.md says more.")
