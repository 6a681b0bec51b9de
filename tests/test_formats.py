"""Wire formats are classes: a 6-bit integer format defined here as one class runs
everywhere a built-in one does (codec, wire message, collectives and their ledger,
calibration, the trainer's keys), and the generic bit packer keeps the built-in
formats' bytes."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import calibration, hlo, message
from taco_jax.kernels import formats, wire
from taco_jax.train import compression, trainer
from taco_jax.train.config import TrainConfig
from tests import reference as ref
from tests.test_calibration import _collector_of

INT6 = "int6:32:H:bf16"
RANKS = 4


@pytest.fixture(scope="module")
def int6():
    """INT6 in [-31, 31], defined as a user would: the class alone registers it."""

    class Int6(formats.SymmetricInteger):
        """Symmetric 6-bit integers."""

        name = "int6"
        bits = 6

    yield formats.wire_format("int6")
    del formats.WIRE_FORMATS["int6"]


def _data(shape, seed=0):
    """Gaussian rows with log-normal channel scales (float32)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * rng.lognormal(0, 1, shape[-1])).astype(np.float32)


def _rel(out, exact):
    out, exact = np.asarray(out, np.float64), np.asarray(exact, np.float64)
    return np.linalg.norm(out - exact) / np.linalg.norm(exact)


def _pack_bits(codes, bits):
    """Independent packer: the codes as one little-endian bit stream (code i in bits
    [bits * i, bits * (i + 1)) of its row), 8 bits a byte."""
    codes = np.asarray(codes, np.uint8)
    stream = (codes[..., None] >> np.arange(bits)) & 1
    return np.packbits(stream.reshape(*codes.shape[:-1], -1), axis=-1, bitorder="little")


def test_defining_the_class_registers_it(int6):
    assert (int6.bits, int6.max_value, int6.dtype, int6.is_integer) == (6, 31.0, jnp.int8, True)
    spec = tj.QuantSpec("int6", 32, True, "bf16")
    assert spec == tj.QuantSpec.parse(INT6) and spec.element_bits == 6 and spec.bits_per_element == 6.5
    with pytest.raises(ValueError, match="'int6' is already defined"):

        class Again(formats.SymmetricInteger):
            name = "int6"
            bits = 6

    with pytest.raises(TypeError, match="'int7' .* must set bits"):

        class Unfinished(formats.SymmetricInteger):
            name = "int7"

    assert "int7" not in formats.WIRE_FORMATS
    # A minifloat is held in float8_e4m3fn: an 8-bit E4M3 without Inf or NaN reaches 480.
    with pytest.raises(ValueError, match="do not all fit float8_e4m3fn"):

        class Wide(formats.Minifloat):
            name = "e4m3x"
            exponent_bits = 4
            mantissa_bits = 3

    assert "e4m3x" not in formats.WIRE_FORMATS
    with pytest.raises(ValueError, match="stochastic rounding does not take 'e4m3'"):
        wire.cast_to_wire(jnp.zeros(4), formats.wire_format("e4m3"), draws=jnp.zeros(4))


def test_round_trip_matches_the_float64_reference_between_int4_and_int8(int6, monkeypatch):
    monkeypatch.setitem(ref.FORMATS, "int6", (31.0, 0, 0, True))
    x = _data((8, 256))
    spec = tj.QuantSpec.parse(INT6)
    compressed = jax.jit(tj.compress, static_argnums=1)(x, spec)
    codes, _, _, multiplier = ref.compress(x, "int6", 32, True, "bf16")
    got = ref.as_float64(compressed.payload).reshape(codes.shape)
    assert compressed.payload.dtype == jnp.int8 and np.abs(got).max() == 31
    # float32 against float64 arithmetic flips only values within rounding of a tie, by one step.
    assert np.mean(got != codes) < 2e-3 and np.abs(got - codes).max() <= 1
    out = jax.jit(tj.decompress)(compressed)
    expected = ref.decompress(got, multiplier, True, 32).reshape(x.shape)
    np.testing.assert_allclose(ref.as_float64(out), expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())

    def reference_error(fmt):
        codes, _, _, multiplier = ref.compress(x, fmt, 32, True, "bf16")
        return _rel(ref.decompress(codes, multiplier, True, 32).reshape(x.shape), x)

    error = _rel(out, x)
    assert 1.5 * reference_error("int8") < error < reference_error("int4") / 1.5


