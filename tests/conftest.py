"""Test setup: 8 fake CPU devices and exact fp32 matmuls, before JAX initialises its backend."""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
jax.config.update("jax_default_matmul_precision", "highest")
