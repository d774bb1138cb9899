"""GRPO against TRL's GRPOTrainer: the same steps on the same weights, side by side.

    python bench/grpo_trl.py [--steps 20] [--rounds 2] [--new-tokens 64] [--sft-steps 150]

Needs TRL next to the test extra: `pip install -e '.[test,trl]'`.

Both sides start from one HF directory this script writes, with one tokenizer (r1jax's own, as
its GRPO trains it) and one prompt stream (r1jax's reverse-task prompts for train.seed 0 in R1's
chat format, handed to TRL as plain text in the same order, unshuffled), G=8 completions of 2
prompts a step, temperature 1, the same partial-credit reward (r1jax/data/tasks.py, scored on the
completion decoded the same way), beta 0 (no reference) and one update per rollout, token-level
averaging, clip 0.2, AdamW (b2 0.95, no weight decay, clip 1.0) on a cosine to 0, fp32, 2 threads
(torch) against XLA's CPU client on the same 2 cores. r1jax's side is bench/configs/grpo_trl.yaml
run by `python -m r1jax.train`.

Two models of configs/tiny.yaml's shape (no MTP):
- `random`: freshly initialised. It almost never samples EOS, so every completion runs the full
  --new-tokens on both sides: the step-time comparison. Its reward is 0 (no answer block).
- `sft`: the same shape after --sft-steps of configs/r1_sft.yaml (cold-start SFT on the task),
  whose completions end with EOS and earn partial reward: the reward-curve comparison.

The sides run in fresh processes, alternating (r1jax, TRL, r1jax, TRL, ...) for --rounds rounds,
so load drifts evenly; each step's rollout and update are timed (r1jax: the loop's rollout_s and
update_s; TRL: its generate-and-score call, and the rest of the optimizer step). The first step
(compilation on r1jax's side, warm-up on TRL's) is reported apart; step times are medians over
the later steps of every round. /proc/pressure/cpu is read before and after: another busy
process slows torch at 2 threads 10-30x and XLA 1.2-2.5x, which fakes a win.
Writes bench/results/grpo_trl.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CONFIG = ROOT / "bench" / "configs" / "grpo_trl.yaml"
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.moe_intermediate_size=32",
        "model.num_hidden_layers=3", "model.num_nextn_predict_layers=0"]     # configs/tiny.yaml's shape
THREADS = 2


# ---------------------------------------------------------------- setup (a JAX process)
def prepare(work: Path, steps: int, rounds: int, sft_steps: int) -> None:
    """work/sft (an SFT run of the tiny shape), work/sft_hf and work/random_hf (HF directories with
    its tokenizer.json), work/prompts.jsonl (the r1jax prompt stream, rendered)."""
    py = sys.executable
    run = lambda *a: subprocess.run([py, *a], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run("-m", "r1jax.train", "--config", "configs/r1_sft.yaml", "--run-dir", str(work / "sft"), *TINY,
        f"train.steps={sft_steps}", "train.eval_every=0", "train.stop_at_eval_loss=0", f"checkpoint.every={sft_steps}")
    run("-m", "r1jax.convert", "orbax-to-hf", str(work / "sft" / "checkpoints"), str(work / "sft_hf"))
    run(__file__, "--side", "prepare", "--work", str(work), "--steps", str(steps * rounds))


def _prepare_side(work: Path, n_steps: int) -> None:
    from r1jax import config as configlib
    from r1jax import weights
    from r1jax.convert import hf
    from r1jax.data import chat
    from r1jax.data import tokenizer as toklib
    from r1jax.rl.grpo import Prompts, step_examples

    shutil.copy(work / "sft" / "tokenizer.json", work / "sft_hf" / "tokenizer.json")
    cfg = configlib.load(str(CONFIG), [f"model.hf_config={work / 'sft_hf'}"])
    hf.save(weights.create(cfg.model, seed=0), cfg.model, work / "random_hf")
    shutil.copy(work / "sft" / "tokenizer.json", work / "random_hf" / "tokenizer.json")
    tok = toklib.load(work / "sft_hf" / "tokenizer.json")
    template = chat.for_directory(work / "sft_hf")
    prompts = Prompts("reverse", tok, template)
    P = cfg.train.global_batch_size // cfg.grpo.group_size
    with open(work / "prompts.jsonl", "w") as f:
        for step in range(n_steps):     # as grpo.Rollouts draws them for train.seed 0
            examples = step_examples(cfg, step, 0, P)
            for ex, ids in zip(examples, prompts.encode(examples)):
                f.write(json.dumps({"prompt": template.render([{"role": "user", "content": ex["prompt"]}]),
                                    "ids": ids, "example": json.dumps(ex)}) + "\n")
    (work / "eos.txt").write_text(tok.id_to_token(toklib.eos_id(tok)))


# ---------------------------------------------------------------- r1jax side
def run_r1jax(work: Path, model: str, steps: int, new_tokens: int, lr: float, out: Path) -> dict:
    src = work / f"{model}_hf"
    longest = max(len(json.loads(l)["ids"]) for l in open(work / "prompts.jsonl"))
    seq_len = -(-(longest + new_tokens) // 8) * 8      # rows as long as TRL's, not a padded 128
    cmd = [sys.executable, "-m", "r1jax.train", "--config", str(CONFIG), "--run-dir", str(out),
           f"model.hf_config={src}", f"model.init_from=hf:{src}", f"train.steps={steps}",
           f"grpo.max_new_tokens={new_tokens}", f"optim.lr={lr}", f"data.seq_len={seq_len}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    wall = time.perf_counter() - t0
    rec = [json.loads(l) for l in open(out / "metrics.jsonl")]
    rec = [r for r in rec if r.get("split", "train") == "train" and "rollout_s" in r]
    # step: the loop's wall time per step (log_every 1), all but the first; that one compiles and
    # has no step_time, so its rollout and update stand for it
    return {"wall_s": wall, "steps": [{"rollout": r["rollout_s"], "update": r["update_s"],
                                       "step": r.get("step_time", r["rollout_s"] + r["update_s"]),
                                       "reward": r["reward_mean"], "length": r["completion_len"]} for r in rec]}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------- TRL side (a torch process)
def _trl_side(work: Path, model: str, steps: int, new_tokens: int, lr: float, out: Path) -> None:
    import torch
    torch.set_num_threads(THREADS)
    torch.set_num_interop_threads(1)
    import datasets
    import tokenizers
    from transformers import DeepseekV3ForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from r1jax.data import tasks
    from r1jax.rl import rewards as rewardlib

    src = work / f"{model}_hf"
    eos = (work / "eos.txt").read_text()
    raw = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), eos_token=eos, pad_token=eos)
    tok.padding_side = "left"
    rows = [json.loads(l) for l in open(work / "prompts.jsonl")]
    for r in rows[:4]:       # the same prompt ids on both sides
        got = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        assert got == r["ids"], (r["prompt"], got, r["ids"])
    data = datasets.Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "example": [r["example"] for r in rows]})
    combined = rewardlib.combine({"task_partial": 1.0}, {**rewardlib.REWARDS, **tasks.TASK_REWARDS})

    def reward(prompts, completions, completion_ids, example, **kw) -> list[float]:
        out = []
        for ids, ex in zip(completion_ids, example):      # decoded as r1jax's Rollouts decode
            text = raw.decode(list(ids), skip_special_tokens=False)
            text = text[:-len(eos)] if text.endswith(eos) else text
            out.append(combined.total(combined.scores(text, json.loads(ex))))
        return out

    P, G = 2, 8
    cfg = GRPOConfig(output_dir=str(out), num_generations=G, per_device_train_batch_size=P * G,
                     gradient_accumulation_steps=1, max_completion_length=new_tokens, temperature=1.0,
                     learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
                     adam_beta2=0.95, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
                     scale_rewards="group", shuffle_dataset=False, max_steps=steps, logging_steps=1,
                     save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False,
                     dataloader_num_workers=0, seed=0, disable_tqdm=True)
    policy = DeepseekV3ForCausalLM.from_pretrained(src, dtype=torch.float32)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok)
    cur: dict[str, float] = {}
    timed_steps: list[dict] = []
    fn = trainer._generate_and_score_completions

    def rollout(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            cur["rollout"] = cur.get("rollout", 0.0) + time.perf_counter() - t0
    trainer._generate_and_score_completions = rollout

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            cur.clear()
            cur["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step = time.perf_counter() - cur.pop("t0")
            timed_steps.append({"step": step, "rollout": cur.get("rollout", 0.0),
                                "update": step - cur.get("rollout", 0.0)})
    trainer.add_callback(Clock())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for s, h in zip(timed_steps, logs):
        s["reward"] = h["reward"]
        s["length"] = h.get("completions/mean_length", float("nan"))
    (out / "steps.json").write_text(json.dumps(timed_steps))


def run_trl(work: Path, model: str, steps: int, new_tokens: int, lr: float, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--side", "trl", "--work", str(work), "--model", model, "--steps", str(steps),
           "--new-tokens", str(new_tokens), "--lr", str(lr), "--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    return {"wall_s": time.perf_counter() - t0, "steps": json.loads((out / "steps.json").read_text())}


# ---------------------------------------------------------------- report
def summary(runs: list[dict]) -> dict:
    later = [s for r in runs for s in r["steps"][1:]]
    med = {k: statistics.median(s[k] for s in later) for k in ("step", "rollout", "update")}
    first = statistics.median(r["steps"][0]["step"] for r in runs)
    return {**{f"{k}_s": v for k, v in med.items()}, "first_step_s": first,
            "first_minus_median_s": first - med["step"],
            "length": statistics.mean(s["length"] for s in later),
            "rewards": [[round(s["reward"], 4) for s in r["steps"]] for r in runs]}


def report(meta: dict, res: dict) -> str:
    lines = ["# GRPO: r1jax against TRL's GRPOTrainer", "",
             f"`{meta['command']}` ({meta['date']}; {meta['machine']}; {meta['pressure']}; {meta['versions']})", "",
             f"configs/tiny.yaml's shape without MTP, {meta['G']} completions x 2 prompts a step, up to "
             f"{meta['new_tokens']} new tokens, beta 0, one update per rollout, fp32, 2 threads; medians over steps "
             f"2..{meta['steps']} of {meta['rounds']} alternating rounds.", "",
             "| model | side | step | rollout | update | first step - median (compile, warm-up) | new tokens (mean) | r1jax faster |",
             "|---|---|---|---|---|---|---|---|"]
    for model, sides in res.items():
        r, t = sides["r1jax"], sides["trl"]
        for name, s in (("r1jax", r), ("TRL", t)):
            ratio = f"**{t['step_s'] / r['step_s']:.2f}x** (rollout {t['rollout_s'] / r['rollout_s']:.2f}x, update " \
                    f"{t['update_s'] / r['update_s']:.2f}x)" if name == "r1jax" else ""
            lines.append(f"| {model} | {name} | {1000 * s['step_s']:.0f} ms | {1000 * s['rollout_s']:.0f} ms | "
                         f"{1000 * s['update_s']:.0f} ms | {s['first_minus_median_s']:.1f} s | {s['length']:.1f} | {ratio} |")
    lines += ["", "Reward (sampled, mean over the step's completions) by step, each round:", ""]
    for model, sides in res.items():
        for name in ("r1jax", "trl"):
            for i, rw in enumerate(sides[name]["rewards"]):
                k = max(1, len(rw) // 4)
                lines.append(f"- {model}, {name}, round {i + 1}: first {k} steps {statistics.mean(rw[:k]):.3f}, "
                             f"last {k} {statistics.mean(rw[-k:]):.3f}: {rw}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--side", choices=("prepare", "trl"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side == "prepare":
        _prepare_side(Path(a.work), a.steps)
        return 0
    if a.side == "trl":
        _trl_side(Path(a.work), a.model, a.steps, a.new_tokens, a.lr, Path(a.out))
        return 0

    from r1jax.bench import machine_line
    from r1jax.bench.generation import cpu_pressure
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    before = cpu_pressure()
    t0 = time.perf_counter()
    if not (work / "prompts.jsonl").is_file():
        prepare(work, a.steps, a.rounds, a.sft_steps)
    print(f"prepared {work} in {time.perf_counter() - t0:.0f} s", flush=True)
    res = {}
    for model in ("random", "sft"):
        runs = {"r1jax": [], "trl": []}
        for i in range(a.rounds):
            for side, fn in (("r1jax", run_r1jax), ("trl", run_trl)):
                out = work / "runs" / f"{model}_{side}_{i}"
                shutil.rmtree(out, ignore_errors=True)
                runs[side].append(fn(work, model, a.steps, a.new_tokens, a.lr, out))
                s = runs[side][-1]["steps"]
                print(f"{model} {side} round {i + 1}: median step {statistics.median(x['step'] for x in s[1:]):.3f} s, "
                      f"first {s[0]['step']:.1f} s, wall {runs[side][-1]['wall_s']:.0f} s", flush=True)
        res[model] = {side: summary(r) for side, r in runs.items()}
    after = cpu_pressure()
    busy = max(x or 0 for x in (before, after)) > 5
    import torch
    import trl
    meta = {"command": "python bench/grpo_trl.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.date.today().isoformat(), "machine": machine_line(),
            "pressure": f"CPU pressure avg10 {before} -> {after}%" + (": machine busy, times are rough" if busy else ""),
            "versions": f"torch {torch.__version__}, trl {trl.__version__}", "G": 8, "steps": a.steps,
            "rounds": a.rounds, "new_tokens": a.new_tokens}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpo_trl.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2))
    md = report(meta, res)
    (RESULTS / "grpo_trl.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
