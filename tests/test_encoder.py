"""Encoder inputs (multimodal items): the encoder cache, the per-step encoder
budget and their checks (reference/encoder_cache_manager.py, spec 3.2 step 8,
3.3, 4.2, 6 e, 10.5, 10.6).

``Scheduler(EngineConfig(...))`` is driven directly; every test asserts exact
token counts, input ids and cache contents. Names mirror the vLLM test they
reproduce (``tests/v1/core/test_scheduler.py``, spec 9.1) where one exists.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.check import check_steps
from harness.trace.recorder import record
from harness.replay import replay
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from reference.config import ConfigError, EngineConfig
from reference.encoder_cache_manager import (
    EncoderCacheManager,
    mm_identifier,
    mm_items_in_window,
)
from reference.engine import reject_reason
from harness.candidates.mutants import NoEncoderGiveBack
from reference.output import EncoderPlan, ScheduledRequest, Skip, Withdrawal
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import Scheduler
from reference.workload import RequestSpec, WorkloadError
from workloads import synthetic

_BASES = itertools.count(10_000, 10_000)


def make_scheduler(**overrides) -> Scheduler:
    config = dict(num_gpu_blocks=1001, block_size=16, max_model_len=2048, max_num_seqs=16,
                  max_num_batched_tokens=1024)
    config.update(overrides)
    return Scheduler(EngineConfig(**config))


def make_request(request_id: str, num_tokens: int, mm_positions=(), *, token_ids=None, priority: int = 0,
                 arrival_time: float = 0.0, block_size: int = 16, max_tokens: int = 16) -> Request:
    """A request with unique prompt tokens (unless ``token_ids`` is given)."""
    if token_ids is None:
        base = next(_BASES)
        token_ids = list(range(base, base + num_tokens))
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival_time, priority=priority, block_size=block_size,
                   mm_positions=tuple(mm_positions))


def sampled(sched: Scheduler, output) -> dict[str, list[int]]:
    return {rid: [1] for rid in output.num_scheduled_tokens if not sched.requests[rid].is_prefill_chunk}


def entries(sched: Scheduler) -> tuple[dict[str, set[str]], list[str]]:
    """Encoder-cache entries (identifier -> referencing requests) and the
    freeable ones, oldest first."""
    manager = sched.encoder_cache_manager
    return {h: set(ids) for h, ids in manager.cached.items()}, list(manager.freeable)


# -- the window and the budget ------------------------------------------------------
def test_mm_items_in_window() -> None:
    positions = ((2, 3), (5, 2), (10, 4))
    assert mm_items_in_window(positions, 0, 2) == (0, 0)
    assert mm_items_in_window(positions, 0, 3) == (0, 1)
    assert mm_items_in_window(positions, 4, 6) == (0, 2)
    assert mm_items_in_window(positions, 5, 10) == (1, 2)
    assert mm_items_in_window(positions, 7, 11) == (2, 3)
    assert mm_items_in_window(positions, 14, 20) == (3, 3)


def test_schedule_multimodal_requests() -> None:
    """Each request is scheduled whole with its one encoder input (budget and
    cache default to max_num_batched_tokens = 1024 embeds)."""
    sched = make_scheduler()
    requests = [make_request(f"r{i}", 200, [(10, 100)]) for i in range(3)]
    for r in requests:
        sched.add_request(r)
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"r0": 200, "r1": 200, "r2": 200}
    assert output.scheduled_encoder_inputs == {"r0": [0], "r1": [0], "r2": [0]}
    assert sched.encoder_cache_manager.num_free_slots == 1024 - 300
    assert output.free_encoder_mm_hashes == []


def test_schedule_partial_requests() -> None:
    """vLLM's test: the encoder budget (1024 embeds) covers one 600-embed
    image per step, so the second and third requests stop before theirs
    (800/100/100); next step the third, RUNNING, is not scheduled at all."""
    sched = make_scheduler()
    requests = [make_request(f"r{i}", 800, [(100, 600)]) for i in range(3)]
    for r in requests:
        sched.add_request(r)
    output = sched.schedule()
    assert sched.max_num_encoder_input_tokens == 1024
    assert output.num_scheduled_tokens == {"r0": 800, "r1": 100, "r2": 100}
    assert output.scheduled_encoder_inputs == {"r0": [0]}
    assert [e for e in output.events if isinstance(e, EncoderPlan)] == [
        EncoderPlan("r0", 0, 800, [0]), EncoderPlan("r1", 0, 100, []), EncoderPlan("r2", 0, 100, [])]
    sched.update_from_output(output, {"r0": [1], "r1": [], "r2": []})
    # r0 passed its image: its entry is freeable, evicted for r1's.
    assert entries(sched) == ({requests[0].mm_hashes[0]: set()}, [requests[0].mm_hashes[0]])
    output = sched.schedule()
    assert [r.request_id for r in sched.running] == ["r0", "r1", "r2"]
    assert output.num_scheduled_tokens == {"r0": 1, "r1": 700}
    assert output.scheduled_encoder_inputs == {"r1": [0]}
    assert output.free_encoder_mm_hashes == [requests[0].mm_hashes[0]]
    assert [e for e in output.events if isinstance(e, EncoderPlan)] == [
        EncoderPlan("r1", 100, 700, [0]), EncoderPlan("r2", 100, 0, [])]


def test_budget_cuts_the_window_before_the_first_input_that_does_not_fit() -> None:
    """Budget 8 embeds: the first 8-embed input fits, the second does not, so
    the window stops at its offset; the next step encodes it."""
    sched = make_scheduler(max_num_encoder_input_tokens=8)
    request = make_request("r", 40, [(5, 8), (20, 8)])
    sched.add_request(request)
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"r": 20}
    assert output.scheduled_encoder_inputs == {"r": [0]}
    sched.update_from_output(output, {})
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"r": 20}
    assert output.scheduled_encoder_inputs == {"r": [1]}
    assert output.events[0] == EncoderPlan("r", 20, 20, [1])


def test_prefix_hit_inside_an_unavailable_input_skips_the_waiting_request() -> None:
    """A prefix hit (16 tokens) ends inside an input (10, 12) whose entry was
    evicted: the window must start with that input; when the budget left
    cannot encode it the request is skipped (0.33.0: skip, not break) and the
    request behind it is admitted."""
    sched = make_scheduler(max_num_encoder_input_tokens=12, encoder_cache_size=12)
    tokens = list(range(500, 530))
    first = make_request("a", 30, [(10, 12)], token_ids=tokens)
    sched.add_request(first)
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {"a": [0]}
    sched.update_from_output(output, sampled(sched, output))
    # Same prompt (so a 16-token prefix hit), same item; an unrelated request
    # with a 12-embed item first takes this step's budget and evicts a's entry.
    other = make_request("b", 20, [(0, 12)])
    again = make_request("c", 30, [(10, 12)], token_ids=tokens)
    text = make_request("d", 8)
    for r in (other, again, text):
        sched.add_request(r)
    output = sched.schedule()
    assert output.free_encoder_mm_hashes == [first.mm_hashes[0]]
    assert output.num_scheduled_tokens == {"a": 1, "b": 20, "d": 8}
    assert [e for e in output.events if isinstance(e, (EncoderPlan, Skip))] == [
        EncoderPlan("b", 0, 20, [0]), EncoderPlan("c", 16, 0, []),
        Skip("c", "encoder input unavailable")]
    assert "c" in sched.deferred_waiting


# -- the encoder cache ---------------------------------------------------------------
def test_cache_hit_shared_between_two_requests() -> None:
    """The same item (same tokens) in two prompts at different offsets has one
    identifier: the second request, in the same step, hits the entry the first
    allocated; both reference it until each passes it."""
    image = list(range(900, 932))
    a = make_request("a", 72, [(8, 32)], token_ids=list(range(100, 108)) + image + list(range(200, 232)))
    b = make_request("b", 52, [(20, 32)], token_ids=list(range(300, 320)) + image)
    assert a.mm_hashes == b.mm_hashes == (mm_identifier(image),)
    sched = make_scheduler(max_num_encoder_input_tokens=32, encoder_cache_size=32)
    sched.add_request(a)
    sched.add_request(b)
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"a": 72, "b": 52}
    assert output.scheduled_encoder_inputs == {"a": [0]}
    assert [e for e in output.events if isinstance(e, EncoderPlan)] == [
        EncoderPlan("a", 0, 72, [0]), EncoderPlan("b", 0, 52, [])]
    assert entries(sched) == ({a.mm_hashes[0]: {"a", "b"}}, [])
    assert sched.encoder_cache_manager.num_free_slots == 0
    sched.update_from_output(output, sampled(sched, output))
    assert entries(sched) == ({a.mm_hashes[0]: set()}, [a.mm_hashes[0]])
    # A later request with the same item hits the freeable entry: no encode.
    c = make_request("c", 40, [(0, 32)], token_ids=image + list(range(400, 408)))
    sched.add_request(c)
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {}
    assert output.num_scheduled_tokens["c"] == 40
    assert entries(sched) == ({a.mm_hashes[0]: {"c"}}, [])


def test_eviction_oldest_freeable_first() -> None:
    """Entries become freeable in the order requests pass them (a, b, c); a
    new 8-embed input in a 12-embed cache evicts the two oldest, reported once
    in free_encoder_mm_hashes."""
    sched = make_scheduler(max_num_encoder_input_tokens=12, encoder_cache_size=12)
    first = [make_request(name, 10, [(2, 4)]) for name in "abc"]
    for r in first:
        sched.add_request(r)
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {"a": [0], "b": [0], "c": [0]}
    sched.update_from_output(output, sampled(sched, output))
    assert entries(sched)[1] == [r.mm_hashes[0] for r in first]
    d = make_request("d", 10, [(0, 8)])
    sched.add_request(d)
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {"d": [0]}
    assert output.free_encoder_mm_hashes == [first[0].mm_hashes[0], first[1].mm_hashes[0]]
    assert entries(sched) == ({first[2].mm_hashes[0]: set(), d.mm_hashes[0]: {"d"}}, [first[2].mm_hashes[0]])
    assert sched.schedule().free_encoder_mm_hashes == []  # reported once


def test_manager_repeated_item_keeps_its_reference_until_the_last_occurrence() -> None:
    """One request carrying the same item twice: a same-step duplicate, one
    allocation; the entry stays referenced until both occurrences are freed."""
    image = [7, 8, 9, 10]
    request = make_request("r", 12, [(0, 4), (6, 4)], token_ids=image + [1, 2] + image + [3, 4])
    sched = make_scheduler()
    sched.add_request(request)
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {"r": [0]}
    manager = sched.encoder_cache_manager
    assert manager.get_cached_input_ids(request) == {0, 1}
    assert manager.num_free_slots == 1024 - 4
    manager.free_encoder_input(request, 0)
    assert entries(sched) == ({request.mm_hashes[0]: {"r"}}, [])
    manager.free_encoder_input(request, 1)
    assert entries(sched) == ({request.mm_hashes[0]: set()}, [request.mm_hashes[0]])


def test_manager_eviction_needs_room_in_free_plus_freeable() -> None:
    manager = EncoderCacheManager(10)
    a, b = make_request("a", 6, [(0, 6)]), make_request("b", 6, [(0, 6)])
    assert manager.can_allocate(a, 0, 100, 0)
    manager.allocate(a, 0)
    assert not manager.can_allocate(b, 0, 100, 0)  # 6 > 4 free + 0 freeable
    assert not manager.can_allocate(b, 0, 5, 0)    # over the compute budget
    manager.free(a)
    assert manager.can_allocate(b, 0, 100, 0) and manager.freed == [a.mm_hashes[0]]
    assert manager.get_freed_mm_hashes() == [a.mm_hashes[0]] and manager.freed == []


# -- freeing -------------------------------------------------------------------------
def test_free_encoder_inputs_unchanged_without_spec_decode() -> None:
    """Freed at the update of the step whose computed count passes the item's
    end; an item the step only reached stays referenced."""
    sched = make_scheduler(long_prefill_token_threshold=10)
    request = make_request("r", 30, [(2, 4), (8, 6)])
    sched.add_request(request)
    sched.add_request(make_request("other", 4))  # two eligible: the threshold applies
    output = sched.schedule()
    assert output.num_scheduled_tokens["r"] == 10
    assert output.scheduled_encoder_inputs["r"] == [0, 1]
    sched.update_from_output(output, sampled(sched, output))
    assert sched.encoder_cache_manager.get_cached_input_ids(request) == {1}  # (8, 6) ends at 14 > 10
    assert entries(sched)[1] == [request.mm_hashes[0]]


def test_free_encoder_inputs_respects_unconfirmed_placeholders() -> None:
    """Async scheduling: the step that completes the prompt (ending with an
    item) leaves one output placeholder, so computed - placeholders stops one
    short of the item's end: the entry is kept until a later update."""
    sched = make_scheduler(async_scheduling=True)
    request = make_request("r", 8, [(4, 4)])
    sched.add_request(request)
    first = sched.schedule()
    second = sched.schedule()
    assert (first.num_scheduled_tokens, second.num_scheduled_tokens) == ({"r": 8}, {"r": 1})
    assert (request.num_computed_tokens, request.num_output_placeholders) == (9, 2)
    sched.update_from_output(first, {"r": [1]})
    assert sched.encoder_cache_manager.get_cached_input_ids(request) == {0}  # 9 - 2 = 7 < 8
    sched.update_from_output(second, {"r": [2]})
    assert sched.encoder_cache_manager.get_cached_input_ids(request) == set()


