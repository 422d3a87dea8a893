"""Torch datasets over a RetrievalSplit and the collate functions that batch them. Text is
tokenised per batch in the collate, so a batch is padded only to its longest caption."""

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset

from course_lib.data.split import RetrievalSplit

# timm / torchvision ImageNet statistics: pretrained backbones expect pixels normalised this way
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MODALITIES = ("regions", "pixels")


def size_hw(image_size) -> tuple[int, int] | None:
    """image_size as (H, W): an int is a square; None stays None."""
    if isinstance(image_size, int):
        return image_size, image_size
    return None if image_size is None else (int(image_size[0]), int(image_size[1]))


def read_image(path, image_size=None) -> np.ndarray:
    """One image file as uint8 RGB (H, W, 3), resized (bicubic) to image_size (int or (H, W))."""
    im = Image.open(path)
    im.load()  # decodes and closes the file
    if im.mode != "RGB":  # grey / palette / CMYK JPEGs exist in COCO
        im = im.convert("RGB")
    return resize_pixels(np.asarray(im), image_size)


def resize_pixels(pixels: np.ndarray, image_size=None) -> np.ndarray:
    """uint8 (H, W, 3) resized to image_size (int or (H, W)); unchanged if it already fits."""
    hw = size_hw(image_size)
    if hw is None or tuple(pixels.shape[:2]) == hw:
        return pixels
    im = Image.fromarray(pixels).resize((hw[1], hw[0]), Image.BICUBIC)  # PIL wants (W, H)
    return np.asarray(im)


