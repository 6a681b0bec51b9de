"""MaxText with and without taco on 8 simulated CPU devices: the compiled train step's
bytes per mesh axis and element type (from its HLO), and loss curves.

For each decoder block (llama2; qwen3 with its query/key norm) and mesh (tp4 x dp2, tp4 x fsdp2) it compiles
MaxText's train step twice, plain and with `taco+` (every message compressed:
`min_bytes=0`), through MaxText's own pre-training main; then trains the tiny llama2
decoder `--steps` steps with `--taco off` and with `taco+` from the same start.

Usage (in the environment of `make test-maxtext`):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m benchmarks.maxtext [--steps 200] [--out benchmarks/results/maxtext_wire.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

from taco_jax import TacoConfig, strict_json
from taco_jax.integrations import maxtext as taco_maxtext

TINY = (
    "base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 head_dim=64 base_mlp_dim=1024 "
    "base_num_decoder_layers=2 vocab_size=1024 max_target_length=128 per_device_batch_size=1 "
    "attention=dot_product hardware=cpu dataset_type=synthetic skip_jax_distributed_system=true "
    "enable_checkpointing=false"
).split()
MESHES = {
    "tp4 x dp2": ["ici_tensor_parallelism=4", "ici_data_parallelism=2"],
    "tp4 x fsdp2": ["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "ici_data_parallelism=1"],
}
# Decoder blocks and their own settings (qwen3 with its query/key normalisation).
BLOCKS = {"llama2": [], "qwen3": ["use_qk_norm=true"]}
MODES = {"plain": None, "taco+": TacoConfig.preset("taco+", min_bytes=0)}


def _run(tmp: str, name: str, args: list[str], mode: str) -> dict:
    """MaxText's train main: plain ("plain"), or with taco ("off", "taco+")."""
    argv = [f"run_name={name}", f"base_output_directory={tmp}", f"metrics_file={tmp}/{name}.jsonl", *TINY, *args]
    return taco_maxtext.run(argv, taco=MODES.get(mode, mode), preset=mode)


def wire_rows(tmp: str) -> list[dict]:
    """One row per block, mesh and mode: the train step's bytes per step and device."""
    rows = []
    for block, block_args in BLOCKS.items():
        for mesh, mesh_args in MESHES.items():
            for mode in MODES:
                name = f"{block}-{mesh.replace(' ', '')}-{mode}".replace("+", "plus")
                summary = _run(tmp, name, [f"decoder_block={block}", *block_args, *mesh_args, "steps=1"], mode)
                rows.append(
                    {
                        "block": block,
                        "mesh": mesh,
                        "mode": mode,
                        "bytes_by_axis": summary["hlo_bytes_by_axis"],
                        "recomputed_bytes_by_axis": summary["hlo_recomputed_bytes_by_axis"],
                        "tensor_bytes": summary["tensor_bytes"],
                        "tensor_bytes_f32_as_bf16": summary["tensor_bytes_f32_as_bf16"],
                        "ledger_tensor_bytes": summary["ledger_tensor_bytes"],
                        "ledger_tensor_bytes_bf16": summary["ledger_tensor_bytes_bf16"],
                    }
                )
                print(f"{block:7} {mesh:12} {mode:6} tensor {summary['tensor_bytes']:>10,} B", file=sys.stderr)
    return rows


def loss_curves(tmp: str, steps: int) -> list[dict]:
    """The tiny llama2 decoder (tp4 x dp2), `off` and `taco+` from the same start."""
    curves = []
    for mode in ("off", "taco+"):
        name = f"curve-{mode}".replace("+", "plus")
        _run(tmp, name, [*MESHES["tp4 x dp2"], f"steps={steps}"], mode)
        with open(f"{tmp}/{name}.jsonl") as file:
            losses = [row["learning/loss"] for row in map(json.loads, file)]
        curves.append({"mode": mode, "mesh": "tp4 x dp2", "block": "llama2", "losses": losses})
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps of the loss curves")
    parser.add_argument("--out", default="benchmarks/results/maxtext_wire.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record = {
            "card": "CPU, 8 simulated devices",
            "date": datetime.date.today().isoformat(),
            "command": "python -m benchmarks.maxtext" + (f" --steps {args.steps}" if args.steps != 200 else ""),
            "maxtext": taco_maxtext.MAXTEXT_VERSION,
            "config": " ".join(TINY),
            "rows": wire_rows(tmp),
        }
        Path(args.out).write_text(strict_json.dumps(record, indent=1) + "\n")  # kept if the curves fail
        record["curves"] = loss_curves(tmp, args.steps)
    Path(args.out).write_text(strict_json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
