"""r1jax.serve: an OpenAI-compatible server over continuous batching (python -m r1jax.serve)."""
