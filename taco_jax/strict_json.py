"""Strict JSON, the one writer of every JSON file and line the project writes.

Strict JSON has no NaN or Infinity: Python's `json` writes them as bare `NaN` /
`Infinity` tokens that strict parsers reject. Here a non-finite number is written as
`null`, numpy scalars and arrays as their Python values, and files are replaced
atomically (a crash mid-write leaves the previous file, never half of a new one).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, numpy scalars and arrays as
    Python values and tuples as lists (recursively through dicts and sequences)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` of `finite(value)`, refusing anything that is not strict JSON.

    Args:
      value: what to write.
      **kwargs: passed to `json.dumps` (e.g. `indent`).

    Returns:
      The JSON text.

    Examples:
      >>> from taco_jax import strict_json
      >>> strict_json.dumps({"loss": float("nan"), "step": 3})
      '{"loss": null, "step": 3}'
    """
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def write(path: str | Path, value: Any, **kwargs: Any) -> None:
    """Write `dumps(value, **kwargs)` to `path` atomically (`replace_text`).

    Args:
      path: the file.
      value: what to write.
      **kwargs: passed to `json.dumps`.
    """
    replace_text(path, dumps(value, **kwargs))


def replace_text(path: str | Path, text: str) -> None:
    """Replace the file `path` with `text` atomically: written into a temporary file
    beside it, then renamed over it, so a crash leaves the old file or the new one.

    Args:
      path: the file.
      text: its new content.
    """
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
