"""r1jax: DeepSeek-V3/R1 training in JAX/Flax NNX."""
__version__ = "0.1.0"
