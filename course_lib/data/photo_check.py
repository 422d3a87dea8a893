"""Check a Karpathy file against its image folder before any feature is computed. An entry whose
file is missing, truncated or not an image, or that has no sentences, is left out with the reason;
the check fails when most images are missing (the folder is not that file's)."""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.data.karpathy import _THREADS, _load_json, entry_path

# more than this share of an image folder's files missing: it is not the JSON file's folder
MOST_MISSING = 0.5


@dataclass
class Screening:
    """What screen_karpathy found: the files left out, each with why, and how many it looked at."""

    skipped: dict = field(default_factory=dict)  # entry_path -> reason
    n_entries: int = 0

    def report(self, json_path) -> str:
        """One line per skipped file, for the terminal."""
        lines = [f"skipped {len(self.skipped)} of {self.n_entries} images of {json_path} (and "
                 "their captions):"] + [f"  {path}: {why}" for path, why in self.skipped.items()]
        return "\n".join(lines) if self.skipped else ""


def decode_problem(path) -> str | None:
    """None if the image file decodes whole; else why not, in words."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.draft("RGB", (64, 64))  # JPEG: decode at 1/8 scale; every byte is still read
            image.load()
    except UnidentifiedImageError:
        return "not an image (PIL cannot identify the file); replace it or delete its entry"
    except (OSError, SyntaxError, ValueError) as e:  # "image file is truncated", broken headers
        return f"cannot be decoded ({e}); the file is truncated or damaged: re-download it"
    return None


def screen_karpathy(json_path, image_root, splits, progress: bool = True) -> Screening:
    """Check the image entries of `splits` of a Karpathy file and their files under image_root."""
    from tqdm.auto import tqdm

    json_path, root = Path(json_path), Path(image_root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} not found; pass the folder that holds the "
                                f"images of {json_path.name} (--images)")
    entries = [img for img in _load_json(json_path)["images"]
               if isinstance(img, dict) and img.get("split") in set(splits) and "filename" in img]
    screening = Screening(n_entries=len(entries))
    missing, present = [], []
    for img in entries:
        path = entry_path(img)
        if not (root / path).is_file():
            missing.append(path)
            screening.skipped[path] = f"its image {root / path} is missing; its captions skipped"
        elif not img.get("sentences"):
            screening.skipped[path] = "its entry has no sentences; the image is skipped"
        else:
            present.append(path)
    if entries and len(missing) > MOST_MISSING * len(entries):
        raise FileNotFoundError(
            f"{len(missing)} of the {len(entries)} images that {json_path} lists are not in {root} "
            f"(e.g. {missing[0]}): that folder is not this JSON file's image folder. Pass the "
            "right --images (Flickr30k: flickr30k-images; COCO: the folder holding train2014/ and "
            "val2014/); nothing was written")
    with ThreadPoolExecutor(_THREADS) as pool:  # decoding frees the GIL
        problems = list(tqdm(pool.map(lambda p: decode_problem(root / p), present),
                             total=len(present), desc="checking images", unit="img",
                             disable=not progress, mininterval=1.0))
    screening.skipped.update({path: problem for path, problem in zip(present, problems, strict=True)
                              if problem is not None})
    return screening
