"""Which kernel module each backend name picks, per platform."""

from __future__ import annotations

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend


@pytest.mark.parametrize("platform, auto, pallas", [("cpu", "reference", "mosaic_gpu"), ("gpu", "mosaic_gpu", "mosaic_gpu"),
                                                    ("tpu", "mosaic_tpu", "mosaic_tpu")])
def test_auto_and_pallas_pick_the_platforms_kernels(monkeypatch, platform, auto, pallas):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    assert backend.resolve("auto") == auto
    assert backend.resolve("pallas") == pallas
    module = backend.implementation("pallas_kernels.paged_attention", "auto")
    assert module.__name__ == f"pallas_kernels.paged_attention.{auto}"


def test_kernels_named_off_their_platform_are_interpreted():
    assert jax.default_backend() == "cpu"
    assert isinstance(backend.interpret_params("mosaic_tpu", None), pltpu.InterpretParams)
    assert backend.interpret_params("mosaic_tpu", False) is None
    with pytest.raises(ValueError, match="backend='triton' is not one of"):
        backend.resolve("triton")
