"""List the collectives of a compiled function with their dtypes and bytes."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVE_OPS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e8m0fnu": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\([^)]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[0-9,{}]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# jax 0.12 and newer: `replica_groups=mesh['a'=2,'b'=4] {'b'}`, groups along the named axes
# of the devices in mesh order.
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


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
      groups: the replica groups as device ids (for a collective-permute, its
        (source, target) pairs); empty if the instruction names none.
      parts: (dtype, shape) of each array of the result (several for a combined,
        tuple-shaped collective).
    """

    op: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    result_bytes: int
    operand_bytes: int
    groups: tuple[tuple[int, ...], ...]
    parts: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def sent_bytes(self) -> int:
        """Bytes each device sends over its links, counted as `taco_jax.WireRecord`
        counts them: an all-gather sends its operand to k-1 peers, an all-to-all or
        reduce-scatter (k-1)/k of it, a ring all-reduce 2 (k-1)/k, a permute all of it."""
        k = self.group_size
        factor = {
            "all-gather": (k - 1, 1),
            "all-to-all": (k - 1, k),
            "reduce-scatter": (k - 1, k),
            "all-reduce": (2 * (k - 1), k),
            "collective-permute": (1, 1),
        }[self.op]
        return self.operand_bytes * factor[0] // factor[1]

    def mesh_axes(self, mesh) -> tuple[str, ...]:
        """The axes of `mesh` the collective runs over: those along which the devices of
        a group differ (device ids are `jax.Device.id`s of the mesh's devices)."""
        coords = {device.id: index for index, device in np.ndenumerate(mesh.devices)}
        varying = {
            axis
            for group in self.groups
            for a in group
            for b in group
            for axis, (i, j) in enumerate(zip(coords[a], coords[b]))
            if i != j
        }
        return tuple(name for axis, name in enumerate(mesh.axis_names) if axis in varying)


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of an HLO element type (e.g. "bf16" -> 2).

    Raises:
      ValueError: an element type this reader does not know.
    """
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(
            f"collective with element type {dtype!r}, whose size this reader does not know; "
            f"known: {sorted(_DTYPE_BYTES)}"
        ) from None


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    """Replica groups (or permute pairs): explicit, in iota form `[G,S]<=[dims]T(perm)`,
    or along named mesh axes."""
    if match := _GROUPS_LIST.search(line):
        return tuple(
            tuple(int(d) for d in group.split(",") if d) for group in re.findall(r"\{([0-9,]*)\}", match.group(1))
        )
    if match := _GROUPS_IOTA.search(line):
        shape, dims = [[int(d) for d in g.split(",")] for g in match.group(1, 2)]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(3):
            ids = ids.transpose([int(d) for d in match.group(3).split(",")])
        return tuple(tuple(int(d) for d in row) for row in ids.reshape(shape[0], -1))
    if match := _GROUPS_MESH.search(line):
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=([0-9]+)", match.group(1))}
        grouped = re.findall(r"'([^']+)'", match.group(2))
        names = list(sizes)
        order = [names.index(name) for name in names if name not in grouped] + [names.index(name) for name in grouped]
        ids = np.arange(math.prod(sizes.values())).reshape(list(sizes.values())).transpose(order)
        return tuple(tuple(int(d) for d in row) for row in ids.reshape(-1, math.prod(sizes[n] for n in grouped)))
    return ()


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
        arrays = [
            (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(match.group("shape"))
        ]
        if match.group("start"):
            arrays = arrays[-1:]  # an async start's tuple is (operands..., result)
        dtype, shape = arrays[-1]
        # A tuple-shaped (e.g. per-peer all-to-all) result counts all its parts.
        result_bytes = sum(math.prod(dims) * dtype_bytes(t) for t, dims in arrays)
        groups = _groups(line)
        op = match.group("op")
        group = 1 if op == "collective-permute" or not groups else len(groups[0])
        operand_bytes = {"all-gather": result_bytes // max(group, 1), "reduce-scatter": result_bytes * group}.get(
            op, result_bytes
        )
        found.append(HloCollective(op, dtype, shape, group, result_bytes, operand_bytes, groups, tuple(arrays)))
    return found


__all__ = ["COLLECTIVE_OPS", "HloCollective", "collectives_in_hlo", "dtype_bytes"]
