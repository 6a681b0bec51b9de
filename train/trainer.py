"""The 3-D parallel training loop: DP over "data", GPipe over "pipe", compressed TP over
"tensor", all under one jit(shard_map) step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import models, strict_json
from taco_jax.calibration import Calibration
from taco_jax.mesh import DATA_AXIS, PIPE_AXIS, TENSOR_AXIS
from taco_jax.models.api import sequence_parallel_grads
from taco_jax.models.transformer import Parallelism
from taco_jax.probe import Message

from . import data as data_lib
from . import link_policy, run_dir
from .checkpoint import Checkpointer
from .config import RESUMABLE_KEYS, TrainConfig, changed_keys, overlap_sites, to_dict
from .errors import TrainingError
from .pipeline import bubble_fraction, pipeline_loss


def _check_setup(cfg: TrainConfig, model_config: models.ModelConfig, corpus: data_lib.TokenData) -> None:
    data, pipe, tensor = cfg.mesh
    models.check_tensor_parallel(model_config, tensor)
    if model_config.n_layers % pipe:
        raise ValueError(f"{model_config.n_layers} layers do not split into pipe={pipe} stages")
    if cfg.seq_len > model_config.max_positions:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_positions {model_config.max_positions}")
    if cfg.sequence_parallel and cfg.seq_len % tensor:
        raise ValueError(f"seq_len {cfg.seq_len} is not divisible by tensor={tensor} (sequence parallelism)")
    if corpus.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"the data has token ids up to {corpus.vocab_size - 1} but model {cfg.model} has vocab_size "
            f"{model_config.vocab_size}"
        )
    for split, tokens in (("training", corpus.train), ("validation", corpus.val)):
        if len(tokens) < cfg.seq_len + 2:
            raise ValueError(
                f"the {split} split of {corpus.name} has {len(tokens)} tokens; a batch needs at least "
                f"seq_len + 2 = {cfg.seq_len + 2} (use more data, another val_fraction or a shorter seq_len)"
            )
    if cfg.sample_tokens < 0 or SAMPLE_PROMPT_TOKENS + cfg.sample_tokens > model_config.max_positions:
        raise ValueError(
            f"sample_tokens {cfg.sample_tokens} must be >= 0 and, after a {SAMPLE_PROMPT_TOKENS}-token prompt, "
            f"within the model's max_positions {model_config.max_positions}"
        )


# The prompt of the samples at each evaluation (`sample_tokens`): the validation split's
# first tokens.
SAMPLE_PROMPT_TOKENS = 32


def _decay_mask(model_config: models.ModelConfig) -> dict:
    """Weight decay on matrices only, not on norm scales or biases (the stacked "layers"
    axis does not count as a dimension)."""
    return jax.tree.map(
        lambda leaf: sum(axis != "layers" for axis in leaf[1]) >= 2,
        models.layout(model_config),
        is_leaf=models.params.is_layout_leaf,
    )


def make_optimizer(
    cfg: TrainConfig, model_config: models.ModelConfig
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (decay on matrices only) with warmup + cosine, after global-norm clipping."""
    decay_steps = cfg.decay_steps or cfg.steps
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        cfg.lr,
        min(cfg.warmup_steps, decay_steps),
        max(decay_steps, cfg.warmup_steps + 1),
        cfg.lr * cfg.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay, mask=_decay_mask(model_config)
        ),
    )
    return tx, schedule


