"""A run's setup and the state it starts from: checked against its model and data, fresh
or restored from the newest checkpoint that restores (checked against the configuration
it was saved with), and a run's parameters for generation."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax
import optax

import taco_jax as tj
from taco_jax import models
from taco_jax.calibration import Calibration

from . import data as data_lib
from . import run_dir
from .calibrate import calibration_digest, file_calibration, load_calibration
from .checkpoint import Checkpointer
from .compression import feedback_layout, init_error_feedback
from .config import RESUMABLE_KEYS, TrainConfig, changed_keys, to_dict
from .optimizer import abstract_opt_state, init_state, make_optimizer


def check_setup(cfg: TrainConfig, model_config: models.ModelConfig, corpus: data_lib.TokenData) -> None:
    """Refuse a run its model and data cannot make before anything is built.

    Raises:
      ValueError: naming the problem: a mesh the model does not split over, a sequence
        beyond the model's positions or not divisible for sequence parallelism, token ids
        beyond the vocabulary, a split shorter than a batch, or samples beyond the
        positions.
    """
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


def device_mesh(cfg: TrainConfig):
    """The run's device mesh: cfg.mesh, or one device when the mesh is simulated."""
    return tj.make_mesh(1, 1, 1, devices=jax.devices()[:1]) if cfg.simulate_mesh else tj.make_mesh(*cfg.mesh)


@dataclasses.dataclass
class RunState:
    """A run's setup and the state it starts from (fresh or restored).

    `calibration_file_digest` fingerprints the calibration_file the run started with
    (`calibration_digest`); checkpoints keep it, and a resume checks the file against it.
    """

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
    calibration_file_digest: str | None = None
    lock: run_dir.RunLock | None = None

    def checkpoint_meta(self, given: TrainConfig) -> dict:
        """What a checkpoint at the current step records beside the arrays, for a resume
        to check (`resumed_config`, `check_calibration_file`); `given`: the configuration
        as the user gave it."""
        return {
            "step": self.step,
            "data_position": self.step,
            "skipped_steps": self.bad_total,
            "model": self.cfg.model,
            "seed": self.cfg.seed,
            "calibrated": self.calibrated,
            "calibration": self.calibration.to_json(),
            "calibration_file_digest": self.calibration_file_digest,
            "error_feedback": bool(self.feedback),
            "config": to_dict(given),
            "schedule_steps": self.cfg.decay_steps or self.cfg.steps,
        }

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


def start_run(cfg: TrainConfig, resume: bool, *, force: bool = False) -> RunState:
    """Set up a run and its initial state: fresh, or restored from the newest checkpoint
    that restores (an unreadable newer one is skipped with a line saying so). A resumed
    run keeps the calibration its checkpoint holds.

    Args:
      cfg: the configuration.
      resume: restore the newest checkpoint in `cfg.out`.
      force: with `resume`, continue with the checkpoint's calibration although
        `calibration_file` changed since the run started or cannot be read.

    Raises:
      ValueError: bad setup, no restorable checkpoint or a changed configuration with
        `resume`, a changed or unreadable `calibration_file` with `resume` (without
        `force`), checkpoints already present without it, or an unreadable
        `calibration_file` or one that does not fit the preset (before the run
        directory is made).
    """
    mesh = device_mesh(cfg)
    model_config = models.preset(cfg.model)
    corpus = data_lib.load(cfg.data, val_fraction=cfg.val_fraction, tokenizer=cfg.tokenizer, dtype=cfg.data_dtype)
    check_setup(cfg, model_config, corpus)
    given = file_calibration(cfg) if cfg.calibration_file and not resume else None
    out, lock = run_dir.prepare(cfg.out, lock=jax.process_index() == 0)
    checkpoints = Checkpointer(out / "checkpoints", cfg.keep_checkpoints)
    try:
        run = _initial_run(cfg, mesh, model_config, corpus, out, checkpoints, resume, force)
        if given is not None:
            run.calibration, run.calibrated, run.calibration_file_digest = given, True, calibration_digest(given)
    except BaseException:
        checkpoints.close()
        if lock is not None:
            lock.release()
        raise
    run.lock = lock
    return run


def _initial_run(cfg, mesh, model_config, corpus, out, checkpoints, resume: bool, force: bool) -> RunState:
    """The run fresh, or restored from `checkpoints` with `resume` (`force` as
    `start_run`'s)."""
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
        run = _restored_run(cfg, mesh, model_config, corpus, out, checkpoints, steps, force)
    return run


def _fresh_run(cfg, mesh, model_config, corpus, out, checkpoints) -> RunState:
    tx, schedule = make_optimizer(cfg, model_config)
    params, opt_state = init_state(model_config, cfg.seed, mesh, tx)
    return RunState(
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


def _restored_run(cfg, mesh, model_config, corpus, out, checkpoints, steps: list[int], force: bool) -> RunState:
    """The run restored from the newest of `steps` that restores."""
    failures = []
    for step in steps:
        try:
            run = _restore(cfg, mesh, model_config, corpus, out, checkpoints, step, force)
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


def _restore(cfg, mesh, model_config, corpus, out, checkpoints, step: int, force: bool) -> RunState:
    try:
        meta = checkpoints.meta(step)
    except ValueError as error:
        raise _Unrestorable from error
    if meta.get("model") != cfg.model:
        raise ValueError(f"checkpoint at step {step} is for model {meta.get('model')!r}, not {cfg.model!r}")
    cfg = resumed_config(cfg, meta, step)
    saved_calibration = Calibration.from_json(meta.get("calibration", {"plans": []}))
    file_digest = meta.get("calibration_file_digest") or calibration_digest(saved_calibration)
    if cfg.calibration_file:
        check_calibration_file(cfg.calibration_file, file_digest, force)
    run = _fresh_run(cfg, mesh, model_config, corpus, out, checkpoints)
    saved_feedback = feedback_layout(cfg, model_config, run.params, mesh) if meta.get("error_feedback") else {}
    try:
        state, meta = checkpoints.restore(step, checkpoint_state(run.params, run.opt_state, saved_feedback))
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
    run.calibration, run.calibrated = saved_calibration, bool(meta.get("calibrated", False))
    run.calibration_file_digest = file_digest if cfg.calibration_file else None
    return run


def check_calibration_file(path: str, started_with: str, force: bool) -> None:
    """Check that the calibration_file at `path` still holds the calibration the run
    started with (`started_with`, its `calibration_digest`): a resumed run keeps its
    checkpoint's calibration, and a file changed or gone since would silently no
    longer describe it.

    Raises:
      ValueError: the file changed or cannot be read (without `force`; with it, a line
        says that the checkpoint's calibration is kept).
    """
    try:
        changed = calibration_digest(load_calibration(path)) != started_with
        problem = f"calibration_file {path} has changed since the run started" if changed else None
    except ValueError as error:
        problem = str(error)
    if problem is None:
        return
    if not force:
        raise ValueError(
            f"--resume: {problem}; the run's calibration is in its checkpoint: restore the file, or pass "
            "--force to resume with the checkpoint's calibration"
        )
    print(f"{problem}; resuming with the checkpoint's calibration (--force)", file=sys.stderr)


def checkpoint_state(params: dict, opt_state, feedback: dict) -> dict:
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
    opt_state = abstract_opt_state(tx, params, mesh)
    meta = checkpoints.meta(step)
    feedback = feedback_layout(cfg, model_config, params, mesh) if meta.get("error_feedback") else {}
    state, _ = checkpoints.restore(step, checkpoint_state(params, opt_state, feedback))
    return state["params"]
