"""Pallas kernels (Mosaic GPU and Mosaic TPU), each with a pure-jnp reference beside it."""
