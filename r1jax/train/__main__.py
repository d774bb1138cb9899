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
        # before anything starts the JAX backend
        distributed.initialize(cfg.distributed.init_timeout_s, cfg.distributed.heartbeat_timeout_s)
    except configlib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or Path("runs") / Path(args.config).stem)

    if cfg.loss.objective is configlib.ObjectiveKind.grpo:
        from r1jax.rl.grpo import train          # the RL loop: rollouts feed the same train step
    else:
        from r1jax.train.trainer import train
    import jax

    from r1jax.checkpoint.manager import CheckpointWriteError
    from r1jax.train.loop import RunFailed
    try:
        final = train(cfg, run_dir)
    except configlib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (RunFailed, CheckpointWriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        distributed.await_peers_verdict()     # a dead peer is named by the heartbeat, which exits
        print(f"error: process {jax.process_index()}: a collective failed with every peer alive: "
              f"{str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    if final.get("already_complete"):
        return 0
    if "loss" in final:          # not on processes other than 0, nor when no step ran
        msg = result_line(final, cfg)
        plot = "rewards.png" if cfg.loss.objective is configlib.ObjectiveKind.grpo else "loss.png"
        print(f"{msg}\nlogs: {run_dir}/metrics.jsonl, {run_dir}/tensorboard/ "
              f"(tensorboard --logdir {run_dir}/tensorboard), {run_dir}/{plot}\n"
              f"checkpoints: {run_dir}/checkpoints/")
    return 0


def result_line(final: dict, cfg) -> str:
    """The run's result, like with like: the train next-token loss (cross-entropy, the last log
    window's mean, `lm_loss`) beside the eval loss (the same cross-entropy on held-out documents).
    The objective the optimizer minimised adds MTP and balance terms; it is named apart."""
    from r1jax.config import ObjectiveKind
    if cfg.loss.objective is ObjectiveKind.grpo or "lm_loss" not in final:
        msg = f"final loss {final['loss']:.4f}"
        if "eval_reward_mean" in final:
            msg += f" (eval reward_mean {final['eval_reward_mean']:.4f})"
        return msg
    msg = f"final next-token loss: train {final['lm_loss']:.4f} (last logged steps)"
    if "eval_loss" in final:
        msg += f", eval {final['eval_loss']:.4f} (held-out, perplexity {final['eval_perplexity']:.2f})"
    if abs(final["loss"] - final["lm_loss"]) > 5e-5:
        terms = ([f"distillation (distill.alpha={cfg.distill.alpha:g})"] if "kd_loss" in final else []) + \
            ([f"{cfg.loss.mtp_loss_weight:g} x MTP"] if final.get("mtp_loss") else []) + \
            ([f"{cfg.loss.seq_aux_loss_alpha:g} x balance"] if final.get("balance_loss") else [])
        msg += f"; objective with {' + '.join(terms) or 'other'} loss: {final['loss']:.4f}"
    return msg


if __name__ == "__main__":
    from r1jax.train.loop import catch_stop_signals_early
    catch_stop_signals_early()       # a SIGUSR1 during start-up must not kill the job (SLURM requeue)
    sys.exit(main())