def optimizer_shardings(tx: optax.GradientTransformation, params: dict, mesh) -> dict:
    """Shardings of the optimizer state: every per-parameter tree (Adam moments) sharded
    like the parameters, scalars (step counts) replicated. Left to propagation, moments
    born from `zeros_like` come out replicated, and every step then all-gathers the
    full float32 parameters and moments over "tensor"."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        jax.eval_shape(tx.init, params),
        jax.tree.map(lambda p: p.sharding, params),
        transform_non_params=lambda _: replicated,
    )


def init_state(
    model_config: models.ModelConfig, seed: int, mesh, tx: optax.GradientTransformation
) -> tuple[dict, dict]:
    """Parameters (born sharded) and optimizer state on `mesh`: moments sharded like the
    parameters, scalars replicated."""
    params = models.init_params(model_config, jax.random.key(seed), mesh)
    return params, jax.jit(tx.init, out_shardings=optimizer_shardings(tx, params, mesh))(params)


def taco_config(cfg: TrainConfig, axis: str = TENSOR_AXIS) -> tj.TacoConfig:
    """The run's TACO configuration for one mesh axis's traffic (its compression group's
    preset and quantizers, the min_bytes override; for "tensor" also the measured link
    profile of taco_policy)."""
    group = cfg.compression.of(axis)
    overrides: dict[str, Any] = {"link": link_policy.link_for(cfg)} if axis == TENSOR_AXIS else {}
    if cfg.taco_min_bytes >= 0:
        overrides["min_bytes"] = cfg.taco_min_bytes
    if group.forward:
        overrides["forward"] = tj.QuantSpec.parse(group.forward)
    if group.backward:
        overrides["backward"] = tj.QuantSpec.parse(group.backward)
    return tj.TacoConfig.preset(group.preset, **overrides)


def uses_error_feedback(cfg: TrainConfig) -> bool:
    """Whether the run compresses its data-parallel reduction (and keeps residuals)."""
    return taco_config(cfg, DATA_AXIS).enabled and cfg.mesh.data > 1


def _residual_specs(model_config: models.ModelConfig) -> dict:
    """(data, *parameter shape) split over "data" and then like the parameter."""
    return jax.tree.map(
        lambda spec: P(DATA_AXIS, *spec), models.partition_specs(model_config), is_leaf=lambda s: isinstance(s, P)
    )


def feedback_specs(cfg: TrainConfig, model_config: models.ModelConfig) -> dict:
    """PartitionSpecs of the error-feedback residuals, one per parameter and data rank;
    {} when the run keeps none."""
    return _residual_specs(model_config) if uses_error_feedback(cfg) else {}


def _feedback_layout(cfg: TrainConfig, model_config: models.ModelConfig, params: dict, mesh) -> dict:
    """Shapes and shardings of residuals for `params` (what a checkpoint holds)."""
    return jax.tree.map(
        lambda p, spec: jax.ShapeDtypeStruct(
            (cfg.mesh.data, *p.shape), jnp.float32, sharding=NamedSharding(mesh, spec)
        ),
        params,
        _residual_specs(model_config),
        is_leaf=lambda x: isinstance(x, jax.Array),
    )


def init_error_feedback(cfg: TrainConfig, model_config: models.ModelConfig, params: dict, mesh) -> dict:
    """Zero residuals (float32, laid out by `feedback_specs`); {} when the run keeps none."""
    if not uses_error_feedback(cfg):
        return {}
    layout = _feedback_layout(cfg, model_config, params, mesh)
    zeros = lambda: jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), layout)
    return jax.jit(zeros, out_shardings=jax.tree.map(lambda leaf: leaf.sharding, layout))()


def tp_messages(
    cfg: TrainConfig, model_config: models.ModelConfig, mesh, params: dict, tokens: jax.Array
) -> list[Message]:
    """The tensor-parallel message shapes one step sends (traced, not run)."""
    always = dataclasses.replace(cfg, taco_policy="always")
    with tj.record_wire() as ledger:
        feedback = _feedback_layout(cfg, model_config, params, mesh) if uses_error_feedback(cfg) else {}
        jax.jit(make_grads_fn(always, model_config, mesh)).lower(params, tokens, feedback)
    return [
        Message(r.op.removesuffix("_one_shot").removesuffix("_two_shot"), r.shape, r.dtype)
        for r in ledger.records
        if r.compressed and r.axis == TENSOR_AXIS
    ]


def resolve_taco_policy(
    cfg: TrainConfig, model_config: models.ModelConfig, mesh, params: dict, tokens: jax.Array, out: Path | None
) -> TrainConfig:
    """`cfg` with taco_policy="auto" resolved (train/link_policy.py): probe the link on
    GPUs and write OUT/link_profile.json, or compress every message."""
    return link_policy.choose(
        cfg,
        taco_config(dataclasses.replace(cfg, taco_policy="always")).mode,
        mesh,
        lambda: tp_messages(cfg, model_config, mesh, params, tokens),
        out,
        log=lambda line: print(line, file=sys.stderr),
    )


def resolve_tp_overlap(
    cfg: TrainConfig, model_config: models.ModelConfig, mesh, params: dict, tokens: jax.Array, out: Path | None
) -> TrainConfig:
    """`cfg` with tp_overlap="auto" resolved (train/link_policy.py): on GPUs, by timings
    of the step's gradients with the collective matmuls at every site, at each site
    alone, and without them."""

    def time_step(setting: str) -> float:
        variant = cfg.with_keys(tp_overlap=setting)
        feedback = init_error_feedback(variant, model_config, params, mesh)
        grads = jax.jit(make_grads_fn(variant, model_config, mesh))
        jax.block_until_ready(grads(params, tokens, feedback))  # compile and warm up
        times = []
        for _ in range(OVERLAP_PROBE_STEPS):
            start = time.perf_counter()
            jax.block_until_ready(grads(params, tokens, feedback))
            times.append(time.perf_counter() - start)
        return _agreed(float(np.median(times)))

    return link_policy.choose_overlap(cfg, time_step, out, log=lambda line: print(line, file=sys.stderr))


# Timed calls per setting of the tp_overlap=auto probe (after one to compile).
OVERLAP_PROBE_STEPS = 3


def _agreed(seconds: float) -> float:
    """The slowest process's time, so every process decides alike."""
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    return float(np.max(multihost_utils.process_allgather(np.float64(seconds))))


def _parallelism(cfg: TrainConfig, calibration: Calibration) -> Parallelism:
    return Parallelism(
        taco_config(cfg),
        cfg.sequence_parallel,
        jnp.dtype(cfg.compute_dtype),
        calibration=calibration,
        remat=cfg.remat,
        overlap=overlap_sites(cfg.tp_overlap),
        scan_layers=cfg.scan_layers,
    )


def _shard_map(cfg: TrainConfig, mesh, fn, in_specs, out_specs):
    if cfg.simulate_mesh:
        return tj.simulated_shard_map(fn, cfg.mesh._asdict(), in_specs, out_specs)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def device_mesh(cfg: TrainConfig):
    """The run's device mesh: cfg.mesh, or one device when the mesh is simulated."""
    return tj.make_mesh(1, 1, 1, devices=jax.devices()[:1]) if cfg.simulate_mesh else tj.make_mesh(*cfg.mesh)


def _sum_over_stages(grad: jax.Array) -> jax.Array:
    """psum over "pipe" of a parameter every stage holds, recorded as pipe traffic."""
    tj.collectives.record_plain_all_reduce(grad, PIPE_AXIS, site="pipe.shared_grads", direction="backward")
    return lax.psum(grad, PIPE_AXIS)


