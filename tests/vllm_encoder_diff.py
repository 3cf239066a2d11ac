"""Encoder inputs: the reference vs real vLLM 0.33.0, step by step.

Run with the vLLM venv's Python from the repository root
(``.vllm-envs/0.33.0/bin/python tests/vllm_encoder_diff.py N``; used by
``tests/test_encoder.py``). Builds vLLM's own ``Scheduler`` the way the vLLM
candidate does (``harness.candidates.vllm.driver.Driver.init``, read-only use), then
gives it what a multimodal model would: the encoder compute budget, an
``EncoderCacheManager`` of the configured size, ``disable_chunked_mm_input``
and requests carrying ``MultiModalFeatureSpec`` items with the reference's
identifiers (so vLLM's block hasher adds the same multimodal extra keys).
Both schedulers then run N seeded random workloads and configurations in
lockstep (FCFS and PRIORITY, tight pools, prefix caching, thresholds, shared
items) with the same sampled tokens; every step's scheduled tokens (in
order), encoder inputs, evicted identifiers, preemptions and running queue
must be identical. Prints ``bad B of N`` and totals; exits 1 if B > 0.
"""
import hashlib
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.candidates.vllm.driver import Driver
from reference.config import EngineConfig
from reference.engine import reject_reason
from reference.scheduler import Scheduler as RefScheduler
from reference.request import Request as RefRequest, SamplingParams as RefSP
from workloads import synthetic
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

MM_KEYS = ('max_num_encoder_input_tokens', 'encoder_cache_size', 'disable_chunked_mm_input')

def token(rid, i):
    return 10 + int.from_bytes(hashlib.blake2b(f"{rid}:{i}".encode(), digest_size=4).digest(), "little") % 30000

def run(cfg, wl, per_step=2, verbose=False):
    config = EngineConfig(**cfg)
    base = {k: v for k, v in config.to_dict().items() if k not in MM_KEYS}
    d = Driver(); d.init(base, seed=0)
    vs = d.sched
    vs.max_num_encoder_input_tokens = config.encoder_compute_budget
    vs.encoder_cache_manager = EncoderCacheManager(config.encoder_cache_capacity)
    vs.scheduler_config.disable_chunked_mm_input = config.disable_chunked_mm_input
    ref = RefScheduler(config)
    specs = [s for s in wl.requests if reject_reason(s, config) is None]
    outputs = {}
    step = 0; stats = dict(enc=0, freed=0, preempt=0, steps=0)
    while specs or ref.requests:
        for s in specs[:per_step]:
            ref.add_request(RefRequest(s.request_id, list(s.prompt_token_ids), RefSP(max_tokens=s.max_tokens),
                                       arrival_time=s.arrival_time, priority=s.priority, block_size=config.block_size,
                                       mm_positions=s.mm_positions))
            rr = ref.requests[s.request_id]
            params = d.SamplingParams(max_tokens=s.max_tokens, ignore_eos=True)
            params.update_from_generation_config({}, 2)
            feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=h,
                                           mm_position=PlaceholderRange(offset=o, length=n))
                     for (o, n), h in zip(rr.mm_positions, rr.mm_hashes)]
            vreq = d.Request(request_id=s.request_id, prompt_token_ids=list(s.prompt_token_ids), sampling_params=params,
                             pooling_params=None, arrival_time=s.arrival_time, priority=s.priority,
                             block_hasher=d.block_hasher, mm_features=feats)
            vs.add_request(vreq)
        specs = specs[per_step:]
        out = ref.schedule()
        so = vs.schedule()
        a = (dict(out.num_scheduled_tokens), out.scheduled_encoder_inputs, out.free_encoder_mm_hashes,
             sorted(out.preempted_req_ids), [r.request_id for r in ref.running])
        b = (dict(so.num_scheduled_tokens), {k: list(v) for k, v in so.scheduled_encoder_inputs.items()},
             list(so.free_encoder_mm_hashes), sorted(so.preempted_req_ids), [r.request_id for r in vs.running])
        if a != b or list(out.num_scheduled_tokens) != list(so.num_scheduled_tokens):
            print("DIVERGED at step", step)
            for x, y, name in zip(a, b, ("tokens", "encoder", "freed", "preempted", "running")):
                if x != y: print("  ", name, "ref", x, "vllm", y)
            return False, stats
        stats["enc"] += sum(map(len, out.scheduled_encoder_inputs.values()))
        stats["freed"] += len(out.free_encoder_mm_hashes); stats["preempt"] += len(out.preempted_req_ids)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = ref.requests[rid]
            if not r.is_prefill_chunk:
                i = outputs.get(rid, 0); outputs[rid] = i + 1
                sampled[rid] = [token(rid, i)]
        ref.update_from_output(out, sampled)
        vs.update_from_output(so, d._model_runner_output(list(so.num_scheduled_tokens), sampled))
        step += 1
        if step > 5000: print("too many steps"); return False, stats
    stats["steps"] = step
    return True, stats

SMALL = dict(block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64)
if __name__ == "__main__":
    n = int(sys.argv[1]); bad = 0; tot = dict(enc=0, freed=0, preempt=0, steps=0)
    for k in range(n):
        r = random.Random(k)
        L = r.choice([2, 3, 4, 6, 8, 12])
        wl = synthetic(num_requests=r.choice([10, 20, 30]), seed=k, mm_fraction=r.choice([0.5, 1.0]), mm_item_len=L,
                       mm_items_per_request=r.choice([1, 2, 3, 6]), mm_distinct_items=r.choice([0, 1, 3, 8]),
                       shared_prefix_len=r.choice([0, 8, 16]), shared_prefix_fraction=0.5, priority_levels=r.choice([1, 3]),
                       prompt_len=(1, r.choice([16, 32, 48])), output_len=(1, r.choice([8, 24])))
        cfg = {**SMALL, "num_gpu_blocks": r.choice([26, 30, 40, 60]), "policy": r.choice(["fcfs", "priority"]),
               "scheduler_reserve_full_isl": r.random() < 0.5, "enable_prefix_caching": r.random() < 0.8,
               "long_prefill_token_threshold": r.choice([0, 0, 6, 12]),
               "max_num_encoder_input_tokens": r.choice([L, 2 * L, 4 * L]), "encoder_cache_size": r.choice([L, 2 * L, 4 * L, 8 * L]),
               "disable_chunked_mm_input": r.random() < 0.25}
        ok, st = run(cfg, wl, per_step=r.choice([1, 2, 5]))
        for key in tot: tot[key] += st[key]
        if not ok:
            bad += 1; print("case", k, {kk: v for kk, v in cfg.items() if kk not in SMALL})
    print("bad", bad, "of", n, tot)
    sys.exit(1 if bad else 0)
