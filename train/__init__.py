"""3-D parallel trainer (`python -m taco_jax.train`): configuration, data, GPipe schedule,
checkpoints, link policy and the training loop."""
