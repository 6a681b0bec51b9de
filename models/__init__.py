"""Flax GPT-2 and Qwen2 models with tensor-parallel layers (not yet available)."""
