"""A decode step's every decoder layer in one persistent kernel (batch 1 first): its math and layouts.

`reference` holds the stacked layouts and the math in jnp; the Mosaic GPU kernel is still the benchmark skeleton
`benchmarks/megakernel_skeleton_gpu.py` (see benchmarks/int8_gpu_notes.md, sessions 27-30).
"""
