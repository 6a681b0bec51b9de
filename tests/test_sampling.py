"""Generation's arguments and sampling: bad arguments are errors naming them, and the
samples depend on the prompts, the seed and the sampling settings, never on the mesh
(8 CPU devices)."""

import jax
import jax.numpy as jnp
import pytest

import taco_jax as tj
from taco_jax import models


def _mesh(data=1, pipe=1, tensor=1):
    return tj.make_mesh(data, pipe, tensor, devices=jax.devices()[: data * pipe * tensor])


def test_samples_do_not_depend_on_the_mesh():
    """Each prompt's draws are keyed by the seed, the step and the prompt's index: the
    same call samples the same tokens on one device and on data x tensor meshes (every
    data rank drew the same numbers before, so four copies of a prompt at data=4 gave one
    sample), and copies of a prompt get samples of their own."""
    config = models.preset("gpt2-tiny")
    params = models.init_params(config, jax.random.key(0))
    prompts = [[1, 2, 3]] * 4 + [[5, 6, 7, 8, 9]]
    kwargs = dict(max_new_tokens=6, temperature=1.0, top_k=50, seed=3)
    single = models.generate(config, params, prompts, mesh=_mesh(), **kwargs)
    assert len({tuple(s) for s in single[:4]}) == 4
    for mesh in (_mesh(data=4), _mesh(data=2, tensor=2)):
        assert models.generate(config, params, prompts, mesh=mesh, **kwargs) == single


def test_generation_refuses_bad_input():
    config = models.preset("qwen2-tiny")
    params = models.init_params(config, jax.random.key(0))
    cases = [
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, config.vocab_size]]), "outside"),
        (dict(prompts=[[1] * config.max_positions]), "exceeds the model's max_positions"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1]], top_p=0.0), "top_p"),
        (dict(prompts=[[1]], temperature=float("nan")), "temperature must be a finite number"),
        (dict(prompts=[[1]], top_k=2.7), "top_k must be an integer"),
        (dict(prompts=[[1]], seed=2**40), r"seed must be an integer in \[0, 2\*\*32\)"),
        (dict(prompts=[[1]], dtype=jnp.int32), "dtype must be a floating-point dtype"),
        (dict(prompts=[[1, -1]]), "outside"),
        (dict(prompts=[[1]], mesh=_mesh(pipe=2)), "pipe"),
        (dict(prompts=[[1]], mesh=_mesh(tensor=8)), "not divisible by the tensor axis"),
    ]
    for kwargs, message in cases:
        prompts = kwargs.pop("prompts")
        with pytest.raises(ValueError, match=message):
            models.generate(config, params, prompts, **kwargs)