def _preempt_setup(**overrides):
    """FCFS, 4 usable blocks of 4 tokens, threshold 6: b (4 tokens, 2 outputs)
    and a (12 tokens, an item at (4, 4)) are admitted; a's first chunk [0, 6)
    encodes the item; next step b's decode takes the last block and a, the
    tail, preempts itself while still referencing the item (6 < 8 computed);
    b then finishes, freeing its blocks."""
    config = dict(num_gpu_blocks=5, block_size=4, max_model_len=16, max_num_batched_tokens=64, max_num_seqs=4,
                  scheduler_reserve_full_isl=False, long_prefill_token_threshold=6)
    config.update(overrides)
    sched = Scheduler(EngineConfig(**config))
    b = make_request("b", 4, block_size=4, max_tokens=2)
    a = make_request("a", 12, [(4, 4)], block_size=4)
    sched.add_request(b)
    sched.add_request(a)
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"b": 4, "a": 6}
    assert output.scheduled_encoder_inputs == {"a": [0]}
    sched.update_from_output(output, {"b": [1]})
    assert entries(sched) == ({a.mm_hashes[0]: {"a"}}, [])
    output = sched.schedule()
    assert [type(e).__name__ for e in output.events] == ["ScheduledRequest", "EncoderPlan", "Preemption"]
    assert output.events[1] == EncoderPlan("a", 6, 6, [])  # a hit on its own entry
    assert output.preemptions[0].request_id == "a"
    assert [f.request_id for f in sched.update_from_output(output, {"b": [1]}).finished] == ["b"]
    return sched, a, b


