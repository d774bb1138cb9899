"""python -m r1jax.convert {hf-to-orbax,orbax-to-hf,lora-to-peft} SRC DST

hf-to-orbax   an HF DeepseekV3 directory (config.json + safetensors) -> an r1jax checkpoint
              directory (Orbax step 0, item `params`, plus model_config.json)
orbax-to-hf   an r1jax checkpoint directory (a conversion output or a run's checkpoints/) ->
              an HF directory that transformers.AutoModelForCausalLM.from_pretrained loads
              (a LoRA run's adapters merged into the weights), with the run's tokenizer
lora-to-peft  a LoRA run's checkpoints/ -> a PEFT adapter directory (adapter_config.json,
              adapter_model.safetensors) for peft.PeftModel.from_pretrained over the base model

The tokenizer files of SRC (or of the training run around a run's checkpoints/) are copied
beside the weights. DST receives the output only once it is whole: a conversion that fails
leaves DST as it was and says in one line what is wrong.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

DTYPES = {"float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m r1jax.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=["hf-to-orbax", "orbax-to-hf", "lora-to-peft"])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--step", type=int, default=None,
                    help="orbax-to-hf, lora-to-peft: step to convert (default latest)")
    ap.add_argument("--base", default=None,
                    help="lora-to-peft: base_model_name_or_path to record in adapter_config.json")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32",
                    help="orbax-to-hf: dtype of the written weights (router stays float32)")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="orbax-to-hf: safetensors shard size")
    ap.add_argument("--force", action="store_true", help="write into a non-empty DST")
    args = ap.parse_args(argv)

    src, dst = Path(args.src), Path(args.dst)
    if not src.is_dir():
        print(f"error: SRC {src} is not a directory", file=sys.stderr)
        return 2
    if dst.exists() and any(dst.iterdir()) and not args.force:
        print(f"error: DST {dst} exists and is not empty (nothing overwritten; pass --force to write into it)",
              file=sys.stderr)
        return 2

    import logging
    logging.getLogger("absl").setLevel(logging.ERROR)   # orbax's notes on metadata it does without
    from r1jax.config import ConfigError
    from r1jax.convert import hf, output
    from r1jax.convert.safetensors_io import CheckpointError

    t0 = time.time()
    try:
        with output.staged(dst) as out:
            if args.direction == "hf-to-orbax":
                cfg = hf.hf_to_orbax(src, out)
            elif args.direction == "lora-to-peft":
                from r1jax.convert import peft
                cfg, lo, n = peft.export(src, out, step=args.step, base=args.base)
            else:
                import ml_dtypes
                dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else DTYPES[args.dtype]
                cfg = hf.orbax_to_hf(src, out, step=args.step, dtype=dtype,
                                     max_shard_bytes=int(args.max_shard_gb * 2**30))
            tok = [] if args.direction == "lora-to-peft" else output.copy_tokenizer(src, out)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}; nothing was written to {dst}", file=sys.stderr)
        return 2
    with_tok = f"; with {', '.join(tok)}" if tok else "; no tokenizer.json found beside SRC"
    if args.direction == "lora-to-peft":
        print(f"lora-to-peft: {src} -> {dst} (rank {lo.rank}, {n} tensors on {', '.join(lo.targets)}) "
              f"in {time.time() - t0:.1f}s")
        return 0
    print(f"{args.direction}: {src} -> {dst} ({cfg.num_hidden_layers} layers, "
          f"MTP depth {cfg.num_nextn_predict_layers}) in {time.time() - t0:.1f}s{with_tok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
