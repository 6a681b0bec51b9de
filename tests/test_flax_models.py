"""GPT-2 and Qwen2 as Flax NNX modules (models.flax_modules) against the functional
models: logits, gradients and a user's own nnx + optax loop (8 CPU devices)."""

import dataclasses
import functools
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import models
from taco_jax.models import flax_modules
from taco_jax.models.config import GPT2Config, Qwen2Config
from taco_jax.models.params import is_layout_leaf

DATA = pathlib.Path(__file__).parent / "data"

FAMILIES = ["gpt2-tiny", "qwen2-tiny"]


def _setup(name, seed=0):
    config = models.preset(name)
    params = models.init_params(config, jax.random.key(seed))
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (4, 33))
    return config, params, tokens


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_grads_equal_the_functional_model(name, sequence_parallel):
    """The module under `nnx.jit` with the gradient outside its shard_map (check_vma=True)
    against `models.logits` / `models.loss_and_grads` (gradient inside, check_vma=False):
    the user's optax loss on the logits and the module's vocabulary-parallel `loss`."""
    config, params, tokens = _setup(name)
    mesh = tj.make_mesh(2, 1, 4)
    model = flax_modules.from_params(
        config, params, mesh=mesh, taco=tj.TacoConfig.preset("off"), sequence_parallel=sequence_parallel
    )
    want = models.logits(config, params, tokens[:, :-1])
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    got = nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5 * float(jnp.abs(want).max()), rtol=1e-4)

    want_loss, want_grads = models.loss_and_grads(config, params, tokens, mesh=mesh)
    for loss_fn in (_loss, lambda m, t: m.loss(t)):
        loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        got_grads = nnx.state(grads, nnx.Param).to_pure_dict()
        assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(
                np.asarray(g),
                np.asarray(w),
                rtol=1e-4,
                atol=1e-6 * float(jnp.abs(w).max()) + 1e-9,
                err_msg=jax.tree_util.keystr(path),
            )


@pytest.mark.parametrize("name", FAMILIES)
def test_compressed_logits_within_codec_error(name):
    config, params, tokens = _setup(name)
    mesh = tj.make_mesh(2, 1, 4)
    model = flax_modules.from_params(config, params, mesh=mesh, taco=tj.TacoConfig.preset("taco+", min_bytes=0))
    got = nnx.jit(lambda m, t: m(t))(model, tokens)
    want = models.logits(config, params, tokens)
    assert 1e-5 < _rel(got, want) < 0.05


def test_own_nnx_optax_loop_trains_with_and_without_compression():
    """A user's loop: nnx.Optimizer + optax.adamw, batch sharded over data; taco+ follows off."""
    config, _, _ = _setup("gpt2-tiny")
    mesh = tj.make_mesh(2, 1, 4)
    rng = np.random.default_rng(1)
    batches = [jax.device_put(rng.integers(0, 64, (8, 33)), NamedSharding(mesh, P("data"))) for _ in range(6)]

    def train(preset):
        model = flax_modules.Transformer(
            config, mesh=mesh, taco=tj.TacoConfig.preset(preset, min_bytes=0), rngs=nnx.Rngs(0)
        )
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, tokens):
            loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
            optimizer.update(model, grads)
            return loss

        return np.array([float(step(model, optimizer, b)) for b in batches])

    off, compressed = train("off"), train("taco+")
    assert off[-1] < off[0] - 0.5
    assert np.all(np.abs(compressed - off) < 0.02 * off) and not np.array_equal(compressed, off)


def test_split_pattern_step_traces_once():
    """Flax's split pattern (`nnx.split` once, a pure `jax.jit` step on the donated state,
    optimizer counters placed on the mesh as the Flax guide shows): the step's outputs come
    back with the shardings its inputs had, so three steps trace it once; the loss falls."""
    config, _, _ = _setup("gpt2-tiny")
    mesh = tj.make_mesh(2, 1, 4)
    model = flax_modules.Transformer(config, mesh=mesh, taco=tj.TacoConfig.preset("off"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)))
    replicated = NamedSharding(mesh, P())
    state = jax.tree.map(lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, replicated), state)
    traces = []

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, tokens):
        traces.append(1)
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    tokens = jax.device_put(np.random.default_rng(2).integers(0, 64, (8, 33)), NamedSharding(mesh, P("data")))
    losses = []
    for _ in range(3):
        loss, state = step(state, tokens)
        losses.append(float(loss))
    assert len(traces) == 1 and losses[-1] < losses[0]


