"""The measurement tables and figures of README.md and docs/, rendered from the result
files under benchmarks/results/, so that a page cannot drift from its source.

A page asks for a table with a marker pair, and this module writes the table between
them (the card, date, command and file of each source below it):

    <!-- results: step_vs_torch -->
    ...generated...
    <!-- /results -->

and for a figure with `<!-- figure: NAME -->`, which the docs build replaces with the
figure, drawn from its result file, and the same source line.

    python -m benchmarks.report           # rewrite every generated table in place
    python -m benchmarks.report --check   # exit 1 if a page differs from its sources
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"
PAGES = ("README.md", "docs")
TABLE = re.compile(r"^(<!-- results: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /results -->)$", re.S | re.M)
FIGURE = re.compile(r"^<!-- figure: (?P<name>[\w-]+) -->$", re.M)  # on a line of its own
# A measured figure in prose or a table: a number with a unit of time, speed, size or a
# share, a speed-up ("1.20x") or an error bar ("0.31 ± 0.02").
MEASUREMENT = re.compile(r"(?<![\w.])[-+−]?\d+(?:\.\d+)?(?:\s?(?:%|ms\b|us\b|µs\b|TB/s|GB/s|GiB\b)|x\b)|\d\s?±\s?\d")


@dataclass(frozen=True)
class Source:
    """Where a table's numbers come from.

    Attributes:
      file: the result file, relative to benchmarks/results/.
      command: the command that wrote it.
      card: the accelerator it ran on ("CPU" for the host).
      date: the day it ran.
    """

    file: str
    command: str
    card: str = ""
    date: str = ""

    def line(self) -> str:
        """One line naming the file, card, date and command."""
        meta = _meta(load(self.file))
        card = self.card or meta.get("card") or meta.get("device") or meta.get("device_kind", "")
        date = self.date or meta.get("date", "")
        parts = [f"`benchmarks/results/{self.file}`", card, date, f"`{self.command}`"]
        return " · ".join(p for p in parts if p)


def load(name: str) -> dict:
    """A result file's JSON."""
    return json.loads((RESULTS / name).read_text())


def _meta(record: dict) -> dict:
    return record.get("meta", record) if isinstance(record, dict) else {}


def _rows(name: str) -> list[dict]:
    return load(name)["rows"]


def _pct(value: float, digits: int = 0, sign: bool = False) -> str:
    return f"{100 * value:{'+' if sign else ''}.{digits}f}%"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


# ----------------------------------------------------------------------------- tables

FAMILIES = {"gpt2": "GPT 0.91B", "qwen2": "Qwen2 0.93B"}
STEP_COMMAND = "python -m benchmarks.step --families gpt2,qwen2 --modes off,taco,taco+"


def _step_ms(name: str) -> dict[tuple[str, str], float]:
    return {(r["family"], r["mode"]): r["step_ms"] for r in _rows(name)}


def step_vs_torch() -> tuple[str, list[Source]]:
    """The one-GPU training step against PyTorch's on the same card, in one run."""
    file = "step_h200_vs_torch.json"
    rows, ms = _rows(file), _step_ms(file)
    mfu = {(r["family"], r["mode"]): r["mfu"] for r in rows}
    body = []
    for family, label in FAMILIES.items():
        torch, off = ms[family, "torch"], ms[family, "off"]
        body.append(
            [
                label,
                f"{torch:.1f} ms ({_pct(mfu[family, 'torch'], 1)} MFU)",
                f"{off:.1f} ms ({off / torch:.2f}x torch's time, {_pct(mfu[family, 'off'], 1)} MFU)",
                *(
                    f"{ms[family, mode]:.1f} ms ({_pct(ms[family, mode] / off - 1, 1, sign=True)})"
                    for mode in ("taco", "taco+")
                ),
            ]
        )
    head = ["step, one GPU", "PyTorch", "off", "taco", "taco+"]
    command = f"XLA_FLAGS=--xla_gpu_enable_triton_gemm=false {STEP_COMMAND} --reference torch"
    return _table(head, body), [Source(file, command)]


def step_layers() -> tuple[str, list[Source]]:
    """The same step with the layers in a scan against unrolled (the default)."""
    scanned, unrolled = _step_ms("step_layers_scanned.json"), _step_ms("step_layers_unrolled.json")
    body = []
    for family, label in FAMILIES.items():
        for mode in ("off", "taco"):
            before, after = scanned[family, mode], unrolled[family, mode]
            body.append([label, mode, f"{before:.1f} ms", f"{after:.1f} ms", f"{before / after:.2f}x"])
    command = "python -m benchmarks.step --families gpt2,qwen2 --modes off,taco --profile"
    sources = [Source(f"step_layers_{kind}.json", command) for kind in ("scanned", "unrolled")]
    return _table(["model", "mode", "layers scanned", "unrolled", "speed-up"], body), sources


