"""Download Flickr8k / Flickr30k / COCO with Karpathy's split files; check the layout the course
reads.

    python data_scripts/download_data.py coco --out data/coco            # splits + images (~19 GB)
    python data_scripts/download_data.py flickr8k --out data/flickr8k    # splits + images (~1 GB)
    python data_scripts/download_data.py flickr30k --out data/flickr30k  # splits; images by form
    python data_scripts/download_data.py flickr30k --out data/flickr30k --check

Layout afterwards (what course_lib.data.karpathy.read_karpathy expects):

    flickr8k:  DIR/dataset_flickr8k.json, DIR/images/*.jpg  (image_root=DIR/images)
    flickr30k: DIR/dataset_flickr30k.json, DIR/flickr30k-images/*.jpg
               (image_root=DIR/flickr30k-images)
    coco:      DIR/dataset_coco.json, DIR/train2014/*.jpg, DIR/val2014/*.jpg  (image_root=DIR)

Flickr8k's split file is Karpathy's where caption_datasets.zip can be had; otherwise it is built
in the same format from the official Flickr8k_text.zip (captions from Flickr8k.token.txt, splits
from its train / dev / test lists, dev as "val"). Its photos come from Flickr8k_Dataset.zip, whose
Flicker8k_Dataset/ folder (sic) is extracted straight into DIR/images.

Downloads resume from DIR/<name>.part after an interruption; only urllib is used.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

KARPATHY_SPLITS_URL = "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"
COCO_IMAGE_URLS = {
    "train2014": "http://images.cocodataset.org/zips/train2014.zip",
    "val2014": "http://images.cocodataset.org/zips/val2014.zip",
}
FLICKR30K_FORM_URL = "https://shannon.cs.illinois.edu/DenotationGraph/"
FLICKR30K_IMAGE_DIR = "flickr30k-images"
_FLICKR8K_RELEASE = "https://github.com/jbrownlee/Datasets/releases/download/Flickr8k/"
FLICKR8K_IMAGES_URL = _FLICKR8K_RELEASE + "Flickr8k_Dataset.zip"
FLICKR8K_TEXT_URL = _FLICKR8K_RELEASE + "Flickr8k_text.zip"
FLICKR8K_ZIP_DIR = "Flicker8k_Dataset"  # the folder in Flickr8k_Dataset.zip, misspelt as published
FLICKR8K_IMAGE_DIR = "images"
FLICKR8K_TOKENS = "Flickr8k.token.txt"
FLICKR8K_SPLIT_LISTS = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt",
                        "test": "Flickr_8k.testImages.txt"}
CHUNK = 1 << 20


class DownloadError(RuntimeError):
    pass


def download(url: str, dest: Path, progress: bool = True) -> Path:
    """Fetch url to dest via dest.part, resuming a partial file where the server allows ranges."""
    from tqdm.auto import tqdm

    if dest.is_file():
        return dest
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            # else the server sent it all
            resumed = have and getattr(response, "status", None) == 206
            total = response.headers.get("Content-Length")
            total = int(total) + (have if resumed else 0) if total else None
            with open(part, "ab" if resumed else "wb") as f, tqdm(
                total=total, initial=have if resumed else 0, unit="B", unit_scale=True,
                desc=dest.name, disable=not progress,
            ) as bar:
                while chunk := response.read(CHUNK):
                    f.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError) as e:
        raise DownloadError(
            f"could not download {url} ({e}).\nOffline? Fetch it on a machine with internet and "
            f"put it at {dest}, then run this command again (it skips files that are already "
            f"there) and finish with --check. A partial download stays in {part} and resumes next "
            "time. "
            "Without real data the course runs on the synthetic benchmark: "
            "python data_scripts/make_synthetic.py --out data/synthetic") from e
    part.replace(dest)
    return dest


def extract(archive: Path, out: Path, members=None, progress: bool = False) -> None:
    """Unzip archive into out: everything (keeping its folders), or only the named files (flat)."""
    from tqdm.auto import tqdm

    try:
        with zipfile.ZipFile(archive) as z:
            if members is None:
                for info in tqdm(z.infolist(), desc=f"extracting {archive.name}", unit="file",
                                 disable=not progress):
                    z.extract(info, out)  # zipfile strips absolute and ".." parts
                return
            for name in members:
                with z.open(member(z, name, archive)) as src, open(out / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{archive} is not a valid zip ({e}); delete it and download it "
                            "again") from e


def member(z: zipfile.ZipFile, name: str, archive: Path) -> str:
    """The member of z called name, at its top level or in any folder."""
    match = next((n for n in z.namelist() if n == name or n.endswith("/" + name)), None)
    if match is None:
        raise DownloadError(f"{archive} holds no {name}; delete it and download it again")
    return match


def extract_folder(archive: Path, folder: str, dest: Path, suffix: str = ".jpg",
                   progress: bool = False) -> int:
    """Unzip the *suffix files of archive's folder/ straight into dest (flat); returns how many."""
    from tqdm.auto import tqdm

    dest.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(archive) as z:
            infos = [i for i in z.infolist()
                     if i.filename.startswith(folder + "/") and not i.is_dir()
                     and i.filename.lower().endswith(suffix)
                     and not Path(i.filename).name.startswith("._")]  # macOS resource forks
            if not infos:
                raise DownloadError(f"{archive} holds no {folder}/*{suffix}; "
                                    "delete it and download it again")
            for info in tqdm(infos, desc=f"extracting {archive.name}", unit="file",
                             disable=not progress):
                with z.open(info) as src, open(dest / Path(info.filename).name, "wb") as dst:
                    shutil.copyfileobj(src, dst)  # flat: only the file name is kept
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{archive} is not a valid zip ({e}); delete it and download it "
                            "again") from e
    return len(infos)