def test_bad_model_shapes_are_clear_errors():
    config = models.preset("qwen2-tiny")  # 4 kv heads
    with pytest.raises(ValueError, match="n_kv_heads=4 is not divisible by the tensor axis size 8"):
        flax_modules.Transformer(config, mesh=tj.make_mesh(1, 1, 8), taco=tj.TacoConfig.preset("off"), rngs=nnx.Rngs(0))
    model = flax_modules.Transformer(
        config, mesh=tj.make_mesh(2, 1, 4), taco=tj.TacoConfig.preset("off"), rngs=nnx.Rngs(0), sequence_parallel=True
    )
    with pytest.raises(ValueError, match="not divisible by the tensor axis size 4"):
        model(jnp.zeros((2, 6), jnp.int32))
    with pytest.raises(ValueError, match="exceeds max_positions"):
        model(jnp.zeros((1, config.max_positions + 4), jnp.int32))
    with pytest.raises(ValueError, match="runs without a pipeline"):
        flax_modules.Transformer(config, mesh=tj.make_mesh(1, 2, 4), taco=tj.TacoConfig.preset("off"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"overlap names unknown sites \['layers.mlp'\]"):
        flax_modules.Transformer(
            config,
            mesh=tj.make_mesh(2, 1, 4),
            taco=tj.TacoConfig.preset("off"),
            rngs=nnx.Rngs(0),
            overlap={"layers.mlp"},
        )


@pytest.mark.parametrize(
    ("name", "sequence_parallel"),
    [(FAMILIES[0], True), (FAMILIES[1], True), (FAMILIES[1], False)],
    ids=lambda v: {True: "sp", False: "no_sp"}.get(v, v) if isinstance(v, bool) else v,
)
def test_overlapped_layers_equal_the_collective_path(name, sequence_parallel):
    """`overlap=True` (collective matmuls in every layer and the head: the sequence-
    parallel gathers and reduce-scatters, or the all-reduces): uncompressed, the logits
    and gradients of the collective path to float rounding; compressed, within codec
    error of the uncompressed model."""
    config, params, tokens = _setup(name)
    mesh = tj.make_mesh(2, 1, 4)

    def run(preset, overlap, grads=True):
        model = flax_modules.from_params(
            config,
            params,
            mesh=mesh,
            taco=tj.TacoConfig.preset(preset, min_bytes=0),
            sequence_parallel=sequence_parallel,
            overlap=overlap,
        )
        logits = nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1])
        leaves = jax.tree.leaves(nnx.jit(nnx.grad(_loss))(model, tokens)) if grads else []
        return [np.asarray(logits, np.float64)] + [np.asarray(g, np.float64) for g in leaves]

    plain, overlapped = run("off", False), run("off", True)
    for got, want in zip(overlapped, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max() + 1e-9)
    (compressed,) = run("taco+", True, grads=False)
    assert 1e-5 < _rel(compressed, plain[0]) < 0.05


@pytest.mark.parametrize("name", FAMILIES)
def test_nnx_generation_is_the_functional_generation(name):
    """The module's state is the functional parameters, unchanged, and
    `flax_modules.generate` continues prompts as `models.generate` does with them
    (greedy, TP=2, Qwen2 with grouped kv heads)."""
    config, params, _ = _setup(name)
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    model = flax_modules.from_params(config, params, mesh=mesh, taco="off")  # a preset name
    assert model.taco == tj.TacoConfig.preset("off")
    back = flax_modules.functional_params(model)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    prompts = [[5, 9, 2, 7], [11, 3]]
    want = models.generate(config, params, prompts, mesh=mesh, taco="off", decode_taco="off", max_new_tokens=5)
    assert flax_modules.generate(model, prompts, max_new_tokens=5) == want and len(want[0]) == 5


