"""Unit tests for the scheduler (spec sections 3, 4, 6 and the 0.33.0 deltas of 10).

``Scheduler(EngineConfig(...))`` is driven directly with ``Request`` objects:
``schedule()`` then ``update_from_output(output, {req_id: [token]})``. Every test
asserts exact token counts, block ids and queue orders. Names mirror the vLLM
test they reproduce (``tests/v1/core/test_scheduler.py``, spec 9.1) where one
exists.
"""

from __future__ import annotations

import itertools

import pytest

from reference.config import ConfigError, EngineConfig
from reference.request import Request, RequestStatus, SamplingParams
from reference.output import Withdrawal
from reference.scheduler import Preemption, ScheduledRequest, Scheduler, SchedulerOutput

BS = 16
TOKEN = 1  # a sampled token that is never EOS / stop in these tests

_TOKEN_BASES = itertools.count(10_000, 10_000)


# -- helpers -------------------------------------------------------------------
def make_scheduler(**overrides) -> Scheduler:
    config = dict(num_gpu_blocks=101, block_size=BS, max_model_len=512, max_num_seqs=16,
                  max_num_batched_tokens=2048)
    config.update(overrides)
    return Scheduler(EngineConfig(**config))


def make_request(request_id: str, num_tokens: int, *, token_ids: list[int] | None = None,
                 max_tokens: int = 16, arrival_time: float = 0.0, priority: int = 0,
                 **sampling) -> Request:
    """A request whose prompt tokens are unique unless ``token_ids`` is given."""
    if token_ids is None:
        base = next(_TOKEN_BASES)
        token_ids = list(range(base, base + num_tokens))
    assert len(token_ids) == num_tokens
    return Request(request_id, token_ids, SamplingParams(max_tokens=max_tokens, **sampling),
                   arrival_time=arrival_time, priority=priority, block_size=BS)


def sampled_for(sched: Scheduler, output: SchedulerOutput, token: int = TOKEN) -> dict[str, list[int]]:
    """What the model returns: one token per request whose prefill is complete."""
    return {rid: [token] for rid in output.num_scheduled_tokens
            if rid in sched.requests and not sched.requests[rid].is_prefill_chunk}


def step(sched: Scheduler, token: int = TOKEN):
    output = sched.schedule()
    result = sched.update_from_output(output, sampled_for(sched, output, token))
    return output, result


def scheduled(output: SchedulerOutput) -> list[tuple[str, str, int, int, list[int]]]:
    """(id, kind, computed before, scheduled tokens, new block ids) per scheduled request."""
    return [(s.request_id, s.kind, s.num_computed_tokens, s.num_scheduled_tokens, s.new_block_ids)
            for s in output.scheduled]


def waiting_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


def running_ids(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.running]


def free_queue(sched: Scheduler) -> list[int]:
    return sched.kv_cache_manager.block_pool.free_block_queue.block_ids()


# -- FCFS admission ------------------------------------------------------------------
def test_add_requests_and_get_num_unfinished_requests():
    sched = make_scheduler()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 10))
        assert len(sched.waiting) == i + 1
        assert f"r{i}" in sched.requests
    assert sched.get_num_unfinished_requests() == 3
    with pytest.raises(ValueError):
        sched.add_request(make_request("r0", 10))


def test_schedule():
    """vLLM ``test_schedule``: everything fits, so all requests are admitted in
    one step, in arrival order, with their full prompt lengths."""
    sched = make_scheduler()
    lengths = [10, 20, 16, 33, 1, 47]
    for i, n in enumerate(lengths):
        sched.add_request(make_request(f"r{i}", n))
    output = sched.schedule()
    assert scheduled(output) == [
        ("r0", "new", 0, 10, [1]),
        ("r1", "new", 0, 20, [2, 3]),
        ("r2", "new", 0, 16, [4]),
        ("r3", "new", 0, 33, [5, 6, 7]),
        ("r4", "new", 0, 1, [8]),
        ("r5", "new", 0, 47, [9, 10, 11]),
    ]
    assert output.num_scheduled_tokens == {f"r{i}": n for i, n in enumerate(lengths)}
    assert list(output.num_scheduled_tokens) == [f"r{i}" for i in range(6)]
    assert output.total_num_scheduled_tokens == 127
    assert output.token_budget == 2048 - 127
    assert output.preempted_req_ids == set()
    assert output.finished_req_ids == set()
    assert running_ids(sched) == [f"r{i}" for i in range(6)]
    assert len(sched.waiting) == 0
    for i, n in enumerate(lengths):
        request = sched.requests[f"r{i}"]
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens == n
        assert request.is_prefill_chunk is False


