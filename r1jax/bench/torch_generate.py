"""The reference side of `--mode generate`: transformers' `generate` on the HF export, greedy,
EOS ignored, timed in its own pinned process (r1jax/bench/generation.py runs it)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from r1jax.bench.generation import prompts


def run(spec: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32,
                                                 experts_implementation=spec["experts"]).eval()
    model.generation_config.eos_token_id = None
    x = torch.as_tensor(prompts(model.config.vocab_size, spec["B"], spec["prompt_len"], spec["seed"]), dtype=torch.long)

    class FirstToken:
        """generate's streamer: its second put() is the first new token (the first is the prompt)."""
        def __init__(self):
            self.puts, self.t = 0, None

        def put(self, value):
            self.puts += 1
            if self.puts == 2:
                self.t = time.perf_counter()

        def end(self):
            pass

    def gen(n):
        first = FirstToken()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, streamer=first)
        return first.t - t, time.perf_counter() - t, out

    gen(2)
    runs = []                       # (t1, tN) of one run each, as r1jax's side measures
    for _ in range(spec["repeats"]):
        t1, tN, out = gen(spec["new_tokens"])
        runs.append((t1, tN))
    t1, tN = min(runs, key=lambda r: r[1] - r[0])
    return {"t1": t1, "tN": tN, "tokens": out[:, x.shape[1]:].tolist(),
            "experts": getattr(model.config, "_experts_implementation", spec["experts"]),
            "attn": model.config._attn_implementation, "torch": torch.__version__,
            "transformers": transformers.__version__}



if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    job.pop("role")
    Path(sys.argv[2]).write_text(json.dumps(run(job)))
