"""The MaxText drop-in (taco_jax.integrations.maxtext) on MaxText's own train main: a tiny
llama2-style decoder on 8 CPU devices, tensor x data and tensor x fsdp meshes.

Five short MaxText runs, each compiled once: plain MaxText (its step-0 checkpoint is the
common start), `--taco off` and taco+ continuing from it, and plain and taco+ on the fsdp
mesh. Runs only where MaxText is installed (`make test-maxtext`)."""

import json
import math
import os

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (make test-maxtext)")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from taco_jax import TacoConfig  # noqa: E402
from taco_jax.integrations import maxtext as taco_maxtext  # noqa: E402

# The tiny decoder, with the query, key and value projections as one kernel (MaxText's
# fused_qkv), so that every message the ledger records is one the compiled step sends.
TINY = (
    "base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 head_dim=64 base_mlp_dim=1024 "
    "base_num_decoder_layers=2 vocab_size=1024 max_target_length=128 per_device_batch_size=1 "
    "attention=dot_product hardware=cpu dataset_type=synthetic skip_jax_distributed_system=true fused_qkv=true"
).split()
TP_DP = ["ici_tensor_parallelism=4", "ici_data_parallelism=2"]
TP_FSDP = ["ici_tensor_parallelism=4", "ici_fsdp_parallelism=2", "ici_data_parallelism=1"]
STEPS = 21
LAYERS = 2
TACO_PLUS = TacoConfig.preset("taco+", min_bytes=0)
# taco+ against off after 20 steps of the same start: the relative loss gap (measured
# 2026-12-06 on this config: see test_taco_plus_trains_like_off).
LOSS_BOUND = 2e-3

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _args(tmp, name: str, mesh: list[str], *extra: str) -> list[str]:
    return [
        f"run_name={name}",
        f"base_output_directory={tmp}",
        f"metrics_file={tmp}/{name}.jsonl",
        *TINY,
        *mesh,
        *extra,
    ]