def test_encoder_cache_retained_across_preemption_and_resume() -> None:
    """Preemption only makes the entry freeable; the resumed request (prefix
    hit of 4 tokens) hits it: nothing is encoded again."""
    sched, a, _ = _preempt_setup()
    assert entries(sched) == ({a.mm_hashes[0]: set()}, [a.mm_hashes[0]])
    output = sched.schedule()
    resumed = [e for e in output.events if isinstance(e, ScheduledRequest) and e.request_id == "a"]
    assert resumed == [ScheduledRequest("a", "resumed", 4, 8, 4, resumed[0].new_block_ids, [], [])]
    assert EncoderPlan("a", 4, 8, []) in output.events
    assert output.scheduled_encoder_inputs == {}
    assert entries(sched) == ({a.mm_hashes[0]: {"a"}}, [])


def test_encoder_cache_recomputed_when_evicted_during_preemption() -> None:
    """While a is preempted another input evicts its freeable entry (a 4-embed
    cache): the resumed a encodes its item again. The eviction is not
    reported in that step's free_encoder_mm_hashes because the identifier is
    cached again by then (vLLM's get_freed_mm_hashes keeps the worker's
    tensor, which the new encode overwrites)."""
    sched, a, _ = _preempt_setup(encoder_cache_size=4)
    manager = sched.encoder_cache_manager
    other = make_request("x", 4, [(0, 4)])
    assert manager.can_allocate(other, 0, 4, 0)  # evicts a's entry
    assert manager.freed == [a.mm_hashes[0]] and a.mm_hashes[0] not in manager.cached
    output = sched.schedule()
    assert EncoderPlan("a", 4, 8, [0]) in output.events
    assert output.scheduled_encoder_inputs == {"a": [0]}
    assert output.free_encoder_mm_hashes == []
    assert entries(sched) == ({a.mm_hashes[0]: {"a"}}, [])