# The TP=2 step on two GPUs, per link (the slow link: NCCL's peer-to-peer path disabled).
TP2_FILES = {"NVLink": "step_tp2_nvlink_flash_attention.json", "slow link": "step_tp2_slowlink_flash_attention.json"}


def tp2_source(link: str) -> Source:
    """The source line of the TP=2 step over `link`."""
    prefix = "NCCL_P2P_DISABLE=1 " if link == "slow link" else ""
    command = f"{prefix}python -m benchmarks.step --mesh 1,1,2 --modes off,taco,taco+,default"
    return Source(TP2_FILES[link], command)


def step_tp2() -> tuple[str, list[Source]]:
    """The TP=2 step on two GPUs over NVLink and over the slow-link proxy."""
    body = []
    for link, file in TP2_FILES.items():
        ms = _step_ms(file)
        off = ms["gpt2", "off"]
        cells = [f"{off:.1f} ms"]
        for mode in ("taco", "taco+", "default"):
            cells.append(f"{ms['gpt2', mode]:.1f} ms, {off / ms['gpt2', mode]:.2f}x")
        body.append([link, *cells])
    head = ["0.91B GPT step, TP=2", "off", "taco", "taco+", "default (`taco_policy=auto`)"]
    return _table(head, body), [tp2_source(link) for link in TP2_FILES]


def collectives() -> tuple[str, list[Source]]:
    """Compressed collectives against bf16 on the slow link, per message size."""
    file = "collectives_slowlink.json"
    rows = _rows(file)
    sizes = sorted({r["mib_per_rank"] for r in rows if r["mib_per_rank"] >= 64})
    body = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):

        def cell(part: str, preset: str, key: str, best: Callable = max) -> str:
            picked = [r for r in rows if (r["op"], r["part"], r["preset"]) == (op, part, preset)]
            values = {s: best(r[key] for r in picked if r["mib_per_rank"] == s) for s in sizes}
            return " / ".join(f"{values[s]:.2f}" for s in sizes)

        body.append(
            [
                op,
                cell("plain", "off (bf16)", "ms", min) + " ms",
                cell("bytes", "taco+", "speedup") + "x",
                cell("library", "taco+", "speedup") + "x",
            ]
        )
    head = [
        " / ".join(f"{s:.0f}" for s in sizes) + " MiB per rank",
        "bf16",
        "bytes alone",
        "library (taco+, best route)",
    ]
    return _table(head, body), [Source(file, "NCCL_P2P_DISABLE=1 python -m benchmarks.collectives")]


def kernel_shares(file: str) -> dict[tuple[str, str, str, tuple[int, int]], float]:
    """Per (op, kernel, preset, shape): the GPU kernel's bandwidth as a share of the
    fastest copy's (XLA's or PyTorch's) of the same bytes, in GPU time."""
    timings = load(file)["timings"]
    copy: dict[tuple[int, int], float] = {}
    for r in timings:
        if r["op"] == "copy":
            shape = (r["tokens"], r["channels"])
            copy[shape] = max(copy.get(shape, 0.0), r["device_tb_per_s"])
    return {
        (r["op"], r["impl"], r["preset"], (r["tokens"], r["channels"])): r["device_tb_per_s"]
        / copy[r["tokens"], r["channels"]]
        for r in timings
        if r["impl"] in ("gluon", "pallas")
    }


def kernels(file: str = "kernels.json") -> tuple[str, list[Source]]:
    """Each codec op on its Gluon and its Pallas kernel, as a share of a copy's bandwidth."""
    shares = kernel_shares(file)
    keys = list(shares)
    shapes = list(dict.fromkeys(k[3] for k in keys))
    presets = [p for p in ("taco", "taco+", "fp8") if any(k[2] == p for k in keys)]
    impls = [i for i in ("gluon", "pallas") if any(k[1] == i for k in keys)]

    def cell(op: str, impl: str, shape: tuple[int, int]) -> str:
        return " / ".join(_pct(shares[op, impl, p, shape]) if (op, impl, p, shape) in shares else "–" for p in presets)

    head = ["op (" + " / ".join(presets) + ")"] + [f"{impl} {t} x {c}" for t, c in shapes for impl in impls]
    body = [
        [op] + [cell(op, impl, shape) for shape in shapes for impl in impls] for op in dict.fromkeys(k[0] for k in keys)
    ]
    shape_text = ",".join(f"{t}x{c}" for t, c in shapes)
    return _table(head, body), [Source(file, f"python -m benchmarks.kernels --no-sweep --shapes {shape_text}")]


KERNELS_PACKED_COMMAND = "python -m benchmarks.kernels --packed-only --packed-launches 32:2:2,32:4:2"


