"""The bench's outputs: one markdown table (also printed), a JSON file with every number and
each step's loss, and a PNG with throughput and memory bars and the loss curves overlaid."""
from __future__ import annotations

import json
from pathlib import Path

MiB = 2**20


def _ms(s: float) -> str:
    return f"{1000 * s:,.0f} ms"


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / MiB:,.0f} MiB"


def table(result: dict) -> str:
    rows = ["| framework | dtype | step (median) | step (min) | tokens/s | MFU | compile | first step | XLA argument "
            "| XLA temp | XLA output | peak RSS |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for side in ("r1jax", "torch"):
            r = run.get(side)
            if r is None:
                continue
            mem = r.get("memory", {})
            compile_s = f"{r['lower_s'] + r['compile_s']:.1f} s" if "compile_s" in r else "— (eager)"
            rows.append(f"| {side} | {run['dtype']} | {_ms(r['step_s_median'])} | {_ms(r['step_s_min'])} | "
                        f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {compile_s} | {r['first_step_s']:.2f} s | "
                        f"{_mib(mem.get('argument'))} | {_mib(mem.get('temp'))} | {_mib(mem.get('output'))} | "
                        f"{_mib(r['peak_rss_bytes'])} |")
        if "ratio" in run:
            rows.append(f"| **r1jax / torch** | {run['dtype']} | | | **{run['ratio']:.2f}x** | | | | | | | |")
    return "\n".join(rows)


def notes(result: dict) -> list[str]:
    out = [f"Machine: {result['machine']}. Threads: {result['threads_note']}.",
           f"MFU: {result['flops_per_token'] / 1e9:.3f} GFLOP per token (analytic, r1jax.train.mfu) x tokens/s over "
           f"{result['peak_note']}."]
    for run in result["runs"]:
        if "max_abs_loss_diff" in run:
            out.append(f"{run['dtype']}: loss {run['r1jax']['losses'][0]:.3f} -> {run['r1jax']['losses'][-1]:.3f} "
                       f"(r1jax) / {run['torch']['losses'][-1]:.3f} (torch) over {len(run['r1jax']['losses'])} steps; "
                       f"max per-step |loss difference| {run['max_abs_loss_diff']:.2e}.")
    return out


def markdown(result: dict) -> str:
    dtypes = ", ".join(r["dtype"] for r in result["runs"])
    head = f"# Step benchmark: {result['config_name']} ({dtypes})\n\n`{result['command']}` on {result['date']}.\n\n"
    return head + table(result) + "\n\n" + " ".join(notes(result)) + f"\n\n![{result['config_name']}]({result['png_name']})\n"


def write(result: dict, prefix: Path) -> dict[str, Path]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": prefix.with_suffix(".json"), "png": prefix.with_suffix(".png"), "md": prefix.with_suffix(".md")}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    plot(result, paths["png"])
    paths["md"].write_text(markdown(result))
    return paths


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    sides = [s for s in ("r1jax", "torch") if any(s in r for r in runs)]
    colors = {"r1jax": "#1f77b4", "torch": "#d62728"}
    fig, (ax_tp, ax_mem, ax_loss) = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / len(sides)
    for k, side in enumerate(sides):
        xs = [i + k * width for i, r in enumerate(runs) if side in r]
        ax_tp.bar(xs, [r[side]["tokens_per_s"] for r in runs if side in r], width, label=side, color=colors[side])
        ax_mem.bar(xs, [r[side]["peak_rss_bytes"] / MiB for r in runs if side in r], width, label=f"{side} peak RSS",
                   color=colors[side], alpha=0.5)
    for i, r in enumerate(runs):
        mem = r.get("r1jax", {}).get("memory")
        if mem:
            ax_mem.bar(i, (mem["argument"] + mem["temp"] + mem["output"] - mem["alias"]) / MiB, width * 0.5,
                       label="r1jax XLA arg+temp+out" if i == 0 else None, color="#17becf")
    for ax, title, unit in ((ax_tp, "throughput", "tokens/s"), (ax_mem, "memory", "MiB")):
        ax.set_xticks([i + width * (len(sides) - 1) / 2 for i in range(len(runs))], [r["dtype"] for r in runs])
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    for r in runs:
        for side in sides:
            if side in r:
                ax_loss.plot(range(1, len(r[side]["losses"]) + 1), r[side]["losses"], label=f"{side} {r['dtype']}",
                             color=colors[side], linestyle="-" if r["dtype"] == "fp32" else "--", alpha=0.8)
    ax_loss.set_title("training loss (same weights, same batches)")
    ax_loss.set_xlabel("step")
    ax_loss.legend(fontsize=8)
    fig.suptitle(f"{result['config_name']}: {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