def _give_back_setup(scheduler_class: type[Scheduler] = Scheduler, **overrides):
    """PRIORITY, 5 usable blocks of 4 tokens, an encoder budget of one 4-embed
    item, requests placed in running directly (running order v, r, r2):
    v (priority 5) and r2 (priority 1) each have 4 of 8 tokens computed and
    both blocks allocated, their next 4 tokens an item (4, 4); r (priority 0)
    has 4 of 8 text tokens computed and one block. No block is free."""
    config = dict(num_gpu_blocks=6, block_size=4, max_model_len=16, max_num_batched_tokens=64, max_num_seqs=4,
                  policy="priority", scheduler_reserve_full_isl=False, max_num_encoder_input_tokens=4)
    config.update(overrides)
    sched = scheduler_class(EngineConfig(**config))
    v = make_request("v", 8, [(4, 4)], priority=5, block_size=4)
    r = make_request("r", 8, priority=0, block_size=4)
    r2 = make_request("r2", 8, [(4, 4)], priority=1, block_size=4)
    for request, computed, slots in ((v, 4, 8), (r, 4, 4), (r2, 4, 8)):
        sched.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        assert sched.kv_cache_manager.allocate_slots(request, slots) is not None
        request.num_computed_tokens = computed
        request.is_prefill_chunk = True
        sched.running.append(request)
    assert sched.kv_cache_manager.num_free_blocks == 0
    return sched, v, r, r2


