"""Test setup: 8 fake CPU devices and exact fp32 matmuls, before JAX initialises its backend."""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
jax.config.update("jax_default_matmul_precision", "highest")

# One compilation cache for the session (and the subprocesses its tests start): many tests build
# the same tiny model and step, and XLA:CPU spends seconds on each compile.
import tempfile  # noqa: E402

_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="r1jax-jit-cache-"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