def test_token_budget_chunks_prefill_and_continues_in_running_loop():
    """Budget 100, prompts 80 and 80: 80 + 20 in step 1; step 2 decodes r0 (1)
    and finishes r1's prefill (60); step 3 decodes both. The partial chunk
    gets no sampled token."""
    sched = make_scheduler(num_gpu_blocks=33, max_model_len=256, max_num_seqs=4,
                           max_num_batched_tokens=100)
    sched.add_request(make_request("r0", 80))
    sched.add_request(make_request("r1", 80))

    out1 = sched.schedule()
    assert scheduled(out1) == [("r0", "new", 0, 80, [1, 2, 3, 4, 5]),
                               ("r1", "new", 0, 20, [6, 7])]
    assert out1.total_num_scheduled_tokens == 100
    assert out1.token_budget == 0
    assert sched.requests["r0"].is_prefill_chunk is False
    assert sched.requests["r1"].is_prefill_chunk is True
    result = sched.update_from_output(out1, {"r0": [TOKEN]})
    assert result.new_token_ids == {"r0": [TOKEN]}
    assert sched.requests["r1"].num_output_tokens == 0
    assert sched.requests["r1"].num_computed_tokens == 20

    out2, result = step(sched)
    assert scheduled(out2) == [("r0", "running", 80, 1, [8]),
                               ("r1", "running", 20, 60, [9, 10, 11])]
    assert out2.total_num_scheduled_tokens == 61
    assert result.new_token_ids == {"r0": [TOKEN], "r1": [TOKEN]}

    out3, _ = step(sched)
    assert scheduled(out3) == [("r0", "running", 81, 1, []),
                               ("r1", "running", 80, 1, [12])]


def test_schedule_concurrent_partial_requests_threshold_caps_each_request():
    """long_prefill_token_threshold 30 with two eligible requests: 30 each."""
    sched = make_scheduler(num_gpu_blocks=65, max_model_len=512, max_num_seqs=4,
                           max_num_batched_tokens=100, long_prefill_token_threshold=30)
    sched.add_request(make_request("r0", 80))
    sched.add_request(make_request("r1", 80))
    out1, _ = step(sched)
    assert out1.num_scheduled_tokens == {"r0": 30, "r1": 30}
    out2, _ = step(sched)
    assert out2.num_scheduled_tokens == {"r0": 30, "r1": 30}
    out3, _ = step(sched)
    assert out3.num_scheduled_tokens == {"r0": 20, "r1": 20}


def test_long_prefill_threshold_not_applied_to_a_single_request():
    """0.33.0 (spec 10.3): with one eligible request there is nobody to starve,
    so no cap (200-token prompt gets the full budget of 100). Once a second
    request arrives the cap applies to both loops."""
    sched = make_scheduler(num_gpu_blocks=65, max_model_len=512, max_num_seqs=4,
                           max_num_batched_tokens=100, long_prefill_token_threshold=30)
    sched.add_request(make_request("r0", 200))
    out1, _ = step(sched)
    assert out1.num_scheduled_tokens == {"r0": 100}
    sched.add_request(make_request("r1", 80))
    out2, _ = step(sched)
    assert out2.num_scheduled_tokens == {"r0": 30, "r1": 30}
    assert scheduled(out2)[0][1:3] == ("running", 100)


def test_schedule_order_chunked_prefill_disabled_stops_admission():
    """vLLM ``test_schedule_order``: with chunked prefill off, a waiting request
    that does not fit the remaining budget stops admission; the shorter one
    behind it is not admitted either (break, no skipping)."""
    sched = make_scheduler(num_gpu_blocks=33, max_model_len=100, max_num_seqs=4,
                           max_num_batched_tokens=100, enable_chunked_prefill=False)
    for rid, n in (("r0", 60), ("r1", 50), ("r2", 10)):
        sched.add_request(make_request(rid, n))
    out1, _ = step(sched)
    assert scheduled(out1) == [("r0", "new", 0, 60, [1, 2, 3, 4])]
    assert out1.token_budget == 40
    assert waiting_ids(sched) == ["r1", "r2"]

    out2, _ = step(sched)
    assert scheduled(out2) == [("r0", "running", 60, 1, []),
                               ("r1", "new", 0, 50, [5, 6, 7, 8]),
                               ("r2", "new", 0, 10, [9])]


