"""Command line of `python -m taco_jax.train`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

EPILOG = """
Any config field can also be set as key=value (after the flags), e.g.
  python -m taco_jax.train --steps 50 lr=1e-3 batch_size=32 sequence_parallel=true
Fields (see train/config.py): {fields}.
Precedence: defaults < --config file < flags < key=value.

--resume continues the run in --out with the settings it was started with (saved in each
checkpoint); a key that differs is an error, except these: {resumable}.
A run resumed to more steps keeps its learning-rate schedule unless decay_steps was set.
A resumed run keeps the calibration its checkpoint holds: a calibration_file changed or
gone since the run started is an error (--force resumes with the checkpoint's).

Where compression is used: taco_policy=auto (the default) times every tensor-parallel
message shape plain and compressed on the GPUs at start-up, prints the decision, writes
OUT/link_profile.json, and compresses only what was measured faster (on two H200s:
plain over NVLink, where the codec costs more than it saves; compressed on a slow link,
1.11x per step). On CPU every message is compressed. taco_policy=always compresses
everything; taco_policy=PATH reuses a link_profile.json.

Multi-host: start one process per host with the same flags plus --coordinator HOST:PORT
--num-processes N --process-id I (or --distributed auto where jax detects the cluster).
"""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one `error:` line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .config import RESUMABLE_KEYS, flat_keys

    parser = OneLineParser(
        prog="python -m taco_jax.train",
        description="Train a GPT-2 / Qwen2 model with 3-D parallelism (data x pipe x tensor) and "
        "TACO-compressed tensor-parallel communication. Without arguments: a tiny byte-level GPT "
        "on the shipped Shakespeare text on 8 simulated CPU devices (configs/default.yaml).",
        epilog=EPILOG.format(fields=" ".join(flat_keys()), resumable=" ".join(RESUMABLE_KEYS)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", default="default", help="YAML file, or a preset name under configs/ (default: default)"
    )
    parser.add_argument("--model", help="model preset, e.g. gpt2-tiny, gpt2-small, qwen2-0.5b")
    parser.add_argument("--mesh", help="DATA,PIPE,TENSOR degrees; their product must equal the device count")
    parser.add_argument("--taco", help="compression preset: off | fp8 | taco | taco+ | taco+mixed | taco6-4 | taco4")
    parser.add_argument("--steps", help="train up to this optimizer step")
    parser.add_argument("--seed", help="seed of the parameter init and the data order, in [0, 2**32)")
    parser.add_argument("--out", help="run directory: checkpoints/, metrics.jsonl, summary.json, loss.png")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="observe the compressed tensors again for calibration_steps and recalibrate",
    )
    parser.add_argument(
        "--calibrate-only",
        action="store_true",
        help="observe calibration_steps batches without training (from the checkpoint with --resume), "
        "write OUT/calibration.json for calibration_file=",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --calibrate-only: overwrite OUT/calibration.json; with --resume: continue with the "
        "checkpoint's calibration although calibration_file changed since the run started or is gone",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--coordinator", help="multi-host: coordinator address HOST:PORT (jax.distributed)")
    parser.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, help="multi-host: this process's index")
    parser.add_argument("--distributed", choices=["auto"], help="multi-host: let jax.distributed detect the cluster")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config field overrides")
    return parser


def _simulated_cpu_devices(mesh: tuple[int, ...]) -> None:
    """Give XLA's CPU backend as many devices as the mesh needs (a no-op for GPUs; must
    run before jax initializes its backends)."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    devices = 1
    for degree in mesh:
        devices *= int(degree)
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    )


def _config(args: argparse.Namespace):
    """The TrainConfig of the command line: YAML file, then flags, then key=value."""
    from . import config as config_lib

    values = config_lib.load_yaml(args.config)
    for flag in ("model", "mesh", "taco", "steps", "seed", "out"):
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    if args.recalibrate:
        values["recalibrate"] = True
    values.update(config_lib.parse_key_values(args.overrides))
    return config_lib.apply_overrides(config_lib.TrainConfig(), values)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = _config(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.coordinator or args.distributed:
        import jax

        if args.distributed == "auto":
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    else:
        _simulated_cpu_devices(cfg.mesh)
    from taco_jax import strict_json

    from .errors import EXPECTED_FAILURES
    from .trainer import calibrate_only, train

    try:
        if args.calibrate_only:
            summary = calibrate_only(cfg, resume=args.resume, force=args.force)
        else:
            summary = train(cfg, resume=args.resume, progress=not args.no_progress, force=args.force)
    except EXPECTED_FAILURES as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(strict_json.dumps(summary, indent=1))
    if "wire_fraction_of_uncompressed_by_axis" in summary:
        print(wire_fraction_line(summary), file=sys.stderr)
    return 0


def wire_fraction_line(summary: dict) -> str:
    """One line saying what each mesh axis sends per step as a share of what the same
    collectives send uncompressed, with the axis's preset, e.g. "bytes sent per step
    against the same collectives uncompressed: tensor 26% (taco+), data 100% (off)"."""
    presets = {"tensor": summary["taco"], "pipe": summary["taco_pipe"], "data": summary["taco_data"]}
    shares = ", ".join(
        f"{axis} {100 * share:.0f}% ({presets[axis]})"
        for axis, share in summary["wire_fraction_of_uncompressed_by_axis"].items()
    )
    return f"bytes sent per step against the same collectives uncompressed: {shares or 'nothing crosses a mesh axis'}"