def test_priority_give_back_restores_the_encoder_budget() -> None:
    """v encodes its item (budget 4 -> 0); r needs a block, so v, the lowest
    priority, is withdrawn (giving back its item) and preempted; r has no
    item, so the restored budget stands and r2 encodes its item."""
    sched, v, _, r2 = _give_back_setup()
    output = sched.schedule()
    kinds = [(type(e).__name__, e.request_id) for e in output.events]
    assert kinds == [("EncoderPlan", "v"), ("ScheduledRequest", "v"), ("Withdrawal", "v"),
                     ("Preemption", "v"), ("ScheduledRequest", "r"), ("EncoderPlan", "r2"),
                     ("ScheduledRequest", "r2")]
    withdrawal = output.events[2]
    assert withdrawal == Withdrawal("v", 4, [], [0])
    assert output.events[5] == EncoderPlan("r2", 4, 4, [0])
    assert output.num_scheduled_tokens == {"r": 4, "r2": 4}
    assert output.scheduled_encoder_inputs == {"r2": [0]}
    # v's allocation was released by its preemption: freeable, not evicted.
    assert entries(sched) == ({v.mm_hashes[0]: set(), r2.mm_hashes[0]: {"r2"}}, [v.mm_hashes[0]])


def test_priority_give_back_without_encoder_restore_starves_the_next_request() -> None:
    """The no-encoder-give-back mutant keeps v's embeds spent: r2's window is
    cut to 0 before its item and r2 is not scheduled."""
    broken, *_ = _give_back_setup(NoEncoderGiveBack)
    output = broken.schedule()
    assert EncoderPlan("r2", 4, 0, []) in output.events
    assert output.num_scheduled_tokens == {"r": 4}