def test_schedule_order_chunked_prefill_enabled_chunks_instead():
    sched = make_scheduler(num_gpu_blocks=33, max_model_len=100, max_num_seqs=4,
                           max_num_batched_tokens=100)
    for rid, n in (("r0", 60), ("r1", 50), ("r2", 10)):
        sched.add_request(make_request(rid, n))
    out1 = sched.schedule()
    assert out1.num_scheduled_tokens == {"r0": 60, "r1": 40}
    assert waiting_ids(sched) == ["r2"]


def test_max_num_seqs_stops_admission():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    sched.add_request(make_request("r0", 10, max_tokens=1))
    sched.add_request(make_request("r1", 10))
    sched.add_request(make_request("r2", 10))
    out1, result = step(sched)
    assert scheduled(out1) == [("r0", "new", 0, 10, [1]), ("r1", "new", 0, 10, [2])]
    assert waiting_ids(sched) == ["r2"]
    # r0 hit max_tokens=1 and left; its slot frees up for r2.
    assert [f.request_id for f in result.finished] == ["r0"]
    out2, _ = step(sched)
    assert out2.finished_req_ids == {"r0"}
    assert scheduled(out2) == [("r1", "running", 10, 1, []), ("r2", "new", 0, 10, [1])]
    assert running_ids(sched) == ["r1", "r2"]


def test_prefix_caching_for_prefill_dedup():
    """vLLM ``test_prefix_caching_for_prefill_dedup``: blocks are cached at
    scheduling time, so an identical prompt admitted later in the same step
    hits them and schedules only prompt_len % bs tokens."""
    sched = make_scheduler()
    prompt = list(range(40))
    sched.add_request(make_request("r0", 40, token_ids=prompt))
    sched.add_request(make_request("r1", 40, token_ids=prompt))
    output = sched.schedule()
    assert scheduled(output) == [("r0", "new", 0, 40, [1, 2, 3]),
                                 ("r1", "new", 32, 8, [1, 2, 4])]
    assert [s.num_prefix_hit_tokens for s in output.scheduled] == [0, 32]
    blocks = sched.kv_cache_manager.block_pool.blocks
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]


def test_block_aligned_same_step_duplicate_recomputes_last_block():
    sched = make_scheduler()
    prompt = list(range(32))
    sched.add_request(make_request("r0", 32, token_ids=prompt))
    sched.add_request(make_request("r1", 32, token_ids=prompt))
    output = sched.schedule()
    assert scheduled(output) == [("r0", "new", 0, 32, [1, 2]),
                                 ("r1", "new", 16, 16, [1, 3])]