def pixels_to_tensor(pixels: np.ndarray, normalize: bool = True) -> torch.Tensor:
    """uint8 (H, W, 3) -> float32 (3, H, W) in [0, 1], then ImageNet-normalised if normalize."""
    # copy: PIL-decoded arrays are read-only, which torch.from_numpy warns about
    x = torch.from_numpy(np.array(pixels, dtype=np.uint8)).permute(2, 0, 1)  # (3, H, W)
    x = x.float().div_(255.0)
    if normalize:
        mean, std = (torch.tensor(v).view(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
        x = (x - mean) / std
    return x


class ImageDataset(Dataset):
    """The images of a split, each {"index", then "regions", "boxes", "region_mask" (and
    "region_classes") or "pixels" (3, H, W), read lazily from image_paths if not in memory}."""

    def __init__(self, split: RetrievalSplit, modality: str = "regions", image_size=None,
                 normalize: bool = True):
        if modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {modality!r}")
        if modality == "regions" and not split.has_regions:
            raise ValueError(
                f"split {split.name!r} has no region features. Use the synthetic benchmark (it "
                "ships detector-style regions), pass regions_file=... to read_karpathy after "
                "extracting features (data_scripts), or use modality='pixels'.")
        if modality == "pixels" and not split.has_pixels:
            raise ValueError(
                f"split {split.name!r} has no pixels: neither images in memory nor image_paths. "
                "Pass image_root=... to read_karpathy (the folder holding the images), or use "
                "modality='regions'.")
        self.split, self.modality = split, modality
        self.image_size, self.normalize = image_size, normalize

    def __len__(self) -> int:
        return self.split.n_images

    def image_fields(self, i: int) -> dict:
        """The tensors of image i (without its index): what ImageDataset and PairDataset share."""
        s = self.split
        if self.modality == "pixels":
            pixels = (resize_pixels(s.images[i], self.image_size) if s.images is not None
                      else read_image(s.image_paths[i], self.image_size))  # lazily, file by file
            return {"pixels": pixels_to_tensor(pixels, self.normalize)}  # (3, H, W)
        dtypes = dict(regions=np.float32, boxes=np.float32, region_mask=bool)  # (R, D) (R, 7) (R,)
        if s.region_classes is not None:
            dtypes["region_classes"] = np.float32  # (R, C)
        return {k: torch.from_numpy(np.asarray(getattr(s, k)[i], dtype=dtypes[k])) for k in dtypes}

    def __getitem__(self, i: int) -> dict:
        return {"index": int(i), **self.image_fields(i)}


class CaptionDataset(Dataset):
    """The captions of a split: item = {"index": caption position, "text": caption}."""

    def __init__(self, split: RetrievalSplit):
        self.split = split

    def __len__(self) -> int:
        return self.split.n_texts

    def __getitem__(self, t: int) -> dict:
        return {"index": int(t), "text": self.split.captions[t]}


class PairDataset(Dataset):
    """One item per caption: `text`, `txt_index`, `img_index` (= txt2img) and its image's fields."""

    def __init__(self, split: RetrievalSplit, modality: str = "regions", image_size=None,
                 normalize: bool = True):
        self.split = split
        self.images = ImageDataset(split, modality, image_size, normalize)

    def __len__(self) -> int:
        return self.split.n_texts

    def __getitem__(self, t: int) -> dict:
        i = int(self.split.txt2img[t])
        return {"txt_index": int(t), "img_index": i, "text": self.split.captions[t],
                **self.images.image_fields(i)}


def collate_images(items: list[dict]) -> dict:
    """ImageDataset items (any dicts) -> a batch of the same keys: tensors stacked (B, ...), ints
    a long tensor (B,), others lists."""
    batch = {key: [item[key] for item in items] for key in items[0]}
    for key, values in batch.items():
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(values[0], (int, np.integer)):
            batch[key] = torch.tensor(values, dtype=torch.long)
    return batch


class TextCollate:
    """CaptionDataset items (or strings) -> index, text, input_ids and attention_mask (B, T)."""

    def __init__(self, tokenizer, max_length: int = 40):
        self.tokenizer, self.max_length = tokenizer, max_length

    def encode(self, texts: list[str]) -> dict:
        enc = self.tokenizer(list(texts), padding="longest", truncation=True,
                             max_length=self.max_length, return_tensors="pt",
                             return_token_type_ids=False)
        return {k: enc[k].long() for k in ("input_ids", "attention_mask")}  # (B, T), mask 1 = real

    def __call__(self, items) -> dict:
        if items and isinstance(items[0], str):
            items = [{"index": t, "text": s} for t, s in enumerate(items)]
        batch = collate_images(items)
        batch.update(self.encode(batch["text"]))  # the whole batch at once: one fast-tokenizer call
        return batch


class PairCollate(TextCollate):
    """PairDataset items -> TextCollate's batch with img_index, txt_index and the image fields."""


def make_loader(dataset: Dataset, batch_size: int, *, tokenizer=None, shuffle: bool = False,
                max_length: int = 40, **kwargs) -> DataLoader:
    """A DataLoader with the collate that fits the dataset (or a Subset of one); kwargs go to it."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset  # collate follows items
    if isinstance(base, ImageDataset):
        collate = collate_images
    elif isinstance(base, (CaptionDataset, PairDataset)):
        if tokenizer is None:
            raise ValueError(f"{type(base).__name__} needs a tokenizer: make_loader(..., "
                             "tokenizer=tokenizer_for(train_split))")
        cls = PairCollate if isinstance(base, PairDataset) else TextCollate
        collate = cls(tokenizer, max_length)
    else:
        raise TypeError(f"make_loader knows ImageDataset, CaptionDataset and PairDataset, not "
                        f"{type(dataset).__name__}; use torch.utils.data.DataLoader directly")
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=collate, **kwargs)


# ---- a split's fields as tensors, all at once (models that score given pairs of items)
IMAGE_KEYS = ("regions", "boxes", "region_mask")  # the image fields the region models read


def image_fields(split) -> dict:
    """The split's region tensors (N, R, ...) as views of its arrays, in their stored dtype."""
    return {"regions": torch.from_numpy(np.asarray(split.regions)),  # (N, R, D)
            "boxes": torch.from_numpy(np.asarray(split.boxes, dtype=np.float32)),  # (N, R, 7)
            "region_mask": torch.from_numpy(np.asarray(split.region_mask, dtype=bool))}  # (N, R)


def image_batch(fields: dict, rows) -> dict:
    """Rows of image_fields as a batch (b, R, ...), floats as float32; only these rows are
    converted (converting the whole gallery made every re-ranked query cost all its regions)."""
    return {k: v[rows].float() if v.is_floating_point() else v[rows] for k, v in fields.items()}


def text_fields(captions, tokenizer, max_length: int) -> dict:
    """Tokenise captions once: input_ids, attention_mask (n, T), T = the longest caption."""
    return TextCollate(tokenizer, max_length).encode(list(captions))
