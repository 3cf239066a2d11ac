"""Finding: vLLM 0.33.0's SWA bounded replay nulls the block its replay starts in.

With a ``SlidingWindowMLASpec(bounded_replay=True)`` group (DeepSeek-V4.1's
"SWA bounded replay", config key ``swa_bounded_replay``) a prefix hit of the
other groups ending at ``H`` tokens is admitted at ``replay_start = H - W``
(``Scheduler._mark_prefix_replay``, W the window): the hit's last W tokens are
recomputed to rebuild the window group, which never hits. The worker writes
their window KV into the group's table and reads it from ``replay_start`` on
(``sparse_swa.py``: a token at p reads ``max(p - W + 1, replay_start) .. p``),
so the slot of token ``H - W`` must hold a block. But the window group's
table is built for the window of token H (``add_local_computed_blocks``:
``(H - W + 1) // block_size`` leading null slots), one slot too many when
``H - W + 1`` is a multiple of the block size. vLLM cuts connector hits to
whole blocks for this (its comment: "a hit ending one token short of one
would retire the block the replay starts in"), which is enough only when
``W - 1`` is not a multiple of the block size: with a block-aligned hit and
W = 17 (33, 49, ...; or 1) over blocks of 16 the first replayed token's slot
is the null block, and all W replayed tokens read that token's window KV
through it (the null block is shared by every request). Window 16, 18 and 32
(vLLM's own test) do not.

Found by reading vLLM 0.33.0's source and confirmed on its own classes
(``tests/data/record_swa_replay_first_block.py``, which also made the
recording here). The checker reports it as SLIDING-WINDOW-HELD: it follows
the replay's start (``harness.check.hybrid.replay_null_slots``). The reference
mirrors vLLM (identical replay both ways).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm.recording_convert import convert
from harness.check.checker import check_trace, unjudged_rules
from harness.check.profiles import SAFETY_ONLY
from harness.fuzz import FuzzCase, run_case
from harness.replay import replay
from harness.trace.reader import open_trace
from reference.scheduler import Scheduler
from reference.workload import RequestSpec

RECORDING = Path(__file__).resolve().parent / "data" / "vllm-0.33.0-swa-replay-window-17.jsonl"
PROMPT = (0,) * 100  # 6 full blocks of 16: a 96-token hit for the same prompt
HELD_17 = ("group 1: slot 4 is the null block, but the window of token 79 reads it (bounded replay: the tokens "
           "recomputed before 96 write and read window KV from the replay's start on, in slot 4)")


def _case(window: int, threshold: int = 0) -> FuzzCase:
    """a prefills 100 tokens; b, the same prompt while a decodes, hits 96."""
    config = {"num_gpu_blocks": 40, "block_size": 16, "max_model_len": 256, "max_num_seqs": 4,
              "max_num_batched_tokens": 256, "sliding_window": window,
              "layer_types": ["full_attention", "sliding_attention"], "swa_bounded_replay": True,
              "enable_prefix_caching": True, "long_prefill_token_threshold": threshold}
    return FuzzCase(config, tuple(RequestSpec(request_id=rid, arrival_time=at, prompt_token_ids=PROMPT,
                                              max_tokens=2, ignore_eos=True)
                                  for rid, at in (("a", 0.0), ("b", 0.001))))


def _admission_of_b(run) -> tuple:
    (row,) = [r for _, rows in run.steps for r in rows if r["kind"] == "schedule" and r["request_id"] == "b"
              and r.get("num_prefix_hit_tokens")]
    return row["num_computed_tokens"], row["num_scheduled_tokens"], row["group_block_ids"][1]


def test_the_arithmetic() -> None:
    """Block-aligned hit H = 96, blocks of 16: the first replayed token's slot,
    (H - W) // 16, is among vLLM's (H - W + 1) // 16 null slots exactly when
    W - 1 is a multiple of 16."""
    bad = [w for w in range(1, 96) if (96 - w) // 16 < (96 - w + 1) // 16]
    assert bad == [1, 17, 33, 49, 65, 81]


def test_vllms_recording_nulls_the_slot_its_replay_starts_in(tmp_path: Path) -> None:
    summary = convert(RECORDING, tmp_path / "w17.parquet")
    assert (summary["steps"], summary["finished"], summary["warnings"]) == (3, 2, [])
    trace = open_trace(tmp_path / "w17.parquet")
    config = trace.meta["config"]
    assert (config["sliding_window"], config["block_size"], config["swa_bounded_replay"]) == (17, 16, True)
    assert unjudged_rules(trace.meta) == {}
    (row,) = [r for _, rows in trace.iter_steps() for r in rows
              if r["kind"] == "schedule" and r["request_id"] == "r000001" and r["num_prefix_hit_tokens"]]
    # Replay from 79 (96 - 17); token 79 lies in slot 4, which holds the null block.
    assert (row["num_computed_tokens"], row["num_scheduled_tokens"], row["group_block_ids"]) == (
        79, 21, [[1, 2, 3, 4, 5, 6, 12], [0, 0, 0, 0, 0, 11, 10]])
    for semantics in ("auto", "safety"):
        result = check_trace(trace, semantics)
        assert result.by_invariant == {"SLIDING-WINDOW-HELD": 1}, semantics
        (v,) = result.violations
        assert (v.step, v.request, v.message) == (1, "r000001", HELD_17)
    # The reference mirrors vLLM 0.33.0: the same decisions, this slot included.
    assert replay(trace, resolve_candidate("reference")) == (None, 3)


@pytest.mark.parametrize("window, table, held", [
    (16, [0, 0, 0, 0, 0, 11, 10], 0),    # replay from 80, slot 5: held
    (17, [0, 0, 0, 0, 0, 11, 10], 1),    # replay from 79, slot 4: null
    (18, [0, 0, 0, 0, 11, 10, 9], 0),    # replay from 78, slot 4: held
    (32, [0, 0, 0, 0, 10, 9, 8], 0),     # vLLM's own test_prefix_replay.py window
    (33, [0, 0, 0, 0, 10, 9, 8], 1),     # replay from 63, slot 3: null
])
def test_the_reference_does_the_same_and_the_checker_says_so(window: int, table: list, held: int) -> None:
    run = run_case(Scheduler, _case(window))
    assert run.ended == ""
    assert _admission_of_b(run) == (96 - window, 4 + window, table)
    assert run.result.by_invariant == ({"SLIDING-WINDOW-HELD": held} if held else {}), run.result.violations[:2]
    if window == 17:
        (v,) = run.result.violations
        assert (v.step, v.request, v.message) == (1, "b", HELD_17)


def test_a_chunked_replay_reads_the_null_slot_at_every_chunk() -> None:
    """A threshold of 8: the replay runs in chunks from 79 (8 tokens) and 87
    (13: the rest of the prompt), and each chunk's first token reads token 79."""
    run = run_case(Scheduler, _case(17, threshold=8))
    assert run.result.by_invariant == {"SLIDING-WINDOW-HELD": 2}
    assert [(v.step, v.request, v.message.split(" reads")[0]) for v in run.result.violations] == [
        (step, "b", f"group 1: slot 4 is the null block, but the window of token {t}")
        for step, t in ((1, 79), (2, 87))]


