"""Ground truth of the synthetic benchmark: scenes (objects on a 3x3 grid, each with a shape,
colour, size and distinct cell) and caption meanings, as tables of numpy arrays; scene sampling."""

from __future__ import annotations

import numpy as np

SHAPES = ("circle", "square", "triangle", "diamond", "cross", "ring")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "cyan")
SIZES = ("small", "big")
GRID = 3  # the scene is a GRID x GRID board of cells; cell = row * GRID + col, row 0 at the top
RELATIONS = ("left of", "right of", "above", "below")  # relation codes 0..3 in Meanings.relation
FAMILIES = ("pair", "relation", "place", "count", "terse")  # caption family codes 0..4
N_CLASSES = len(SHAPES) * len(COLORS)  # "detector" classes: shape x colour, class = shape*8+colour


class ArrayTable:
    """A table of equal-length numpy arrays (one row per item), named by the subclass's FIELDS."""

    FIELDS: tuple[str, ...] = ()
    PAD = -1  # value of padded / "not mentioned" entries; padded columns are filled with it

    def __init__(self, **arrays: np.ndarray):
        if set(arrays) != set(self.FIELDS):
            raise ValueError(f"{type(self).__name__}: missing fields "
                             f"{sorted(set(self.FIELDS) - set(arrays))}, unknown "
                             f"{sorted(set(arrays) - set(self.FIELDS))}")
        lengths = {len(np.asarray(arrays[f])) for f in self.FIELDS}
        if len(lengths) > 1:
            raise ValueError(f"{type(self).__name__}: fields of unequal lengths {sorted(lengths)}")
        for f in self.FIELDS:
            setattr(self, f, np.asarray(arrays[f]))

    def __len__(self) -> int:
        return len(getattr(self, self.FIELDS[0]))

    def take(self, indices) -> ArrayTable:
        """The rows at `indices` (an index array or boolean mask), as a new table."""
        return type(self)(**{f: getattr(self, f)[np.asarray(indices)] for f in self.FIELDS})

    @classmethod
    def concatenate(cls, tables: list[ArrayTable]) -> ArrayTable:
        """Rows of all tables in order; 2-d fields with different widths are padded with PAD."""
        out = {}
        for f in cls.FIELDS:
            parts = [getattr(t, f) for t in tables]
            if parts[0].ndim == 2:
                width = max(p.shape[1] for p in parts)
                parts = [np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=cls.PAD)
                         for p in parts]
            out[f] = np.concatenate(parts)
        return cls(**out)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Field name -> array (copies), e.g. for np.savez."""
        return {f: getattr(self, f).copy() for f in self.FIELDS}

    @classmethod
    def from_arrays(cls, arrays: dict) -> ArrayTable:
        """Inverse of to_arrays; extra keys (another table's fields in one .npz) are ignored."""
        return cls(**{f: np.array(arrays[f]) for f in cls.FIELDS})

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and all(
            getattr(self, f).dtype == getattr(other, f).dtype
            and np.array_equal(getattr(self, f), getattr(other, f)) for f in self.FIELDS)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} rows: {', '.join(self.FIELDS)})"


class Scenes(ArrayTable):
    """shape, color, size, cell: int8 (n, max_objects), -1 in slots >= n_objects, random order."""

    FIELDS = ("shape", "color", "size", "cell", "n_objects")

    @property
    def max_objects(self) -> int:
        return self.shape.shape[1]

    @property
    def valid(self) -> np.ndarray:
        """bool (n, max_objects): which slots hold an object."""
        return self.shape >= 0

    def describe(self, i: int) -> list[str]:
        """Human-readable objects of scene i, e.g. 'small red circle at row 0, col 2'."""
        return [f"{SIZES[self.size[i, o]]} {COLORS[self.color[i, o]]} {SHAPES[self.shape[i, o]]} "
                f"at row {self.cell[i, o] // GRID}, col {self.cell[i, o] % GRID}"
                for o in range(int(self.n_objects[i]))]


class Meanings(ArrayTable):
    """One row per caption: what it asserts, int8 with -1 = not mentioned (any value matches).
    family indexes FAMILIES; object a and optional b (absent when all -1) by shape, color, size;
    relation (RELATIONS, "a <relation> b"), place (a's cell), count (number of objects); noisy:
    a deliberately wrong pre-training caption.
    True of a scene when some object i matches a (in `place` if given) and, if b is present, some
    other object j matches b with relation(i, j) if given, and the scene has `count` objects."""

    FIELDS = ("family", "a_shape", "a_color", "a_size", "b_shape", "b_color", "b_size",
              "relation", "place", "count", "noisy")

    @property
    def has_b(self) -> np.ndarray:
        return (self.b_shape >= 0) | (self.b_color >= 0) | (self.b_size >= 0)


def sample_scenes(rng: np.random.Generator, n: int, min_objects: int, max_objects: int) -> Scenes:
    """n random scenes with min_objects..max_objects objects each, in distinct random cells."""
    n_objects = rng.integers(min_objects, max_objects + 1, size=n)  # (n,)
    cells = np.argsort(rng.random((n, GRID * GRID)), axis=1)[:, :max_objects]  # (n, O)
    shape, color, size = (rng.integers(len(v), size=(n, max_objects))
                          for v in (SHAPES, COLORS, SIZES))
    unused = np.arange(max_objects)[None, :] >= n_objects[:, None]  # (n, O)
    pad = lambda a: np.where(unused, -1, a).astype(np.int8)  # noqa: E731
    return Scenes(shape=pad(shape), color=pad(color), size=pad(size), cell=pad(cells),
                  n_objects=n_objects.astype(np.int8))
