"""The `Collective` descriptor's bytes and the ledger's records against the compiled
programs' collectives, and the op names spelled once (`taco_jax.accounting.Op`)."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import hlo as hlo_lib
from taco_jax.accounting import Collective, Op, record_collective

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
    op, _, _ = CASES[name]
    return Collective(op=op, axis_name="tensor", ranks=RANKS, shape=SHAPE, dtype=jnp.float32, direction="forward")


@pytest.mark.parametrize("name", list(CASES))
def test_plain_bytes_equal_the_compiled_collective(compiled, name):
    records, found = compiled[name, "off"]
    collective = _descriptor(name)
    assert {c.dtype for c in found} == {"f32"}
    assert collective.plain_bytes == sum(c.sent_bytes for c in found) > 0
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


def _message_bytes(groups: int) -> int:
    """Bytes of one taco+ message of `groups` groups of 128: payload rows of 128 bytes
    and one bf16 scale per group, the scales padded to whole rows."""
    return (groups + -(-2 * groups // 128)) * 128


def _chunks(groups: int) -> int:
    """Bytes of the two chunk messages of `groups` groups (the first 64-aligned)."""
    first = min(-(-(-(-groups // 2)) // 64) * 64, groups)
    return _message_bytes(first) + (_message_bytes(groups - first) if groups > first else 0)


# 64 x 320 per rank: 64 rows of 3 groups = 192 groups; one rank's block of a
# reduce-scatter along the rows is 16 rows x 3 groups = 48; along the channels, 80 of
# them with the 64 rows last, 80 groups; a two-shot block is 192 / 4 = 48 groups.
COMPRESSED_BYTES = {
    "all_gather": (RANKS - 1) * _chunks(192),
    "reduce_scatter": (RANKS - 1) * _chunks(48),
    "reduce_scatter_last_axis": (RANKS - 1) * _chunks(80),
    "all_reduce_one_shot": (RANKS - 1) * _chunks(192),
    "all_reduce_two_shot": 2 * (RANKS - 1) * _chunks(48),
    "ppermute": _message_bytes(192),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compressed_bytes_equal_the_compiled_messages(compiled, name):
    """The ledger's bytes are those its steps moved: equal to the compiled program's
    collectives, and to the count by hand from the wire format."""
    records, found = compiled[name, "taco+"]
    collective, spec = _descriptor(name), _config("taco+").forward
    assert {c.dtype for c in found} == {"u8"}
    sent = sum(c.sent_bytes for c in found)
    assert sent == COMPRESSED_BYTES[name]
    assert BF16_SHARE[name] < sent / collective.bf16_bytes < 1.05 * BF16_SHARE[name]  # + the scales
    (record,) = records
    ledger_op = name.removesuffix("_last_axis")
    assert (record.op, record.site, record.compressed, record.reason) == (ledger_op, ledger_op, True, spec.text)
    assert (record.sent_bytes, record.uncompressed_sent_bytes) == (sent, collective.plain_bytes)


@pytest.mark.parametrize("preset", sorted(tj.PRESETS))
def test_every_preset_records_the_bytes_of_its_compiled_program(preset):
    """Both directions of every collective (the gradient rules send the backward
    messages), the collective matmul's shifts and the data-parallel bucket: the ledger
    equals the compiled program's collectives, axis by axis."""
    config = tj.TacoConfig.preset(preset, min_bytes=0)
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    weight = jnp.asarray(np.random.default_rng(1).standard_normal((SHAPE[1], 32)), jnp.float32)

    def loss(v):
        # Each call on its own input: XLA merges equal collectives of equal inputs. The
        # scatter along the channels leaves 80 of them, fewer than a group of 128.
        calls = [call for name, (_, _, call) in CASES.items() if name != "reduce_scatter_last_axis"]
        outputs = [call((index + 1) * v, config) for index, call in enumerate(calls)]
        (product,) = tj.tp.gather_matmul(v, (weight,), "tensor", config, axis=0, site="matmul", overlap=True)
        return sum(jnp.sum(out * out) for out in [*outputs, product])

    def body(v):
        grad = jax.grad(loss)(v)
        return grad, tj.data_parallel.mean_gradients(grad, "tensor", config, site="grads")[0]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"), check_vma=False))
    with tj.record_wire() as ledger:
        hlo = fn.lower(jax.ShapeDtypeStruct((RANKS * SHAPE[0], SHAPE[1]), jnp.float32)).compile().as_text()
    compiled = {axis: sum(by_type.values()) for axis, by_type in hlo_lib.bytes_by_axis(hlo, mesh).items()}
    assert compiled == ledger.by_axis(("tensor",)) and compiled["tensor"] > 0
    assert {r.direction for r in ledger.records} == {"forward", "backward"}
    assert {r.compressed for r in ledger.records} == {preset != "off"}


def test_op_values_are_the_ledger_names_and_a_plain_record_needs_its_reason():
    assert [op.value for op in Op] == [
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "all_reduce_one_shot",
        "all_reduce_two_shot",
        "ppermute",
        "all_to_all",
    ]
    assert Collective(op="ppermute", axis_name="t", ranks=2, shape=(4,), dtype="bfloat16", direction="forward").op is (
        Op.PPERMUTE
    )
    with pytest.raises(ValueError, match="not a valid Op"):
        Collective(op="all_to_al", axis_name="t", ranks=2, shape=(4,), dtype="float32", direction="forward")
    with tj.record_wire() as ledger, pytest.raises(ValueError, match="reason"):
        record_collective(_descriptor("ppermute"), reason="")
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
