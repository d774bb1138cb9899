"""Parameter counts from abstract shapes (nothing allocated): total, main model, MTP, activated."""
from __future__ import annotations

import dataclasses
import math

from flax import nnx

from r1jax.config import ModelConfig
from r1jax.model import abstract

ROUTED = ("gate_EDF", "up_EDF", "down_EFD")


@dataclasses.dataclass(frozen=True)
class ParamCount:
    main: int        # DeepseekV3ForCausalLM's parameters (embedding and head included)
    mtp: int         # the MTP modules' own parameters (they share the embedding and head)
    activated: int   # main-model parameters used per token: routed experts count k of E
    routed: int      # all routed-expert parameters of the main model

    @property
    def total(self) -> int:
        return self.main + self.mtp


def count(cfg: ModelConfig) -> ParamCount:
    _, state = abstract(cfg)
    main = mtp = routed = 0
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Param):
            continue
        n = math.prod(var.get_value().shape)
        if path[0] == "mtp":
            mtp += n
            continue
        main += n
        if path[-1] in ROUTED:
            routed += n
    frac = cfg.num_experts_per_tok / max(cfg.n_routed_experts, 1)
    return ParamCount(main=main, mtp=mtp, activated=main - round(routed * (1 - frac)), routed=routed)