def make_grads_fn(
    cfg: TrainConfig,
    model_config: models.ModelConfig,
    mesh,
    calibration: Calibration = Calibration(),
    collector: tj.calibration.Collector | None = None,
):
    """shard_map'd (params, tokens, feedback) -> (loss, grads, feedback): the pipelined
    loss and its gradients, averaged over data (compressed with error feedback where
    taco_data says so: `feedback` holds the residuals, `init_error_feedback`) and
    accumulation steps, sharded like the parameters. With a `collector`, every
    compressed tensor-parallel collective reports what it sends to it."""
    par = _parallelism(cfg, calibration)
    pipe, data = taco_config(cfg, PIPE_AXIS), taco_config(cfg, DATA_AXIS)
    specs = models.partition_specs(model_config)

    def reduce_grads(loss, grads, feedback):
        grads = sequence_parallel_grads(model_config, grads, par)
        # Parameters not split over "pipe" (embeddings, final norm, head) are used by one
        # stage each: sum their gradients over the stages.
        grads = jax.tree.map(lambda g, s: g if PIPE_AXIS in tuple(s) else _sum_over_stages(g), grads, specs)
        loss = lax.psum(loss, PIPE_AXIS)
        residual = jax.tree.map(lambda r: r[0], feedback) if feedback else None
        grads, residual = tj.data_parallel.mean_gradients(grads, DATA_AXIS, data, residual)
        return lax.pmean(loss, DATA_AXIS), grads, jax.tree.map(lambda r: r[None], residual) if feedback else feedback

    def local_grads(params, tokens, feedback):
        with tj.calibration.observing(collector) if collector is not None else contextlib.nullcontext():
            return accumulated_grads(params, tokens, feedback)

    def accumulated_grads(params, tokens, feedback):
        chunks = tokens.reshape(cfg.grad_accum, -1, tokens.shape[-1])
        grad_fn = jax.value_and_grad(lambda p, t: pipeline_loss(model_config, p, t, par, cfg.microbatches, pipe))

        def accumulate(total, chunk):
            loss, grads = grad_fn(params, chunk)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        zeros = (jnp.float32(0.0), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = lax.scan(accumulate, zeros, chunks)
        return reduce_grads(loss / cfg.grad_accum, jax.tree.map(lambda g: g / cfg.grad_accum, grads), feedback)

    fb_specs = feedback_specs(cfg, model_config)
    return _shard_map(cfg, mesh, local_grads, (specs, P(DATA_AXIS), fb_specs), (P(), specs, fb_specs))


def make_step_functions(
    cfg: TrainConfig,
    model_config: models.ModelConfig,
    mesh,
    tx,
    state_shardings,
    calibration: Calibration = Calibration(),
    collector: tj.calibration.Collector | None = None,
):
    """(train_step, eval_step), jitted. train_step(params, opt_state, feedback, tokens,
    poison) -> (params, opt_state, feedback, metrics); a non-finite loss or gradient
    leaves params, optimizer state and error-feedback residuals unchanged
    (metrics["ok"] is False). `state_shardings` (of params, optimizer state and
    feedback) are kept on the outputs, so every step reuses one compilation.
    `calibration` and `collector` as in `make_grads_fn`."""
    par = _parallelism(cfg, calibration)
    pipe = taco_config(cfg, PIPE_AXIS)
    specs = models.partition_specs(model_config)
    grads_fn = make_grads_fn(cfg, model_config, mesh, calibration, collector)

    def train_step(params, opt_state, feedback, tokens, poison):
        loss, grads, new_feedback = grads_fn(params, tokens, feedback)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        # A finite gradient can still make a parameter non-finite (an update that
        # overflows); `save_checkpoint` refuses such a state. Selecting on it here would
        # make every write wait for a reduction over the new parameters: 8.5% of a 0.91B
        # step on an H200 (a flag beside the step, 1.5%).
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        return (
            keep(optax.apply_updates(params, updates), params),
            keep(new_opt_state, opt_state),
            keep(new_feedback, feedback),
            {"loss": loss, "grad_norm": grad_norm, "ok": ok},
        )

    def local_eval(params, tokens):
        loss = pipeline_loss(model_config, params, tokens, par, cfg.microbatches, pipe)
        return lax.pmean(lax.psum(loss, PIPE_AXIS), DATA_AXIS)

    eval_fn = _shard_map(cfg, mesh, local_eval, (specs, P(DATA_AXIS)), P())
    jitted = jax.jit(train_step, donate_argnums=(0, 1, 2), out_shardings=(*state_shardings, None))
    return jitted, jax.jit(eval_fn)


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every value of every float array in `tree` is finite (a scalar bool)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def _global_batch(tokens: np.ndarray, mesh) -> jax.Array:
    """A batch every process computed identically, as a global array sharded over data."""
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


def _scalar(x: jax.Array) -> float:
    return float(np.asarray(x.addressable_shards[0].data))


# Sites traced once per optimizer step, outside the gradient-accumulation scan.
PER_STEP_SITES = ("pipe.shared_grads", "data.grads")


def wire_bytes_per_step(cfg: TrainConfig, model_config, train_step, state: tuple, tokens) -> tuple[dict, dict]:
    """Bytes each rank sends per optimizer step on every mesh axis, as sent and as plain
    bfloat16: ({"tensor": .., "pipe": .., "data": ..}, the same as bf16), from the
    collectives traced in one step. Scanned layer sites count once per local layer,
    what runs per microbatch once per accumulation step. (Scalars, e.g. the loss's mean
    over data, and forward messages recomputed under `remat` are not counted.)

    Args:
      train_step: from `make_step_functions`.
      state: (params, opt_state, feedback) as train_step takes them.
      tokens: a global batch.
    """
    with tj.record_wire() as ledger:
        train_step.lower(*state, tokens, jnp.bool_(False))
    layers_per_stage = model_config.n_layers // cfg.mesh.pipe
    factor = lambda r: (
        (layers_per_stage if r.site.startswith("layers.") else 1) * (1 if r.site in PER_STEP_SITES else cfg.grad_accum)
    )
    sums = lambda bf16: {
        axis: sum(factor(r) * (r.bf16_sent_bytes if bf16 else r.sent_bytes) for r in ledger.records if r.axis == axis)
        for axis in tj.MESH_AXES
    }
    return sums(False), sums(True)


def _calibration_summary(calibration: Calibration) -> dict:
    return {
        "calibrated_sites": len(calibration.plans),
        "sites_with_transform": sum(plan.hadamard for _, _, plan in calibration.plans),
    }


def calibrate_run(cfg: TrainConfig, collector: tj.calibration.Collector, out: Path | None, bar=None) -> Calibration:
    """Decide the run's calibration from what `collector` observed; write the per-site
    report (every candidate's codec error) to `out`/calibration.json."""
    jax.effects_barrier()  # every host callback of the observed steps has run
    strategies = tj.calibration.STRATEGIES if cfg.calibration_strategy == "auto" else (cfg.calibration_strategy,)
    calibration, report = tj.calibration.calibrate(
        collector, taco_config(cfg), strategies=strategies, min_gain=cfg.calibration_min_gain
    )
    if out is not None:
        strict_json.write(out / "calibration.json", {"calibration": calibration.to_json(), "report": report})
    chosen = ", ".join(
        f"{site}/{direction[0]}: {'H' if plan.hadamard else '-'}" for site, direction, plan in calibration.plans
    )
    message = f"calibrated {len(calibration.plans)} site directions ({chosen})"
    (bar.write if bar is not None else lambda m: print(m, file=sys.stderr))(message)
    return calibration


@dataclasses.dataclass
class _StopFlag:
    """The signal that asks the run to stop, as every process agrees on it: a signal one
    host receives (a preemption) stops all of them at the same step, so none is left
    waiting in a collective or saves a checkpoint the others do not."""

    def __init__(self):
        self.received: str | None = None
        self.signal_name: str | None = None

    def __call__(self, signum, frame):
        self.received = signal.Signals(signum).name

    def agree(self) -> str | None:
        """Update `signal_name` from every process's flag (a host collective when there
        are several) and return it."""
        if jax.process_count() == 1:
            self.signal_name = self.received
        elif self.signal_name is None:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.int32(self.received is not None))
            if np.any(flags):
                self.signal_name = self.received or "a signal to another process"
        return self.signal_name


