"""Inference: the MLA latent cache, sampling and batched generation (see generator.py)."""