def kernels_packed() -> tuple[str, list[Source]]:
    """Each op of the packed (sub-byte) specs at its default launch, as a share of a
    copy's bandwidth in GPU time, INT8 beside them."""
    file = "kernels_packed.json"
    record = load(file)
    rows = [r for r in record["packed"] if r["launch"] == "default"]
    spec = lambda r: f"{r['fmt'].upper()} G{r['group_size']}"
    specs = list(dict.fromkeys(map(spec, rows)))
    shares = {(r["op"], spec(r)): r["device_tb_per_s"] / record["copy_tb_per_s"] for r in rows}
    # A tenth of a point: the kernels are held to 85% of a copy, which whole points round across.
    body = [[op, *(_pct(shares[op, name], 1) for name in specs)] for op in dict.fromkeys(r["op"] for r in rows)]
    return _table(["op", *specs], body), [Source(file, KERNELS_PACKED_COMMAND)]


def quality(file: str = "quality_stable.json") -> tuple[str, list[Source]]:
    """Paired validation-loss gaps to bf16 per corpus, model and preset."""
    from benchmarks import quality as harness

    record = load(file)
    settings = record["settings"]
    text, _ = harness.table(harness.chosen_runs(record), settings["models"].split(","), settings["variants"].split(","))
    return text, [quality_source(file)]


QUALITY_COMMANDS = {
    "quality_stable.json": "python -m benchmarks.quality --simulate --tag stable --corpora CORPUS "
    "--models gpt2-40m,qwen2-40m --variants off,off-control,fp8,taco,taco+,int4+H --seeds 3 --steps 1600 "
    "--batch-size 8 --seq-len 128 --lr-sweep 3e-4,1.5e-4 (one run per corpus)",
    "quality_pipe_data.json": "python -m benchmarks.quality --simulate --mesh 2,2,2 --microbatches 2 --tag pipe_data "
    "--variants off,pipe-taco,pipe-taco+,data-taco,data-taco+,data-int4+H,all-taco+ --models gpt2-mini,qwen2-mini "
    "--seeds 5",
    "quality_bits_direction.json": "python -m benchmarks.quality --simulate --tag bits_direction "
    "--corpora shakespeare --models gpt2-40m,qwen2-40m --variants off,e2m3fwd-int4bwd,int4g16fwd-int4bwd,"
    "e2m3fwd-int4g16bwd --seeds 2 --steps 1600 --batch-size 8 --seq-len 128 --lr 1.5e-4, then --seeds 4 "
    "without int4g16fwd-int4bwd",
    "quality_bits.json": "python -m benchmarks.quality --simulate --tag bits --corpora shakespeare "
    "--models gpt2-40m,qwen2-40m --variants off,taco+,taco+mixed,taco6-4,taco4 --seeds 3 --steps 1600 "
    "--batch-size 8 --seq-len 128 --lr 1.5e-4 --jobs 16 (Shakespeare); then --corpora python-code,python-docs,"
    "shakespeare --variants off,taco6-4,e2m3fwd-int4g16bwd,taco+mixed, cut at 525 s (python-code: off, and "
    "seeds 0-1 of the others); then --corpora python-code --variants off,taco+mixed,int5,taco6-4,"
    "e2m3fwd-int4g16bwd --jobs 12 (python-code, 3 seeds); then --corpora python-docs --variants "
    "off,taco+mixed,taco6-4 --seeds 2 --jobs 12; then --corpora python-docs --variants "
    "off,taco+,taco+mixed,taco6-4 --seeds 3 --jobs 12 (seed 2, and taco+); then --corpora python-code,python-docs "
    "--variants off,taco4 --seeds 3 --jobs 12; then --corpora python-code --variants off,taco+ --seeds 3 --jobs 6",
}
QUALITY_DATES = {
    "quality_stable.json": "2026-12-02 to 2026-12-03",
    "quality_pipe_data.json": "2026-11-30",
    "quality_bits_direction.json": "2026-12-06",
    "quality_bits.json": "2026-12-06 to 2026-12-08",
}
QUALITY_CARDS = {"quality_bits_direction.json": "NVIDIA H100 80GB HBM3", "quality_bits.json": "NVIDIA H100 80GB HBM3"}


def quality_source(file: str) -> Source:
    """The source line of a quality harness's results file."""
    return Source(file, QUALITY_COMMANDS[file], card=QUALITY_CARDS.get(file, "NVIDIA H200"), date=QUALITY_DATES[file])


def gradient_fidelity() -> tuple[str, list[Source]]:
    """Each preset's gradient error against the minibatch noise, at checkpoints of one run."""
    file = "gradient_fidelity.json"
    record = load(file)

    def overall(entry: dict) -> float:  # the whole gradient's relative error
        return float(entry["all"]["rel_error"])

    presets = [p for p in next(iter(record["steps"].values()))["presets"]]
    body = []
    for step, at in record["steps"].items():
        if step == "0":
            continue
        noise = overall(at["noise"])
        cells = [
            f"{_pct(overall(at['presets'][p]), 1)} ({noise / overall(at['presets'][p]):.0f}x below)" for p in presets
        ]
        body.append([step, _pct(noise), *cells])
    command = (
        "python -m benchmarks.gradient_fidelity --simulate --model gpt2-40m --corpus shakespeare "
        "--steps 1600 --checkpoints 0,400,1600 --lr 1.5e-4 --batch-size 8 --seq-len 128"
    )
    head = ["step", "minibatch noise", *presets]
    return _table(head, body), [Source(file, command, card=record["device"], date="2026-12-02")]


