"""A training stage and the name its trained model is cached (and shipped) under.

    stage = Stage("lightningdot-pretrain",
                  reads=config_fields(config, without=FINETUNE_FIELDS),  # the fields it reads
                  data=bench["pretrain"], vocabulary=tokenizer,          # what it trains on
                  starts_from=(),                # the stages it starts from (their names count)
                  version=self.format_version)   # bumped when its layout or recipe changes
    stage.file_name  # "lightningdot-pretrain-<hash>.pt"

The hash covers exactly those five things (and MODEL_FORMAT), never the source code: an edit that
changes no number keeps every model (the shipped models' probes check that it changed none)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

# bumped when every model's modules change shape or names (one method's changes bump its version)
MODEL_FORMAT = 2
DATA_ARRAYS = ("images", "regions", "boxes", "region_mask", "region_classes")  # of a RetrievalSplit
FULL_CHECKSUM_BYTES = 1 << 30  # larger arrays (real detector features) are checksummed by rows


def _array_checksum(array: np.ndarray) -> str:
    """"<dtype> <shape> <crc32>" of the array's bytes, above FULL_CHECKSUM_BYTES of evenly spaced
    rows (first and last included) adding up to about that much."""
    head = f"{array.dtype.str} {list(array.shape)}"
    if array.nbytes > FULL_CHECKSUM_BYTES and len(array) > 1:
        rows = max(2, int(FULL_CHECKSUM_BYTES // (array.nbytes // len(array))))
        array = array[np.unique(np.linspace(0, len(array) - 1, rows).astype(np.int64))]
    array = np.ascontiguousarray(array)  # no copy when it already is
    return f"{head} {zlib.crc32(array.reshape(-1).view(np.uint8)):08x}"


def data_digest(split) -> dict:
    """What a model trains on beyond the vocabulary: captions, txt2img, a crc32 of every array and
    real data's image paths (crc32 runs at GB/s: docs/tuning_notes.md, "Core and data")."""
    captions = hashlib.sha1("\n".join(split.captions).encode()).hexdigest()
    digest = {"n_images": split.n_images, "captions": captions,
              "txt2img": f"{zlib.crc32(np.ascontiguousarray(split.txt2img, dtype=np.int64)):08x}"}
    for name in DATA_ARRAYS:
        value = getattr(split, name, None)
        digest[name] = None if value is None else _array_checksum(np.asarray(value))
    paths = getattr(split, "image_paths", None)
    digest["image_paths"] = (None if paths is None
                             else hashlib.sha1("\n".join(map(str, paths)).encode()).hexdigest())
    return digest


def fingerprint_hash(value) -> str:
    """sha1 hex digest of a JSON value (keys sorted; anything else by its str)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def config_fields(config, without=()) -> dict:
    """{field: value} of a dataclass config but the fields in `without` (each must be a field)."""
    names = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(without) - set(names))
    if unknown:
        raise ValueError(f"{type(config).__name__} has no fields {unknown}; its fields: {names}")
    return {name: getattr(config, name) for name in names if name not in without}


def config_with_defaults(config, fields):
    """`config` with `fields` at their defaults (an earlier stage ignores later settings)."""
    defaults = type(config)()
    return dataclasses.replace(config, **{name: getattr(defaults, name) for name in fields})


@dataclass(frozen=True)
class Stage:
    """One trained stage, named by what it is trained from."""

    prefix: str  # the file name's first part: which model this is
    reads: dict  # the config fields the stage reads, {name: value}
    data: object  # the split it trains on (a RetrievalSplit; data_digest reads it)
    vocabulary: object = None  # the tokenizer whose vocabulary it reads (None: it reads no text)
    # the stages it starts from or reads (None skipped) and anything else that shapes it, as a
    # string (e.g. the function that mines its negatives)
    starts_from: tuple = ()
    version: int = 1  # its format version, bumped on purpose

    @cached_property
    def fingerprint(self) -> dict:
        """What the name hashes, as JSON-ready values."""
        vocab = [] if self.vocabulary is None else sorted(self.vocabulary.get_vocab().items())
        return {"format": MODEL_FORMAT, "version": self.version, "config": self.reads,
                "vocab": vocab, "data": data_digest(self.data),
                "starts_from": [item.file_name if isinstance(item, Stage) else item
                                for item in self.starts_from if item is not None]}

    @property
    def file_name(self) -> str:
        """"<prefix>-<hash>.pt", the hash of `fingerprint`."""
        return f"{self.prefix}-{fingerprint_hash(self.fingerprint)[:10]}.pt"

    def path(self, cache_dir) -> Path | None:
        """cache_dir / file_name, or None without a cache folder (then nothing is cached)."""
        return None if cache_dir is None else Path(cache_dir) / self.file_name
