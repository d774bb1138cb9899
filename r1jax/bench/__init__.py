"""`python -m r1jax.bench`: the training step timed, with MFU and memory, optionally side by side
with transformers' PyTorch DeepseekV3ForCausalLM on the same weights and batches."""