# The earlier per-block NNX state ("state/...") as that module saved it from
# `init_params(config, key(0))`, and those parameters ("functional/...").
_BLOCK_STATE_CONFIGS = {
    "gpt2": GPT2Config(vocab_size=64, max_positions=16, d_model=32, n_layers=2, n_heads=4, d_ff=64),
    "qwen2": Qwen2Config(vocab_size=64, max_positions=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48),
}


def _nested(flat: dict, prefix: str) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        if key.startswith(prefix + "/"):
            *parents, leaf = key.removeprefix(prefix + "/").split("/")
            node = tree
            for name in parents:
                node = node.setdefault(name, {})
            node[leaf] = value
    return tree


@pytest.mark.parametrize("family", list(_BLOCK_STATE_CONFIGS))
def test_earlier_block_state_converts_and_is_refused_unconverted(family):
    config = _BLOCK_STATE_CONFIGS[family]
    flat = safetensors.numpy.load_file(DATA / f"nnx_blocks_{family}.safetensors")
    state, want = _nested(flat, "state"), _nested(flat, "functional")
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="params_from_blocks"):
        flax_modules.from_params(config, state, mesh=mesh, taco=tj.TacoConfig.preset("off"))
    converted = flax_modules.params_from_blocks(config, state)
    assert jax.tree.structure(converted) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(converted), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    other = _BLOCK_STATE_CONFIGS["qwen2" if family == "gpt2" else "gpt2"]
    with pytest.raises(ValueError, match=f"do not match the {other.family} layout"):
        flax_modules.from_params(other, converted, mesh=mesh, taco=tj.TacoConfig.preset("off"))


def _zeros(config, dtype=np.float32) -> dict:
    """Parameters of `config`'s layout, all zero (no device work)."""
    return jax.tree.map(lambda leaf: np.zeros(leaf[0], dtype), models.layout(config), is_leaf=is_layout_leaf)


_GPT2 = _BLOCK_STATE_CONFIGS["gpt2"]


def _with(params: dict, group: str, name: str, value) -> dict:
    return params | {group: params[group] | {name: value}}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            _zeros(dataclasses.replace(_GPT2, d_model=64)),  # another model, the same names
            r"\['embed'\]\['positions'\] is \(16, 64\), expected \(16, 32\)",
        ),
        (
            _with(_zeros(_GPT2), "embed", "tokens", np.zeros((128, 32), np.int32)),
            r"'tokens'\] is int32, expected a float",
        ),
        (
            _with(_zeros(_GPT2), "final", "norm_bias", "zeros"),
            r"'norm_bias'\] is a str, expected an array of shape \(32,\)",
        ),
        (_with(_zeros(_GPT2), "final", "norm_bias", None), r"missing \[\"\['final'\]\['norm_bias'\]\"\]"),
        ([_zeros(_GPT2)], "parameters must be a nested dict of arrays, got list"),
    ],
    ids=["other_model", "int_dtype", "not_an_array", "none", "not_a_dict"],
)
def test_from_params_refuses_other_shapes_and_dtypes(params, message):
    """Before anything is built or compiled: one error naming the parameter and both shapes."""
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=message):
        flax_modules.from_params(_GPT2, params, mesh=mesh, taco=tj.TacoConfig.preset("off"))


def _transposed_attn_in(blocks: dict) -> dict:
    first = blocks["0"]
    return {0: first | {"attn_in": first["attn_in"] | {"kernel": first["attn_in"]["kernel"].T}}, 1: blocks["1"]}


