"""How the model's heaviest parts run (`kernels.*` in the config): blockwise attention
(`flash`), the routed-expert compute (`dispatch`) and the token exchange when experts are
sharded (`expert_parallel`). Each is held to a plain reference in the tests; none changes
what the model computes. They import only `r1jax.logical` for sharding."""
