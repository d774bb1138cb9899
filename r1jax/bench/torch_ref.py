"""The reference's side of the bench, run in its own process:

    python -m r1jax.bench.torch_ref SPEC.json RESULT.json

transformers' `DeepseekV3ForCausalLM` loaded from the HF checkpoint r1jax exported (so the same
initial weights), trained on the same token array with `torch.optim.AdamW` replaying r1jax's
per-step learning rates, betas, eps and weight decay (none on norms and biases, as r1jax's
decay mask), and global-norm clipping. bf16 runs under `torch.autocast` with fp32 weights, the
counterpart of r1jax's fp32 masters with bf16 compute. The model keeps transformers' default
attention and experts implementations (printed in the result)."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    import numpy as np
    import torch
    import transformers
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).train()
    tokens = np.load(spec["tokens"])
    o = spec["optim"]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n or n.endswith("bias")]
    decay = [p for n, p in model.named_parameters() if not ("norm" in n or n.endswith("bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec["lrs"][0], betas=(o["b1"], o["b2"]), eps=o["eps"])
    autocast = spec["dtype"] == "bf16"
    from r1jax.bench import peak_rss_bytes
    rss_loaded = peak_rss_bytes()

    losses, times = [], []
    for i in range(len(tokens)):
        x = torch.as_tensor(tokens[i], dtype=torch.long)
        s = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = spec["lrs"][i]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if o["clip_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_norm"])
        opt.step()
        value = float(loss.item())
        times.append(time.perf_counter() - s)
        losses.append(value)
    timed = times[spec["warmup"]:]
    a = torch.ones(1024, 1024)
    a @ a
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        a @ a
        n += 1
    result = {"matmul_flops": 2 * 1024**3 * n / (time.perf_counter() - t0), "framework": "torch", "first_step_s": times[0], "step_s": timed,
              "step_s_median": statistics.median(timed), "step_s_min": min(timed), "losses": losses,
              "peak_rss_bytes": peak_rss_bytes(),
              "rss_after_load_bytes": rss_loaded, "threads": torch.get_num_threads(),
              "attn_implementation": model.config._attn_implementation,
              "experts_implementation": getattr(model.config, "_experts_implementation", None),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "pid_cpus": sorted(os.sched_getaffinity(0))}
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