# -- preemption ----------------------------------------------------------------------
def test_fcfs_preemption_victim_is_running_tail_and_resumes_with_prefix_hit():
    """Pool of 5 blocks (4 usable). r0 and r1 (32 tokens each) fill it in
    step 1. In step 2 r0's decode needs a 3rd block: the victim is the running
    tail r1, which frees [4, 3] (both hashed -> tail of the queue); r0 then
    pops block 4. r1 ends PREEMPTED, 0 computed, no blocks, at the head of
    waiting (ahead of r2, which was already waiting); nothing is admitted
    that step.
    r0 finishes (max_tokens 2) and frees [4, 2, 1]. In step 3 r1 resumes:
    its first block (3) is still cached (16-token hit; its second block's
    hash went with block 4), it schedules 33 - 16 = 17 tokens and r2 follows.
    """
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=64)
    sched.add_request(make_request("r0", 32, max_tokens=2))
    sched.add_request(make_request("r1", 32))
    out1, _ = step(sched)
    assert scheduled(out1) == [("r0", "new", 0, 32, [1, 2]), ("r1", "new", 0, 32, [3, 4])]
    assert free_queue(sched) == []

    sched.add_request(make_request("r2", 10))
    out2 = sched.schedule()
    assert out2.events == [
        Preemption("r1", 32, [4, 3]),
        ScheduledRequest("r0", "running", 32, 1, 0, [4]),
    ]
    assert out2.num_scheduled_tokens == {"r0": 1}
    assert out2.preempted_req_ids == {"r1"}
    r1 = sched.requests["r1"]
    assert r1.status == RequestStatus.PREEMPTED
    assert r1.num_computed_tokens == 0
    assert r1.num_preemptions == 1
    assert r1.num_tokens == 33  # keeps its prompt + generated token
    assert sched.kv_cache_manager.get_block_ids("r1") == []
    assert running_ids(sched) == ["r0"]
    assert waiting_ids(sched) == ["r1", "r2"]
    assert free_queue(sched) == [3]

    result = sched.update_from_output(out2, sampled_for(sched, out2))
    assert [(f.request_id, f.status, f.freed_block_ids) for f in result.finished] == [
        ("r0", RequestStatus.FINISHED_LENGTH_CAPPED, [4, 2, 1])]
    assert free_queue(sched) == [4, 3, 2, 1]

    out3 = sched.schedule()
    assert out3.finished_req_ids == {"r0"}
    assert out3.preempted_req_ids == set()
    assert scheduled(out3) == [("r1", "resumed", 16, 17, [3, 4, 2]),
                               ("r2", "new", 0, 10, [1])]
    assert out3.scheduled[0].num_prefix_hit_tokens == 16
    assert running_ids(sched) == ["r1", "r2"]
    assert sched.requests["r1"].status == RequestStatus.RUNNING


def test_preempted_request_not_resumed_in_same_step():
    """Preemption in the running loop skips the whole waiting phase."""
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=64)
    sched.add_request(make_request("r0", 32))
    sched.add_request(make_request("r1", 32))
    step(sched)
    output = sched.schedule()
    assert [type(e).__name__ for e in output.events] == ["Preemption", "ScheduledRequest"]
    assert "r1" not in output.num_scheduled_tokens
    assert sched.requests["r1"].status == RequestStatus.PREEMPTED


def test_priority_no_admission_in_a_preempting_step_even_if_head_fits():
    """Pool of 5. X (priority 1) and Y (priority 9) fill it in step 1. W
    (priority 0, 5 tokens) arrives. In step 2 X's decode preempts Y (the
    lowest priority), which frees [4, 3]; X takes 4, so block 3 is free and W
    (head of the priority queue) would fit, but the waiting phase does not run
    in a step that preempted. W is admitted in step 3 with block 3."""
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=64, policy="priority")
    sched.add_request(make_request("X", 32, priority=1, arrival_time=0.0))
    sched.add_request(make_request("Y", 32, priority=9, arrival_time=1.0))
    out1, _ = step(sched)
    assert scheduled(out1) == [("X", "new", 0, 32, [1, 2]), ("Y", "new", 0, 32, [3, 4])]
    sched.add_request(make_request("W", 5, priority=0, arrival_time=2.0))

    out2 = sched.schedule()
    assert out2.events == [
        Preemption("Y", 32, [4, 3]),
        ScheduledRequest("X", "running", 32, 1, 0, [4]),
    ]
    assert out2.num_scheduled_tokens == {"X": 1}
    assert free_queue(sched) == [3]
    assert waiting_ids(sched) == ["W", "Y"]
    sched.update_from_output(out2, sampled_for(sched, out2))

    out3 = sched.schedule()
    assert scheduled(out3) == [("X", "running", 33, 1, []), ("W", "new", 0, 5, [3])]
    assert waiting_ids(sched) == ["Y"]


def _two_running_priority_requests(policy: str, a_prompt: int):
    """Pool of 5 (4 usable). A (priority 5, arrival 0, ``a_prompt`` tokens,
    blocks [1, 2]) runs alone in step 1; B (priority 0 = higher, arrival 1,
    32 tokens) is admitted in step 2 with [3, 4]. After step 2 both are
    decoding and the pool is full."""
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=64, policy=policy)
    sched.add_request(make_request("A", a_prompt, priority=5, arrival_time=0.0))
    out1, _ = step(sched)
    assert scheduled(out1) == [("A", "new", 0, a_prompt, [1, 2])]
    sched.add_request(make_request("B", 32, priority=0, arrival_time=1.0))
    out2, _ = step(sched)
    assert scheduled(out2) == [("A", "running", a_prompt, 1, []), ("B", "new", 0, 32, [3, 4])]
    assert free_queue(sched) == []
    return sched


