"""List the collectives of a compiled function with their dtypes and bytes."""

from __future__ import annotations

import dataclasses
import math
import re


COLLECTIVE_OPS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\([^)]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    """One collective instruction of a compiled HLO module.

    Attributes:
      op: "all-gather", "all-to-all", "all-reduce", "reduce-scatter" or "collective-permute".
      dtype: element type of the result, as HLO spells it (e.g. "u8", "bf16").
      shape: result shape per device (the last part, for a tuple-shaped result).
      group_size: devices per replica group.
      result_bytes: bytes of the result per device.
      operand_bytes: bytes each device hands to the collective.
    """

    op: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    result_bytes: int
    operand_bytes: int


def _dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"collective with element type {dtype!r}, whose size this reader does not know; "
                         f"known: {sorted(_DTYPE_BYTES)}") from None


def _group_size(line: str) -> int:
    if match := _GROUPS_LIST.search(line):
        return len(match.group(1).split(","))
    if match := _GROUPS_IOTA.search(line):
        return int(match.group(1).split(",")[-1])
    return 1


def collectives_in_hlo(hlo_text: str) -> list[HloCollective]:
    """Parse compiled HLO text (`jax.jit(f).lower(...).compile().as_text()`).

    Args:
      hlo_text: the module text.

    Returns:
      One `HloCollective` per collective instruction (async `-start` halves included,
      `-done` halves skipped), in program order.

    Raises:
      ValueError: a collective of an element type whose size is not known.
    """
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(match.group("shape"))]
        if match.group("start"):
            arrays = arrays[-1:]  # an async start's tuple is (operands..., result)
        dtype, shape = arrays[-1]
        # A tuple-shaped (e.g. per-peer all-to-all) result counts all its parts.
        result_bytes = sum(math.prod(dims) * _dtype_bytes(t) for t, dims in arrays)
        group = _group_size(line)
        op = match.group("op")
        operand_bytes = {"all-gather": result_bytes // max(group, 1), "reduce-scatter": result_bytes * group}.get(
            op, result_bytes
        )
        found.append(HloCollective(op, dtype, shape, group, result_bytes, operand_bytes))
    return found


__all__ = ["COLLECTIVE_OPS", "HloCollective", "collectives_in_hlo"]
