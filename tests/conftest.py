"""Shared fixtures. The embedded model and its transformers reference load once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Twelve CPU devices for the mesh tests (tests/test_parallel*.py), set before anything imports jax. Other
# tests run on the first device as before; on a GPU or TPU the flag changes nothing.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=12".strip()


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from jaxserve.checkpoint import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm(embedded_path):
    """The embedded SmolLM2 in float32, through jaxserve's loader."""
    from jaxserve.checkpoint import load_model

    return load_model(embedded_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_tokenizer(embedded_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(embedded_path), gguf_file=os.path.basename(embedded_path))


@pytest.fixture(scope="session")
def hf_model(embedded_path):
    """transformers' own Llama on the same GGUF, dequantized to float32: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(embedded_path), gguf_file=os.path.basename(embedded_path), dtype=torch.float32
    )
    return model.eval()