def test_give_back_is_lost_when_the_preempting_request_encodes() -> None:
    """vLLM 0.33.0 commits a request's encoder budget as computed before its
    allocation loop: when r itself encodes an input, the budget v gave back
    while r allocated is overwritten, so r2 (budget 8: v 4 + r 4) is cut."""
    sched, _, r, _ = _give_back_setup(max_num_encoder_input_tokens=8)
    r.mm_positions = ((4, 4),)
    r.mm_hashes = (mm_identifier(r.prompt_token_ids[4:8]),)
    output = sched.schedule()
    assert [e for e in output.events if isinstance(e, EncoderPlan)] == [
        EncoderPlan("v", 4, 4, [0]), EncoderPlan("r", 4, 4, [0]), EncoderPlan("r2", 4, 0, [])]
    assert output.events[3] == Withdrawal("v", 4, [], [0])
    assert output.scheduled_encoder_inputs == {"r": [0]}
    assert output.num_scheduled_tokens == {"r": 4}


# -- chunking off, admissibility, the livelock finding -------------------------------
def test_no_mm_input_chunking() -> None:
    """vLLM's test: with disable_chunked_mm_input only the 400 text tokens
    before the 800-token image are scheduled, then the whole image."""
    sched = make_scheduler(disable_chunked_mm_input=True)
    request = make_request("r", 1200, [(400, 800)])
    sched.add_request(request)
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"r": 400}
    assert output.scheduled_encoder_inputs == {}
    sched.update_from_output(output, {})
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"r": 800}
    assert output.scheduled_encoder_inputs == {"r": [0]}
    # vLLM refuses to start with an item over max_num_batched_tokens; the
    # reference refuses such a request at arrival.
    config = EngineConfig(max_num_batched_tokens=100, max_model_len=200, max_num_seqs=4, encoder_cache_size=200,
                          max_num_encoder_input_tokens=200, disable_chunked_mm_input=True)
    spec = RequestSpec("r", 0.0, tuple(range(10, 130)), 4, mm_positions=((0, 100),))
    assert reject_reason(spec, config) is None
    spec = RequestSpec("r", 0.0, tuple(range(10, 130)), 4, mm_positions=((0, 101),))
    assert reject_reason(spec, config) == \
        "encoder input 0 has 101 tokens, more than a step's 100 with disable_chunked_mm_input"


def test_reject_reason_for_encoder_inputs() -> None:
    config = EngineConfig(max_num_batched_tokens=64, max_model_len=128, max_num_seqs=4,
                          max_num_encoder_input_tokens=16, encoder_cache_size=24)
    def spec(*positions):
        return RequestSpec("r", 0.0, tuple(range(10, 110)), 4, mm_positions=positions)
    assert reject_reason(spec((0, 16), (20, 16)), config) is None
    assert reject_reason(spec((0, 25)), config) == \
        "encoder input 0 has 25 embeds, more than the encoder cache size 24"
    assert reject_reason(spec((0, 4), (10, 17)), config) == \
        "encoder input 1 has 17 embeds, more than the encoder compute budget 16 (max_num_encoder_input_tokens)"
    threshold = EngineConfig(max_num_batched_tokens=64, max_model_len=128, max_num_seqs=4,
                             long_prefill_token_threshold=12, disable_chunked_mm_input=True)
    assert reject_reason(spec((0, 13)), threshold) == \
        "encoder input 0 has 13 tokens, more than a step's 12 with disable_chunked_mm_input"


