"""The `Collective` descriptor's bytes against the compiled programs' collectives, and the
op names spelled once (`taco_jax.collective_op.Op`)."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.collective_op import Collective, Op, record_collective
from taco_jax.message import WirePlan

RANKS = 4
RING = [(i, (i + 1) % RANKS) for i in range(RANKS)]
# 64 x 320 float32 per rank: the last axis pads to 3 groups of 128, and the 192 groups go
# in two chunks (`chunks=2`), so both the padding and the chunking show in the bytes.
SHAPE = (64, 320)
# name: (the op the descriptor is built for, its reduce-scatter dimension, the call).
CASES = {
    "all_gather": (Op.ALL_GATHER, 0, lambda v, c: tj.all_gather(v, "tensor", c)),
    "reduce_scatter": (Op.REDUCE_SCATTER, 0, lambda v, c: tj.reduce_scatter(v, "tensor", c)),
    "reduce_scatter_last_axis": (
        Op.REDUCE_SCATTER,
        1,
        lambda v, c: tj.reduce_scatter(v, "tensor", c, scatter_dimension=1),
    ),
    "all_reduce_one_shot": (Op.ALL_REDUCE, 0, lambda v, c: tj.all_reduce(v, "tensor", c, algorithm="one_shot")),
    "all_reduce_two_shot": (Op.ALL_REDUCE, 0, lambda v, c: tj.all_reduce(v, "tensor", c, algorithm="two_shot")),
    "ppermute": (Op.PPERMUTE, 0, lambda v, c: tj.ppermute(v, "tensor", c, perm=RING)),
}
MODES = ("off", "taco+")
# Compressed bytes over bf16's, scales aside: a byte for bf16's two per element, the
# elements padded to whole groups of 128 (320 channels to 384; scattered along the
# channels, the 64 rows, now last, to 128); the one-shot all-reduce sends k-1 copies of
# the message where the ring sends 2 (k-1) / k.
BF16_SHARE = {name: 384 / 320 / 2 for name in CASES} | {
    "reduce_scatter_last_axis": 128 / 64 / 2,
    "all_reduce_one_shot": 384 / 320 / 2 * RANKS / 2,
}


def _config(mode):
    return tj.TacoConfig.preset(mode, min_bytes=0, chunks=2)


@pytest.fixture(scope="module")
def compiled():
    """(case, mode) -> (the ledger's records, the compiled program's collectives), each
    program compiled once for every test of the module."""
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    x = jax.ShapeDtypeStruct((RANKS * SHAPE[0], SHAPE[1]), jnp.float32)
    programs = {}
    for name, (_, _, call) in CASES.items():
        for mode in MODES:
            body = lambda v, call=call, mode=mode: call(v, _config(mode))
            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
            with tj.record_wire() as ledger:
                hlo = fn.lower(x).compile().as_text()
            programs[name, mode] = ledger.records, tj.collectives_in_hlo(hlo)
    return programs


def _descriptor(name):
    op, dimension, _ = CASES[name]
    return Collective(
        op=op,
        axis_name="tensor",
        ranks=RANKS,
        shape=SHAPE,
        dtype=jnp.float32,
        direction="forward",
        scatter_dimension=dimension,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_plain_bytes_equal_the_compiled_collective(compiled, name):
    records, found = compiled[name, "off"]
    collective = _descriptor(name)
    assert {c.dtype for c in found} == {"f32"}
    assert collective.plain_bytes == sum(c.sent_bytes for c in found) > 0
    assert collective.sent_bytes(None) == collective.plain_bytes
    assert collective.bf16_bytes == collective.plain_bytes // 2
    (record,) = records
    assert (record.site, record.op, record.compressed, record.reason) == (
        collective.op,
        collective.op,
        False,
        "mode off",
    )
    assert (record.sent_bytes, record.uncompressed_sent_bytes) == (collective.plain_bytes,) * 2
    assert record.bf16_sent_bytes == collective.bf16_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_compressed_bytes_equal_the_compiled_messages(compiled, name):
    records, found = compiled[name, "taco+"]
    collective, spec = _descriptor(name), _config("taco+").forward
    algorithm = name.removeprefix("all_reduce_") if collective.op == Op.ALL_REDUCE else "one_shot"
    plan = WirePlan(spec, chunks=2, algorithm=algorithm)
    sent = collective.sent_bytes(plan)
    assert {c.dtype for c in found} == {"u8"}
    assert sent == sum(c.sent_bytes for c in found)
    assert BF16_SHARE[name] < sent / collective.bf16_bytes < 1.05 * BF16_SHARE[name]  # + the scales
    (record,) = records
    ledger_op = name.removesuffix("_last_axis")
    assert (record.op, record.site, record.compressed, record.reason) == (ledger_op, ledger_op, True, spec.text)
    assert (record.sent_bytes, record.uncompressed_sent_bytes) == (sent, collective.plain_bytes)


def test_the_block_of_a_reduce_scatter_follows_its_dimension():
    """A block cut along the rows keeps the 320 channels (3 groups a row); cut along the
    channels it is 80 channels of 64 rows, laid out with the rows last (1 group each)."""
    rows, channels = _descriptor("reduce_scatter"), _descriptor("reduce_scatter_last_axis")
    assert rows.block_groups(128) == 16 * 3
    assert channels.block_groups(128) == 80 * 1


def test_a_bucket_pads_each_array_to_whole_groups():
    bucket = Collective(
        op=Op.ALL_REDUCE_TWO_SHOT,
        axis_name="data",
        ranks=RANKS,
        shape=(130 + 1 + 256,),
        dtype=jnp.float32,
        direction="backward",
        bucket=(130, 1, 256),
    )
    assert bucket.groups(128) == 2 + 1 + 2  # not ceil(387 / 128) = 4
    assert bucket.block_groups(128) == 2


def test_op_values_are_the_ledger_names_and_a_plain_record_needs_its_reason():
    assert [op.value for op in Op] == [
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "all_reduce_one_shot",
        "all_reduce_two_shot",
        "ppermute",
    ]
    assert Collective(op="ppermute", axis_name="t", ranks=2, shape=(4,), dtype="bfloat16", direction="forward").op is (
        Op.PPERMUTE
    )
    with pytest.raises(ValueError, match="not a valid Op"):
        Collective(op="all_to_all", axis_name="t", ranks=2, shape=(4,), dtype="float32", direction="forward")
    with tj.record_wire() as ledger, pytest.raises(ValueError, match="reason"):
        record_collective(_descriptor("ppermute"), None)
    assert ledger.records == []


# The modules that name ops through `Op` alone.
SPELLED_BY_OP = ("policy", "probe", "collectives", "collective_matmul", "data_parallel", "message")


@pytest.mark.parametrize("module", SPELLED_BY_OP)
def test_no_op_name_is_spelled_out(module):
    """No string constant of the module is an op's name or starts one (an f-string such
    as f"all_reduce_{algorithm}"); docstrings and messages may mention them."""
    names = {op.value for op in Op}
    tree = ast.parse((Path(tj.__file__).parent / f"{module}.py").read_text())
    spelled = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value in names or node.value.rstrip("_") in names)
    ]
    assert spelled == []
