"""The trainer's preset configurations (YAML), shipped as package data."""
