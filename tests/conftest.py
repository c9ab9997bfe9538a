"""Shared fixtures. The embedded model and its transformers reference load once per session."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Twelve CPU devices for the mesh tests (tests/test_parallel*.py), set before anything imports jax. Other
# tests run on the first device as before; on a GPU or TPU the flag changes nothing.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=12".strip()
# XLA's CPU backend skips LLVM's expensive passes here and optimises at level 1: less compile time for the many step
# buckets the suite builds (about 6 % less wall time over the speculative, engine and family modules), at no cost in
# run time measured on the embedded model. Not level 0: there a decode step ran 1.8x slower and a prefill 1.5x, and
# the suite is as much run-bound as compile-bound. Left out where there is a GPU or TPU (the flags would reach their
# code generation too).
_ACCELERATOR = any(os.path.exists(f"/dev/{device}") for device in ("nvidia0", "accel0", "vfio"))
for _flag in ("--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=1"):
    if not _ACCELERATOR and _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" {_flag}"
# Tests that run a model in this process leave the GPU's memory to the servers other tests start (JAX would take
# three quarters of it at its first use).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# One persistent compilation cache for the session's processes (the pytest-xdist workers, spawned after this runs,
# and the CLI, server and batch subprocesses inherit it): the embedded model's step buckets, built by many tests,
# compile once. A directory of this session's own, removed at its end; a cache set from outside is left alone.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxserve-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):  # (the controller's; workers inherit it)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def interpreted_threads_compile_once():
    """Mosaic GPU's interpreter runs each program of a grid as threads (one per warpgroup) and compiles each
    thread's body anew for every program: `thread_map._run_jaxpr` jits a fresh closure each time, so JAX's cache,
    which its comment there counts on, never hits. Those compiles were most of an interpreted kernel's time (on
    2 cores a float8 decode call took 8.5 s, 4 s with each body compiled once). Here each thread's body compiles
    once per traced kernel and every program of the grid reuses it; the threads still run as before, each its
    own executable (one executable shared by threads that wait on each other's barriers deadlocks). Where JAX
    has no such private function, nothing is patched and the kernels run as JAX runs them."""
    import threading
    import weakref

    import jax

    from pallas_kernels.compat import eval_jaxpr, interpreter_thread_map

    thread_map = interpreter_thread_map()
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None:
        yield
        return
    compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # thread body -> {thread id: executable}
    lock = threading.Lock()

    def evaluate(jaxpr, consts, *args):
        return eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        thread = int(args[0])  # thread_map passes the thread id first
        with lock:
            executable = compiled.setdefault(jaxpr, {}).get(thread)
        if executable is None:
            executable = jax.jit(evaluate, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
            with lock:
                compiled[jaxpr][thread] = executable
        jax.block_until_ready(executable(consts, *args))

    thread_map._run_jaxpr = run_jaxpr
    yield
    thread_map._run_jaxpr = original


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