CODEC_SPECS = (
    ("fp8", "e4m3", "single"),
    ("fp8", "int8", "single"),
    ("taco", "e4m3", "dual"),
    ("taco", "e4m3", "bf16"),
    ("taco", "e5m2", "dual"),
    ("taco", "int8", "dual"),
    ("taco", "int8", "bf16"),
    ("taco", "int8", "e8m0"),
)
TENSORS = ("gaussian", "activation", "gradient", "lognormal")


def codec_error() -> tuple[str, list[Source]]:
    """Relative RMSE per format, single-shot / through a two-shot all-reduce, G=128."""
    file = "codec_error.json"
    rows = [r for r in _rows(file) if r["group_size"] == 128]
    body = []
    for mode, fmt, scales in CODEC_SPECS:
        mine = {r["tensor"]: r for r in rows if (r["mode"], r["fmt"], r["scales"]) == (mode, fmt, scales)}
        if not mine:
            continue
        ratio = next(iter(mine.values()))["wire_ratio"]
        cells = [f"{_pct(mine[t]['rel_rmse'], 2)} / {_pct(mine[t]['two_shot_rel_rmse'], 2)}" for t in TENSORS]
        body.append([mode, fmt, scales, f"{ratio:.3f}", *cells])
    head = ["mode", "fmt", "scales", "wire / bf16", *TENSORS]
    return _table(head, body), [Source(file, "python -m benchmarks.codec_error", card="CPU", date="2026-11-29")]


def fewer_bits() -> tuple[str, list[Source]]:
    """Relative RMSE of the formats below 8 bits against E4M3's (`fewer_bits.table`)."""
    from benchmarks import fewer_bits as harness

    file = "fewer_bits_error.json"
    source = Source(file, load(file)["meta"]["command"], card="CPU", date="2026-12-07")
    return harness.table(_rows(file)), [source]


def captured_error() -> tuple[str, list[Source]]:
    """The codec's error on the models' own tensors, per corpus: relative RMSE, median
    over sites, forward / backward."""
    files = [f"captured_error_{c}.json" for c in ("shakespeare", "python-docs", "python-code")]
    picked = ("e4m3 + H (taco)", "int8 + H (taco+)", "int4 + H", "int8 calibrated")

    def median(rows: list[dict], spec: str, direction: str) -> str:
        return _pct(
            float(np.median([r["rel_rmse"] for r in rows if (r["spec"], r["direction"]) == (spec, direction)])), 2
        )

    body = []
    for file in files:
        corpus = file.removeprefix("captured_error_").removesuffix(".json")
        for model, rows in load(file).items():
            body.append(
                [corpus, model, *(f"{median(rows, s, 'forward')} / {median(rows, s, 'backward')}" for s in picked)]
            )
    command = "python -m benchmarks.captured_error --simulate --models gpt2-40m,qwen2-40m --corpus CORPUS --steps 400 --tag CORPUS"
    sources = [Source(file, command, card="NVIDIA H200", date="2026-12-01") for file in files]
    return _table(["corpus", "model", *picked], body), sources


def generate() -> tuple[str, list[Source]]:
    """Prefill and decode wall-clock time with and without compression."""
    file = "generate_h200_repeats.json"
    rows = {(r["family"], r["mode"]): r for r in _rows(file)}
    body = []
    for family, label in FAMILIES.items():
        off, taco = rows[family, "off"], rows[family, "taco+"]
        body.append(
            [
                label,
                f"{off['prefill_ms']:.1f} ms",
                f"{taco['prefill_ms']:.1f} ms ({_pct(taco['prefill_ms'] / off['prefill_ms'] - 1, sign=True)})",
                f"{off['decode_ms_per_token']:.2f} ms",
                f"{taco['decode_ms_per_token']:.2f} ms",
            ]
        )
    head = ["model, batch 4", "prefill 512, off", "prefill, taco+", "decode per token, off", "decode, taco+"]
    command = "python -m benchmarks.generate --modes off,taco+ --repeats 20"
    return _table(head, body), [Source(file, command, card="NVIDIA H200", date="2026-12-03")]


