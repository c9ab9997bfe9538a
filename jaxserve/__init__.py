"""jaxserve: an LLM inference server on JAX/XLA for GPUs and TPUs."""

__version__ = "0.1.0"
