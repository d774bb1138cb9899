"""python -m r1jax.train --config FILE [--run-dir DIR] [section.key=value ...]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.train",
                                 description="Train a DeepSeek-V3/R1 model (resumes from DIR's latest checkpoint).")
    ap.add_argument("--config", required=True, help="YAML config (see configs/)")
    ap.add_argument("--run-dir", default=None, help="output directory (default: runs/<config name>)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    args = ap.parse_args(argv)

    from r1jax import config as configlib
    from r1jax.parallel import distributed
    try:
        cfg = configlib.load(args.config, args.overrides)
        distributed.initialize(cfg.distributed.init_timeout_s)   # before anything starts the JAX backend
    except configlib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)

    if cfg.loss.objective is configlib.ObjectiveKind.grpo:
        from r1jax.rl.grpo import train          # the RL loop: rollouts feed the same train step
    else:
        from r1jax.train.trainer import train
    try:
        final = train(cfg, run_dir)
    except configlib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if "loss" in final:          # not on processes other than 0, nor when no step ran
        msg = f"final loss {final['loss']:.4f}"
        if "eval_loss" in final:
            msg += f" (eval {final['eval_loss']:.4f}, perplexity {final['eval_perplexity']:.2f})"
        if "eval_reward_mean" in final:
            msg += f" (eval reward_mean {final['eval_reward_mean']:.4f})"
        plot = "rewards.png" if cfg.loss.objective is configlib.ObjectiveKind.grpo else "loss.png"
        print(f"{msg}\nlogs: {run_dir}/metrics.jsonl, {run_dir}/tensorboard/ "
              f"(tensorboard --logdir {run_dir}/tensorboard), {run_dir}/{plot}\n"
              f"checkpoints: {run_dir}/checkpoints/")
    return 0


if __name__ == "__main__":
    from r1jax.train.loop import catch_stop_signals_early
    catch_stop_signals_early()       # a SIGUSR1 during start-up must not kill the job (SLURM requeue)
    sys.exit(main())
