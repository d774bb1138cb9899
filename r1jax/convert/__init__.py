"""Weights between Hugging Face DeepseekV3 safetensors and r1jax (models and Orbax checkpoints)."""