def step_pipe_data() -> tuple[str, list[Source]]:
    """Compressed data-parallel and pipeline traffic on two GPUs."""
    cases = (
        ("step_dp2_slowlink_0.91b.json", "data 2", "slow"),
        ("step_dp2_slowlink.json", "data 2", "slow"),
        ("step_dp2_nvlink.json", "data 2", "NVLink"),
        ("step_pp2_slowlink.json", "pipe 2", "slow"),
    )
    body, sources = [], []
    for file, mesh, link in cases:
        rows = _rows(file)
        off = next(r for r in rows if r["mode"] == "off")
        for row in rows:
            if row["mode"] == "off":
                continue
            size = f"{row['params'] / 1e9:.2f}B"
            speedup = off["step_ms"] / row["step_ms"]
            body.append(
                [
                    mesh,
                    link,
                    size,
                    f"{off['step_ms']:.1f} ms",
                    f"{row['mode']} {row['step_ms']:.1f} ms",
                    f"{speedup:.2f}x",
                ]
            )
        prefix = "NCCL_P2P_DISABLE=1 " if link == "slow" else ""
        mesh_arg = "2,1,1" if mesh.startswith("data") else "1,2,1"
        sources.append(Source(file, f"{prefix}python -m benchmarks.step --mesh {mesh_arg}"))
    head = ["mesh", "link", "model", "off", "compressed", "speed-up"]
    return _table(head, body), sources


def permutation_cost() -> tuple[str, list[Source]]:
    """A calibrated permutation's gathers against the GEMM that produces the message."""
    file = "permutation_cost.json"
    body = [
        [
            f"{r['tokens']}x{r['channels']}",
            r["preset"],
            f"{r['matmul_ms']:.3f} ms",
            f"{r['compress_ms']:.3f} / {r['compress_perm_ms']:.3f} ms",
            f"{r['decompress_ms']:.3f} / {r['decompress_perm_ms']:.3f} ms",
            _pct(
                (r["compress_perm_ms"] + r["decompress_perm_ms"] - r["compress_ms"] - r["decompress_ms"])
                / r["matmul_ms"]
            ),
        ]
        for r in _rows(file)
    ]
    head = ["message", "preset", "GEMM", "compress / + gather", "decompress / + gather", "gathers vs GEMM"]
    return _table(head, body), [
        Source(file, "python -m benchmarks.permutation_cost", card=load(file)["device"], date="2026-11-29")
    ]


CODEC_COST_FILES = ("codec_cost_gpt2.json", "codec_cost_qwen2.json", "codec_cost_gpt2_taco.json")
CODEC_COST_PATHS = {
    "train_step": "the trainer's step",
    "nnx_step": "your NNX step, `nnx.jit`",
    "nnx_split_step": "your NNX step, split pattern",
    "prefill": "prefill 4 x 512 (wall clock)",
}


def codec_cost() -> tuple[str, list[Source]]:
    """Each path a user runs, per mode, on one GPU with every site compressed: the time
    and its cost over `off` in the same run (a mode measured in another run says so)."""
    runs = {file: load(file) for file in CODEC_COST_FILES}
    cells: dict[tuple[str, str, str], tuple[float, str]] = {}
    for file, record in runs.items():
        for row in record["rows"]:
            cells[row["path"], row["family"], row["mode"]] = (row["ms"], file)
    body = []
    for family, label in FAMILIES.items():
        trainer_off = cells["train_step", family, "off"][0]
        for path, name in CODEC_COST_PATHS.items():
            off, off_file = cells[path, family, "off"]
            row = [name, label, f"{off:.1f} ms"]
            for mode in ("taco", "taco+"):
                ms, file = cells[path, family, mode]
                row.append(
                    f"{ms:.1f} ms ({_pct(ms / off - 1, 1, sign=True)})"
                    if file == off_file
                    else f"{ms:.1f} ms (another run)"
                )
            vs_trainer = "" if path in ("train_step", "prefill") else _pct(off / trainer_off - 1, 1, sign=True)
            body.append([*row, vs_trainer])
    head = ["path", "model", "off", "taco", "taco+", "off vs the trainer's off"]
    return _table(head, body), [Source(file, record["command"]) for file, record in runs.items()]


# The presets each packed wire spec serves.
SPEC_PRESETS = {
    "INT8 G128": "taco+",
    "E2M3 G128": "taco+mixed; taco6-4 forward",
    "INT4 G32": "taco4; taco6-4 backward",
    "INT4 G128": "",
    "INT5 G32": "int5",
}


def tp2_messages() -> tuple[str, list[Source]]:
    """The model's TP=2 time of one 256 MiB bf16 all-reduce per link and wire spec, the
    codec at the packed kernels' GPU timings."""
    file = "scaling_model.json"
    messages = load(file)["tp2_messages"]
    specs = list(dict.fromkeys(m["spec"] for m in messages))
    ratio = {m["spec"]: m["wire_ratio"] for m in messages if m["spec"] != "bf16"}
    head = [
        "link",
        "bf16",
        *(f"{spec} ({SPEC_PRESETS[spec] or 'no preset'}, {_pct(ratio[spec])})" for spec in specs[1:]),
    ]
    times = {(m["link"], m["spec"]): m["ms"] for m in messages}
    links = list(dict.fromkeys(m["link"] for m in messages))
    body = [[link, *(f"{times[link, spec]:.2f} ms" for spec in specs)] for link in links]
    sources = [
        Source(file, "python -m benchmarks.scaling_model", date="2026-12-08"),
        Source("kernels_packed.json", KERNELS_PACKED_COMMAND),
    ]
    return _table(head, body), sources


