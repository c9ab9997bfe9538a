"""Many devices and many hosts, with JAX's own machinery (jax.sharding, shard_map, jax.distributed).

| module         | noun                                                                           |
|----------------|--------------------------------------------------------------------------------|
| mesh.py        | the mesh (`data`, `seq`, `model`) and `MeshPlan`: a model and engine placed on it |
| sharding.py    | logical-axis rules: weight and cache axes to mesh axes, with a collision check  |
| ring.py        | ring attention over `seq` (zig-zag causal order) and the log-sum-exp merge rule |
| attention.py   | the engine's attention on a mesh: heads over `model`, striped pages over `seq`  |
| distributed.py | `jax.distributed.initialize` from DistributedConfig or the environment           |
| lockstep.py    | multi-host: the leader broadcasts each StepInput, followers run the same step    |

A mesh of one device is not a mesh: the engine then runs today's single-device code unchanged.
"""