def get_splits(dataset: str, out: Path, progress: bool) -> Path:
    json_path = out / f"dataset_{dataset}.json"
    if not json_path.is_file():
        archive = download(KARPATHY_SPLITS_URL, out / "caption_datasets.zip", progress)
        extract(archive, out, [json_path.name])
    return json_path


def flickr8k_from_text(archive: Path) -> dict:
    """Karpathy's format built from the official Flickr8k_text.zip: the images of its train / dev /
    test lists in the order of Flickr8k.token.txt, imgid and sentid from 0, tokens the lower-cased
    runs of letters and digits of each caption."""
    try:
        with zipfile.ZipFile(archive) as z:
            def read(name):
                return z.read(member(z, name, archive)).decode("utf-8", "replace")

            split_of = {line.strip(): split for split, name in FLICKR8K_SPLIT_LISTS.items()
                        for line in read(name).splitlines() if line.strip()}
            lines = read(FLICKR8K_TOKENS).splitlines()
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{archive} is not a valid zip ({e}); delete it and download it "
                            "again") from e
    images: dict[str, dict] = {}
    sentid = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key, tab, raw = line.partition("\t")
        filename, hash_, _ = key.strip().rpartition("#")
        if not (tab and hash_ and filename):
            raise DownloadError(f"{archive}: {FLICKR8K_TOKENS} line {number} is not "
                                f"'<filename>#<n>\\t<caption>' ({line[:60]!r}); delete the archive "
                                "and download it again")
        if filename not in split_of:
            continue  # in no split list (the token file also names a few stray entries)
        if filename not in images:
            images[filename] = {"filename": filename, "filepath": "", "split": split_of[filename],
                                "imgid": len(images), "sentids": [], "sentences": []}
        img, raw = images[filename], raw.strip()
        img["sentids"].append(sentid)
        img["sentences"].append({"raw": raw, "tokens": re.findall(r"[a-z0-9]+", raw.lower()),
                                 "imgid": img["imgid"], "sentid": sentid})
        sentid += 1
    if not images:
        raise DownloadError(f"{archive}: no caption of {FLICKR8K_TOKENS} belongs to an image of "
                            "the split lists; delete the archive and download it again")
    return {"dataset": "flickr8k", "images": list(images.values())}


def get_flickr8k_splits(out: Path, progress: bool) -> str:
    """DIR/dataset_flickr8k.json, Karpathy's if caption_datasets.zip can be had, else built from the
    official text files; returns a line saying which."""
    json_path = out / "dataset_flickr8k.json"
    if json_path.is_file():
        return f"{json_path.name}: already in {out}, kept"
    try:
        get_splits("flickr8k", out, progress)
        return f"{json_path.name}: Karpathy's, from caption_datasets.zip"
    except DownloadError as e:
        reason = str(e).splitlines()[0]
    archive = download(FLICKR8K_TEXT_URL, out / "Flickr8k_text.zip", progress)
    data = flickr8k_from_text(archive)
    part = json_path.with_name(json_path.name + ".part")
    part.write_text(json.dumps(data), encoding="utf-8")
    part.replace(json_path)
    return (f"{json_path.name}: built from the official Flickr8k_text.zip "
            f"({len(data['images'])} images), since Karpathy's was not to be had: {reason}")


def get_flickr8k_images(out: Path, progress: bool, keep_archive: bool) -> None:
    """Flickr8k_Dataset.zip's photos straight into DIR/images (no second copy), once."""
    done = out / f".{FLICKR8K_IMAGE_DIR}.done"
    if (out / FLICKR8K_IMAGE_DIR).is_dir() and done.is_file():
        return  # extracted on an earlier run
    archive = download(FLICKR8K_IMAGES_URL, out / "Flickr8k_Dataset.zip", progress)
    extract_folder(archive, FLICKR8K_ZIP_DIR, out / FLICKR8K_IMAGE_DIR, progress=progress)
    done.touch()
    if not keep_archive:
        archive.unlink()