CODEC_COST_BITS_FILES = {"taco6-4": "codec_cost_bits_gpt2.json", "taco4": "codec_cost_taco4_gpt2.json"}


def codec_cost_bits() -> tuple[str, list[Source]]:
    """The sub-byte presets on their kernels beside taco+, one GPU, every site
    compressed: each preset's time and its cost over `off` of its own run."""
    runs = {preset: load(file) for preset, file in CODEC_COST_BITS_FILES.items()}
    cells = {(r["path"], preset, r["mode"]): r["ms"] for preset, record in runs.items() for r in record["rows"]}
    first = next(iter(runs))
    body = []
    for path, name in CODEC_COST_PATHS.items():
        off = cells[path, first, "off"]
        row = [
            name,
            f"{off:.1f} ms",
            f"{cells[path, first, 'taco+']:.1f} ms ({_pct(cells[path, first, 'taco+'] / off - 1, 1, sign=True)})",
        ]
        for preset in runs:
            ms = cells[path, preset, preset]
            row.append(f"{ms:.1f} ms ({_pct(ms / cells[path, preset, 'off'] - 1, 1, sign=True)})")
        body.append(row)
    head = ["path (GPT 0.91B)", "off", "taco+", *runs]
    return _table(head, body), [Source(file, runs[preset]["command"]) for preset, file in CODEC_COST_BITS_FILES.items()]


# Each preset's quality, from the panel that measured it at the stable learning rate.
PRESET_PANELS = {
    "fp8": "quality_stable.json",
    "taco": "quality_stable.json",
    "taco+": "quality_stable.json",
    "taco+mixed": "quality_bits.json",
    "taco6-4": "quality_bits.json",
    "taco4": "quality_bits.json",
}


def _cell_gaps(file: str, variant: str) -> dict[tuple[str, str], tuple[float, int]]:
    """(corpus, model) -> (the mean paired val-loss gap to bf16 in percent, seeds) of one
    variant in a quality file."""
    from benchmarks import quality as harness

    runs = harness.chosen_runs(load(file))
    cells = {}
    for corpus, model in dict.fromkeys((r["corpus"], r["model"]) for r in runs):
        mine = [r for r in runs if (r["corpus"], r["model"]) == (corpus, model)]
        base = {r["seed"]: r for r in mine if r["variant"] == "off"}
        gaps = harness._paired_gaps([r for r in mine if r["variant"] == variant], base, "val_loss")
        if gaps:
            cells[corpus, model] = (float(np.mean(gaps)), len(gaps))
    return cells


def _tensor_share(run: dict) -> float:
    """The tensor axis's bytes as a share of bf16's, as the run measured them."""
    if "wire_fraction" in run:
        return float(run["wire_fraction"])
    return run["wire_bytes_by_axis"]["tensor"] / run["wire_bytes_bf16_by_axis"]["tensor"]


def presets() -> tuple[str, list[Source]]:
    """Each preset: what it sends each way, its tensor bytes as measured, and its paired
    val-loss gap to bf16 over the quality cells (corpus x model, mean over seeds)."""
    from taco_jax.policy import PRESETS

    body = []
    for name, file in PRESET_PANELS.items():
        config = PRESETS[name]
        sends = f"{config.forward.text} / {config.backward.text}"
        if config.fewer_bits is not None:
            sends += " or fewer bits, calibrated per site: " + ", ".join(c.text for c in config.fewer_bits.candidates)
        shares = [_tensor_share(r) for r in load(file)["runs"] if r["variant"] == name]
        cells = _cell_gaps(file, name)
        gaps = [gap for gap, _ in cells.values()]
        seeds = sorted({n for _, n in cells.values()})
        within = sum(gap <= 0.1 for gap in gaps)
        low, high = _pct(min(shares)), _pct(max(shares))
        body.append(
            [
                f"`{name}`",
                sends,
                low if low == high else f"{low}-{high}",
                f"{min(gaps):+.2f} to {max(gaps):+.2f}%",
                f"{within} of {len(cells)} ({'-'.join(map(str, seeds))} seeds)",
                f"`{file}`",
            ]
        )
    head = [
        "preset",
        "forward / backward",
        "tensor bytes of bf16",
        "val-loss gap to bf16",
        "cells at most +0.1%",
        "file",
    ]
    return _table(head, body), [quality_source(file) for file in dict.fromkeys(PRESET_PANELS.values())]


