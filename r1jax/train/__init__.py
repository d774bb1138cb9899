"""Training: losses, optimizer, the pure train step, the loop, checkpoints and metrics."""
