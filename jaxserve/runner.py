"""The runner: the engine's device side. It holds the weights and the device state, compiles every step bucket
ahead of time, and enqueues steps and their samplers without waiting.

Buckets are (rows, width, pages): (r, 1, p) for decode over the first r slots, for each r in
`decode_buckets`, with page tables p pages wide (`decode_page_widths`), (r, c, max pages) for
prefill chunks of width c from r requests (`prefill_buckets`), and with speculative decoding (r, k + 1, max pages)
for verify rows. All are compiled at start; a step of any other shape raises instead of compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import LoadedModel
from jaxserve.config import EngineConfig
from jaxserve.engine.batch import StepInput, StepOutput
from jaxserve.engine.engine import Engine
from jaxserve.errors import JaxserveError
from jaxserve.model.kv_cache import KVCache, page_dtype
from jaxserve.model.sampler import SAMPLING_INPUTS, masked_greedy_fn, sample_fn, verify_fn
from jaxserve.parallel import sharding
from jaxserve.step import (
    DeviceState,
    pack_step_input,
    prompt_fn,
    stacked_step_fn,
    step_fn,
    unpack_step_input,
    verify_step_fn,
)
from pallas_kernels import backend as backend_lib
from pallas_kernels.decode_megakernel import StackedLayers, check_config, stack_layers, stack_pages
from pallas_kernels.paged_attention import reads_float8_pages

log = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = 0
_compilations_lock = threading.Lock()  # buckets compile on several threads


def _count_compilation(event: str, duration_secs: float, **_: str | int) -> None:
    global _compilations
    if event == _BACKEND_COMPILE_EVENT:
        with _compilations_lock:
            _compilations += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilation)


def compilation_count() -> int:
    """XLA backend compilations in this process so far (every jit, not only the step's)."""
    return _compilations


# One jit per sampler variant for every single-device runner of a process: a sampler depends only on (rows, vocab,
# max_slots), so engines of the same model share its compilations.
SAMPLERS = {(sort, top): jax.jit(partial(sample_fn, sort=sort, top=top), donate_argnums=(1,))
            for sort in (False, True) for top in (False, True)}
MASKED_GREEDY = jax.jit(masked_greedy_fn, donate_argnums=(1,))
VERIFIERS = {(sort, top): jax.jit(partial(verify_fn, sort=sort, top=top), donate_argnums=(1,))
             for sort in (False, True) for top in (False, True)}
VERIFY_INPUTS = (*SAMPLING_INPUTS, "tokens", "valid")


def pages_in_memory(stats: list[dict[str, int]], fraction: float, unit_bytes: int, unit: int, *, reserved: int,
                    at_least: int) -> int:
    """Pages, in multiples of `unit` (each `unit` pages take `unit_bytes` on every device), that fit on every
    device in `fraction` of its memory limit beside what it has in use, less `reserved` (the padding page).
    Raises if fewer than `at_least` fit (one full slot)."""
    free = min(s["bytes_limit"] * fraction - s.get("bytes_in_use", 0) for s in stats)
    pages = int(max(free, 0) // unit_bytes) * unit - reserved
    if pages < at_least:
        in_use = max(s.get("bytes_in_use", 0) for s in stats)
        raise JaxserveError(
            f"kv_memory_fraction={fraction} leaves {max(free, 0) / 2**30:.2f} GiB for KV pages beside the "
            f"{in_use / 2**30:.2f} GiB in use: {max(pages, 0)} pages, fewer than the {at_least} of one full slot "
            f"(max_pages_per_slot); raise kv_memory_fraction or lower max_pages_per_slot")
    return pages


class StepRunner:
    """Owns the device state (weights, KV pages) and the compiled steps.

    With `cfg.parallel` over more than one device, a MeshPlan (jaxserve.parallel) lays the weights,
    the pages and each bucket's inputs out on the mesh and the step attends through its MeshAttention;
    with several processes, every step is broadcast to the followers first (jaxserve.parallel.lockstep).
    On one device none of that exists and the step is exactly the single-device one.
    """

    def __init__(self, model: LoadedModel, cfg: EngineConfig) -> None:
        self.model_cfg = model.config
        self.cfg = cfg
        self.weights = model.weights
        dtype = page_dtype(cfg.kv_cache_dtype, model.weights.final_norm.dtype)  # the weights may be int8
        if jnp.dtype(dtype).itemsize == 1 and not reads_float8_pages(cfg.attention, model.config.head_dim):
            raise JaxserveError(
                f"kv_cache_dtype={cfg.kv_cache_dtype!r}: attention={cfg.attention!r} "
                f"({backend_lib.resolve(cfg.attention)}) cannot read 8-bit pages at this model's "
                f"head_dim={model.config.head_dim} (Mosaic GPU needs a multiple of 128, Mosaic TPU none); "
                f"use attention='reference'")
        from jaxserve.launch import use_compilation_cache

        use_compilation_cache(cfg)
        self.plan = None
        self.lockstep = None
        if cfg.parallel.num_devices > 1:
            from jaxserve.parallel.lockstep import Lockstep
            from jaxserve.parallel.mesh import MeshPlan

            self.plan = MeshPlan.build(model.config, model.weights, cfg)
            self.model_cfg, self.weights = self.plan.model_cfg, self.plan.weights
            self.lockstep = Lockstep(cfg.max_slots) if jax.process_count() > 1 else None
        self.params: Any = self.weights  # what the compiled steps take: with decode_megakernel the layers stacked too
        if cfg.decode_megakernel:
            self.params = (self.weights, self._stacked_layers(model, dtype))
        if cfg.kv_memory_fraction:  # after the weights are in place: what remains is the pages'
            self.cfg = cfg = dataclasses.replace(cfg, num_pages=self._pages_that_fit(dtype))
        vocab = self.model_cfg.vocab_size
        if self.plan is not None:
            replicated = self.plan.replicated()
            self.state = DeviceState.zeros(self.plan.zeros_cache(cfg.num_pages, cfg.page_size, dtype), cfg.max_slots,
                                           vocab, lambda x: jax.device_put(x, replicated))
        else:
            zeros = partial(KVCache.zeros, model.config, cfg.num_pages, cfg.page_size, dtype, padding_page=True)
            cache: Any
            if cfg.decode_megakernel:  # every layer's pages in one pool a side, as stack_pages lays them out (its
                # shape taken without making the per-layer pool)
                pool = jax.eval_shape(lambda: stack_pages(zeros().k))
                cache = (jnp.zeros(pool.shape, pool.dtype), jnp.zeros(pool.shape, pool.dtype))
            else:
                cache = zeros()
            self.state = DeviceState.zeros(cache, cfg.max_slots, vocab)
        full = cfg.max_pages_per_slot
        self.buckets = sorted({(r, 1, p) for r in cfg.decode_buckets for p in cfg.decode_page_widths}
                              | {(r, c, full) for r, c in cfg.prefill_buckets})
        attention = self.plan.attention if self.plan else cfg.attention
        step = (partial(stacked_step_fn, cfg=self.model_cfg, attention=cfg.attention, page_size=cfg.page_size)
                if cfg.decode_megakernel else partial(step_fn, cfg=self.model_cfg, attention=attention))
        # Speculative decoding's verify steps: (rows, num_tokens + 1) for every decode row count, all positions'
        # logits, then `verify_fn` (jaxserve.model.sampler) in the variants of the samplers.
        self.verify_buckets: list[tuple[int, int, int]] = []
        if cfg.speculative is not None:
            if cfg.decode_megakernel or self.plan is not None:
                raise JaxserveError("speculative decoding runs on one device without decode_megakernel; got "
                                    f"{cfg.parallel.num_devices} devices, decode_megakernel={cfg.decode_megakernel}")
            self.verify_buckets = [(r, cfg.speculative.num_tokens + 1, full) for r in cfg.decode_buckets]
        start = time.perf_counter()
        jobs: dict[Any, tuple[Callable[..., Any], tuple[int, int, int]]] = {("step", b): (step, b) for b in self.buckets}
        jobs |= {("verify", b): (partial(verify_step_fn, cfg=self.model_cfg, attention=attention), b)
                 for b in self.verify_buckets}
        compiled_jobs = self._compile(jobs, start)
        self._compiled = {b: fn for (kind, b), fn in compiled_jobs.items() if kind == "step"}
        self._verify_steps = {b: fn for (kind, b), fn in compiled_jobs.items() if kind == "verify"}
        self._verifiers = {(r, sort, top): VERIFIERS[sort, top] for r, _, _ in self.verify_buckets
                           for sort in (False, True) for top in (False, True)}
        # The sampler's variants (see step_fn) for each row count of the buckets, compiled by a first run on
        # padding rows; and the prompt log-probabilities of each prefill bucket.
        self._samplers = {(r, sort, top): self._jit_sampler(r, sort, top) for r, _, _ in self.buckets
                          for sort in (False, True) for top in (False, True)}
        for r, sort, top in self._samplers:
            padding: dict[str, Any] = vars(StepInput.build([None] * r, 1, 1, cfg.max_slots))
            logits: Any = np.zeros((r, vocab), np.float32)
            if self.plan is not None:  # global arrays, as a mesh over processes needs
                logits = sharding.put(logits, self._logits_sharding(r))
                padding = {name: sharding.put(x, self.plan.replicated()) for name, x in padding.items()}
            self._sample((r, sort, top), logits, padding)
        self._prompt_fns = {(r, width): self._compile_prompt_fn(r, width) for r, width, _ in self.buckets if width > 1}
        self._masked_samplers: dict[tuple[int, bool, bool], Any] = {}
        self._masked_greedy: dict[int, Any] = {}
        for (r, width, pages) in self.verify_buckets:  # the verifiers, compiled by a first run on padding rows
            blank = StepInput.build([None] * r, width, pages, cfg.max_slots)
            for sort in (False, True):
                for top in (False, True):
                    self._verify(blank, np.zeros((r, width, vocab), np.float32), sort, top)
        compiled = time.perf_counter()
        # A first run of each bucket on padding rows (they write nothing): XLA initialises an executable
        # lazily at its first run (about 1.3 s per bucket on CPU), which would otherwise fall on the
        # first requests' time to first token. Followers of a multi-host group run the same steps.
        # Kernels in interpret mode (a test setting) skip it: there each run is a whole slow interpretation.
        first_runs = () if backend_lib.interpreted(cfg.attention) else [(b, False) for b in self.buckets] + \
            [(b, True) for b in self.verify_buckets]
        for done, ((r, width, pages), verify) in enumerate(first_runs, 1):
            blank = StepInput.build([None] * r, width, pages, cfg.max_slots)
            # (not dispatch: a multi-host leader would send the followers steps they run on their own here)
            jax.block_until_ready(self.dispatch(blank, verify=True)() if verify else self._run(blank))
            log.info("first run %d/%d (%.0f s)", done, len(first_runs), time.perf_counter() - start)
        jax.block_until_ready(self.state)
        log.info("compiled %d step buckets and their samplers in %.1f s, first runs %.1f s: ready after %.1f s",
                 len(self.buckets), compiled - start, time.perf_counter() - compiled, time.perf_counter() - start)

    def _compile(self, jobs: dict[Any, tuple[Callable[..., Any], tuple[int, int, int]]], start: float) -> dict[Any, Any]:
        """Each job's step function compiled for its bucket. Each is traced and lowered here (that holds the GIL:
        one at a time), then compiled on a thread of its own (XLA compiles outside the GIL) while the next is
        lowered."""
        compiled = {}
        threads = max(1, min(len(jobs), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            futures = {}
            for key, (fn, bucket) in jobs.items():
                blank = StepInput.build([None] * bucket[0], bucket[1], bucket[2], self.cfg.max_slots)
                example: Any = pack_step_input(blank)
                if self.plan is not None:  # shapes only: a mesh over processes takes no numpy arrays
                    example = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in vars(blank).items()}
                lowered = self._jit(fn, bucket).lower(self.params, self.state, example)
                futures[pool.submit(lowered.compile)] = key
            log.info("lowered %d step buckets in %.1f s; compiling on %d threads", len(jobs),
                     time.perf_counter() - start, threads)
            for done, future in enumerate(as_completed(futures), 1):
                compiled[futures[future]] = future.result()
                log.info("compiled %d/%d step buckets (%.0f s; %s rows, width, pages %s)", done, len(futures),
                         time.perf_counter() - start, *futures[future])
        return compiled

    def _stacked_layers(self, model: LoadedModel, dtype: Any) -> StackedLayers:
        """The model's layers stacked for the decode megakernel; raises JaxserveError naming what it cannot take."""
        backend = backend_lib.resolve(self.cfg.attention)
        if backend not in ("reference", "mosaic_gpu") or (backend == "mosaic_gpu" and jax.default_backend() != "gpu"):
            raise JaxserveError(f"decode_megakernel runs its Mosaic GPU kernel on a GPU or its jnp reference "
                                f"(attention='reference'); attention={self.cfg.attention!r} is {backend} on "
                                f"{jax.default_backend()}")
        if model.config.switches:
            raise JaxserveError(f"decode_megakernel runs Llama's layers; this {model.config.architecture} model turns "
                                f"on {', '.join(model.config.switches)}")
        try:
            check_config(model.config, self.cfg.page_size, dtype, backend=backend)
            return stack_layers(model.config, model.weights.layers, tiles=backend == "mosaic_gpu")
        except ValueError as e:
            raise JaxserveError(f"decode_megakernel: {e} (page_size={self.cfg.page_size}, kv_cache_dtype="
                                f"{self.cfg.kv_cache_dtype!r})") from None

    def _pages_that_fit(self, dtype: Any) -> int:
        """KV pages that fit in cfg.kv_memory_fraction of the devices' memory (see `pages_in_memory`)."""
        cfg, mc = self.cfg, self.model_cfg
        if jax.process_count() > 1:
            raise JaxserveError("kv_memory_fraction sizes the pool from one process's devices; with several "
                                "processes set num_pages, the same on every process")
        unit = cfg.parallel.sp  # the pool is split evenly over the sequence axis: pages come in multiples of it
        shape: tuple[int, ...] = (mc.num_kv_heads, unit, cfg.page_size, mc.head_dim)
        if self.plan is not None:
            shape = self.plan.cache_sharding(unit, cfg.page_size).shard_shape(shape)
        devices = list(self.plan.mesh.devices.flat) if self.plan is not None else [jax.devices()[0]]
        stats = []
        for device in devices:
            stats.append(device.memory_stats() or {})
            if "bytes_limit" not in stats[-1]:
                raise JaxserveError(f"kv_memory_fraction needs devices that report their memory; {device.platform} "
                                    f"device {device.id} does not: set num_pages instead")
        unit_bytes = 2 * mc.num_layers * int(np.prod(shape)) * jnp.dtype(dtype).itemsize  # K and V of every layer
        pages = pages_in_memory(stats, cfg.kv_memory_fraction, unit_bytes, unit, reserved=0 if self.plan else 1,
                                at_least=cfg.max_pages_per_slot)
        log.info("kv_memory_fraction=%.2f: %d KV pages of %d tokens, %.2f GiB a device", cfg.kv_memory_fraction,
                 pages, cfg.page_size, pages * unit_bytes / unit / 2**30)
        return pages

    def _jit(self, step: Callable[..., Any], bucket: tuple[int, int, int]) -> Any:
        if self.plan is None:  # one packed input array (see pack_step_input)
            return jax.jit(lambda weights, state, packed: step(weights, state, unpack_step_input(packed, *bucket[1:])),
                           donate_argnums=(1,))
        state = jax.tree_util.tree_map(lambda x: x.sharding, self.state)
        weights = jax.tree_util.tree_map(lambda x: x.sharding, self.weights)
        final = self.plan.replicated() if bucket[1] > 1 else None
        return jax.jit(step, donate_argnums=(1,), in_shardings=(weights, state, self.plan.input_shardings(bucket)),
                       out_shardings=(self.plan.replicated(), self._logits_sharding(bucket[0]), final, state))

    def _jit_sampler(self, rows: int, sort: bool, top: bool, masked: bool = False) -> Any:
        if self.plan is None:
            return SAMPLERS[sort, top]  # (one jit: a call with masks traces its own variant)
        replicated = self.plan.replicated()
        inputs = {name: replicated for name in SAMPLING_INPUTS}
        masks = (replicated,) if masked else ()
        return jax.jit(partial(sample_fn, sort=sort, top=top), donate_argnums=(1,),
                       in_shardings=(self._logits_sharding(rows), replicated, replicated, replicated, inputs, *masks),
                       out_shardings=(replicated, replicated))

    def _sample(self, variant: tuple[int, bool, bool], logits: jax.Array, arrays: dict[str, Any],
                masks: Any = None) -> jax.Array:
        """Enqueues the sampler `variant` (rows, sort, top) on a step's logits; with `masks`, its masked variant,
        compiled at its first use (a server that never constrains a request never compiles it)."""
        state = self.state
        sampler, extra = self._samplers[variant], ()  # type: tuple[Any, tuple[Any, ...]]
        if masks is not None:
            if variant not in self._masked_samplers:
                self._masked_samplers[variant] = self._jit_sampler(*variant, masked=True)
            sampler, extra = self._masked_samplers[variant], (masks,)
        packed, last_tokens = sampler(logits, state.last_tokens, state.counts, state.in_prompt,
                                      {name: arrays[name] for name in SAMPLING_INPUTS}, *extra)
        self.state = state._replace(last_tokens=last_tokens)
        return packed

    def _compile_prompt_fn(self, rows: int, width: int) -> Any:
        """prompt_fn compiled for a prefill bucket's final hidden states."""
        dtype = self.weights.final_norm.dtype
        spec = {"sharding": self.plan.replicated()} if self.plan is not None else {}
        final = jax.ShapeDtypeStruct((rows, width, self.model_cfg.hidden_size), dtype, **spec)
        targets = jax.ShapeDtypeStruct((rows, width), jnp.int32, **spec)
        return jax.jit(partial(prompt_fn, cfg=self.model_cfg)).lower(self.weights, final, targets).compile()

    def _logits_sharding(self, rows: int) -> Any:
        assert self.plan is not None
        return self.plan.sharding(sharding.logical_spec(("batch", "vocab"), (rows, self.model_cfg.vocab_size),
                                                        self.plan.mesh))

    def dispatch(self, inp: StepInput, verify: bool = False) -> Callable[[], StepOutput]:
        """Enqueues a step on the device and returns at once; calling the result waits and copies it back.
        `verify`: a speculative verify step (rows of a last token and its drafts)."""
        if verify:
            logits, self.state = self._verify_steps[inp.shape](self.params, self.state, pack_step_input(inp))
            packed, counts = self._verify(inp, logits, inp.sorts, bool(inp.want_top.any()))
            return lambda: StepOutput.unpack_verify(np.asarray(packed), np.asarray(counts))
        if inp.shape not in self._compiled:
            raise RuntimeError(f"step shape {inp.shape} is not one of the compiled buckets {self.buckets}")
        if self.lockstep is not None:
            self.lockstep.send(inp)
        return self._reader(*self._run(inp))

    @property
    def constrains(self) -> bool:
        """Whether steps with masks can be dispatched (`dispatch_constrained`): not over several processes, whose
        followers would need each step's masks too."""
        return self.lockstep is None

    def dispatch_constrained(self, inp: StepInput) -> Callable[[np.ndarray], Callable[[], StepOutput]]:
        """`dispatch` for a step whose sampler waits for its rows' masks of allowed tokens: enqueues the step's forward
        now and returns `sample(masks)`, which enqueues the masked sampler (masks [rows, ceil(vocab / 32)] int32,
        sampler.only_allowed's layout; every bit set for a free row) and returns what `dispatch` would. The engine
        computes the masks while the forward runs (jaxserve.engine.engine)."""
        if inp.shape not in self._compiled:
            raise RuntimeError(f"step shape {inp.shape} is not one of the compiled buckets {self.buckets}")
        unmasked, logits, arrays, prompt = self._forward(inp)
        variant = (inp.shape[0], inp.sorts, bool(inp.want_top.any()))

        def sample(masks: np.ndarray) -> Callable[[], StepOutput]:
            placed = masks if self.plan is None else sharding.put(masks, self.plan.replicated())
            if inp.samples:
                return self._reader(self._sample(variant, logits, arrays, placed), prompt)
            return self._reader(self._sample_masked_greedy(logits, arrays["slots"], placed, unmasked), prompt)

        return sample

    def _sample_masked_greedy(self, logits: jax.Array, slots: Any, masks: Any, unmasked: jax.Array) -> jax.Array:
        """Enqueues `masked_greedy_fn` (compiled at its first use for the row count) on a step's logits."""
        rows = logits.shape[0]
        if rows not in self._masked_greedy:
            fn: Any = MASKED_GREEDY
            if self.plan is not None:
                replicated = self.plan.replicated()
                fn = jax.jit(masked_greedy_fn, donate_argnums=(1,), out_shardings=(replicated, replicated),
                             in_shardings=(self._logits_sharding(rows), replicated, replicated, replicated, replicated))
            self._masked_greedy[rows] = fn
        packed, last_tokens = self._masked_greedy[rows](logits, self.state.last_tokens, slots, masks, unmasked)
        self.state = self.state._replace(last_tokens=last_tokens)
        return packed

    def _reader(self, packed: jax.Array, prompt: jax.Array | None) -> Callable[[], StepOutput]:
        """A dispatched step's result: waits for it and copies it back."""

        def local(x: jax.Array) -> np.ndarray:
            return np.asarray(x.addressable_data(0) if self.plan is not None else x)

        if prompt is None:
            return lambda: StepOutput.unpack(local(packed))
        if (plan := self.plan) is not None:
            return lambda: StepOutput.unpack(local(packed), plan.restore_order(local(prompt)))
        return lambda: StepOutput.unpack(local(packed), local(prompt))

    def _run(self, inp: StepInput) -> tuple[jax.Array, jax.Array | None]:
        """Enqueues the step of `inp`, then the sampler on its logits if a row needs it (StepInput.samples), and
        the prompt log-probabilities if a row wants them; returns the packed result of the last sampling and the
        prompt log-probabilities (or None)."""
        packed, logits, arrays, prompt = self._forward(inp)
        if inp.samples:
            packed = self._sample((inp.shape[0], inp.sorts, bool(inp.want_top.any())), logits, arrays)
        return packed, prompt

    def _forward(self, inp: StepInput) -> tuple[jax.Array, jax.Array, dict[str, Any], jax.Array | None]:
        """Enqueues the step of `inp`, and the prompt log-probabilities if a row wants them -> (its packed greedy
        result, its logits, the input arrays the sampler reads, the prompt log-probabilities or None)."""
        compiled = self._compiled[inp.shape]
        arrays = vars(inp)
        if self.plan is not None:
            arrays = vars(self.plan.reorder(inp))
            if self.lockstep is not None:  # a mesh over processes takes global arrays; each process gives its shards
                shardings = self.plan.input_shardings(inp.shape)
                arrays = {name: sharding.put(x, shardings[name]) for name, x in arrays.items()}
        step_inputs = arrays if self.plan is not None else pack_step_input(inp)
        packed, logits, final, self.state = compiled(self.params, self.state, step_inputs)
        prompt = None
        if final is not None and (inp.targets >= 0).any():
            targets: Any = inp.targets if self.plan is None else sharding.put(arrays["targets"], self.plan.replicated())
            prompt = self._prompt_fns[inp.shape[:2]](self.weights, final, targets)
        return packed, logits, arrays, prompt

    def _verify(self, inp: StepInput, logits: Any, sort: bool, top: bool) -> tuple[jax.Array, jax.Array]:
        arrays = vars(inp)
        packed, counts, last_tokens = self._verifiers[inp.shape[0], sort, top](
            logits, self.state.last_tokens, {name: arrays[name] for name in VERIFY_INPUTS})
        self.state = self.state._replace(last_tokens=last_tokens)
        return packed, counts

    def follow(self) -> None:
        """A follower's loop: runs each step the leader broadcasts, until the leader closes."""
        assert self.lockstep is not None and not self.lockstep.is_leader, "only a follower process follows"
        while (inp := self.lockstep.receive()) is not None:
            self._run(inp)
        jax.block_until_ready(self.state)

    def close(self) -> None:
        """Releases the followers (multi-host leader); nothing to do otherwise."""
        if self.lockstep is not None:
            self.lockstep.close()


def build_engine(model: LoadedModel, cfg: EngineConfig) -> Engine:
    """Compiles every bucket for `model` and returns an engine ready to take requests."""
    runner = StepRunner(model, cfg)
    draft = None
    if cfg.speculative is not None and cfg.speculative.method == "draft":
        draft = StepRunner(_draft_model(model, cfg.speculative.model), dataclasses.replace(runner.cfg, kv_memory_fraction=0))
    spans = [model.config.attention_span] + ([] if draft is None else [draft.model_cfg.attention_span])
    return Engine(runner, model.tokenizer, runner.cfg, vocab_size=model.config.vocab_size,  # num_pages may be sized
                  context_len=model.config.max_position_embeddings, draft=draft,
                  attention_span=None if None in spans else max(spans))  # type: ignore[type-var]


def _draft_model(target: LoadedModel, path: str | None) -> LoadedModel:
    """The draft model of speculative decoding, in the target's dtype; it must share the target's vocabulary."""
    from jaxserve.checkpoint import load_model

    draft = load_model(path, dtype=str(jnp.dtype(target.weights.final_norm.dtype)))
    if draft.config.vocab_size != target.config.vocab_size:
        raise JaxserveError(f"the draft model {path!r} has vocab_size={draft.config.vocab_size}; the target's is "
                            f"{target.config.vocab_size}: a draft must share the target's tokenizer")
    return draft


def release_followers(engine: Engine) -> None:
    """Tells the follower processes of a multi-host group that the leader is done; nothing on one process."""
    if isinstance(engine.runner, StepRunner):
        engine.runner.close()