def headline() -> tuple[str, list[Source]]:
    """One line per claim, each from its result file."""
    stable = load("quality_stable.json")
    from benchmarks import quality as harness

    runs = harness.chosen_runs(stable)
    gaps = {v: [gap for gap, _ in _cell_gaps("quality_stable.json", v).values()] for v in ("taco+", "int4+H")}
    wire = {r["variant"]: harness._bytes(r).removeprefix("tensor ") for r in runs}
    slow, nvlink = _step_ms(TP2_FILES["slow link"]), _step_ms(TP2_FILES["NVLink"])
    gluon = [100 * share for (_, impl, _, _), share in kernel_shares("kernels.json").items() if impl == "gluon"]
    decode = [r["decode_ms_per_token"] for r in _rows("generate_h200_repeats.json")]
    costs = {(r["path"], r["family"], r["mode"]): r["ms"] for f in CODEC_COST_FILES for r in load(f)["rows"]}
    prefill_cost = [costs["prefill", f, "taco+"] / costs["prefill", f, "off"] - 1 for f in FAMILIES]
    step_cost = [costs["train_step", f, "taco+"] / costs["train_step", f, "off"] - 1 for f in FAMILIES]
    body = [
        [
            "bytes",
            f"`taco+` sends {wire['taco+']} of bf16's bytes (`taco` {wire['taco']}, `int4+H` {wire['int4+H']})",
            "quality_stable.json",
        ],
        [
            "quality",
            f"paired validation-loss gap to bf16, 3 corpora x 2 models: `taco+` {min(gaps['taco+']):+.2f} to "
            f"{max(gaps['taco+']):+.2f}%, `int4+H` {min(gaps['int4+H']):+.2f} to {max(gaps['int4+H']):+.2f}%",
            "quality_stable.json",
        ],
        [
            "step, slow link",
            f"TP=2 step of a 0.91B GPT on two GPUs: `taco+` {slow['gpt2', 'off'] / slow['gpt2', 'taco+']:.2f}x bf16's speed, "
            f"the default policy {slow['gpt2', 'off'] / slow['gpt2', 'default']:.2f}x",
            TP2_FILES["slow link"],
        ],
        [
            "step, NVLink",
            f"`taco+` everywhere {nvlink['gpt2', 'off'] / nvlink['gpt2', 'taco+']:.2f}x; the default policy keeps "
            f"messages plain: {nvlink['gpt2', 'off'] / nvlink['gpt2', 'default']:.2f}x",
            TP2_FILES["NVLink"],
        ],
        [
            "kernels",
            f"Gluon kernels at {min(gluon):.0f}-{max(gluon):.0f}% of a copy's bandwidth (GPU time)",
            "kernels.json",
        ],
        [
            "codec cost, one GPU",
            f"`taco+` with every site compressed and nothing on the wire: the trainer's step "
            f"{_pct(min(step_cost), 1, sign=True)} to {_pct(max(step_cost), 1, sign=True)}, the prefill "
            f"{_pct(min(prefill_cost), sign=True)} to {_pct(max(prefill_cost), sign=True)} in wall-clock time",
            "codec_cost_gpt2.json, codec_cost_qwen2.json",
        ],
        [
            "inference",
            f"decode {min(decode):.2f}-{max(decode):.2f} ms/token at 0.9B on one GPU (plain: its messages are small)",
            "generate_h200_repeats.json",
        ],
    ]
    body = [[claim, text, ", ".join(f"`{f}`" for f in files.split(", "))] for claim, text, files in body]
    sources = [
        quality_source("quality_stable.json"),
        *(tp2_source(link) for link in TP2_FILES),
        *codec_cost()[1][:2],
        *kernels()[1],
        *generate()[1],
    ]
    return _table(["", "result", "file"], body), sources


def maxtext_wire() -> tuple[str, list[Source]]:
    """MaxText's compiled train step, plain and with taco+: bytes per step and device on
    the tensor axis and on the other axes; and the loss curves' last step."""
    file = "maxtext_wire.json"
    record = load(file)
    rows = {(r["block"], r["mesh"], r["mode"]): r for r in record["rows"]}

    def others(row: dict) -> float:
        return sum(sum(v.values()) for axes, v in row["bytes_by_axis"].items() if "tensor" not in axes.split("+"))

    body = []
    for block, mesh in dict.fromkeys((r["block"], r["mesh"]) for r in record["rows"]):
        plain, taco = rows[block, mesh, "plain"], rows[block, mesh, "taco+"]
        body.append(
            [
                block,
                mesh,
                f"{plain['tensor_bytes'] / 1e6:.2f} MB",
                f"{taco['tensor_bytes'] / 1e6:.2f} MB ({_pct(taco['tensor_bytes'] / plain['tensor_bytes'])})",
                _pct(taco["tensor_bytes_f32_as_bf16"] / plain["tensor_bytes_f32_as_bf16"]),
                _pct(taco["ledger_tensor_bytes"] / taco["ledger_tensor_bytes_bf16"], 1),
                f"{others(plain) / 1e6:.2f} / {others(taco) / 1e6:.2f} MB",
            ]
        )
    head = [
        "block",
        "mesh",
        "tensor axis, plain",
        "tensor axis, taco+",
        "taco+ / plain, f32 as bf16",
        "taco's messages / bf16",
        "other axes, plain / taco+",
    ]
    curves = {c["mode"]: c["losses"] for c in record["curves"]}
    off, taco = curves["off"][-1], curves["taco+"][-1]
    loss = (
        f"Loss after {len(curves['off'])} steps (tiny llama2, tp4 x dp2, same start): off {off:.4f}, "
        f"taco+ {taco:.4f} ({_pct(taco / off - 1, 2, sign=True)})."
    )
    return _table(head, body) + "\n\n" + loss, [Source(file, record["command"])]


