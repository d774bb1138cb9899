"""The embedding lookup where the table is split over its hidden axis (fsdp; outside a pipeline's
stages pipeline; expert under mesh.expert_fsdp; r1jax/model/layers.py `Embed`): a table with more
rows than a device looks up stays in its slices, and the rows are exchanged (all-to-all) instead
of the table being gathered; a small table is gathered. Both give the logits and gradients of
the other path and of one device."""
from __future__ import annotations

import re

import numpy as np

from r1jax.model import layers
from runs import logits_and_grads

def _table_gathers(hlo: str) -> int:
    """All-gathers whose result is the whole [512, 64] table (fp32 or bf16)."""
    return len(re.findall(r"= (?:f32|bf16)\[512,64\][^ ]* all-gather", hlo))


def test_a_large_table_is_looked_up_in_place_and_a_small_one_gathered(monkeypatch):
    one = logits_and_grads(["train.global_batch_size=8"])[:2]
    # fsdp 8, 8 rows of 64: a device's 64 tokens against a 512-row table: in place
    logits, grads, _, hlo = logits_and_grads(["mesh.data=1", "mesh.fsdp=8", "train.global_batch_size=8"])
    assert layers.lookup_in_place(512, 64)
    assert _table_gathers(hlo) == 0 and "all-to-all" in hlo
    # the same step with the table gathered (the path a small table takes)
    monkeypatch.setattr(layers, "lookup_in_place", lambda vocab, looked_up: False)
    g_logits, g_grads, _, g_hlo = logits_and_grads(["mesh.data=1", "mesh.fsdp=8", "train.global_batch_size=8"])
    assert _table_gathers(g_hlo) > 0
    for name, (lg, gr) in {"in place": (logits, grads), "gathered": (g_logits, g_grads)}.items():
        d_l = float(np.abs(lg - one[0]).max())
        d_g = max(float(np.abs(gr[k] - g).max() / max(np.abs(g).max(), 1e-30)) for k, g in one[1].items())
        print(f"\n{name} on fsdp 8 vs one device: logits {d_l:.1e}, gradients {d_g:.1e} (relative)")
        assert d_l <= 1e-6 and d_g <= 1e-6
