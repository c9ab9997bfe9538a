"""int8 decode layer past attention (wo, residual, norm, gate_up, SiLU·up, down, residual, the next layer's norm and
qkv) as one kernel: see mosaic_gpu.py; reference.py is what it computes."""

from pallas_kernels.quantized_layer.reference import LayerWeights
from pallas_kernels.quantized_layer.reference import decode_layer as decode_layer_reference

__all__ = ["LayerWeights", "decode_layer_reference"]