def test_priority_preemption_gives_back_budget_of_already_scheduled_victim():
    """PRIORITY: A (decode fits its 2 blocks) is scheduled first; B then needs
    a 3rd block. The victim is max(priority, arrival) = A, already scheduled
    this step: a Withdrawal follows its ScheduledRequest in the events, it
    leaves num_scheduled_tokens and ``scheduled`` and its token is given
    back. A frees [2, 1] (2 is a partial unhashed block -> head), and B takes
    block 2."""
    sched = _two_running_priority_requests("priority", a_prompt=20)
    out3 = sched.schedule()
    assert out3.events == [
        ScheduledRequest("A", "running", 21, 1, 0, []),
        Withdrawal("A", 1, []),
        Preemption("A", 21, [2, 1]),
        ScheduledRequest("B", "running", 32, 1, 0, [2]),
    ]
    assert out3.scheduled == [ScheduledRequest("B", "running", 32, 1, 0, [2])]
    assert out3.num_scheduled_tokens == {"B": 1}
    assert out3.total_num_scheduled_tokens == 1
    assert out3.token_budget == 63
    assert out3.preempted_req_ids == {"A"}
    a = sched.requests["A"]
    assert a.status == RequestStatus.PREEMPTED
    assert a.num_computed_tokens == 0
    assert running_ids(sched) == ["B"]
    assert waiting_ids(sched) == ["A"]
    assert sched.kv_cache_manager.get_block_ids("B") == [3, 4, 2]
    assert free_queue(sched) == [1]
    # The update only concerns B; A's given-back token is never delivered.
    result = sched.update_from_output(out3, sampled_for(sched, out3))
    assert result.new_token_ids == {"B": [TOKEN]}
    assert a.num_output_tokens == 2


def test_priority_self_preemption_continues_running_loop():
    """0.33.0 (spec 10.5): A is the lowest-priority running request and its
    decode needs a 3rd block; it preempts itself (frees [2, 1], both hashed ->
    tail) and the running loop continues, so B still decodes, taking block 2.
    (Before 0.33.0 the loop broke and B was not scheduled.)"""
    sched = _two_running_priority_requests("priority", a_prompt=31)
    out3 = sched.schedule()
    assert out3.events == [
        Preemption("A", 32, [2, 1]),
        ScheduledRequest("B", "running", 32, 1, 0, [2]),
    ]
    assert out3.num_scheduled_tokens == {"B": 1}
    assert out3.preempted_req_ids == {"A"}
    assert running_ids(sched) == ["B"]
    assert waiting_ids(sched) == ["A"]


def test_priority_victim_skipped_before_cursor_does_not_make_loop_jump():
    """0.33.0 (spec 10.5): removing a victim that sits before the cursor always
    decrements the index, even if the victim was skipped (not scheduled) this
    step, so no request is jumped over (the 4.2 quirk is gone).

    Pool of 5, no full-sequence gate, budget 32, threshold 15. V (priority 9)
    runs alone in step 1 ([1]). Step 2 decodes V ([2]) and admits R and T
    (priority 0) with 15-token chunks ([3], [4]). Step 3 is scheduled while
    step 2 is still in flight: V has nothing to compute and is skipped; R needs
    a 2nd block, the victim is V (index 0 < cursor), V frees [2, 1], R takes 2
    and T, right behind R, is still scheduled and takes 1.
    """
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=32, policy="priority",
                           long_prefill_token_threshold=15, scheduler_reserve_full_isl=False)
    sched.add_request(make_request("V", 16, priority=9, arrival_time=0.0))
    out1, _ = step(sched)
    assert scheduled(out1) == [("V", "new", 0, 16, [1])]
    sched.add_request(make_request("R", 48, priority=0, arrival_time=1.0))
    sched.add_request(make_request("T", 48, priority=0, arrival_time=2.0))
    out2 = sched.schedule()
    assert scheduled(out2) == [("V", "running", 16, 1, [2]),
                               ("R", "new", 0, 15, [3]),
                               ("T", "new", 0, 15, [4])]
    out3 = sched.schedule()  # step 2's output not processed yet
    assert out3.events == [
        Preemption("V", 17, [2, 1]),
        ScheduledRequest("R", "running", 15, 15, 0, [2]),
        ScheduledRequest("T", "running", 15, 15, 0, [1]),
    ]
    assert out3.num_scheduled_tokens == {"R": 15, "T": 15}
    assert running_ids(sched) == ["R", "T"]
    assert waiting_ids(sched) == ["V"]
    assert sched.requests["V"].num_stale_output_tokens == 1  # step 2's token is in flight


