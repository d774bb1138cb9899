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

# The files below compare r1jax with r1jax (meshes, resumes, processes, schedules, decoding
# paths, memory) and are almost all XLA:CPU compiles: they compile with XLA's backend at -O0
# (jax_disable_most_optimizations, which subprocesses read from the environment). That halves
# the compiles (tiny.yaml's first train step, circular pipeline: 45 s -> 30 s; data 8: 31 s ->
# 14 s) and gives the same losses. Files that compare against transformers, torch or a bound set
# from a measurement compile as users compile: -O0 rounds differently (one decode parity config
# went 5.1e-6 -> 1.05e-5 against the 1e-5).
import pytest  # noqa: E402

BACKEND_O0 = {"test_mesh.py", "test_step.py", "test_train.py", "test_multiprocess.py", "test_slurm.py",
              "test_attention.py", "test_plan.py", "test_bench_memory.py", "test_bench_tables.py"}


@pytest.fixture(autouse=True, scope="module")
def _backend_optimisation(request):
    o0 = os.path.basename(request.module.__file__) in BACKEND_O0
    jax.config.update("jax_disable_most_optimizations", o0)
    if o0:
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    else:
        os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