def test_codes_pack_and_unpack_into_ceil_six_eighths_bytes(int6):
    payload = jnp.asarray(np.random.default_rng(1).integers(-31, 32, (3, 64)), jnp.int8)
    codes = int6.codes(payload)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(payload).view(np.uint8) & 0x3F)
    packed = int6.pack(payload)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 48) and int6.payload_bytes(64) == 48
    np.testing.assert_array_equal(np.asarray(packed), _pack_bits(codes, 6))
    np.testing.assert_array_equal(np.asarray(int6.unpack(packed)), np.asarray(payload))

    spec = tj.QuantSpec.parse(INT6)
    assert tj.wire_bytes((64, 256), jnp.float32, spec) == 64 * 256 * 6 // 8 + 64 * 256 // 32 * 2
    layout = message.message_layout(100, spec)  # 100 groups: 24-byte rows, 200 scale bytes in 9 rows
    assert (layout.row_bytes, layout.scale_bytes, layout.shape) == (24, 2, (109, 24))

    @jax.jit
    def encoded(x):
        typed = wire.quantize_groups(x, fmt="int6", group_size=32, scale_format="bf16", transform=True)
        return message.encode(x, spec, "jnp"), typed[0]

    buffer, payload = encoded(_data((100, 32), seed=2))
    assert buffer.shape == layout.shape
    np.testing.assert_array_equal(np.asarray(buffer[:100]), _pack_bits(np.asarray(payload).view(np.uint8) & 0x3F, 6))
    np.testing.assert_array_equal(np.asarray(wire.payload_of(buffer, layout)), np.asarray(payload))


@pytest.mark.parametrize("bits", range(1, 9))
def test_any_width_packs_as_a_little_endian_bit_stream(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, (2, 48), dtype=np.uint8)
    packed = formats.pack_codes(jnp.asarray(codes), bits)
    np.testing.assert_array_equal(np.asarray(packed), _pack_bits(codes, bits))
    np.testing.assert_array_equal(np.asarray(formats.unpack_codes(packed, bits)), codes)