def test_no_mm_input_chunking_under_a_threshold_livelocks_in_vllm() -> None:
    """Why such requests are refused: with disable_chunked_mm_input and
    long_prefill_token_threshold 8 < an item's 12 tokens, every window
    reaching the item is capped at 8, cannot cover it and rolls back to the
    item's start: two such requests are skipped forever (vLLM 0.33.0 accepts
    this configuration)."""
    sched = make_scheduler(disable_chunked_mm_input=True, long_prefill_token_threshold=8)
    for name in "ab":
        sched.add_request(make_request(name, 20, [(4, 12)]))
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"a": 4, "b": 4}
    sched.update_from_output(output, {})
    for _ in range(5):
        output = sched.schedule()
        assert output.num_scheduled_tokens == {}
        assert [e for e in output.events if isinstance(e, EncoderPlan)] == [
            EncoderPlan("a", 4, 0, []), EncoderPlan("b", 4, 0, [])]
        sched.update_from_output(output, {})


# -- prefix caching ------------------------------------------------------------------
def test_mm_prefix_caching() -> None:
    """Block hashes carry (identifier, offset in the block) for each item
    overlapping the block: the same tokens as text, or with the item at
    another offset, hash differently; the same tokens and items hit."""
    tokens = list(range(100, 132))
    with_item = make_request("a", 32, [(4, 8)], token_ids=tokens)
    text = make_request("b", 32, token_ids=tokens)
    shifted = make_request("c", 32, [(5, 7)], token_ids=tokens)
    same = make_request("d", 32, [(4, 8)], token_ids=tokens)
    assert with_item.block_hashes[0] != text.block_hashes[0]
    assert with_item.block_hashes[0] != shifted.block_hashes[0]
    assert with_item.block_hashes == same.block_hashes
    assert text.block_hashes[1] != with_item.block_hashes[1]  # chained: the parent differs
    sched = make_scheduler()
    sched.add_request(with_item)
    output = sched.schedule()
    sched.update_from_output(output, sampled(sched, output))
    for r in (text, same):
        sched.add_request(r)
    output = sched.schedule()
    hits = {e.request_id: e.num_prefix_hit_tokens for e in output.events if isinstance(e, ScheduledRequest)}
    assert hits == {"a": 0, "b": 0, "d": 16}


# -- workloads, config, traces -------------------------------------------------------
def test_request_spec_validates_mm_positions() -> None:
    prompt = tuple(range(10, 30))
    assert RequestSpec("r", 0.0, prompt, 4, mm_positions=[[0, 4], [4, 2]]).mm_positions == ((0, 4), (4, 2))
    for positions, message in (
            (((2, 4), (5, 2)), r"mm_positions\[1\] = \(5, 2\) starts before the previous item ends \(token 6\)"),
            (((18, 4),), r"mm_positions\[0\] = \(18, 4\) ends at token 22, past the 20-token prompt"),
            (((0, 0),), r"needs offset >= 0 and length >= 1"),
            (((1.5, 2),), r"must be an \(offset, length\) pair of ints"),
            ((3,), r"mm_positions must be a sequence of \(offset, length\) pairs")):
        with pytest.raises(WorkloadError, match=message):
            RequestSpec("r", 0.0, prompt, 4, mm_positions=positions)


def test_synthetic_mm_items() -> None:
    plain = synthetic(6, seed=3)
    with_mm = synthetic(6, seed=3, mm_fraction=0.5, mm_item_len=4, mm_items_per_request=2, mm_distinct_items=2)
    assert "mm_fraction" not in plain.params and synthetic(6, seed=3, mm_item_len=9) == plain
    assert with_mm.params["mm_distinct_items"] == 2 and with_mm.sha256 != plain.sha256
    assert plain.sha256 == "10dae94a819aa0896f9ef6a7bd3ed4a3fdb09d687352ff04088df0375964a0aa"
    chosen = [r for r in with_mm.requests if r.mm_positions]
    assert [(r.request_id, r.mm_positions) for r in chosen] == [
        ("r000002", ((2, 4), (17, 4))), ("r000004", ((1, 4), (32, 4))), ("r000005", ((10, 4), (28, 4)))]
    for new, old in zip(with_mm.requests, plain.requests):
        assert (new.arrival_time, new.max_tokens) == (old.arrival_time, old.max_tokens)
        assert len(new.prompt_token_ids) == len(old.prompt_token_ids) + 8 * bool(new.mm_positions)
    items = {mm_identifier(r.prompt_token_ids[o:o + n]) for r in chosen for o, n in r.mm_positions}
    assert len(items) == 2  # a pool of two items, shared across requests
    with pytest.raises(WorkloadError, match="mm_item_len must be an int >= 1"):
        synthetic(2, mm_fraction=0.5, mm_item_len=0)


