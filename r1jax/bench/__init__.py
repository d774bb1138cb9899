"""`python -m r1jax.bench`: the training step timed, with MFU and memory, optionally side by side
with transformers' PyTorch DeepseekV3ForCausalLM on the same weights and batches."""


def peak_rss_bytes() -> int:
    """This process's peak resident set so far: /proc's VmHWM (KiB). Not getrusage's ru_maxrss,
    which on Linux also holds the forking parent's resident size at exec."""
    import resource
    try:
        with open("/proc/self/status") as f:
            return 1024 * int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def machine_line() -> str:
    """What the bench tables say of the machine: cores, architecture, jax, and the load average
    when the measurement ended (these machines are shared)."""
    import os
    import platform

    import jax
    return (f"{os.cpu_count()} CPU cores ({platform.machine()}), jax {jax.__version__}, "
            f"load average {os.getloadavg()[0]:.1f} at the end")
