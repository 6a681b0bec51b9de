"""The 3-D parallel trainer: DP over "data", GPipe over "pipe", compressed TP over "tensor",
all under one jit(shard_map) step. Setup (`setup_train_loop`), the step
(`make_step_functions`) and the loop (`train`) live here; the optimizer, the per-axis
compression, the run's state and its restore, calibration, the link and overlap probes,
metrics and signals each have their module beside this one."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import accounting, models, strict_json
from taco_jax.calibration import Calibration
from taco_jax.collectives import record_plain_all_reduce
from taco_jax.mesh import DATA_AXIS, PIPE_AXIS, TENSOR_AXIS
from taco_jax.models.api import sequence_parallel_grads
from taco_jax.models.transformer import Parallelism

from . import data as data_lib
from . import link_policy
from .calibrate import calibrate_run, calibration_summary, recorded_choices, refuse_overwrite
from .compression import feedback_specs, init_error_feedback, taco_config
from .config import TrainConfig, overlap_sites, to_dict
from .errors import TrainingError
from .metrics import MetricsLog, WireBytes, plot_losses, sample_text, summary, wire_bytes_per_step
from .pipeline import pipeline_loss
from .run_state import RunState, checkpoint_state, start_run
from .signals import StopFlag


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


def _sum_over_stages(grad: jax.Array) -> jax.Array:
    """psum over "pipe" of a parameter every stage holds, recorded as pipe traffic."""
    record_plain_all_reduce(grad, PIPE_AXIS, site="pipe.shared_grads", direction="backward")
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
        with accounting.repeated(cfg.grad_accum):
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


def _scalar(x: jax.Array) -> float:
    """A replicated scalar's value (read from this process's first shard)."""
    return float(np.asarray(x.addressable_shards[0].data))


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


def calibrate_only(cfg: TrainConfig, *, resume: bool = False, force: bool = False) -> dict:
    """The standalone calibration step: observe `calibration_steps` batches (from the
    checkpoint's data position with `resume`, else from a fresh init) without training,
    decide the calibration and write it to `out`/calibration.json, which
    `calibration_file=` then loads into any run.

    Args:
      cfg: the configuration.
      resume: observe from the checkpoint in `cfg.out`.
      force: overwrite a calibration.json already in `cfg.out` (a run's own
        calibration, or an earlier --calibrate-only's).

    Returns:
      Summary dict (sites calibrated, sites with the transform, the file).

    Raises:
      ValueError: as `train`, a preset that is not calibrated (mode "taco" only), or
        a calibration.json in `cfg.out` without `force` (before anything is compiled).
    """
    if taco_config(cfg).mode != "taco" or cfg.calibration_steps < 1:
        raise ValueError(
            f"--calibrate-only needs a taco preset (got {cfg.compression.tensor.preset!r}) and calibration_steps >= 1"
        )
    refuse_overwrite(Path(cfg.out) / "calibration.json", force)
    run = start_run(cfg, resume, force=force)
    try:
        batch_of = data_lib.batch_maker(cfg, run.mesh)
        batches = (batch_of(run.corpus.train, run.step + i, cfg.batch_size) for i in range(cfg.calibration_steps))
        collector = observe_batches(cfg, run.model_config, run.mesh, run.params, batches)
        main_process = jax.process_index() == 0
        calibration = calibrate_run(cfg, collector, run.out if main_process else None)
    finally:
        run.close()
    return {
        "model": cfg.model,
        "step": run.step,
        **calibration_summary(calibration, recorded_choices(calibration, run.out / "calibration.json")),
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
      wire: the bytes one step of `train_step` sends per mesh axis (counted again
        whenever the step is compiled anew, as after calibration).
      log: metrics.jsonl.
      collector: what calibration observes until `calibrate_at`; None once calibrated.
      calibrate_at: the step after which the run calibrates, or None.
      main_process: this process writes the run directory.
      consecutive_bad: non-finite steps in a row so far.
    """

    run: RunState
    given: TrainConfig
    batch_of: data_lib.BatchMaker
    train_step: jax.stages.Wrapped
    eval_step: jax.stages.Wrapped
    shardings: tuple[dict, dict, dict]
    wire: WireBytes
    log: MetricsLog
    collector: tj.calibration.Collector | None
    calibrate_at: int | None
    main_process: bool
    consecutive_bad: int = 0


def resolve_link_choices(
    cfg: TrainConfig, model_config: models.ModelConfig, mesh: jax.sharding.Mesh, args: tuple, out: Path | None
) -> TrainConfig:
    """`cfg` with taco_policy="auto" and tp_overlap="auto" resolved (train/link_policy.py):
    on GPUs by the link probe and by timings of the step's gradients, elsewhere to
    compressing every message without overlap.

    Args:
      args: (params, a global batch, error-feedback residuals) as the gradients take them.
      out: the run directory for the probes' files (None: a process that writes none).
    """
    grads_of = lambda variant: make_grads_fn(variant, model_config, mesh)
    always = cfg.with_keys(taco_policy="always")
    log = lambda line: print(line, file=sys.stderr)
    messages = lambda: link_policy.tp_messages(grads_of(always), args)
    cfg = link_policy.choose(cfg, taco_config(always).mode, mesh, messages, out, log=log)
    seconds = lambda setting: link_policy.step_seconds(grads_of(cfg.with_keys(tp_overlap=setting)), args)
    return link_policy.choose_overlap(cfg, seconds, out, log=log)


def setup_train_loop(cfg: TrainConfig, *, resume: bool = False, force: bool = False) -> TrainLoop:
    """Start (or restore) the run, resolve taco_policy, compile its steps and count what
    one step sends (`resume`, `force` as `train`'s).

    Raises:
      ValueError: as `train`.
    """
    run = start_run(cfg, resume, force=force)
    try:
        return _loop_of(run, cfg, resume)
    except BaseException:
        run.close()
        raise


def _loop_of(run: RunState, cfg: TrainConfig, resume: bool) -> TrainLoop:
    """`setup_train_loop`'s work once the run has started."""
    main_process = jax.process_index() == 0
    batch_of = data_lib.batch_maker(run.cfg, run.mesh)
    first_batch = batch_of(run.corpus.train, 0, run.cfg.batch_size)
    args = (run.params, first_batch, run.feedback)
    run.cfg = resolve_link_choices(run.cfg, run.model_config, run.mesh, args, run.out if main_process else None)
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
    wire = wire_bytes_per_step(train_step, (run.params, run.opt_state, run.feedback), first_batch)
    return TrainLoop(
        run=run,
        given=cfg,
        batch_of=batch_of,
        train_step=train_step,
        eval_step=eval_step,
        shardings=shardings,
        wire=wire,
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
        "wire_bytes": loop.wire.sent[TENSOR_AXIS],
        "wire_bytes_bf16": loop.wire.bf16[TENSOR_AXIS],
        "wire_bytes_by_axis": loop.wire.sent,
        "wire_bytes_bf16_by_axis": loop.wire.bf16,
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
            row["sample"] = sample_text(run)
            if loop.main_process:
                line = f"sample at step {run.step}: {row['sample']!r}"
                (bar.write if bar is not None else lambda m: print(m, file=sys.stderr))(line)
    loop.log.write(row)
    return row


def _calibrate(loop: TrainLoop, bar) -> None:
    """Decide the calibration from what the collector observed, recompile the steps and
    count what the new step sends (the calibration may give sites fewer bits)."""
    run = loop.run
    assert loop.collector is not None
    run.calibration = calibrate_run(run.cfg, loop.collector, run.out if loop.main_process else None, bar)
    run.calibrated, loop.collector = True, None
    loop.train_step, loop.eval_step = make_step_functions(
        run.cfg, run.model_config, run.mesh, run.tx, loop.shardings, run.calibration
    )
    tokens = loop.batch_of(run.corpus.train, run.step, run.cfg.batch_size)
    loop.wire = wire_bytes_per_step(loop.train_step, (run.params, run.opt_state, run.feedback), tokens)


def evaluate(loop: TrainLoop) -> float:
    """Mean validation loss over fixed batches: positions no training step uses."""
    run = loop.run
    losses = [
        _scalar(loop.eval_step(run.params, loop.batch_of(run.corpus.val, 10**9 + i, run.cfg.batch_size)))
        for i in range(run.cfg.eval_batches)
    ]
    return float(np.mean(losses))


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
    run.checkpoints.save(
        run.step, checkpoint_state(run.params, run.opt_state, run.feedback), run.checkpoint_meta(loop.given)
    )


def train_loop(loop: TrainLoop, stop: StopFlag, bar=None) -> None:
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


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, force: bool = False) -> dict:
    """Run (or resume) training as configured: `setup_train_loop`, then `train_loop`
    under SIGTERM/SIGINT handlers that stop it at a step every process agrees on (and
    checkpoint there), then the summary and the loss plot.

    Args:
      cfg: the configuration.
      resume: continue from the latest checkpoint in `cfg.out`, with the calibration
        it holds.
      progress: show a progress bar.
      force: with `resume`, continue although `calibration_file` changed since the run
        started or cannot be read (the checkpoint's calibration is used either way).

    Returns:
      Summary dict (also written to `summary.json` in the run directory).

    Raises:
      ValueError: bad mesh or config, data that does not fit the model, a run directory
        that already holds checkpoints (without `resume`), no or a corrupt checkpoint
        (with `resume`), a calibration_file that does not fit the preset, or one changed
        or gone since the run started (with `resume`, without `force`).
      TrainingError: `max_bad_steps` consecutive non-finite steps.
    """
    loop = setup_train_loop(cfg, resume=resume, force=force)
    try:
        return _train_and_summarize(loop, progress)
    finally:
        loop.run.close()


def _train_and_summarize(loop: TrainLoop, progress: bool) -> dict:
    """`train`'s work once its loop is set up."""
    run = loop.run
    stop = StopFlag()
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
    rows = loop.log.rows() if loop.main_process else []
    result = summary(run, rows, loop.wire, stop.signal_name, time.time() - started)
    if loop.main_process:
        strict_json.write(run.out / "summary.json", result, indent=1)
        if rows:
            title = f"{run.cfg.model}, mesh {tuple(run.cfg.mesh)}, taco={run.cfg.compression.tensor.preset}"
            plot_losses(rows, run.out / "loss.png", title)
    return result
