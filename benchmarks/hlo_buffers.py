"""The largest buffers an optimized XLA module writes: its loop fusions, copies,
broadcasts and dynamic-update-slices of at least `--min-mib`, each with the computation
it sits in (ENTRY, a loop body, a fusion), largest first.

Dump the module first, e.g. the trainer's step with the layers scanned:

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*train_step.*" \\
      python -m benchmarks.step --families gpt2 --modes off --steps 1 --scan-layers --out /tmp/step.json
  python -m benchmarks.hlo_buffers /tmp/dump > benchmarks/results/train_step_scan_buffers.txt

A zero-filled (layers, ...) buffer is a `loop_broadcast_fusion` in ENTRY; what a loop
copies out of a stacked buffer is a `dynamic-slice` at the root of a fusion there.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

from taco_jax.hlo import dtype_bytes

INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (.+?) (copy|copy-start|dynamic-update-slice|broadcast|fusion)\(")
SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def _nbytes(result_type: str) -> int:
    """Bytes of an HLO result type (a shape or a tuple of shapes)."""
    return sum(
        int(np.prod([int(d) for d in dims.split(",") if d])) * dtype_bytes(dtype)
        for dtype, dims in SHAPE.findall(result_type)
    )


def large_buffers(hlo_text: str, min_bytes: int) -> list[tuple[int, str, str, str, str]]:
    """(bytes, computation, instruction, opcode, result type) of every loop fusion, copy,
    broadcast and dynamic-update-slice writing at least `min_bytes`, largest first."""
    rows, computation = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split("(")[0].strip()
            continue
        match = INSTRUCTION.match(line)
        if not match or (match[3] == "fusion" and "kind=kLoop" not in line):
            continue
        nbytes = _nbytes(match[2])
        if nbytes >= min_bytes:
            rows.append((nbytes, computation, match[1], match[3], match[2]))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path, help="an --xla_dump_to folder")
    parser.add_argument("--min-mib", type=float, default=64.0)
    parser.add_argument("--rows", type=int, default=45)
    args = parser.parse_args()
    path = max(args.dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    print(path.name)
    for nbytes, computation, name, opcode, result in large_buffers(path.read_text(), int(args.min_mib * 2**20))[
        : args.rows
    ]:
        print(f"{nbytes / 2**20:9.1f} MiB  {opcode:22s} {name[:40]:40s} in {computation[:50]}  {result[:90]}")


if __name__ == "__main__":
    main()