MINIFLOATS = {"e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn, "e2m1": ml_dtypes.float4_e2m1fn}


@pytest.mark.parametrize("fmt", ["int4", *MINIFLOATS])
def test_built_in_sub_byte_formats_keep_their_bytes(fmt):
    """The message rows of a fixed input equal the codes (two's complement nibbles, or
    ml_dtypes' bits of the same values) packed as before: 4-bit codes two to a byte, 6-bit
    codes four to three bytes, the earlier in the lower bits."""
    layout = wire.MessageLayout(6, 64, fmt, "bf16")

    @jax.jit
    def packed(x):
        payload, scales = wire.quantize_groups(x, fmt=fmt, group_size=64, scale_format="bf16", transform=True)
        return payload, wire.pack(payload, scales, layout)

    payload, message = (np.asarray(out) for out in packed(_data((2, 6, 64), seed=3)))
    codes = payload.view(np.uint8) & 0xF if fmt == "int4" else payload.astype(np.float32).astype(MINIFLOATS[fmt])
    bits = formats.wire_format(fmt).bits
    np.testing.assert_array_equal(message[:, :6], _pack_bits(codes.view(np.uint8), bits))


def test_collectives_send_it_and_the_ledger_counts_its_bytes(int6):
    spec = tj.QuantSpec.parse(INT6)
    config = tj.TacoConfig(spec, spec, min_bytes=0)
    mesh = tj.make_mesh(1, 1, RANKS, devices=jax.devices()[:RANKS])
    x = _data((RANKS * 16, 256), seed=4)

    shift = [(rank, (rank + 1) % RANKS) for rank in range(RANKS)]
    weight = _data((256, 64), seed=6)

    def body(v):
        return (
            tj.all_reduce(v, "tensor", config, site="sum"),
            tj.all_gather(v, "tensor", config, site="gather"),
            # -v: the same message as the all-reduce's would be one all-to-all to XLA
            tj.reduce_scatter(-v, "tensor", config, site="scatter"),
            tj.ppermute(v, "tensor", config, perm=shift, site="shift"),
            # the collective matmul's shifts and the data-parallel bucket's two shots
            tj.tp.gather_matmul(2 * v, (weight,), "tensor", config, axis=0, site="matmul", overlap=True)[0],
            tj.data_parallel.mean_gradients(3 * v, "tensor", config, site="grads")[0],
        )

    out_specs = (P("tensor"),) * 4 + (P(), P("tensor"))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tensor"), out_specs=out_specs, check_vma=False))
    with tj.record_wire() as ledger:
        compiled = fn.lower(x).compile()
    summed, gathered, scattered, shifted, multiplied, mean = (np.asarray(out, np.float64) for out in compiled(x))
    blocks = x.astype(np.float64).reshape(RANKS, 16, 256)
    one_pass = _rel(jax.jit(lambda v: tj.decompress(tj.compress(v, spec)))(x), x)
    gather_error = _rel(gathered.reshape(RANKS, RANKS * 16, 256), np.broadcast_to(x, (RANKS, RANKS * 16, 256)))
    assert 0.5 * one_pass < gather_error < 1.5 * one_pass
    sum_error = _rel(summed.reshape(RANKS, 16, 256), np.broadcast_to(blocks.sum(0), (RANKS, 16, 256)))
    assert 0.5 * one_pass < sum_error < 3 * one_pass
    assert 0.5 * one_pass < _rel(scattered, -blocks.sum(0)) < 3 * one_pass
    assert 0.5 * one_pass < _rel(shifted, np.roll(blocks, 1, axis=0).reshape(x.shape)) < 1.5 * one_pass
    product = 2 * x.astype(np.float64) @ weight.astype(np.float64)
    assert 0.3 * one_pass < _rel(multiplied, product) < 1.5 * one_pass
    mean_error = _rel(mean.reshape(RANKS, 16, 256), np.broadcast_to(3 * blocks.mean(0), (RANKS, 16, 256)))
    assert 0.5 * one_pass < mean_error < 3 * one_pass

    sites = {"sum", "gather", "scatter", "shift", "matmul", "grads"}
    assert {(record.compressed, record.site) for record in ledger.records} == {(True, site) for site in sites}
    sent = hlo.bytes_by_axis(compiled.as_text(), mesh)
    assert set(sent) == {"tensor"} and set(sent["tensor"]) == {"u8"}
    assert sent["tensor"]["u8"] == ledger.by_axis(("tensor",))["tensor"] > 0


@pytest.mark.parametrize(("tolerance", "chosen"), [(100.0, True), (1.0, False)])
def test_calibration_chooses_it_within_the_budget(int6, tolerance, chosen):
    """INT6 replaces INT8 (both G=32: the same shapes to compile) where its error is within
    `tolerance` times INT8's."""
    candidate, int8 = tj.QuantSpec.parse(INT6), tj.QuantSpec.parse("int8:32:H:bf16")
    fewer = tj.FewerBits((candidate,), reference=int8, tolerance=tolerance)
    config = tj.TacoConfig(int8, int8, min_bytes=0, fewer_bits=fewer)
    samples = _data((16, 256), seed=5)
    state, report = calibration.calibrate(_collector_of(samples, ("forward",)), config, strategies=("identity",))
    ((_, _, plan),) = state.plans
    assert INT6 in {row["spec"] for row in report}
    assert (plan.quant == candidate) is chosen


def test_the_trainer_sends_it(int6, tmp_path):
    """`taco_forward=int6:...` is a trainer key like any spec, and the trainer's step sends
    it: the forward messages at 6 bits and bf16 scales per 32 values, the backward ones at
    taco+'s 8 (the step as the trainer sets it up and counts it; that count equals the
    compiled step's: tests/test_train.py)."""
    keys = dict(model="gpt2-tiny", steps=1, batch_size=8, seq_len=32, calibration_steps=0)
    cfg = TrainConfig.from_keys(taco="taco+", taco_forward=INT6, out=str(tmp_path / "int6"), **keys)
    assert compression.taco_config(cfg).forward == tj.QuantSpec.parse(INT6)
    loop = trainer.setup_train_loop(cfg)
    loop.run.close()
    share = loop.wire.sent["tensor"] / loop.wire.bf16["tensor"]
    # (6.5 + 8.125) / 2 / 16 of bf16 where every message is compressed; plain loss statistics add a little
    assert 0.40 < share < 0.50


def test_an_unknown_format_names_the_key():
    with pytest.raises(ValueError, match="taco_forward.*unknown format 'int7'"):
        TrainConfig.from_keys(taco="taco+", taco_forward="int7:32:H:bf16")
