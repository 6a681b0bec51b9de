"""3-D parallel trainer: pipeline schedule, data, checkpointing (not yet available)."""