def image_root(dataset: str, out: Path) -> Path:
    """The folder read_karpathy's image_root should be for dataset downloaded into out."""
    return out / {"flickr30k": FLICKR30K_IMAGE_DIR, "flickr8k": FLICKR8K_IMAGE_DIR}.get(dataset, "")


def check(dataset: str, out: Path) -> list[str]:
    """Problems with the layout under out (empty when everything the split file lists is there)."""
    json_path = out / f"dataset_{dataset}.json"
    if not json_path.is_file():
        return [f"{json_path} is missing: run without --check to download the split files"]
    with open(json_path, encoding="utf-8") as f:
        images = json.load(f).get("images", [])
    root = image_root(dataset, out)
    missing = [root / img.get("filepath", "") / img["filename"] for img in images
               if not (root / img.get("filepath", "") / img["filename"]).is_file()]
    if not missing:
        return []
    if dataset == "flickr30k":
        fix = (f"request the images at {FLICKR30K_FORM_URL}, then extract flickr30k-images.tar.gz "
               f"into {out} so that {root}/<id>.jpg exist")
    elif dataset == "flickr8k":
        fix = (f"run without --check to download Flickr8k_Dataset.zip and extract its "
               f"{FLICKR8K_ZIP_DIR} photos into {root} (delete "
               f"{out / f'.{FLICKR8K_IMAGE_DIR}.done'} first to extract again)")
    else:
        fix = f"run without --check to download and extract train2014.zip / val2014.zip into {out}"
    return [f"{len(missing)} of {len(images)} images are missing, e.g. {missing[0]}: {fix}"]


def flickr30k_instructions(out: Path) -> str:
    return (
        "Flickr30k images are not openly downloadable: fill in the form at\n"
        f"  {FLICKR30K_FORM_URL}\n"
        "to receive a link to flickr30k-images.tar.gz (about 4.4 GB), then\n"
        f"  tar -xzf flickr30k-images.tar.gz -C {out}\n"
        f"so that {out / FLICKR30K_IMAGE_DIR}/1000092795.jpg etc. exist, and check with\n"
        f"  python data_scripts/download_data.py flickr30k --out {out} --check"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", choices=("flickr8k", "flickr30k", "coco"))
    p.add_argument("--out", required=True, type=Path,
                   help="directory for the split file and images")
    p.add_argument("--check", action="store_true", help="only check that the files are in place")
    p.add_argument("--splits-only", action="store_true", help="COCO / Flickr8k: skip the images")
    p.add_argument("--keep-archives", action="store_true", help="keep the zips after extracting")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    out, progress = args.out, not args.quiet
    if out.exists() and not out.is_dir():
        p.error(f"--out {out} is a file; give a directory")

    if not args.check:
        out.mkdir(parents=True, exist_ok=True)
        try:
            if args.dataset == "flickr8k":
                print(get_flickr8k_splits(out, progress))
                if not args.splits_only:
                    get_flickr8k_images(out, progress, args.keep_archives)
            else:
                get_splits(args.dataset, out, progress)
            if args.dataset == "coco" and not args.splits_only:
                for name, url in COCO_IMAGE_URLS.items():
                    if (out / name).is_dir() and (out / f".{name}.done").is_file():
                        continue  # extracted on an earlier run
                    archive = download(url, out / f"{name}.zip", progress)
                    extract(archive, out, progress=progress)
                    (out / f".{name}.done").touch()
                    if not args.keep_archives:
                        archive.unlink()
        except DownloadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if not args.keep_archives:
            (out / "caption_datasets.zip").unlink(missing_ok=True)
            (out / "Flickr8k_text.zip").unlink(missing_ok=True)
        if args.dataset == "flickr30k" and not (out / FLICKR30K_IMAGE_DIR).is_dir():
            print(flickr30k_instructions(out))
            return 0
        if args.splits_only:
            print(f"wrote {out / f'dataset_{args.dataset}.json'}")
            return 0

    problems = check(args.dataset, out)
    for line in problems:
        print(f"problem: {line}", file=sys.stderr)
    if problems:
        return 1
    root = image_root(args.dataset, out)
    json_path = str(out / f"dataset_{args.dataset}.json")
    print(f"{args.dataset} is complete in {out}. Read it with:\n"
          "  from course_lib.data.karpathy import read_karpathy\n"
          f"  read_karpathy({json_path!r}, image_root={str(root)!r}, split='test')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
