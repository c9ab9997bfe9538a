"""Engine faults on a tiny random model: a step that raises, and a request whose logits turn NaN."""

from __future__ import annotations

import dataclasses
import queue
import threading

import jax.numpy as jnp
import pytest

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine.engine import Engine, Update
from jaxserve.runner import StepRunner, build_engine
from tests.tiny_models import write_gguf

POISON = 99  # the token whose embedding row is NaN
CFG = EngineConfig(max_slots=2, page_size=4, num_pages=8, max_pages_per_slot=4, chunk_buckets=(8,))
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_gguf(path)
    return load_model(path, dtype="float32")


@pytest.fixture(scope="module")
def poisoned(tiny):
    """The tiny model with a NaN embedding for token POISON: any prompt holding it makes NaN logits."""
    weights = dataclasses.replace(tiny.weights, embed=tiny.weights.embed.at[POISON].set(jnp.nan))
    return dataclasses.replace(tiny, weights=weights)


def drain(box: queue.SimpleQueue[Update], timeout: float = 60) -> list[Update]:
    updates = [box.get(timeout=timeout)]
    while updates[-1].finish_reason is None:
        updates.append(box.get(timeout=timeout))
    return updates


def assert_pool_free(engine: Engine) -> None:
    assert engine.scheduler.slots.num_free == engine.cfg.max_slots
    assert all(ref == 0 for ref in engine.scheduler.pages.refs)


def test_non_finite_logits_end_only_that_request(poisoned):
    alone = build_engine(poisoned, CFG).generate([[5, 6, 7], [5, 6, 8]], [PARAMS] * 2)
    engine = build_engine(poisoned, CFG)
    bad = engine.submit([POISON, 1, 2, 3, 4, 5, 6], PARAMS)  # NaN K/V in every position of two pages
    good = engine.submit([5, 6, 7], PARAMS)
    bad_box, good_box = engine.outbox(bad.request_id), engine.outbox(good.request_id)
    engine.run_until_done()
    last = drain(bad_box)[-1]
    assert last.finish_reason == "error" and "non-finite" in (last.error or "")
    assert bad.output_ids == [] and good.finish_reason == "length"
    assert good.output_ids == alone[0].output_ids
    assert all(u.error is None for u in drain(good_box))
    assert_pool_free(engine)
    # The poisoned pages go back to the pool; whoever gets them next is unaffected.
    again = engine.generate([[5, 6, 7], [5, 6, 8]], [PARAMS] * 2)
    assert [r.output_ids for r in again] == [r.output_ids for r in alone]
    assert engine.fault is None


class FailingRunner:
    """The real runner, except that dispatch number `fail_at` raises."""

    def __init__(self, runner: StepRunner, fail_at: int) -> None:
        self.runner, self.fail_at, self.calls = runner, fail_at, 0

    def dispatch(self, inp):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected device failure")
        return self.runner.dispatch(inp)



def test_a_step_that_raises_fails_every_request_and_stops_the_loop(tiny):
    runner = FailingRunner(StepRunner(tiny, CFG), fail_at=4)
    engine = Engine(runner, tiny.tokenizer, CFG, vocab_size=tiny.config.vocab_size,
                    context_len=tiny.config.max_position_embeddings)
    faults: list[BaseException] = []
    called = threading.Event()
    engine.on_fault.append(lambda e: (faults.append(e), called.set()))
    requests = [engine.submit(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in ([1, 2, 3], [4, 5], [6])]
    engine.start()
    assert called.wait(60)
    for r in requests:
        last = drain(engine.outbox(r.request_id))[-1]
        assert last.finish_reason == "error"
        assert last.error == "engine step failed: RuntimeError: injected device failure"
    assert isinstance(engine.fault, RuntimeError) and faults == [engine.fault]
    assert engine._thread is not None and not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="stopped after a fault: RuntimeError: injected device failure"):
        engine.submit([7, 8], PARAMS)
    engine.stop()