def test_preempted_request_with_stale_output_in_flight_is_not_resumed():
    """Same start as the test above: V is preempted while step 2 (which
    decodes V) is still in flight, so V has a stale share of 1 token. R and T
    are then aborted, freeing the pool. vLLM does not resume V until that
    in-flight output has been delivered (resuming could resample a position
    the output later delivers): the next schedule() admits nothing. Once
    step 2's output arrives (V gets its token: 18 tokens) V resumes with all
    18 tokens."""
    sched = make_scheduler(num_gpu_blocks=5, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=32, policy="priority",
                           long_prefill_token_threshold=15, scheduler_reserve_full_isl=False)
    sched.add_request(make_request("V", 16, priority=9, arrival_time=0.0))
    step(sched)
    sched.add_request(make_request("R", 48, priority=0, arrival_time=1.0))
    sched.add_request(make_request("T", 48, priority=0, arrival_time=2.0))
    out2 = sched.schedule()
    out3 = sched.schedule()
    assert out3.preempted_req_ids == {"V"}
    v = sched.requests["V"]
    assert (v.num_stale_output_tokens, v.drop_stale_output) == (1, False)
    sched.finish_requests(["R", "T"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 4

    out4 = sched.schedule()
    assert out4.num_scheduled_tokens == {}
    assert waiting_ids(sched) == ["V"]
    assert v.status == RequestStatus.PREEMPTED

    result = sched.update_from_output(out2, {"V": [TOKEN]})
    assert result.new_token_ids == {"V": [TOKEN]}
    assert (v.num_stale_output_tokens, v.num_tokens) == (0, 18)
    out5 = sched.schedule()
    assert [(s.request_id, s.kind, s.num_scheduled_tokens) for s in out5.scheduled] == [
        ("V", "resumed", 18)]


def test_fcfs_same_scenario_preempts_tail_instead():
    """The same state under FCFS: the victim is the running tail B (priorities
    are ignored); B frees [4, 3] and A takes block 4."""
    sched = _two_running_priority_requests("fcfs", a_prompt=31)
    out3 = sched.schedule()
    assert out3.events == [
        Preemption("B", 32, [4, 3]),
        ScheduledRequest("A", "running", 32, 1, 0, [4]),
    ]
    assert waiting_ids(sched) == ["B"]


def test_priority_scheduling_basic_ordering_and_arrival_tiebreaker():
    sched = make_scheduler(policy="priority")
    sched.add_request(make_request("p3", 10, priority=3, arrival_time=0.0))
    sched.add_request(make_request("p1_late", 10, priority=1, arrival_time=2.0))
    sched.add_request(make_request("p1_early", 10, priority=1, arrival_time=1.0))
    sched.add_request(make_request("p2", 10, priority=2, arrival_time=0.5))
    assert waiting_ids(sched) == ["p1_early", "p1_late", "p2", "p3"]
    output = sched.schedule()
    assert [s.request_id for s in output.scheduled] == ["p1_early", "p1_late", "p2", "p3"]
    assert running_ids(sched) == ["p1_early", "p1_late", "p2", "p3"]


def test_priority_scheduling_with_limited_slots():
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    for rid, prio in (("a", 4), ("b", 1), ("c", 3), ("d", 2)):
        sched.add_request(make_request(rid, 10, priority=prio))
    output = sched.schedule()
    assert [s.request_id for s in output.scheduled] == ["b", "d"]
    assert waiting_ids(sched) == ["c", "a"]


# -- update_from_output and check_stop ---------------------------------------------------
def _run_one(max_tokens: int = 16, prompt: int = 10, **sampling):
    sched = make_scheduler(num_gpu_blocks=33, max_model_len=128, max_num_batched_tokens=256)
    sched.add_request(make_request("r", prompt, max_tokens=max_tokens, **sampling))
    return sched, sched.requests["r"]


def test_stop_via_update_from_output_eos():
    sched, req = _run_one(eos_token_id=2)
    out1 = sched.schedule()
    result = sched.update_from_output(out1, {"r": [2]})
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None
    [fin] = result.finished
    assert (fin.request_id, fin.finish_reason, fin.stop_reason, fin.num_output_tokens) == ("r", "stop", None, 1)
    assert fin.freed_block_ids == [1]
    assert result.new_token_ids == {"r": [2]}
    assert running_ids(sched) == []
    assert "r" not in sched.requests
    assert sched.kv_cache_manager.num_free_blocks == 32
    out2 = sched.schedule()
    assert out2.finished_req_ids == {"r"}
    assert out2.total_num_scheduled_tokens == 0
    assert sched.schedule().finished_req_ids == set()


def test_stop_via_update_from_output_stop_token_sets_stop_reason():
    sched, req = _run_one(stop_token_ids=(42,))
    step(sched)  # token 1
    out = sched.schedule()
    result = sched.update_from_output(out, {"r": [42]})
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 42
    assert result.finished[0].stop_reason == 42
    assert req.output_token_ids == [TOKEN, 42]


def test_check_stop_eos_checked_before_stop_tokens():
    sched, req = _run_one(eos_token_id=7, stop_token_ids=(7,))
    out = sched.schedule()
    sched.update_from_output(out, {"r": [7]})
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason is None


def test_check_stop_stop_token_checked_before_length():
    sched, req = _run_one(max_tokens=1, stop_token_ids=(42,))
    out = sched.schedule()
    result = sched.update_from_output(out, {"r": [42]})
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 42
    assert result.finished[0].finish_reason == "stop"


def test_check_stop_max_tokens_length_capped():
    sched, req = _run_one(max_tokens=3)
    for _ in range(2):
        _, result = step(sched)
        assert result.finished == []
    _, result = step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert result.finished[0].finish_reason == "length"
    assert req.num_output_tokens == 3
    assert req.stop_reason is None


def test_check_stop_max_model_len_length_capped():
    """Prompt of max_model_len - 1 tokens: the first sampled token reaches
    max_model_len (128) and the request is length-capped."""
    sched, req = _run_one(prompt=127, max_tokens=16)
    _, result = step(sched)
    assert req.num_tokens == 128
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert result.finished[0].freed_block_ids == [8, 7, 6, 5, 4, 3, 2, 1]


def test_stop_via_update_from_output_ignore_eos():
    sched, req = _run_one(max_tokens=3, eos_token_id=2, ignore_eos=True)
    for _ in range(2):
        _, result = step(sched, token=2)
        assert result.finished == []
        assert req.status == RequestStatus.RUNNING
    _, result = step(sched, token=2)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert req.output_token_ids == [2, 2, 2]


@pytest.mark.parametrize("token, status, stop_reason", [
    (2, RequestStatus.FINISHED_STOPPED, None),
    (42, RequestStatus.FINISHED_STOPPED, 42),
])
def test_check_stop_min_tokens_does_not_suppress_stop_ids_in_0_33(token, status, stop_reason):
    """0.33.0 (spec 10.8): EOS / stop tokens are checked before min_tokens,
    so a stop id sampled before min_tokens still stops the request."""
    sched, req = _run_one(max_tokens=10, min_tokens=5, eos_token_id=2, stop_token_ids=(42,))
    out = sched.schedule()
    sched.update_from_output(out, {"r": [token]})
    assert req.status == status
    assert req.stop_reason == stop_reason
    assert req.num_output_tokens == 1


def test_stop_inside_multi_token_output_truncates_the_rest():
    """A stop in the middle of a multi-token output drops the later tokens and
    rolls num_computed_tokens back by the dropped count."""
    sched, req = _run_one(stop_token_ids=(42,))
    out = sched.schedule()
    assert req.num_computed_tokens == 10
    result = sched.update_from_output(out, {"r": [5, 42, 6]})
    assert result.new_token_ids == {"r": [5, 42]}
    assert req.output_token_ids == [5, 42]
    assert req.num_computed_tokens == 9
    assert req.status == RequestStatus.FINISHED_STOPPED


# -- finish_requests (abort) -------------------------------------------------------------
def test_finish_request_aborts_running_and_waiting():
    """vLLM ``test_finish_request``: aborting removes requests from running and
    waiting, frees blocks (tail first) and reports them in the next output."""
    sched = make_scheduler(num_gpu_blocks=11, max_model_len=128, max_num_seqs=1,
                           max_num_batched_tokens=128)
    sched.add_request(make_request("r0", 20))
    sched.add_request(make_request("r1", 20))
    step(sched)
    assert running_ids(sched) == ["r0"]
    assert waiting_ids(sched) == ["r1"]

    finished = sched.finish_requests(["r1", "unknown", "r0"], RequestStatus.FINISHED_ABORTED)
    assert [(f.request_id, f.status, f.finish_reason, f.freed_block_ids) for f in finished] == [
        ("r1", RequestStatus.FINISHED_ABORTED, "abort", []),
        ("r0", RequestStatus.FINISHED_ABORTED, "abort", [2, 1]),
    ]
    assert running_ids(sched) == []
    assert waiting_ids(sched) == []
    assert sched.requests == {}
    assert sched.get_num_unfinished_requests() == 0
    # r0's block 2 was partial (unhashed) -> head; block 1 hashed -> tail.
    assert free_queue(sched) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1]
    output = sched.schedule()
    assert output.finished_req_ids == {"r0", "r1"}
    assert output.total_num_scheduled_tokens == 0
    # Already finished ids are ignored.
    assert sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED) == []


