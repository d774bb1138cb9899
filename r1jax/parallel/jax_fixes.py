"""A fix to the pinned JAX (0.10.2) that r1jax needs, applied by `apply()` (idempotent).

Nested shard_map residuals. A shard_map inside another (the experts' token exchange, manual over
the batch axes, inside the pipeline's shard_map, manual over `pipeline`) is partially evaluated
when autodiff splits the stages' scans. With check_vma on, JAX names each residual's sharding
after every manual axis the residual varies over (`ShapedArray.nospec`), the outer `pipeline`
included, although the inner shard_map maps only its own axes; the lowering then fails ("operand
shape, corresponding sharding, and region operand shape ... must match"). JAX's own source marks
the spot ("should use newly all_names in check_vma path?"). The fix keeps only the axes the
inner shard_map makes manual (`all_names`), as the path without check_vma already does; for a
shard_map that is not nested the two are the same set, so nothing else changes. Checked by
tests/test_mesh.py's expert-inside-stages cases (without it they do not compile)."""
from __future__ import annotations

import jax
from jax._src import core
from jax.sharding import PartitionSpec

PINNED = "0.10.2"
_state = {"applied": False}


def apply() -> None:
    if _state["applied"] or jax.__version__ != PINNED:
        return
    original = core.ShapedArray.nospec

    def nospec(self, mesh, check_vma, all_names):
        if not check_vma:
            return original(self, mesh, check_vma, all_names)
        names = tuple(n for n in core.order_wrt_mesh(mesh, self.mat.varying) if n in all_names)
        u, r = self.mat.unreduced, self.mat.reduced
        return PartitionSpec(names, unreduced=u, reduced=r) if names else PartitionSpec(unreduced=u, reduced=r)

    core.ShapedArray.nospec = nospec
    _state["applied"] = True