# How a state goes wrong -> what the error says (block keys as ints or strings).
_BAD_BLOCK_STATES = {
    "missing_layer": (
        lambda state: state | {"blocks": {"0": state["blocks"]["0"]}},
        r"missing \[\"\['blocks'\]\['1'\]\['attn_in'\]\['bias'\]\"",
    ),
    "transposed": (
        lambda state: state | {"blocks": _transposed_attn_in(state["blocks"])},
        r"\['attn_in'\]\['kernel'\] is \(96, 32\), expected \(32, 96\)",
    ),
    "extra_key": (
        lambda state: state | {"blocks": state["blocks"] | {"x": state["blocks"]["1"]}},
        r"unexpected \[\"\['blocks'\]\['x'\]",
    ),
    "no_positions": (
        lambda state: {key: value for key, value in state.items() if key != "positions"},
        r"missing \[\"\['positions'\]\"\]",
    ),
    "none": (lambda state: None, "per-block state must be a nested dict of arrays, got NoneType"),
}


@pytest.mark.parametrize("case", list(_BAD_BLOCK_STATES))
def test_params_from_blocks_refuses_bad_state_by_name(case):
    edit, message = _BAD_BLOCK_STATES[case]
    state = _nested(safetensors.numpy.load_file(DATA / "nnx_blocks_gpt2.safetensors"), "state")
    with pytest.raises(ValueError, match=message):
        flax_modules.params_from_blocks(_GPT2, edit(state))


def test_taco_takes_a_preset_name_and_names_itself_when_wrong():
    """A preset name is `TacoConfig.preset(name)`; another type or name is refused before
    anything is built."""
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])

    def build(taco):
        return nnx.eval_shape(lambda: flax_modules.Transformer(_GPT2, mesh=mesh, taco=taco, rngs=nnx.Rngs(0)))

    assert build("taco+").taco == tj.TacoConfig.preset("taco+")
    with pytest.raises(TypeError, match="taco must be a taco_jax.TacoConfig, a preset name"):
        build(8)
    with pytest.raises(ValueError, match="taco: unknown TACO preset 'taco9'"):
        build("taco9")


def test_taco_mixed_without_calibration_warns_once(monkeypatch):
    """taco+mixed's fewer bits come from calibration: without one, a warning (once a
    process) says the model runs as taco+ and how to calibrate; calibrated, none."""
    monkeypatch.setattr(flax_modules, "_WARNED_UNCALIBRATED", False)
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])

    def build(taco, calibration=None):
        return nnx.eval_shape(
            lambda: flax_modules.Transformer(_GPT2, mesh=mesh, taco=taco, rngs=nnx.Rngs(0), calibration=calibration)
        )

    with pytest.warns(UserWarning, match=r"no calibration .* int8:128:H:bf16 forward .*calibration.calibrate\("):
        build("taco+mixed")
    plan = tj.calibration.ChannelPlan(tuple(range(_GPT2.d_model)), hadamard=True, quant=None)
    calibrated = tj.calibration.Calibration((("layers.mlp.out", "forward", plan),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build("taco+mixed")  # warned already
        monkeypatch.setattr(flax_modules, "_WARNED_UNCALIBRATED", False)
        build("taco+mixed", calibrated)
        build("taco+")


def test_ledger_names_the_loss_reductions_and_why_they_are_exact():
    """The loss's vocabulary-parallel statistics are rows of their own sites, plain because
    they are per-token statistics (not "mode off" under a compressing config); every
    other row of the step is compressed (traced only)."""
    mesh = tj.make_mesh(1, 1, 2, devices=jax.devices()[:2])
    taco = tj.TacoConfig.preset("taco+", min_bytes=0).with_group_size(32)
    model = nnx.eval_shape(lambda: flax_modules.Transformer(_GPT2, mesh=mesh, taco=taco, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    with tj.record_wire() as ledger:
        jax.eval_shape(lambda s, t: nnx.value_and_grad(lambda m: m.loss(t))(nnx.merge(graphdef, s)), state, tokens)
    plain = {(r.site, r.reason) for r in ledger.records if not r.compressed}
    reason = "a per-token loss statistic: small, kept exact"
    assert plain == {(site, reason) for site in ("loss.peak", "loss.sum_exp", "loss.target_logit")}
    assert all(r.shape == (2, 8) and r.sent_bytes == 2 * 8 * 4 for r in ledger.records if not r.compressed)
