"""Drop-ins for trainers people already run; each imports its trainer only when used.

| module | trainer |
|---|---|
| `taco_jax.integrations.maxtext` | MaxText (`pip install 'taco_jax[maxtext]'`, Python >= 3.12) |
"""
