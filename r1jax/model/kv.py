"""The decode cache as the model sees it: per layer stack, the normed latent and the roped key.

MLA's cache is what DeepSeek's absorbed inference keeps (inference/model.py, attn_impl="absorb"):
per token and layer the latent c = kv_norm(wkv_a x) [C] after its norm and the shared rope key
rope(wk_rope x) [R] after RoPE; nothing per head. r1jax/infer/cache.py allocates the arrays
(slots, maximum length, dtype, shardings); the model only writes and reads them here.

`KV` travels through `Transformer.__call__` with the tokens it extends the cache by:
- `absorbed=False` (prefill): the new tokens attend to each other with the training path's
  attention (expanded keys and values, dense or flash); their latents and rope keys are written
  at `positions` of cache rows `slots`. The rows start at position 0.
- `absorbed=True` (decode, and speculative verification): the new tokens' entries are written
  first, then every query attends to the cache of its row with key index <= its position, with
  W_UK folded into the query and W_UV applied after attention, so the cache is never expanded.
  Row b of the batch is cache row b; a batch of B rows reads the cache's first B slots.
Entries past a row's position are never read, so right-padding a prompt and rejected draft
tokens leave nothing behind that matters.

A 16-bit cache may be stored as its bit patterns (`KV.view`: the arrays are uint16 and hold
bf16 or fp16 values; r1jax/infer/cache.py allocates it so for the generator). Reads bitcast the
slice they take, writes bitcast the new entries, and the scatter runs on integers: XLA's CPU
backend has no 16-bit float scatter and converted the whole cache to f32 and back around every
write, per layer and step, which made a decode step over 8 rows of a 64-slot, 1024-position
cache 4.7x slower than over an 8-slot one.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackKV:
    """One layer stack's cache: latent [L, slots, S, C] and k_rope [L, slots, S, R], or (for
    unrolled layers, `Stack(..., layers=...)`) tuples of L arrays [slots, S, C] / [slots, S, R]:
    each layer's cache its own buffer, so reading it is no copy."""
    latent: jax.Array | tuple[jax.Array, ...]
    k_rope: jax.Array | tuple[jax.Array, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, slots, positions)."""
        if isinstance(self.latent, tuple):
            return (len(self.latent), *self.latent[0].shape[:2])
        return self.latent.shape[:3]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KV:
    """The whole cache: `stacks` keyed "dense", "moe" and "mtp" (the model's layer stacks and its
    MTP modules, each [L, ...]); `slots` [B] the cache rows the batch's rows write (prefill only;
    None: row b is slot b). `positions` [B, T] are the new tokens' (the model fills them in from
    its own `positions` argument)."""
    stacks: dict[str, StackKV]
    slots: jax.Array | None = None
    positions: jax.Array | None = None
    absorbed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # decode attends over the first `attend` positions only (None: all): the caller guarantees
    # every row's position stays below it, so the rest of the cache is never read
    attend: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # the float dtype the arrays' bits hold ("bfloat16"), None: the arrays hold their own values
    view: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    def layer(self, name: str, layer: jax.Array) -> "LayerKV":
        return LayerKV(self.stacks[name], layer, self.positions, self.slots, self.absorbed, self.attend, self.view)

    def with_stack(self, name: str, stack: StackKV) -> "KV":
        return dataclasses.replace(self, stacks={**self.stacks, name: stack})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerKV:
    """What one MLA sees: its stack's arrays, its layer index in them and the new tokens' positions."""
    stack: StackKV
    layer: jax.Array | int                      # an int when the stack is unrolled
    positions: jax.Array                        # [B, T] int32
    slots: jax.Array | None = None
    absorbed: bool = dataclasses.field(default=False, metadata=dict(static=True))
    attend: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    view: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    def write(self, c_BTC: jax.Array, kr_BTR: jax.Array) -> "LayerKV":
        """The new entries at [layer, row, position] (positions past the cache are dropped)."""
        B = c_BTC.shape[0]
        rows = (jnp.arange(B, dtype=jnp.int32) if self.slots is None else self.slots)[:, None]
        s = self.stack

        def put(buf, new):
            dtype = (buf[0] if isinstance(buf, tuple) else buf).dtype
            new = new.astype(self.view or dtype)
            if self.view is not None:
                new = jax.lax.bitcast_convert_type(new, dtype)
            if isinstance(buf, tuple):                       # unrolled: layer is a Python int
                one = buf[self.layer].at[rows, self.positions].set(new, mode="drop")
                return buf[:self.layer] + (one,) + buf[self.layer + 1:]
            return buf.at[self.layer, rows, self.positions].set(new, mode="drop")

        return dataclasses.replace(self, stack=StackKV(put(s.latent, c_BTC), put(s.k_rope, kr_BTR)))

    def read(self) -> tuple[jax.Array, jax.Array]:
        """This layer's latent [B, S, C] and rope key [B, S, R]: the first B slots (a decode step
        over fewer rows than the cache has slots, as the serving engine runs them) and the first
        `attend` positions (S = attend) when set."""
        B = self.positions.shape[0]
        c, kr = self.stack.latent[self.layer], self.stack.k_rope[self.layer]
        S = c.shape[1] if self.attend is None else min(self.attend, c.shape[1])
        if c.shape[:2] != (B, S):
            c, kr = c[:B, :S], kr[:B, :S]
        if self.view is not None:
            c, kr = (jax.lax.bitcast_convert_type(a, self.view) for a in (c, kr))
        return c, kr

