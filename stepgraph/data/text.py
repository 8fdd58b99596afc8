"""Character-level text: a corpus, its vocabulary, a train/validation split, and seeded batches
of token windows on the device.

The corpus is a UTF-8 text file, or, with none given, DEFAULT_CORPUS: the help topics that
every CPython installation carries for `help()` (the `topics` dictionary of
`pydoc_data/topics.py`, the Python Language Reference's sections on statements, operators,
types and so on, about 465,000 characters of English prose and code examples in Python 3.11),
joined in key order. It is read at run time, needs no download, and is the same on every
machine with the same Python version.

The vocabulary is the sorted set of characters of the corpus; token i is its i-th character.
The first 90% of the text is the training split, the rest the validation split. A batch is
`batch_size` windows of block_size + 1 tokens at random offsets: x the first block_size
tokens of each, y the same shifted by one (the next token at every position). The offsets of
batch `step` are a pure function of (seed, split, step), so a resumed run draws the batches an
uninterrupted one would have drawn.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .loader import cupy_or_none, to_device
from .mnist import DatasetFormatError, DatasetNotFoundError

DEFAULT_CORPUS = "pydoc_data.topics"
VAL_FRACTION = 0.1
TOKEN_DTYPE = np.int32
SPLITS = ("train", "val")
# Keeps the batch offsets apart from the other seeded streams of a run.
TEXT_STREAM = 0x54455854


def default_corpus() -> str:
    """DEFAULT_CORPUS: pydoc's help topics, joined in sorted key order (see the module
    docstring)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as err:   # a Python built without its pydoc data
        raise DatasetNotFoundError(
            f"the default text corpus comes from {DEFAULT_CORPUS}, which this Python "
            f"installation lacks ({err}); pass a UTF-8 text file with --text-file") from err
    return "".join(topics[key] for key in sorted(topics))


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file's contents; DatasetNotFoundError / DatasetFormatError say what is
    wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"no text file at {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DatasetFormatError(f"{path} is not UTF-8 text ({err})") from err


@dataclass(frozen=True)
class TextDataset:
    """A corpus as tokens: `vocab` is its sorted characters, `train` and `val` the two splits
    as int32 token arrays."""

    name: str
    vocab: str
    train: np.ndarray = field(repr=False)
    val: np.ndarray = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return self.train if name == "train" else self.val

    def encode(self, text: str) -> np.ndarray:
        return encode(text, self.vocab)

    def decode(self, tokens) -> str:
        return decode(tokens, self.vocab)


def encode(text: str, vocab: str) -> np.ndarray:
    """`text` as int32 tokens of `vocab`; DatasetFormatError names characters it lacks."""
    index = {ch: i for i, ch in enumerate(vocab)}
    missing = sorted(set(text) - index.keys())
    if missing:
        shown = "".join(missing[:20])
        raise DatasetFormatError(f"{len(missing)} character(s) not in the vocabulary: "
                                 f"{shown!r}{' ...' if len(missing) > 20 else ''}")
    return np.fromiter((index[ch] for ch in text), dtype=TOKEN_DTYPE, count=len(text))


def decode(tokens, vocab: str) -> str:
    """Tokens of `vocab` back to text."""
    return "".join(vocab[int(t)] for t in np.asarray(tokens).reshape(-1))


def load_text(path: str | Path | None = None, val_fraction: float = VAL_FRACTION) -> TextDataset:
    """The text file at `path` (or DEFAULT_CORPUS when None) as a character-level dataset:
    the first 1 - val_fraction of it for training, the rest for validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = default_corpus() if path is None else read_text_file(path)
    name = DEFAULT_CORPUS if path is None else str(path)
    if len(text) < 2:
        raise DatasetFormatError(f"{name}: {len(text)} characters is too little text to train on")
    vocab = "".join(sorted(set(text)))
    tokens = encode(text, vocab)
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return TextDataset(name, vocab, tokens[:n_train], tokens[n_train:])


def batch_offsets(seed: int, split: str, step: int, batch_size: int, n_windows: int,
                  stream: int = 0) -> np.ndarray:
    """The start of each window of batch `step` of `split`: batch_size integers in
    [0, n_windows), fixed by (seed, split, step, stream); streams other than 0 draw batches
    apart from the training ones (evaluation)."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be >= 0, got seed={seed}, step={step}")
    rng = np.random.default_rng((TEXT_STREAM, seed, SPLITS.index(split), stream, step))
    return rng.integers(0, n_windows, size=batch_size)


@dataclass
class TokenBatches:
    """Random (x, y) batches of one split of a TextDataset, on `device`: the tokens are put
    there once and every batch is gathered there. x and y are (batch_size, block_size) int32,
    y the tokens that follow those of x. Batch `step` is fixed by (seed, split, step, stream).

    On cuda the gathers run on `cuda_stream` when given (a compiled step's stream): the
    memory pool then reuses a batch's memory only after that stream is done with it."""

    tokens: Any
    batch_size: int
    block_size: int
    split: str = "train"
    seed: int = 0
    device: str = "cpu"
    stream: int = 0
    cuda_stream: Any = None

    def __post_init__(self):
        if self.batch_size < 1 or self.block_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got "
                             f"{self.batch_size}, {self.block_size}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if len(self.tokens) < self.block_size + 1:
            raise DatasetFormatError(
                f"the {self.split} split has {len(self.tokens)} tokens: a window of "
                f"block_size + 1 = {self.block_size + 1} does not fit (use more text or a "
                "smaller --block-size)")
        self.tokens = to_device(np.asarray(self.tokens, dtype=TOKEN_DTYPE), self.device)
        self._xp = np if isinstance(self.tokens, np.ndarray) else cupy_or_none()

    @property
    def n_windows(self) -> int:
        """Number of distinct window starts."""
        return len(self.tokens) - self.block_size

    def offsets(self, first: int, last: int) -> np.ndarray:
        """(last - first, batch_size) window starts of batches first..last-1."""
        return np.stack([batch_offsets(self.seed, self.split, s, self.batch_size,
                                       self.n_windows, self.stream)
                         for s in range(first, last)]).reshape(-1, self.batch_size)

    def batch(self, step: int) -> tuple[Any, Any]:
        """Batch number `step`: (x, y), each a new contiguous array on the device."""
        return next(self.batches(step, step + 1))

    def batches(self, first: int, last: int) -> Iterator[tuple[Any, Any]]:
        """Batches first..last-1 in turn; their offsets go to the device in one copy."""
        xp = self._xp
        with self._on_stream():
            starts = xp.asarray(self.offsets(first, last))
            window = xp.arange(self.block_size + 1)
        for row in range(last - first):
            with self._on_stream():
                windows = self.tokens[starts[row][:, None] + window[None, :]]
                x = xp.ascontiguousarray(windows[:, :-1])
                y = xp.ascontiguousarray(windows[:, 1:])
            yield x, y

    def _on_stream(self):
        return self.cuda_stream if self.cuda_stream is not None and self._xp is not np \
            else contextlib.nullcontext()