def test_abort_while_in_flight_output_is_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("r0", 10))
    sched.add_request(make_request("r1", 10))
    output = sched.schedule()
    sched.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    result = sched.update_from_output(output, {"r0": [TOKEN], "r1": [TOKEN]})
    assert result.new_token_ids == {"r1": [TOKEN]}
    assert result.finished == []
    assert running_ids(sched) == ["r1"]


def test_memory_leak():
    """vLLM ``test_memory_leak``: after every request finishes, no tables, all
    blocks free, all ref counts 0."""
    sched = make_scheduler(num_gpu_blocks=33, max_model_len=128, max_num_batched_tokens=128,
                           max_num_seqs=8)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 20 + 7 * i, max_tokens=5))
    for _ in range(50):
        if not sched.requests:
            break
        step(sched)
    assert sched.requests == {}
    manager = sched.kv_cache_manager
    assert manager.req_to_blocks == {}
    assert manager.num_free_blocks == 32
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks[1:])


# -- configuration -----------------------------------------------------------------------
def test_config_max_model_len_must_fit_kv_pool():
    # 4 usable blocks of 16 tokens hold 64 tokens.
    EngineConfig(num_gpu_blocks=5, block_size=16, max_model_len=64, max_num_seqs=4,
                 max_num_batched_tokens=64)
    with pytest.raises(ConfigError):
        EngineConfig(num_gpu_blocks=5, block_size=16, max_model_len=65, max_num_seqs=4,
                     max_num_batched_tokens=65)


def test_config_chunked_prefill_off_requires_budget_of_max_model_len():
    EngineConfig(max_model_len=2048, max_num_batched_tokens=2048, enable_chunked_prefill=False)
    with pytest.raises(ConfigError):
        EngineConfig(max_model_len=2049, max_num_batched_tokens=2048, enable_chunked_prefill=False)
    # With chunked prefill on, a smaller budget is fine.
    EngineConfig(max_model_len=4096, max_num_batched_tokens=2048)


def test_config_batched_tokens_at_least_max_num_seqs():
    EngineConfig(max_num_seqs=64, max_num_batched_tokens=64)
    with pytest.raises(ConfigError):
        EngineConfig(max_num_seqs=65, max_num_batched_tokens=64)


@pytest.mark.parametrize("bad", [
    dict(policy="lifo"),
    dict(watermark=1.0),
    dict(watermark=-0.1),
    dict(num_gpu_blocks=1),
    dict(long_prefill_token_threshold=-1),
])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ConfigError):
        EngineConfig(**bad)


def test_config_long_prefill_threshold_above_max_model_len_rejected():
    with pytest.raises(ConfigError):
        EngineConfig(max_model_len=1024, long_prefill_token_threshold=1025)


def test_sampling_params_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=5)