def _losses(tmp, name: str) -> dict[int, float]:
    with open(f"{tmp}/{name}.jsonl") as file:
        return {int(row["step"]): row["learning/loss"] for row in map(json.loads, file)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Plain MaxText (checkpointing its step 0), then off and taco+ from that state."""
    tmp = tmp_path_factory.mktemp("maxtext")
    checkpoints = ["enable_checkpointing=true", "async_checkpointing=false", "checkpoint_period=1000"]
    plain = taco_maxtext.run(_args(tmp, "plain", TP_DP, f"steps={STEPS}", *checkpoints), taco=None)
    start = f"load_full_state_path={tmp}/plain/checkpoints/0/items"
    off = taco_maxtext.run(_args(tmp, "taco_off", TP_DP, f"steps={STEPS}", start, *checkpoints), taco="off")
    taco = taco_maxtext.run(
        _args(tmp, "taco", TP_DP, f"steps={STEPS}", start, *checkpoints), taco=TACO_PLUS, preset="taco+"
    )
    return tmp, {"plain": plain, "off": off, "taco": taco}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("maxtext_fsdp")
    plain = taco_maxtext.run(_args(tmp, "plain", TP_FSDP, "steps=1", "enable_checkpointing=false"), taco=None)
    taco = taco_maxtext.run(
        _args(tmp, "taco", TP_FSDP, "steps=1", "enable_checkpointing=false"), taco=TACO_PLUS, preset="taco+"
    )
    return plain, taco


def test_decoder_layers_send_u8_on_the_tensor_axis(runs):
    """The tensor-axis messages of the decoder layers' matmuls are u8 (those left in
    f32 are the embedding's and the logits', which MaxText does not route through its
    quantization hook, and RMSNorm's statistics), and their bytes, the rematerialisation's
    recomputed messages apart, equal the ledger's, which counts the scanned body once
    per layer."""
    tmp, summaries = runs
    summary = summaries["taco"]
    tensor = summary["hlo_bytes_by_axis"]["tensor"]
    recomputed = summary["hlo_recomputed_bytes_by_axis"]["tensor"]
    assert tensor["u8"] > 0 and summary["ledger_tensor_bytes"] < 0.52 * summary["ledger_tensor_bytes_bf16"]
    assert "u8" not in summaries["plain"]["hlo_bytes_by_axis"]["tensor"]
    assert tensor["u8"] - recomputed.get("u8", 0) == summary["ledger_tensor_bytes"]
    assert set(summary["ledger_by_site"]) == {
        "embed_attn/heads/kv",
        "heads/kv/embed_attn",
        "embed/mlp",
        "mlp/embed",
    }
    with open(os.path.join(tmp, "taco", taco_maxtext.WIRE_FILE)) as file:
        assert json.load(file)["tensor_bytes"] == summary["tensor_bytes"]


def test_taco_plus_sends_at_most_55_percent_of_plain(runs):
    """The tensor axis's bytes against plain MaxText's, as the CPU compiles them (bf16
    collectives widened to f32) and with f32 counted as bf16 (as on GPU); the other axes
    send no more than plain's."""
    _, summaries = runs
    plain, taco = summaries["plain"], summaries["taco"]
    assert taco["tensor_bytes"] <= 0.55 * plain["tensor_bytes"]
    assert taco["tensor_bytes_f32_as_bf16"] <= 0.55 * plain["tensor_bytes_f32_as_bf16"]
    for axes, row in taco["hlo_bytes_by_axis"].items():
        if "tensor" not in axes.split("+"):
            assert sum(row.values()) <= sum(plain["hlo_bytes_by_axis"][axes].values()), axes


def test_off_equals_plain_maxtext(runs):
    """`--taco off` from plain MaxText's step-0 state trains as plain MaxText does."""
    tmp, _ = runs
    plain, off = _losses(tmp, "plain"), _losses(tmp, "taco_off")
    steps = sorted(set(off) & set(plain))
    assert len(steps) == STEPS - 1
    for step in steps:
        assert math.isclose(off[step], plain[step], rel_tol=2e-4), (step, off[step], plain[step])


def test_taco_plus_trains_like_off(runs):
    """taco+ after 20 steps from the same state: within LOSS_BOUND of off, and not equal
    (the messages are compressed)."""
    tmp, _ = runs
    off, taco = _losses(tmp, "taco_off"), _losses(tmp, "taco")
    last = max(off)
    assert last == STEPS - 1 and off[last] < off[1]
    gap = abs(taco[last] - off[last]) / off[last]
    assert 0 < gap <= LOSS_BOUND, (taco[last], off[last])


def test_fsdp_adds_no_bytes(fsdp_runs):
    """tp4 x fsdp2: no collective group on the fsdp (or data) axes carries more bytes
    than in plain MaxText, and the tensor axis is compressed."""
    plain, taco = fsdp_runs
    for axes, row in taco["hlo_bytes_by_axis"].items():
        if "tensor" not in axes.split("+"):
            for dtype, size in row.items():
                assert size <= plain["hlo_bytes_by_axis"][axes].get(dtype, 0), (axes, dtype)
    assert taco["tensor_bytes"] <= 0.55 * plain["tensor_bytes"]
    assert taco["hlo_bytes_by_axis"]["tensor"]["u8"] > 0


def test_calibration_is_written_then_loaded(tmp_path, capsys):
    """--calibrate-only writes a plan for every compressed site of the layers into the run
    directory; the next run of the same run_name compiles with it."""
    argv = ["--taco-min-bytes", "0", f"base_output_directory={tmp_path}", "run_name=cal", *TINY, *TP_FSDP]
    assert taco_maxtext.main(["--calibrate-only", *argv]) == 0
    with open(tmp_path / "cal" / taco_maxtext.CALIBRATION_FILE) as file:
        plans = json.load(file)["plans"]
    sites = {"embed_attn/heads/kv", "heads/kv/embed_attn", "embed/mlp", "mlp/embed"}
    assert {(p["site"], p["direction"]) for p in plans} == {(s, d) for s in sites for d in ("forward", "backward")}
    assert taco_maxtext.main([*argv, "steps=2", "enable_checkpointing=false"]) == 0
    with open(tmp_path / "cal" / taco_maxtext.WIRE_FILE) as file:
        assert json.load(file)["calibrated_sites"] == sorted(sites)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("taco_jax: tensor axis")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--taco-layout", "diagonal"], "unknown --taco-layout 'diagonal'"),
        (["--taco", "zip"], "unknown --taco preset 'zip'"),
        (["quantization=int8"], "MaxText quantization='int8' and taco"),
        (["mesh_axes=['data','fsdp']"], "have no 'tensor' axis"),
    ],
)
def test_bad_input_is_one_error_line(argv, message, capsys, tmp_path):
    """Bad input: one `error:` line, exit status 2, before any compile."""
    code = taco_maxtext.main([*argv, f"base_output_directory={tmp_path}", "run_name=bad", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err[-1:]
    assert not os.path.exists(os.path.join(tmp_path, "bad", taco_maxtext.WIRE_FILE))


def test_kernel_plans_follow_maxtext_rules():
    """Column or row from MaxText's logical_axis_rules (the kernel's tensor dimension, an
    output or a contracting one); a kernel not on the tensor axis stays plain."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    rules = (("mlp", ("fsdp_transpose", "tensor")), ("embed", ("fsdp",)), ("heads", "tensor"), ("kv", None))
    quant = taco_maxtext.TacoQuantization("off", mesh=mesh, rules=rules)
    assert quant.kernel_plan(("embed", "mlp"), 1).kind == "column"
    assert quant.kernel_plan(("mlp", "embed"), 1).kind == "row"
    assert quant.kernel_plan(("heads", "kv", "embed"), 2).sharded_dim == 0
    assert quant.kernel_plan(("embed", "kv"), 1) is None
    with pytest.raises(ValueError, match="unknown taco layout"):
        taco_maxtext.TacoQuantization("off", mesh=mesh, layout="diagonal")
    with pytest.raises(ValueError, match="no 'tensor' axis"):
        taco_maxtext.TacoQuantization("off", mesh=jax.make_mesh((8,), ("data",)))


@pytest.mark.parametrize("layout", ["replicated", "feature", "sequence"])
def test_nd_kernels_match_dot_general(layout):
    """3-D kernels, column (embed, heads, kv) then row (heads, kv, embed), in each layout:
    values and gradients equal `lax.dot_general`'s in mode off, and within codec error
    (not equal) with taco+."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))  # MaxText's (automatic) axes
    rules = (("activation_batch", ("data",)), ("heads", ("tensor",)), ("embed", ()), ("kv", ()))
    rules += (("activation_embed", ("tensor",)),) if layout == "feature" else ()
    rules += (("activation_length", ("tensor",)),) if layout == "sequence" else ()
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (4, 16, 64))
    w_in, w_out = jax.random.normal(keys[1], (64, 4, 32)) / 8, jax.random.normal(keys[2], (4, 32, 64)) / 8
    probe = jax.random.normal(keys[3], (4, 16, 64))

    def forward(dot, x, w_in, w_out):
        hidden = dot(("embed", "heads", "kv"), x, w_in, (((2,), (0,)), ((), ())))
        return dot(("heads", "kv", "embed"), hidden, w_out, (((2, 3), (0, 1)), ((), ())))

    def value_and_grads(dot):
        out, pullback = jax.vjp(lambda *a: forward(dot, *a), x, w_in, w_out)
        return out, pullback(probe)

    want = jax.jit(lambda: value_and_grads(lambda _, *b: lax.dot_general(*b)))()
    for preset, close in (("off", 1e-5), (TACO_PLUS, 0.03)):
        quant = taco_maxtext.TacoQuantization(preset, mesh=mesh, rules=rules)
        assert quant.resolved_layout() == layout
        got = jax.jit(lambda: value_and_grads(quant.dot_general))()
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            error = float(np.linalg.norm(np.asarray(g) - w) / np.linalg.norm(w))
            assert error <= close and (preset == "off" or error > 0), (preset, error)