class MetricsLog:
    """metrics.jsonl in the run directory (process 0 only), one row per step: on resume,
    lines past the restored step are dropped so the log matches the restored state, and
    so is a line a crash cut short; of a step logged twice, the later row is kept. The
    file is rewritten atomically."""

    def __init__(self, path: Path, resume_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        lines = path.read_text().splitlines() if (resume_step and path.exists()) else []
        rows = [_parsed_row(line) for line in lines]
        if None in rows:
            print(f"{path}: {rows.count(None)} unreadable line(s) dropped (a write cut short)", file=sys.stderr)
        by_step = {
            row["step"]: line for line, row in zip(lines, rows) if row is not None and row["step"] <= resume_step
        }
        strict_json.replace_text(path, "".join(by_step[step] + "\n" for step in sorted(by_step)))

    def write(self, row: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(strict_json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []


def _parsed_row(line: str) -> dict | None:
    """A metrics.jsonl row, or None for a line that is not one."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def plot_losses(rows: list[dict], path: Path, title: str) -> None:
    """Training (and validation) loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass
class _Run:
    """A run's setup and the state it starts from (fresh or restored)."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    model_config: models.ModelConfig
    corpus: data_lib.TokenData
    out: Path
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    checkpoints: Checkpointer
    params: dict
    opt_state: dict
    feedback: dict
    step: int = 0
    bad_total: int = 0
    calibration: Calibration = Calibration()
    calibrated: bool = False
    lock: run_dir.RunLock | None = None

    def close(self) -> None:
        """Close the checkpoint manager and release the run directory."""
        self.checkpoints.close()
        if self.lock is not None:
            self.lock.release()


def resumed_config(cfg: TrainConfig, meta: dict, step: int) -> TrainConfig:
    """`cfg` checked against the configuration a checkpoint was saved with: the run it
    continues, on the learning-rate schedule it started (with decay_steps left at 0, a
    `steps` that differs keeps the decay where it was).

    Raises:
      ValueError: keys outside `RESUMABLE_KEYS`, or the schedule's horizon, differ (the
        message names them).
    """
    saved = meta.get("config")
    if saved is None:
        print(f"checkpoint at step {step} holds no configuration to check the resumed run against", file=sys.stderr)
        return cfg
    changed = changed_keys(saved, cfg)
    horizon = meta.get("schedule_steps") or saved["decay_steps"] or saved["steps"]
    if cfg.decay_steps and cfg.decay_steps != horizon:
        changed.append(f"decay_steps: the schedule decays over {horizon} steps -> {cfg.decay_steps}")
    if changed:
        raise ValueError(
            f"--resume: the run was started with other settings ({'; '.join(changed)}); resume with "
            f"the run's own settings (its config.json) or start a new --out. Only "
            f"{', '.join(RESUMABLE_KEYS)} may change."
        )
    if not cfg.decay_steps and cfg.steps != horizon:
        print(
            f"the learning rate keeps the schedule the run started with (cosine decay over {horizon} steps)",
            file=sys.stderr,
        )
    return dataclasses.replace(cfg, decay_steps=horizon)


def start_run(cfg: TrainConfig, resume: bool) -> _Run:
    """Set up a run and its initial state: fresh, or restored from the newest checkpoint
    that restores (an unreadable newer one is skipped with a line saying so).

    Raises:
      ValueError: bad setup, no restorable checkpoint or a changed configuration with
        `resume`, checkpoints already present without it, or an unreadable
        `calibration_file`.
    """
    mesh = device_mesh(cfg)
    model_config = models.preset(cfg.model)
    corpus = data_lib.load(cfg.data, val_fraction=cfg.val_fraction, tokenizer=cfg.tokenizer, dtype=cfg.data_dtype)
    _check_setup(cfg, model_config, corpus)
    out, lock = run_dir.prepare(cfg.out, lock=jax.process_index() == 0)
    checkpoints = Checkpointer(out / "checkpoints", cfg.keep_checkpoints)
    try:
        run = _initial_run(cfg, mesh, model_config, corpus, out, checkpoints, resume)
    except BaseException:
        checkpoints.close()
        if lock is not None:
            lock.release()
        raise
    run.lock = lock
    return run


def _initial_run(cfg, mesh, model_config, corpus, out, checkpoints, resume: bool) -> _Run:
    """The run fresh, or restored from `checkpoints` with `resume`."""
    steps = checkpoints.steps()
    if not resume:
        if steps:
            raise ValueError(
                f"{out} already holds checkpoints (latest step {steps[0]}): pass --resume or another --out"
            )
        run = _fresh_run(cfg, mesh, model_config, corpus, out, checkpoints)
    elif not steps:
        raise ValueError(f"--resume: no checkpoint in {checkpoints.directory}")
    else:
        run = _restored_run(cfg, mesh, model_config, corpus, out, checkpoints, steps)
    if cfg.calibration_file:
        run.calibration, run.calibrated = load_calibration(cfg.calibration_file), True
    return run


def _fresh_run(cfg, mesh, model_config, corpus, out, checkpoints) -> _Run:
    tx, schedule = make_optimizer(cfg, model_config)
    params, opt_state = init_state(model_config, cfg.seed, mesh, tx)
    return _Run(
        cfg,
        mesh,
        model_config,
        corpus,
        out,
        tx,
        schedule,
        checkpoints,
        params,
        opt_state,
        init_error_feedback(cfg, model_config, params, mesh),
    )


def _restored_run(cfg, mesh, model_config, corpus, out, checkpoints, steps: list[int]) -> _Run:
    """The run restored from the newest of `steps` that restores."""
    failures = []
    for step in steps:
        try:
            run = _restore(cfg, mesh, model_config, corpus, out, checkpoints, step)
        except _Unrestorable as error:
            failures.append(str(error.__cause__))
            continue
        if failures:
            print(
                f"resuming from step {step}: the newer checkpoint(s) cannot be restored ({'; '.join(failures)})",
                file=sys.stderr,
            )
            _set_aside_newer(checkpoints, step)
        return run
    raise ValueError("; ".join(failures))


def _set_aside_newer(checkpoints: Checkpointer, step: int) -> None:
    """Move the checkpoints newer than `step` (which did not restore) aside, so that the
    resumed run saves those steps anew (orbax declines a step that exists). The main
    process moves them; the others wait for it and read the folder again."""
    if jax.process_index() == 0:
        for newer in checkpoints.steps():
            if newer > step:
                moved = checkpoints.set_aside(newer)
                print(f"set aside the unrestorable checkpoint at step {newer}: {moved}", file=sys.stderr)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("taco_jax set aside unrestorable checkpoints")
        checkpoints.manager.reload()


class _Unrestorable(Exception):
    """A checkpoint that cannot be read (its cause says why); an older one may be."""


def _restore(cfg, mesh, model_config, corpus, out, checkpoints, step: int) -> _Run:
    try:
        meta = checkpoints.meta(step)
    except ValueError as error:
        raise _Unrestorable from error
    if meta.get("model") != cfg.model:
        raise ValueError(f"checkpoint at step {step} is for model {meta.get('model')!r}, not {cfg.model!r}")
    cfg = resumed_config(cfg, meta, step)
    run = _fresh_run(cfg, mesh, model_config, corpus, out, checkpoints)
    saved_feedback = _feedback_layout(cfg, model_config, run.params, mesh) if meta.get("error_feedback") else {}
    try:
        state, meta = checkpoints.restore(step, _checkpoint_state(run.params, run.opt_state, saved_feedback))
    except ValueError as error:
        raise _Unrestorable from error
    run.params, run.opt_state, run.step, run.bad_total = (
        state["params"],
        state["opt_state"],
        meta["step"],
        meta["skipped_steps"],
    )
    if run.feedback:  # a run that starts compressing its data-parallel reduction starts them at zero
        run.feedback = state.get("error_feedback", run.feedback)
    elif saved_feedback:
        print("taco_data is off: the checkpoint's error-feedback residuals are not used", file=sys.stderr)
    run.calibration = Calibration.from_json(meta.get("calibration", {"plans": []}))
    run.calibrated = bool(meta.get("calibrated", False))
    return run


def _checkpoint_state(params: dict, opt_state, feedback: dict) -> dict:
    """What a checkpoint holds: parameters, optimizer state and, where the run keeps
    them, the error-feedback residuals. (A run that starts compressing its data-parallel
    reduction on resume starts them at zero; one that stops drops them.)"""
    return {"params": params, "opt_state": opt_state, **({"error_feedback": feedback} if feedback else {})}


def restore_params(run_dir: str | Path, step: int | None = None) -> tuple[TrainConfig, models.ModelConfig, dict, int]:
    """The parameters of a run's checkpoint, on one device: the newest that restores
    (an unreadable newer one is skipped with a line saying so, as a resume does).

    Args:
      run_dir: the trainer run directory.
      step: the checkpoint's step (None: the newest that restores).

    Returns:
      (the run's config, its model config, the parameters, the checkpoint's step).

    Raises:
      ValueError: no readable config.json, no restorable checkpoint in `run_dir`, or
        none at `step`.
    """
    cfg = _run_config(Path(run_dir))
    model_config = models.preset(cfg.model)
    mesh = tj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    if not (Path(run_dir) / "checkpoints").is_dir():
        raise ValueError(f"no checkpoint in {Path(run_dir) / 'checkpoints'}")
    checkpoints = Checkpointer(Path(run_dir) / "checkpoints", cfg.keep_checkpoints, writer=False)
    try:
        steps = checkpoints.steps()
        if not steps:
            raise ValueError(f"no checkpoint in {checkpoints.directory}")
        if step is not None and step not in steps:
            raise ValueError(f"no checkpoint at step {step} in {checkpoints.directory} (it has {sorted(steps)})")
        failures = []
        for candidate in steps if step is None else [step]:
            try:
                params = _restored_params(cfg, model_config, mesh, checkpoints, candidate)
            except ValueError as error:
                failures.append(str(error))
                continue
            if failures:
                print(f"using step {candidate}: the newer checkpoint(s) cannot be restored", file=sys.stderr)
            return cfg, model_config, params, candidate
        raise ValueError("; ".join(failures))
    finally:
        checkpoints.close()


def _run_config(folder: Path) -> TrainConfig:
    """The configuration a run directory's config.json holds.

    Raises:
      ValueError: it is missing, unreadable or not a run configuration.
    """
    try:
        keys = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{folder} is not a trainer run directory (config.json: {error})") from None
    if not isinstance(keys, dict):
        raise ValueError(f"{folder / 'config.json'} must hold a mapping of configuration keys")
    return TrainConfig.from_keys(**keys)


def _restored_params(cfg: TrainConfig, model_config, mesh, checkpoints: Checkpointer, step: int) -> dict:
    """The parameters of checkpoint `step`, restored onto `mesh`."""
    tx, _ = make_optimizer(cfg, model_config)
    params = models.abstract_params(model_config, mesh)
    opt_state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        jax.eval_shape(tx.init, params),
        optimizer_shardings(tx, params, mesh),
    )
    meta = checkpoints.meta(step)
    feedback = _feedback_layout(cfg, model_config, params, mesh) if meta.get("error_feedback") else {}
    state, _ = checkpoints.restore(step, _checkpoint_state(params, opt_state, feedback))
    return state["params"]


def load_calibration(path: str | Path) -> Calibration:
    """A `Calibration` from a calibration.json (of a run or `--calibrate-only`).

    Raises:
      ValueError: missing or malformed file.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"calibration_file {path} cannot be read: {error}") from None
    return Calibration.from_json(data.get("calibration", data) if isinstance(data, dict) else data)


def batch_maker(cfg: TrainConfig, mesh):
    """(tokens, position, size) -> the global batch at data position `position`."""
    data_seed = cfg.seed if cfg.data_seed < 0 else cfg.data_seed
    return lambda tokens, position, size: _global_batch(
        data_lib.batch(tokens, seed=data_seed, position=position, batch_size=size, seq_len=cfg.seq_len), mesh
    )


def observe_batches(
    cfg: TrainConfig, model_config: models.ModelConfig, mesh, params: dict, batches
) -> tj.calibration.Collector:
    """What every compressed site sends, forward and backward, over `batches` (no update)."""
    collector = tj.calibration.Collector()
    grads_fn = jax.jit(make_grads_fn(cfg, model_config, mesh, collector=collector))
    feedback = init_error_feedback(cfg, model_config, params, mesh)
    for tokens in batches:
        jax.block_until_ready(grads_fn(params, tokens, feedback))
    return collector


def calibrate_only(cfg: TrainConfig, *, resume: bool = False) -> dict:
    """The standalone calibration step: observe `calibration_steps` batches (from the
    checkpoint's data position with `resume`, else from a fresh init) without training,
    decide the calibration and write it to `out`/calibration.json, which
    `calibration_file=` then loads into any run.

    Returns:
      Summary dict (sites calibrated, sites with the transform, the file).

    Raises:
      ValueError: as `train`, or a preset that is not calibrated (mode "taco" only).
    """
    if taco_config(cfg).mode != "taco" or cfg.calibration_steps < 1:
        raise ValueError(
            f"--calibrate-only needs a taco preset (got {cfg.compression.tensor.preset!r}) and calibration_steps >= 1"
        )
    run = start_run(cfg, resume)
    try:
        batch_of = batch_maker(cfg, run.mesh)
        batches = (batch_of(run.corpus.train, run.step + i, cfg.batch_size) for i in range(cfg.calibration_steps))
        collector = observe_batches(cfg, run.model_config, run.mesh, run.params, batches)
        main_process = jax.process_index() == 0
        calibration = calibrate_run(cfg, collector, run.out if main_process else None)
    finally:
        run.close()
    return {
        "model": cfg.model,
        "step": run.step,
        **_calibration_summary(calibration),
        "file": str(run.out / "calibration.json"),
    }


@dataclasses.dataclass
class TrainLoop:
    """What the training loop runs with (`setup_train_loop`): the run and its state, the
    step functions compiled for them, and what one step sends.

    Attributes:
      run: the run's setup and state (advanced by `run_step`).
      given: the configuration as given, which checkpoints record and a resume is
        checked against (`run.cfg` has taco_policy resolved).
      batch_of: (tokens, position, size) -> the global batch at that data position.
      train_step, eval_step: from `make_step_functions`.
      shardings: of (params, optimizer state, feedback), kept across recompilations.
      wire, wire_bf16: bytes one step sends per mesh axis, compressed and as bf16.
      log: metrics.jsonl.
      collector: what calibration observes until `calibrate_at`; None once calibrated.
      calibrate_at: the step after which the run calibrates, or None.
      main_process: this process writes the run directory.
      consecutive_bad: non-finite steps in a row so far.
    """

    run: _Run
    given: TrainConfig
    batch_of: Any
    train_step: Any
    eval_step: Any
    shardings: tuple
    wire: dict
    wire_bf16: dict
    log: MetricsLog
    collector: tj.calibration.Collector | None
    calibrate_at: int | None
    main_process: bool
    consecutive_bad: int = 0


def setup_train_loop(cfg: TrainConfig, *, resume: bool = False) -> TrainLoop:
    """Start (or restore) the run, resolve taco_policy, compile its steps and count what
    one step sends.

    Raises:
      ValueError: as `train`.
    """
    run = start_run(cfg, resume)
    try:
        return _loop_of(run, cfg, resume)
    except BaseException:
        run.close()
        raise


def _loop_of(run: _Run, cfg: TrainConfig, resume: bool) -> TrainLoop:
    """`setup_train_loop`'s work once the run has started."""
    main_process = jax.process_index() == 0
    batch_of = batch_maker(run.cfg, run.mesh)
    first_batch = batch_of(run.corpus.train, 0, run.cfg.batch_size)
    run.cfg = resolve_taco_policy(
        run.cfg, run.model_config, run.mesh, run.params, first_batch, run.out if main_process else None
    )
    run.cfg = resolve_tp_overlap(
        run.cfg, run.model_config, run.mesh, run.params, first_batch, run.out if main_process else None
    )
    if main_process and not resume:
        strict_json.write(run.out / "config.json", to_dict(run.cfg), indent=1)
    shardings = jax.tree.map(lambda x: x.sharding, (run.params, run.opt_state, run.feedback))
    resolved = run.cfg
    observe = (
        taco_config(resolved).mode == "taco"
        and resolved.calibration_steps > 0
        and (resolved.recalibrate or not run.calibrated)
    )
    collector = tj.calibration.Collector() if observe else None
    train_step, eval_step = make_step_functions(
        resolved, run.model_config, run.mesh, run.tx, shardings, run.calibration, collector
    )
    state = (run.params, run.opt_state, run.feedback)
    wire, wire_bf16 = wire_bytes_per_step(resolved, run.model_config, train_step, state, first_batch)
    return TrainLoop(
        run=run,
        given=cfg,
        batch_of=batch_of,
        train_step=train_step,
        eval_step=eval_step,
        shardings=shardings,
        wire=wire,
        wire_bf16=wire_bf16,
        log=MetricsLog(run.out / "metrics.jsonl", run.step, main_process),
        collector=collector,
        calibrate_at=run.step + resolved.calibration_steps if observe else None,
        main_process=main_process,
    )


def run_step(loop: TrainLoop, bar=None) -> dict:
    """One optimizer step: update the run's state, calibrate when it is due, evaluate
    at the eval cadence, and return the step's metrics row (also written to the log).

    Raises:
      TrainingError: `max_bad_steps` consecutive non-finite steps.
    """
    run, cfg = loop.run, loop.run.cfg
    tick = time.perf_counter()
    tokens = loop.batch_of(run.corpus.train, run.step, cfg.batch_size)
    run.params, run.opt_state, run.feedback, metrics = loop.train_step(
        run.params, run.opt_state, run.feedback, tokens, jnp.bool_(run.step in cfg.debug_nan_steps)
    )
    jax.block_until_ready(metrics)  # also keeps CPU collective programs from overlapping
    elapsed = time.perf_counter() - tick
    ok = bool(np.asarray(metrics["ok"].addressable_shards[0].data))
    loop.consecutive_bad = 0 if ok else loop.consecutive_bad + 1
    run.bad_total += 0 if ok else 1
    row = {
        "step": run.step + 1,
        "loss": _scalar(metrics["loss"]),
        "lr": float(run.schedule(run.step)),
        "grad_norm": _scalar(metrics["grad_norm"]),
        "tokens_per_s": cfg.batch_size * cfg.seq_len / elapsed,
        "step_time_s": elapsed,
        "wire_bytes": loop.wire[TENSOR_AXIS],
        "wire_bytes_bf16": loop.wire_bf16[TENSOR_AXIS],
        "wire_bytes_by_axis": loop.wire,
        "wire_bytes_bf16_by_axis": loop.wire_bf16,
        "skipped_steps": run.bad_total,
        "finite": ok,
    }
    run.step += 1
    if run.step == loop.calibrate_at and loop.collector is not None:
        _calibrate(loop, bar)
    if loop.consecutive_bad >= cfg.max_bad_steps:
        raise TrainingError(f"{loop.consecutive_bad} consecutive non-finite steps (last: step {run.step}); stopping")
    if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
        row["val_loss"] = evaluate(loop)
        if cfg.sample_tokens:
            row["sample"] = sample_text(loop)
            if loop.main_process:
                line = f"sample at step {run.step}: {row['sample']!r}"
                (bar.write if bar is not None else lambda m: print(m, file=sys.stderr))(line)
    loop.log.write(row)
    return row


def _calibrate(loop: TrainLoop, bar) -> None:
    """Decide the calibration from what the collector observed and recompile the steps."""
    run = loop.run
    assert loop.collector is not None
    run.calibration = calibrate_run(run.cfg, loop.collector, run.out if loop.main_process else None, bar)
    run.calibrated, loop.collector = True, None
    loop.train_step, loop.eval_step = make_step_functions(
        run.cfg, run.model_config, run.mesh, run.tx, loop.shardings, run.calibration
    )


def evaluate(loop: TrainLoop) -> float:
    """Mean validation loss over fixed batches: positions no training step uses."""
    run = loop.run
    losses = [
        _scalar(loop.eval_step(run.params, loop.batch_of(run.corpus.val, 10**9 + i, run.cfg.batch_size)))
        for i in range(run.cfg.eval_batches)
    ]
    return float(np.mean(losses))


def sample_text(loop: TrainLoop) -> str:
    """The validation split's first `SAMPLE_PROMPT_TOKENS` tokens and their greedy
    continuation by `sample_tokens` tokens, as text (token ids where the run's data has
    no text codec). A pipelined run samples on one device."""
    run = loop.run
    prompt = [int(t) for t in run.corpus.val[:SAMPLE_PROMPT_TOKENS]]
    new = models.generate(
        run.model_config,
        run.params,
        [prompt],
        mesh=run.mesh if run.cfg.mesh.pipe == 1 else None,
        taco=taco_config(run.cfg),
        max_new_tokens=run.cfg.sample_tokens,
        dtype=jnp.dtype(run.cfg.compute_dtype),
    )[0]
    try:
        decode = data_lib.text_codec(run.cfg.data, run.cfg.tokenizer).decode
    except ValueError:
        return " ".join(map(str, prompt + new))
    return decode(prompt) + decode(new)


def save_checkpoint(loop: TrainLoop) -> None:
    """Checkpoint the run's state at its current step, with what a resume checks.

    Raises:
      TrainingError: a parameter or optimizer moment is not finite (an update overflowed
        where loss and gradient were finite); nothing is saved, so the newest checkpoint
        stays the last good state.
    """
    run = loop.run
    if not _scalar(_all_finite((run.params, run.opt_state))):
        raise TrainingError(
            f"the parameters or optimizer state at step {run.step} are not finite although every step's loss and "
            f"gradient were (an update overflowed: is lr={run.cfg.lr:g} too high?); not saving them, the newest "
            f"checkpoint is step {run.checkpoints.latest_step()}"
        )
    meta = {
        "step": run.step,
        "data_position": run.step,
        "skipped_steps": run.bad_total,
        "model": run.cfg.model,
        "seed": run.cfg.seed,
        "calibrated": run.calibrated,
        "calibration": run.calibration.to_json(),
        "error_feedback": bool(run.feedback),
        "config": to_dict(loop.given),
        "schedule_steps": run.cfg.decay_steps or run.cfg.steps,
    }
    run.checkpoints.save(run.step, _checkpoint_state(run.params, run.opt_state, run.feedback), meta)


def train_loop(loop: TrainLoop, stop: _StopFlag, bar=None) -> None:
    """Run steps up to `steps` or until every process agrees to stop, checkpointing at
    the cadence, at the end and when stopped."""
    run, cfg = loop.run, loop.run.cfg
    while run.step < cfg.steps and stop.agree() is None:
        row = run_step(loop, bar)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(
                loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", step_s=f"{row['step_time_s']:.3f}"
            )
        if run.step % cfg.checkpoint_every == 0 or run.step == cfg.steps or stop.signal_name:
            save_checkpoint(loop)


def _summary(loop: TrainLoop, stopped_by: str | None, seconds: float) -> dict:
    run, cfg = loop.run, loop.run.cfg
    rows = loop.log.rows() if loop.main_process else []
    return {
        "model": cfg.model,
        "mesh": list(cfg.mesh),
        "taco": cfg.compression.tensor.preset,
        "taco_policy": cfg.taco_policy,
        "tp_overlap": cfg.tp_overlap,
        "steps": run.step,
        "stopped_by": stopped_by,
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None),
        "skipped_steps": run.bad_total,
        "seconds": round(seconds, 1),
        "taco_pipe": cfg.compression.pipe.preset,
        "taco_data": cfg.compression.data.preset,
        "wire_bytes_per_step": loop.wire[TENSOR_AXIS],
        "wire_bytes_per_step_bf16": loop.wire_bf16[TENSOR_AXIS],
        "wire_bytes_by_axis": loop.wire,
        "wire_bytes_bf16_by_axis": loop.wire_bf16,
        # What each axis sends as a share of the same traffic in bf16 (above 1: more).
        "wire_fraction_by_axis": {
            axis: round(loop.wire[axis] / loop.wire_bf16[axis], 4) for axis in loop.wire if loop.wire_bf16[axis]
        },
        "pipeline_bubble": bubble_fraction(cfg.mesh.pipe, cfg.microbatches),
        **_calibration_summary(run.calibration),
    }


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) training as configured: `setup_train_loop`, then `train_loop`
    under SIGTERM/SIGINT handlers that stop it at a step every process agrees on (and
    checkpoint there), then the summary and the loss plot.

    Args:
      cfg: the configuration.
      resume: continue from the latest checkpoint in `cfg.out`.
      progress: show a progress bar.

    Returns:
      Summary dict (also written to `summary.json` in the run directory).

    Raises:
      ValueError: bad mesh or config, data that does not fit the model, a run directory
        that already holds checkpoints (without `resume`), no or a corrupt checkpoint
        (with `resume`).
      TrainingError: `max_bad_steps` consecutive non-finite steps.
    """
    loop = setup_train_loop(cfg, resume=resume)
    try:
        return _train_and_summarize(loop, progress)
    finally:
        loop.run.close()


def _train_and_summarize(loop: TrainLoop, progress: bool) -> dict:
    """`train`'s work once its loop is set up."""
    run = loop.run
    stop = _StopFlag()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = None
    if progress and loop.main_process:
        from tqdm import tqdm

        description = f"{run.cfg.model} {run.cfg.compression.tensor.preset}"
        bar = tqdm(total=run.cfg.steps, initial=run.step, desc=description, unit="step", file=sys.stderr)
    started = time.time()
    try:
        train_loop(loop, stop, bar)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if bar is not None:
            bar.close()
    if stop.signal_name and (run.checkpoints.latest_step() or 0) < run.step:
        save_checkpoint(loop)
    summary = _summary(loop, stop.signal_name, time.time() - started)
    if loop.main_process:
        strict_json.write(run.out / "summary.json", summary, indent=1)
        rows = loop.log.rows()
        if rows:
            title = f"{run.cfg.model}, mesh {tuple(run.cfg.mesh)}, taco={run.cfg.compression.tensor.preset}"
            plot_losses(rows, run.out / "loss.png", title)
    return summary