TABLES: dict[str, Callable[[], tuple[str, list[Source]]]] = {
    "headline": headline,
    "step_vs_torch": step_vs_torch,
    "step_layers": step_layers,
    "step_tp2": step_tp2,
    "collectives": collectives,
    "kernels": kernels,
    "kernels_4096": lambda: kernels("kernels_4096x4096.json"),
    "quality": quality,
    "quality_pipe_data": lambda: quality("quality_pipe_data.json"),
    "quality_bits_direction": lambda: quality("quality_bits_direction.json"),
    "quality_bits": lambda: quality("quality_bits.json"),
    "gradient_fidelity": gradient_fidelity,
    "codec_error": codec_error,
    "fewer_bits": fewer_bits,
    "captured_error": captured_error,
    "generate": generate,
    "step_pipe_data": step_pipe_data,
    "permutation_cost": permutation_cost,
    "codec_cost": codec_cost,
    "codec_cost_bits": codec_cost_bits,
    "kernels_packed": kernels_packed,
    "tp2_messages": tp2_messages,
    "presets": presets,
    "maxtext_wire": maxtext_wire,
}


def render_table(name: str) -> str:
    """The Markdown a `<!-- results: NAME -->` block holds: the table and its sources."""
    try:
        view = TABLES[name]
    except KeyError:
        raise ValueError(f"no results table named {name!r}; expected one of {sorted(TABLES)}") from None
    text, sources = view()
    lines = "\n".join(f"<small>Source: {source.line()}</small><br>" for source in sources)
    return f"{text}\n\n{lines.removesuffix('<br>')}\n"


# ----------------------------------------------------------------------------- figures


def _quality_figure(file: str) -> bytes:
    from benchmarks import quality as harness

    record = load(file)
    settings = record["settings"]
    runs = harness.chosen_runs(record)
    variants = settings["variants"].split(",")
    _, panels = harness.table(runs, settings["models"].split(","), variants)
    buffer = io.BytesIO()
    harness.plot(runs, panels, variants, buffer, settings["mesh"])
    return buffer.getvalue()


def _step_tp2_figure() -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("off", "taco", "taco+", "default")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for offset, (link, file) in enumerate(TP2_FILES.items()):
        ms = _step_ms(file)
        ax.bar([i + 0.4 * offset for i in range(len(modes))], [ms["gpt2", m] for m in modes], 0.4, label=link)
    ax.set_xticks([i + 0.2 for i in range(len(modes))], modes)
    ax.set_ylabel("step time, ms")
    ax.set_title("0.91B GPT, TP=2 on two GPUs")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


@dataclass(frozen=True)
class Figure:
    """A figure of the docs.

    Attributes:
      draw: the PNG, drawn from the result file.
      source: the result file's source line.
    """

    draw: Callable[[], bytes]
    source: Callable[[], Source]


FIGURES: dict[str, Figure] = {
    "quality": Figure(lambda: _quality_figure("quality_stable.json"), lambda: quality_source("quality_stable.json")),
    "quality_pipe_data": Figure(
        lambda: _quality_figure("quality_pipe_data.json"), lambda: quality_source("quality_pipe_data.json")
    ),
    "step_tp2": Figure(_step_tp2_figure, lambda: tp2_source("slow link")),
}


def render_figure(name: str, url: str) -> str:
    """The Markdown a `<!-- figure: NAME -->` marker becomes, the PNG at `url`."""
    if name not in FIGURES:
        raise ValueError(f"no figure named {name!r}; expected one of {sorted(FIGURES)}")
    return f"![{name}]({url})\n\n<small>Source: {FIGURES[name].source().line()}</small>\n"


# ----------------------------------------------------------------------------- pages


def pages() -> Iterator[Path]:
    """README.md and every page under docs/."""
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").rglob("*.md"))


def rendered(text: str) -> str:
    """`text` with every results block rewritten from its sources."""
    return TABLE.sub(lambda m: m.group(1) + render_table(m.group("name")) + m.group(4), text)


def hand_typed(text: str) -> list[str]:
    """Measured figures outside generated blocks and code: the lines that hold them."""
    text = TABLE.sub("", text)
    found, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and MEASUREMENT.search(re.sub(r"`[^`]*`", "", line)):
            found.append(line.strip())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report pages that differ from their sources")
    args = parser.parse_args()
    stale = []
    for page in pages():
        text = page.read_text()
        fresh = rendered(text)
        if fresh != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(fresh)
    verb = "differ from their sources" if args.check else "rewritten"
    print(f"{len(stale)} pages {verb}" + "".join(f"\n  {p}" for p in stale))
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