def test_an_engine_that_keeps_the_replays_first_block_is_safe(monkeypatch) -> None:
    """A fixed engine: the bounded-replay group nulls only the slots wholly
    before the replay's start, (H - W) // block_size. SLIDING-WINDOW-HELD is
    silent; under the 0.33.0 profile SLIDING-WINDOW-FREE names the slot it
    keeps (0.33.0 adopts the null block there), and the next allocation frees it."""
    from reference.kv.single_type_kv_cache_manager import SlidingWindowManager

    original = SlidingWindowManager.add_local_computed_blocks

    def keep_replay_start(self, request_id, new_computed_blocks, num_local, num_external):
        replay = self.kv_cache_spec.prefix_replay_tokens
        total = num_local + num_external
        if not replay or total <= replay:
            return original(self, request_id, new_computed_blocks, num_local, num_external)
        nulls = (total - replay) // self.block_size  # the slots wholly before the replay's start
        self.req_to_blocks.setdefault(request_id, []).extend([self._null_block] * nulls)
        self.num_cached_block[request_id] = nulls

    monkeypatch.setattr(SlidingWindowManager, "add_local_computed_blocks", keep_replay_start)
    run = run_case(Scheduler, _case(17), SAFETY_ONLY)
    assert _admission_of_b(run) == (79, 21, [0, 0, 0, 0, 11, 10, 9])
    assert run.result.by_invariant == {}
    run = run_case(Scheduler, _case(17))
    assert run.result.by_invariant == {"SLIDING-WINDOW-FREE": 1}
    (v,) = run.result.violations
    assert (v.step, v.request) == (1, "b")
    assert v.message.startswith("group 1 (bounded replay): slot 4 holds block 11, wholly before the window of "
                                "token 96: 0.33.0 adopts the null block there")


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
@pytest.mark.parametrize("threshold", [0, 8])
def test_real_vllm_makes_the_same_decisions(tmp_path: Path, threshold: int) -> None:
    """The reference's trace replays identically on vLLM 0.33.0's Scheduler:
    every group's block ids, the null slot of the replay's start included."""
    import gc

    from harness.trace.recorder import record

    case = _case(17, threshold)
    path = tmp_path / "t.parquet"
    record(case.workload(), case.engine_config(), path)
    divergence, replayed = replay(open_trace(path), resolve_candidate("vllm@0.33.0"))
    gc.collect()
    assert divergence is None, divergence
    assert replayed == open_trace(path).summary["steps"]
