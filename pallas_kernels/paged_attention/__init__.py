"""Paged attention: queries of each batch row attend over the K/V pages listed in its page table."""

from pallas_kernels.paged_attention.reference import paged_attention_reference

__all__ = ["paged_attention_reference"]
