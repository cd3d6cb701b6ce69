"""Byte-level text data for the reference model.

The corpus is real text found on every machine: the `.py` files of the running
Python's standard library (or the user's own files with `--data`), split
deterministically into train and held-out files by a hash of each file's
relative path. Samples are windows of `seq_len + 1` bytes.

The samples of step s depend on (seed, s) only, never on the number of hosts:
`sample_ids(step)` draws the global batch's window offsets from a generator
seeded with (seed, step); each data shard takes its rows of that batch.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sysconfig
import zlib

import numpy as np

HELD_OUT_PERCENT = 5


def stdlib_files() -> tuple[pathlib.Path, list[pathlib.Path]]:
    """(root, sorted .py files of the standard library, site-packages and
    test folders left out)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders
                               if d not in ("site-packages", "dist-packages", "test", "tests",
                                            "__pycache__", "idlelib", "lib2to3"))
        found += [pathlib.Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    return root, found


def text_files(paths: list[str]) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """(common root, sorted files) for user-given files or folders."""
    found = []
    for p in map(pathlib.Path, paths):
        found += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    if not found:
        raise FileNotFoundError(f"no text files in {paths}")
    root = pathlib.Path(os.path.commonpath([str(f.parent) for f in found]))
    return root, found


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Train and held-out bytes (uint8 arrays) and where they came from."""

    train: np.ndarray
    held_out: np.ndarray
    files: int


def load_corpus(paths: list[str] | None = None, max_bytes: int = 8 << 20) -> Corpus:
    """Read up to `max_bytes` of text (files in sorted order), each file going
    to held-out when crc32 of its relative path % 100 < HELD_OUT_PERCENT.
    Raises ValueError when either part is too small to sample from."""
    root, files = text_files(paths) if paths else stdlib_files()
    train, held, total = [], [], 0
    for f in files:
        data = f.read_bytes()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        rel = str(f.relative_to(root)).encode()
        (held if zlib.crc32(rel) % 100 < HELD_OUT_PERCENT else train).append(data)
    corpus = Corpus(np.frombuffer(b"\n".join(train), np.uint8),
                    np.frombuffer(b"\n".join(held), np.uint8), len(files))
    if corpus.train.size < 1 << 16 or corpus.held_out.size < 1 << 12:
        raise ValueError(f"corpus too small: {corpus.train.size} train bytes, "
                         f"{corpus.held_out.size} held-out bytes")
    return corpus


class Batches:
    """The global batch of every step.

    global_batch rows of seq_len + 1 bytes; `rows(step)` returns (inputs,
    targets, weights) padded to a multiple of `data_shards` rows with zero
    weight, so a weighted mean over rows equals the unpadded mean.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int) -> None:
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def sample_ids(self, step: int) -> np.ndarray:
        """Window offsets of step `step`: int64 [global_batch], from (seed, step)."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, self.tokens.size - self.seq_len - 1, size=self.global_batch)

    def rows(self, step: int, data_shards: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs int32 [B', L], targets int32 [B', L], weights float32 [B'])
        with B' = global_batch rounded up to a multiple of data_shards."""
        ids = self.sample_ids(step)
        padded = -(-self.global_batch // data_shards) * data_shards
        windows = np.zeros((padded, self.seq_len + 1), np.int32)
        windows[: self.global_batch] = self.tokens[ids[:, None] + np.arange(self.seq_len + 1)]
        weights = np.zeros(padded, np.float32)
        weights[: self.global_batch] = 1.0
        return windows[:, :-1], windows[:, 1:], weights