def test_encoder_config_keys() -> None:
    config = EngineConfig()
    for key in ("max_num_encoder_input_tokens", "encoder_cache_size", "disable_chunked_mm_input"):
        assert key not in config.to_dict()
    assert (config.encoder_compute_budget, config.encoder_cache_capacity) == (2048, 2048)
    custom = EngineConfig(max_num_encoder_input_tokens=100, encoder_cache_size=300)
    assert (custom.encoder_compute_budget, custom.encoder_cache_capacity) == (100, 300)
    assert custom.to_dict()["encoder_cache_size"] == 300
    with pytest.raises(ConfigError, match="encoder_cache_size must be a positive integer"):
        EngineConfig(encoder_cache_size=0)
    with pytest.raises(ConfigError, match="disable_chunked_mm_input must be true or false"):
        EngineConfig(disable_chunked_mm_input="yes")
    assert config.with_overrides({"max_num_encoder_input_tokens": "64"}).encoder_compute_budget == 64


def test_encoder_inputs_scenario_trace(tmp_path) -> None:
    """The canonical scenario: recorded, every invariant holds, replays
    identically; the trace carries items, plans, encodes and evictions."""
    scenario = SCENARIOS["encoder-inputs"]
    path = tmp_path / "enc.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed)
    trace = open_trace(path)
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert result.ok and (result.steps, result.preemptions) == (485, 105)
    assert replay(trace, Scheduler) == (None, 485)
    table = pq.read_table(path, columns=["kind", "encoder_input_ids", "free_encoder_mm_hashes", "message",
                                         "mm_positions"]).to_pylist()
    kinds = [row["kind"] for row in table]
    encoded = sum(len(row["encoder_input_ids"] or ()) for row in table if row["kind"] == "schedule")
    evicted = sum(len(row["free_encoder_mm_hashes"] or ()) for row in table)
    skips = sum(row["message"] == "encoder input unavailable" for row in table)
    given_back = [row["encoder_input_ids"] for row in table if row["kind"] == "withdraw" and row["encoder_input_ids"]]
    assert (kinds.count("encoder_plan"), encoded, evicted, skips, len(given_back)) == (753, 180, 172, 27, 1)
    assert all(len(row["mm_positions"]) == 6 for row in table if row["kind"] == "arrival")


def test_schema_3_trace_without_encoder_columns_still_reads(tmp_path, schema3_copy) -> None:
    """A trace written before encoder inputs (schema 3, without the three
    columns) reads with them null, checks clean and replays identically."""
    scenario = SCENARIOS["priority-tight"]
    path = tmp_path / "new.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed)
    trace = open_trace(schema3_copy(path, tmp_path / "old.parquet"))
    assert check_steps(trace.meta["config"], trace.iter_steps()).ok
    assert replay(trace, Scheduler) == (None, 221)


# (The checker's encoder tests are in tests/check/test_encoder_family.py.)


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_encoder_decisions_identical_to_vllm() -> None:
    """Real vLLM 0.33.0's Scheduler, given multimodal items, its own
    EncoderCacheManager and budget, makes the reference's decisions on every
    step of 60 random workloads (tests/vllm_encoder_diff.py)."""
    from harness.candidates.vllm.env import ensure_env

    python = ensure_env("0.33.0")
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([str(python), str(repo / "tests" / "vllm_encoder_diff.py"), "60"], cwd=repo,
                          capture_output=True, text=True, timeout=900)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0 and last.startswith("bad 0 of 60"), last
