"""List the collectives of a compiled function with their dtypes and bytes, and count
the bytes a call sends, loops included (`bytes_by_axis`)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import numpy as np
from jax.sharding import Mesh

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


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_CALLS = re.compile(r"(?:calls|body|to_apply|branch_computations)=\{?([^}\s]+(?:,\s*%[^\s,}]+)*)\}?")
_WHILE = re.compile(r"\swhile\(.*?body=%?([^\s,]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"')


class CountedCollective(NamedTuple):
    """A collective instruction with the times one call of the program runs it.

    Attributes:
      collective: the instruction (`HloCollective`).
      times: runs per call: the trip counts of the while loops around it multiplied
        (a scanned layer's collective runs once per layer).
      recomputed: it sits in a rematerialised computation, recomputing a forward
        message for the backward pass.
    """

    collective: HloCollective
    times: int
    recomputed: bool


def _computations(hlo_text: str) -> tuple[str, dict[str, list[str]]]:
    """The ENTRY computation's name and every computation's instruction lines."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if (match := _COMPUTATION.match(line)) and not line.startswith(" "):
            current = match.group(1).lstrip("%")
            bodies[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None:
            bodies[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, bodies


def collectives_with_counts(hlo_text: str) -> list[CountedCollective]:
    """The collectives of a compiled module, each with the times one call runs it.

    A collective in a while loop's body (a `lax.scan`, e.g. scanned layers) counts its
    loop's known trip count, nested loops multiplied; one reached from several call
    sites counts each.

    Args:
      hlo_text: the compiled module's text (`jax.jit(f).lower(...).compile().as_text()`).

    Returns:
      One `CountedCollective` per collective instruction (async `-start` halves
      included), computation by computation.

    Raises:
      ValueError: no ENTRY computation; a collective inside a loop whose trip count the
        compiler does not know; a collective of an unknown element type.
    """
    entry, bodies = _computations(hlo_text)
    counts: dict[str, int | None] = {}

    def visit(name: str, times: int | None) -> None:
        counts[name] = times if name not in counts else _add(counts[name], times)
        for line in bodies.get(name, ()):
            loop = _WHILE.search(line)
            for match in _CALLS.finditer(line):
                for callee in (c.strip().lstrip("%") for c in match.group(1).split(",")):
                    if callee not in bodies:
                        continue
                    if loop and callee == loop.group(1).lstrip("%"):
                        trips = _TRIP_COUNT.search(line)
                        visit(callee, None if trips is None or times is None else times * int(trips.group(1)))
                    else:
                        visit(callee, times)

    visit(entry, 1)
    found = []
    for name, times in counts.items():
        for line in bodies[name]:
            for collective in collectives_in_hlo(line):
                if times is None:
                    raise ValueError(f"a {collective.op} in computation {name!r} runs in a loop of unknown trip count")
                found.append(CountedCollective(collective, times, "rematted_computation" in line))
    return found


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def bytes_by_axis(hlo_text: str, mesh: Mesh, *, recomputed: bool | None = None) -> dict[str, dict[str, int]]:
    """Bytes each device sends per call of a compiled program, by mesh axes and element
    type, loops counted by their trip counts (`collectives_with_counts`).

    Args:
      hlo_text: the compiled module's text.
      mesh: the mesh the program runs on; its devices name the collectives' axes.
      recomputed: True: only the rematerialisation's recomputed messages; False: only
        the others; None: all.

    Returns:
      {mesh axes joined by "+" (e.g. "tensor", "fsdp+tensor"; "none" for a group of one
      device): {element type (e.g. "u8", "f32"): bytes}}.

    Raises:
      ValueError: as `collectives_with_counts`.
    """
    table: dict[str, dict[str, int]] = {}
    for collective, times, remat in collectives_with_counts(hlo_text):
        if recomputed is not None and remat != recomputed:
            continue
        axes = "+".join(collective.mesh_axes(mesh)) or "none"
        row = table.setdefault(axes, {})
        row[collective.dtype] = row.get(collective.dtype, 0) + times * collective.sent_bytes
    return table


def f32_as_bf16(row: dict[str, int]) -> int:
    """Bytes of one `bytes_by_axis` row with its f32 messages counted at 2 bytes an
    element: what the program sends on GPU, where XLA keeps bf16 activations'
    collectives in bf16 (the CPU compiler widens them to f32)."""
    return sum(size // 2 if dtype == "f32" else size for dtype, size in row.items())


__all__ = [
    "COLLECTIVE_OPS",
    "CountedCollective",
    "HloCollective",
    "bytes_by_axis",
    "collectives_in_hlo",
    "collectives_with_counts",
    "dtype_bytes",
    "f32_as_bf16",
]
