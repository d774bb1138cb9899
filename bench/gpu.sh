#!/usr/bin/env bash
# The GPU benchmark, one command on a CUDA machine (one H100/H200/A100 is enough):
#     bash bench/gpu.sh            # results under bench/results/gpu/, summary on stdout
# Installs r1jax with jax[cuda12] into .venv-gpu, then times the bf16 train step of a dense
# ~1.1B model (bench/configs/dense_1b.yaml) and a small MoE (bench/configs/moe_gpu.yaml, with
# the ragged grouped-GEMM and the fixed-capacity expert paths), printing tokens/s, MFU over the
# device's datasheet bf16 peak and XLA's memory analysis. A config that fails (out of memory, say)
# is reported and the script goes on to the next. Target: MFU >= 45% on the dense config. Then
# generation on the MoE config in bf16 (decode tokens/s at batch 1 and 64, weights unquantised,
# int8 and fp8), and last serving: the load test at 64 clients against python -m r1jax.serve on
# the demo model's shapes (fresh weights), batching on and off (--max-batch-size 1).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
STEPS=${STEPS:-20}
mkdir -p "$OUT"

if [ ! -x .venv-gpu/bin/python ]; then
    python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -q -e '.[cuda]' httpx || { echo "install failed"; exit 1; }
fi
PY=.venv-gpu/bin/python
$PY -c "import jax; d = jax.devices()[0]; assert d.platform == 'gpu', d; print(jax.__version__, d.device_kind, len(jax.devices()), 'devices')" \
    || { echo "no CUDA device visible to jax"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

# latency-hiding scheduler and command buffers as JAX's GPU performance guide recommends
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}

status=0
run() {   # name, then r1jax.bench arguments
    local name=$1; shift
    echo "=== $name"
    if ! $PY -m r1jax.bench --steps "$STEPS" --warmup 3 --out "$OUT/$name" "$@"; then
        echo "=== $name FAILED"; status=1
    fi
}
run dense_1b --config bench/configs/dense_1b.yaml --dtypes bf16
run dense_1b_remat_none --config bench/configs/dense_1b.yaml --dtypes bf16 train.remat=none
run moe_gpu_ragged --config bench/configs/moe_gpu.yaml --dtypes bf16 kernels.moe_dispatch=ragged
run moe_gpu_capacity --config bench/configs/moe_gpu.yaml --dtypes bf16 kernels.moe_dispatch=capacity
# generation: bf16 compute and cache, tokens/s at batch 1 and 64 (r1jax alone: no CUDA torch here;
# one round of 3 repeats: a process per variant and batch, each compiling, on a quiet device)
run generate_moe_gpu --config bench/configs/moe_gpu.yaml --mode generate --batch-sizes 1,64 --prompt-len 128 \
    --new-tokens 128 --rounds 1 --repeats 3 --moe-decode dropless --quantize none,int8,fp8 infer.dtype=bf16 infer.cache_dtype=bf16

# serving (bench/serve_load.py needs httpx, installed above)
echo "=== serve_demo"
if $PY - "$OUT/demo_hf" <<'PYEOF'
import sys
from pathlib import Path
from r1jax import config, weights
from r1jax.convert import hf
from r1jax.data import tokenizer
d = Path(sys.argv[1])
m = config.load("configs/demo.yaml", ["mesh.data=1"]).model
hf.save(weights.create(m, seed=1), m, d)
tokenizer.train(["def f(x):\n    return x + 1\n"] * 200, m.vocab_size).save(str(d / "tokenizer.json"))
PYEOF
then
    $PY bench/serve_load.py --serve-model "hf:$OUT/demo_hf" --serve-args "--set infer.dtype=bf16" --compare-batching \
        --clients 64 --requests 2048 --prompt-ids-len 32 --max-tokens 32 --warmup 64 --out "$OUT/serve_demo" \
        --label "r1jax serve, GPU" || { echo "=== serve_demo FAILED"; status=1; }
else
    echo "=== serve_demo FAILED (writing the model)"; status=1
fi

echo; echo "=== summary ($(date -u +%FT%TZ))"
for f in "$OUT"/*.md; do [ -f "$f" ] && { echo "--- $f"; grep -E '^\| (r1jax|[0-9]+ \| [0-9]+ \| r1jax)' "$f"; }; done
exit $status
