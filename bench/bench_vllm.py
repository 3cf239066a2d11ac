#!/usr/bin/env python3
"""Benchmark per-step scheduler time: the reference vs real vLLM 0.33.0 (issue 4).

Run from anywhere:  .venv/bin/python bench/bench_vllm.py [--steps N] [--quick]

Times each ``schedule()`` and ``update_from_output()`` call, per engine step,
of (1) ``reference.scheduler.Scheduler`` in this process, driven by the
scripted model runner (``reference/runners/scripted.py``), and (2) vLLM's real
``vllm.v1.core.sched.scheduler.Scheduler`` in a subprocess under the vLLM
venv's Python (``harness/candidates/vllm/env.py``; build it with
``harness vllm-env 0.33.0``), on the same workloads:

  decode-64, decode-256  N requests with 32-token prompts and long max_tokens
      admitted at once (max_num_seqs=N, no preemption); once every step is N
      one-token decodes, --warmup more steps run untimed, then --steps steps
      (default 1000) are timed.
  azure-code  the first 500 requests of the Azure LLM inference 2023 code trace
      (../shared/data/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv
      relative to the repository root), --time-scale 30, seed 0, with the
      README demo config (num_gpu_blocks=600, max_num_seqs=64,
      max_num_batched_tokens=2048, max_model_len=8192), run to completion on
      the reference engine's virtual clock; every step is timed.

vLLM side: the subprocess is this same file (``--_vllm-child``, standard
library only at import). It builds the scheduler exactly as
``harness/candidates/vllm/driver_engine_core.py`` does (``Driver.init``: CPU platform, synchronous
scheduling, no tokenizer, ``log_stats=False``), then removes the driver's
decision-recording hooks so the real ``KVCacheManager.allocate_slots``/``free``
and ``Scheduler._preempt_request`` run, and calls ``schedule()`` and
``update_from_output()`` directly: no JSON, no IPC, no normalisation inside
the timed region. (The driver's own ``stats`` op only gives a count and total
seconds per op, measured around JSON handling plus normalisation, so it is not
used.) Building the ``ModelRunnerOutput`` and the scripted tokens happens
outside the timed region on both sides.

Both sides run the same loop (below): arrivals on a virtual clock
(``step_fixed_s + step_per_token_s * scheduled tokens`` per step, as
``reference.engine.Engine``), scripted tokens (the same function of (seed,
request, output index) as ``reference.runners.scripted.scripted_token``), one
batch in flight. A digest of each step's decisions (scheduled tokens per
request, preemptions, finishes) is compared between the two runs, so the
figures are for identical work.

--log-stats builds vLLM's Scheduler with ``log_stats=True`` instead (what
vLLM's engine does unless stats logging is disabled; the figures barely move).
By default the garbage collector's heap is collected and frozen before each
scenario (``gc.freeze()``, as vLLM's EngineCore does after start-up with
``freeze_gc_heap``); --no-gc-freeze leaves the collector alone.

The last lines print issue 24's goal per scenario: the reference's CPU time per
timed step (``schedule()`` + ``update_from_output()``, ``time.thread_time_ns``
around each call on both sides) at most 0.25x vLLM's, met or NOT MET; under a
goal NOT MET, "the rest goes to:" names the top functions (own time) of a
cProfile of the reference's calls in that scenario's timed steps
(``reference_profile``; the helper bench/bench_check.py prints its goals' with).

Timings use time.perf_counter_ns around each call. This is a benchmark, not a
test: it prints figures and exits 0, 1 if a run fails or the decisions differ,
2 if the data file or the vLLM env is missing.

One file over ~500 lines on purpose: the same file is both the parent (this
project's venv) and the ``--_vllm-child`` run under vLLM's venv, where this
project's packages cannot be imported, so both sides and the workloads they
share must travel together.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Standard library only above this line: the vLLM child imports this file too.

REPO = Path(__file__).resolve().parent.parent
AZURE_CODE = (REPO / ".." / "shared" / "data" / "azure-llm-inference-2023"
              / "AzureLLMInferenceTrace_code.csv").resolve()
DRIVER = REPO / "harness" / "candidates" / "vllm" / "driver.py"
VLLM_VERSION = "0.33.0"
SEED = 0
AZURE_TIME_SCALE = 30.0
AZURE_CONFIG = {"num_gpu_blocks": 600, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                "max_model_len": 8192}  # the README / `make demo` config
DECODE_PROMPT_LEN = 32
DECODE_MAX_BATCHED = 2048
DECODE_MAX_MODEL_LEN = 8192
CHILD_TIMEOUT_S = 3600

# ----------------------------------------------------------------------------
# Shared by both interpreters (standard library only).
# ----------------------------------------------------------------------------
FIRST_SAMPLED_TOKEN_ID = 10
VOCAB_SIZE = 32000


def scripted_token(seed: int, request_id: str, output_index: int,
                   eos_at: int | None, eos_token_id: int | None) -> int:
    """``reference.runners.scripted.scripted_token`` (checked equal at start-up)."""
    if eos_at is not None and output_index + 1 == eos_at and eos_token_id is not None:
        return eos_token_id
    digest = hashlib.blake2b(f"{seed}:{request_id}:{output_index}".encode(), digest_size=8).digest()
    return FIRST_SAMPLED_TOKEN_ID + (int.from_bytes(digest, "little")
                                     % (VOCAB_SIZE - FIRST_SAMPLED_TOKEN_ID))


def step_digest(num_scheduled: dict, preempted, finished) -> str:
    """A short digest of one step's decisions (order-independent)."""
    text = repr((sorted(num_scheduled.items()), sorted(preempted or ()), sorted(finished)))
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def run_scenario(backend, scenario: dict, gc_freeze: bool) -> dict:
    """Drive ``backend`` through ``scenario``; per-step call times in ns.

    ``backend`` provides: ``add(spec)``, ``num_unfinished()``, ``schedule``
    and ``update`` (the scheduler's bound methods, timed), ``describe(out) ->
    (num_scheduled dict, total tokens, preempted ids)``, ``model_output(out)``
    (the scripted model's answer, untimed) and ``finished_ids(result)``.
    """
    mode = scenario["mode"]
    cfg = scenario["config"]
    pending = scenario["requests"]  # sorted by (arrival_time, request_id)
    fixed_s, per_token_s = cfg["step_fixed_s"], cfg["step_per_token_s"]
    num_requests = len(pending)
    steps_wanted = scenario.get("steps", 0)
    warmup = scenario.get("warmup", 0)
    schedule_fn, update_fn = backend.schedule, backend.update
    sched_ns: list[int] = []
    update_ns: list[int] = []
    digests: list[str] = []
    totals = {"steps": 0, "scheduled_tokens": 0, "preemptions": 0, "finished": 0,
              "timed_preemptions": 0, "timed_finished": 0, "timed_tokens": 0}
    steady_at = None  # steady decode: first step with every request decoding
    clock = 0.0
    nxt = 0
    step = 0
    perf = time.perf_counter_ns
    cpu = time.thread_time_ns  # CPU time of this thread: what a shared machine's load does not inflate
    sched_cpu_ns = update_cpu_ns = 0
    if gc_freeze:
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
        gc.freeze()
    t_start = time.perf_counter()
    try:
        while nxt < num_requests or backend.num_unfinished():
            if not backend.num_unfinished() and pending[nxt]["arrival_time"] > clock:
                clock = pending[nxt]["arrival_time"]
            while nxt < num_requests and pending[nxt]["arrival_time"] <= clock:
                backend.add(pending[nxt])
                nxt += 1
            c0 = cpu()
            t0 = perf()
            out = schedule_fn()
            t1 = perf()
            c1 = cpu()
            num_scheduled, total, preempted = backend.describe(out)
            payload = backend.model_output(out)
            c2 = cpu()
            t2 = perf()
            result = update_fn(out, payload)
            t3 = perf()
            c3 = cpu()
            finished = backend.finished_ids(result)
            digests.append(step_digest(num_scheduled, preempted, finished))
            timed = mode == "trace" or (steady_at is not None and step >= steady_at + warmup)
            if timed:
                sched_ns.append(t1 - t0)
                update_ns.append(t3 - t2)
                sched_cpu_ns += c1 - c0
                update_cpu_ns += c3 - c2
                totals["timed_preemptions"] += len(preempted or ())
                totals["timed_finished"] += len(finished)
                totals["timed_tokens"] += total
            totals["steps"] += 1
            totals["scheduled_tokens"] += total
            totals["preemptions"] += len(preempted or ())
            totals["finished"] += len(finished)
            if mode == "decode":
                if steady_at is None and len(num_scheduled) == num_requests \
                        and all(n == 1 for n in num_scheduled.values()):
                    steady_at = step
                if len(sched_ns) >= steps_wanted:
                    break
            step += 1
            clock += fixed_s + per_token_s * total
            if total == 0 and backend.num_unfinished():
                if nxt >= num_requests:
                    raise RuntimeError(f"step {step}: nothing scheduled and no arrival ahead")
                clock = max(clock, pending[nxt]["arrival_time"])
            if step > 10_000_000:
                raise RuntimeError("no completion within 10,000,000 steps")
    finally:
        if gc_freeze:
            gc.unfreeze()
    totals["wall_s"] = time.perf_counter() - t_start
    totals["steady_at"] = steady_at
    totals["schedule_cpu_ns"], totals["update_cpu_ns"] = sched_cpu_ns, update_cpu_ns
    return {"schedule_ns": sched_ns, "update_ns": update_ns, "digests": digests, "totals": totals}


# ----------------------------------------------------------------------------
# vLLM side: runs under the vLLM venv's Python (--_vllm-child JOB RESULT).
# ----------------------------------------------------------------------------
class VLLMBackend:
    """vLLM's Scheduler built by harness/candidates/vllm/driver_engine_core.py's Driver, hooks removed."""

    def __init__(self, drv, config: dict, seed: int, log_stats: bool = False) -> None:
        self.drv = drv
        if log_stats:
            # The driver builds with log_stats=False; force True, keeping the
            # signature the driver inspects (functools.wraps sets __wrapped__).
            import functools

            cls = drv.Scheduler

            @functools.wraps(cls)
            def build(*args, **kwargs):
                kwargs["log_stats"] = True
                return cls(*args, **kwargs)

            drv.Scheduler = build
            try:
                drv.init(config, seed)
            finally:
                drv.Scheduler = cls
            if not drv.sched.log_stats:
                raise RuntimeError("could not turn log_stats on")
        else:
            drv.init(config, seed)
        sched = drv.sched
        kvm = sched.kv_cache_manager
        # The driver wraps these on the instance to record decisions; drop the
        # wrappers so the class methods (plain vLLM) run.
        for obj, name in ((kvm, "allocate_slots"), (kvm, "free"), (sched, "_preempt_request")):
            obj.__dict__.pop(name, None)
            if name in vars(obj):
                raise RuntimeError(f"could not remove the driver hook {name}")
        self.sched = sched
        self.seed = seed
        self.scripts: dict[str, tuple] = {}
        self.schedule = sched.schedule
        self.update = sched.update_from_output
        self.num_unfinished = sched.get_num_unfinished_requests

    def add(self, spec: dict) -> None:
        self.drv.add(spec)
        self.scripts[spec["request_id"]] = (spec.get("scripted_output_len"), spec.get("eos_token_id"))

    @staticmethod
    def describe(so):
        return (dict(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                getattr(so, "preempted_req_ids", None) or ())

    def model_output(self, so):
        computed = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(so.num_scheduled_tokens)
        sampled: dict[str, list[int]] = {}
        requests = self.sched.requests
        for req_id in req_ids:
            request = requests[req_id]
            if computed[req_id] + so.num_scheduled_tokens[req_id] < request.num_tokens:
                sampled[req_id] = []  # partial prefill chunk
                continue
            eos_at, eos_id = self.scripts[req_id]
            sampled[req_id] = [scripted_token(self.seed, req_id, request.num_output_tokens,
                                              eos_at, eos_id)]
        return self.drv._model_runner_output(req_ids, sampled)

    def finished_ids(self, engine_outputs) -> list[str]:
        done = []
        for client in engine_outputs:
            for out in engine_outputs[client].outputs:
                if out.finish_reason is not None:
                    done.append(out.request_id)
                    self.scripts.pop(out.request_id, None)
        return done


def _load_driver_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_child(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    driver_mod = _load_driver_module()  # sets the VLLM_* environment defaults
    t0 = time.perf_counter()
    drv = driver_mod.Driver()
    import_s = time.perf_counter() - t0
    import torch

    keys = driver_mod.load_sibling("driver_vllm_config")  # the config keys the driver maps
    known = keys.MAPPED_KEYS | keys.HARNESS_ONLY_KEYS | set(keys.SYNC_ONLY)
    out = {"vllm_version": drv.version, "torch_version": torch.__version__,
           "python": f"{platform.python_implementation()} {platform.python_version()}",
           "import_s": import_s, "dropped_keys": [], "scenarios": {}}
    for scenario in job["scenarios"]:
        config = dict(scenario["config"])
        for key in sorted(set(config) - known):
            # A field the driver does not map yet: harmless at its default value.
            if config[key] != job["defaults"].get(key, object()):
                raise RuntimeError(f"config key {key}={config[key]!r} has no mapping in "
                                   f"harness/candidates/vllm/driver_vllm_config.py")
            del config[key]
            if key not in out["dropped_keys"]:
                out["dropped_keys"].append(key)
        backend = VLLMBackend(drv, config, job["seed"], job["log_stats"])
        print(f"[vllm child] {scenario['name']} ...", file=sys.stderr, flush=True)
        out["scenarios"][scenario["name"]] = run_scenario(backend, scenario, job["gc_freeze"])
        drv.sched = None
        del backend
    Path(result_path).write_text(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------
# Reference side and reporting (this project's venv).
# ----------------------------------------------------------------------------
class ReferenceBackend:
    """reference.scheduler.Scheduler + the scripted model runner, in-process."""

    def __init__(self, config: dict, seed: int) -> None:
        from reference.config import EngineConfig
        from reference.runners.scripted import RequestScript, ScriptedModelRunner
        from reference.request import Request, SamplingParams
        from reference.scheduler import Scheduler

        self.config = EngineConfig.from_dict(config)  # a to_dict(): it holds the derived keys
        self.sched = Scheduler(self.config)
        self.runner = ScriptedModelRunner(seed)
        self.Request, self.SamplingParams, self.RequestScript = Request, SamplingParams, RequestScript
        self.schedule = self.sched.schedule
        self.update = self.sched.update_from_output
        self.num_unfinished = self.sched.get_num_unfinished_requests

    def request(self, spec: dict):
        """The reference ``Request`` of ``spec`` (as ``reference.engine.Engine._make_request``)."""
        params = self.SamplingParams(
            max_tokens=spec["max_tokens"], min_tokens=spec["min_tokens"],
            ignore_eos=spec["ignore_eos"], eos_token_id=spec["eos_token_id"],
            stop_token_ids=tuple(spec["stop_token_ids"]))
        return self.Request(
            request_id=spec["request_id"], prompt_token_ids=list(spec["prompt_token_ids"]),
            sampling_params=params, arrival_time=spec["arrival_time"],
            priority=spec["priority"], block_size=self.config.block_size)

    def add(self, spec: dict) -> None:
        self.sched.add_request(self.request(spec))
        self.runner.add_request(spec["request_id"], self.RequestScript(
            len(spec["prompt_token_ids"]), spec["scripted_output_len"], spec["eos_token_id"]))

    @staticmethod
    def describe(output):
        return (output.num_scheduled_tokens, output.total_num_scheduled_tokens,
                output.preempted_req_ids)

    def model_output(self, output):
        return self.runner.execute(output)

    def finished_ids(self, result) -> list[str]:
        done = [f.request_id for f in result.finished]
        for req_id in done:
            self.runner.finish(req_id)
        return done


class _RecordingReferenceBackend(ReferenceBackend):
    """A ``ReferenceBackend`` that keeps, per step, the specs added before it
    and the scripted model's answer (``steps``), for ``reference_profile``."""

    def __init__(self, config: dict, seed: int) -> None:
        super().__init__(config, seed)
        self.steps: list[tuple[list[dict], dict]] = []
        self._added: list[dict] = []

    def add(self, spec: dict) -> None:
        super().add(spec)
        self._added.append(spec)

    def model_output(self, output):
        sampled = super().model_output(output)
        self.steps.append((self._added, sampled))
        self._added = []
        return sampled


def reference_profile(scenario: dict, gc_freeze: bool) -> str:
    """Where the reference's CPU goes in ``scenario``'s timed steps: the top
    functions by own time of a cProfile of its ``schedule()`` and
    ``update_from_output()`` calls, one line (``where_it_goes`` of
    bench/bench_check.py, which prints its goals' the same way).

    A first run records each step's arrivals and the scripted model's answer;
    a fresh scheduler then re-runs them with every request built beforehand
    and the steps before the timed window (decode: admission and warm-up)
    run outside the profile, so the profile holds the timed calls, the
    ``add_request`` of arrivals between them and a loop, nothing of the
    scripted model or the bench's bookkeeping. The recorded answers are only
    valid for the same decisions: the re-run's are compared step by step
    (RuntimeError if they differ)."""
    bench_dir = str(Path(__file__).resolve().parent)
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    from bench_check import where_it_goes

    recorder = _RecordingReferenceBackend(scenario["config"], SEED)
    first = run_scenario(recorder, scenario, gc_freeze)
    steps = recorder.steps
    first_timed = len(steps) - len(first["schedule_ns"])
    backend = ReferenceBackend(scenario["config"], SEED)
    sched = backend.sched
    arrivals = [[backend.request(spec) for spec in added] for added, _ in steps]
    decided: list[tuple] = []  # (SchedulerOutput, UpdateResult) per step

    def step(index: int) -> None:
        for request in arrivals[index]:
            sched.add_request(request)
        output = sched.schedule()
        result = sched.update_from_output(output, steps[index][1])
        decided.append((output, result))

    def timed() -> None:
        for index in range(first_timed, len(steps)):
            step(index)

    for index in range(first_timed):
        step(index)
    if gc_freeze:
        gc.collect()
        gc.freeze()
    try:
        line = where_it_goes(timed)
    finally:
        if gc_freeze:
            gc.unfreeze()
    same = [step_digest(out.num_scheduled_tokens, out.preempted_req_ids, [f.request_id for f in res.finished])
            for out, res in decided]
    if same != first["digests"]:
        raise RuntimeError(f"{scenario['name']}: the profiled re-run took other decisions")
    return line


def _spec_dict(spec) -> dict:
    return {"request_id": spec.request_id, "arrival_time": spec.arrival_time,
            "prompt_token_ids": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
            "min_tokens": spec.min_tokens, "ignore_eos": spec.ignore_eos,
            "eos_token_id": spec.eos_token_id, "stop_token_ids": list(spec.stop_token_ids),
            "priority": spec.priority, "scripted_output_len": spec.scripted_output_len}


def decode_scenario(n: int, steps: int, warmup: int) -> dict:
    from reference.config import EngineConfig
    from reference.workload import RequestSpec
    from workloads import FIRST_PROMPT_TOKEN_ID

    # Long enough that nobody finishes: admission takes a few steps
    # (n * 32 prompt tokens at 2048 per step), then warmup + steps decodes.
    max_tokens = steps + warmup + 64
    blocks_per_req = -(-(DECODE_PROMPT_LEN + max_tokens) // 16)
    # No preemption; at least one max_model_len request's worth (EngineConfig's check).
    num_blocks = max(n * blocks_per_req + 64, DECODE_MAX_MODEL_LEN // 16 + 2)
    config = EngineConfig(num_gpu_blocks=num_blocks, max_num_seqs=n,
                          max_num_batched_tokens=DECODE_MAX_BATCHED,
                          max_model_len=DECODE_MAX_MODEL_LEN)
    requests = []
    for i in range(n):
        rng = random.Random(f"bench-decode:{i}")
        prompt = [rng.randrange(FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE) for _ in range(DECODE_PROMPT_LEN)]
        requests.append(_spec_dict(RequestSpec(request_id=f"r{i:06d}", arrival_time=0.0,
                                               prompt_token_ids=prompt, max_tokens=max_tokens)))
    return {"name": f"decode-{n}", "mode": "decode", "config": config.to_dict(),
            "requests": requests, "steps": steps, "warmup": warmup,
            "describe": (f"{n} requests, {DECODE_PROMPT_LEN}-token prompts, max_tokens={max_tokens}, "
                         f"ignore_eos; num_gpu_blocks={config.num_gpu_blocks}, max_num_seqs={n}, "
                         f"max_num_batched_tokens={DECODE_MAX_BATCHED}, "
                         f"max_model_len={DECODE_MAX_MODEL_LEN}; {warmup} untimed steps after the "
                         f"first all-decode step, then {steps} timed")}


def azure_scenario(limit: int) -> dict:
    from reference.config import EngineConfig
    from reference.engine import reject_reason
    from workloads import load_workload

    config = EngineConfig(**AZURE_CONFIG)
    workload = load_workload(str(AZURE_CODE), limit=limit, time_scale=AZURE_TIME_SCALE, seed=SEED)
    if any(r.abort_time is not None for r in workload.requests):
        raise RuntimeError("the Azure workload has aborts; this benchmark's loop does not model them")
    ordered = sorted(workload.requests, key=lambda r: (r.arrival_time, r.request_id))
    admitted = [r for r in ordered if reject_reason(r, config) is None]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in admitted)
    return {"name": "azure-code", "mode": "trace", "config": config.to_dict(),
            "requests": [_spec_dict(r) for r in admitted],
            "describe": (f"{workload.source}, first {len(workload.requests)} requests "
                         f"({len(ordered) - len(admitted)} rejected at arrival), "
                         f"--time-scale {AZURE_TIME_SCALE:g}, seed {SEED}, {prompt_tokens:,} prompt "
                         f"tokens; " + ", ".join(f"{k}={v}" for k, v in AZURE_CONFIG.items())
                         + "; every step timed")}


#: Issue 24: the reference's CPU per step at most this fraction of vLLM's.
CPU_GOAL = 0.25


def summarise(ns: list[int]) -> dict:
    if not ns:
        return {"n": 0, "mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    ms = sorted(v / 1e6 for v in ns)

    def pct(q: float) -> float:  # linear interpolation (numpy's default)
        pos = (len(ms) - 1) * q
        lo = math.floor(pos)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)

    return {"n": len(ms), "mean": sum(ms) / len(ms), "p50": pct(0.5), "p99": pct(0.99)}


def _fmt3(s: dict) -> str:
    return f"{s['mean']:>7.3f} {s['p50']:>7.3f} {s['p99']:>7.3f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:>6.3f}" if b > 0 else "   n/a"


def run_vllm_child(scenarios: list[dict], gc_freeze: bool, log_stats: bool,
                   tmp: Path) -> tuple[dict | None, str, float]:
    """Run every scenario in one vLLM subprocess: (result, log tail, wall s)."""
    from reference.config import EngineConfig

    from harness.candidates.vllm.env import env_python

    job = {"seed": SEED, "gc_freeze": gc_freeze, "log_stats": log_stats,
           "defaults": EngineConfig().to_dict(),
           "scenarios": [{k: v for k, v in s.items() if k != "describe"} for s in scenarios]}
    job_path, result_path, log_path = tmp / "job.json", tmp / "result.json", tmp / "child.log"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # like the harness: the child must not see this project's packages
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([str(env_python(VLLM_VERSION)), "-u", str(Path(__file__).resolve()),
                                   "--_vllm-child", str(job_path), str(result_path)],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  env=env, cwd=tempfile.gettempdir(), timeout=CHILD_TIMEOUT_S)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - t0
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    tail = "\n".join(lines[-15:])
    if code != 0 or not result_path.is_file():
        return None, f"vLLM subprocess failed (exit {code}):\n{tail}", wall
    return json.loads(result_path.read_text()), tail, wall


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--_vllm-child"]:
        return vllm_child(argv[1], argv[2])

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steady-decode steps per size (default 1000; --quick: 200)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="untimed decode steps after the first all-decode step (default 20)")
    parser.add_argument("--sizes", default="64,256",
                        help="running decode requests, comma-separated (default 64,256)")
    parser.add_argument("--azure-limit", type=int, default=None,
                        help="first N Azure code requests (default 500; --quick: 100; 0 skips it)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: --steps 200, --azure-limit 100")
    parser.add_argument("--log-stats", action="store_true",
                        help="build vLLM's Scheduler with log_stats=True (the driver uses False; "
                             "vLLM's engine uses True unless stats logging is disabled)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="do not collect and freeze the GC heap before each scenario")
    parser.add_argument("--smoke", action="store_true",
                        help="the test suite's run: --sizes 8 --steps 20 --warmup 2 --azure-limit 20")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.steps, args.warmup, args.azure_limit = "8", 20, 2, 20
    steps = args.steps if args.steps is not None else (200 if args.quick else 1000)
    azure_limit = args.azure_limit if args.azure_limit is not None else (100 if args.quick else 500)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error("--sizes must be comma-separated integers")
    if not 1 <= steps <= 7000 or args.warmup < 0 or azure_limit < 0 or any(n < 1 for n in sizes):
        parser.error("--steps must be in [1, 7000]; --warmup, --azure-limit >= 0; sizes >= 1")
    if any(n > DECODE_MAX_BATCHED for n in sizes):
        parser.error(f"sizes must be <= max_num_batched_tokens ({DECODE_MAX_BATCHED})")
    gc_freeze = not args.no_gc_freeze
    t_run = time.perf_counter()

    if str(REPO) not in sys.path:  # importable even without the editable install
        sys.path.insert(0, str(REPO))
    from harness.candidates.vllm.env import env_python, is_ready
    from reference.runners.scripted import RequestScript
    from reference.runners.scripted import scripted_token as ref_scripted_token

    for i in range(50):  # our copy of the scripted model must be the reference's
        script = RequestScript(5, eos_at=7 if i % 2 else None, eos_token_id=2)
        if scripted_token(SEED, f"r{i:06d}", i % 9, script.eos_at, 2) != \
                ref_scripted_token(SEED, f"r{i:06d}", i % 9, script):
            print("error: scripted_token differs from reference.runners.scripted", file=sys.stderr)
            return 1
    if azure_limit and not AZURE_CODE.is_file():
        print(f"error: {AZURE_CODE}: Azure code trace not found", file=sys.stderr)
        return 2
    if not is_ready(VLLM_VERSION):
        print(f"error: the vLLM {VLLM_VERSION} env is not built ({env_python(VLLM_VERSION)}): "
              f"run `harness vllm-env {VLLM_VERSION}`", file=sys.stderr)
        return 2

    scenarios = [decode_scenario(n, steps, args.warmup) for n in sizes]
    if azure_limit:
        scenarios.append(azure_scenario(azure_limit))

    # Reference first (about a second), then one vLLM subprocess for all scenarios.
    ref_results = {}
    for scenario in scenarios:
        ref_results[scenario["name"]] = run_scenario(
            ReferenceBackend(scenario["config"], SEED), scenario, gc_freeze)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        vllm_out, child_log, child_wall = run_vllm_child(scenarios, gc_freeze, args.log_stats,
                                                          Path(tmp))

    print("machine")
    print(f"  platform   {platform.platform()}")
    print(f"  processor  {platform.processor() or platform.machine()}")
    print(f"  cpus       {os.cpu_count()}")
    try:
        print("  loadavg    " + " ".join(f"{x:.2f}" for x in os.getloadavg())
              + " (at the end of the runs)")
    except OSError:
        pass
    print(f"  reference  {platform.python_implementation()} {platform.python_version()} "
          f"({sys.executable})")
    if vllm_out:
        print(f"  vLLM       vllm {vllm_out['vllm_version']}, torch {vllm_out['torch_version']}, "
              f"{vllm_out['python']} ({env_python(VLLM_VERSION)}); import + driver setup "
              f"{vllm_out['import_s']:.1f} s")
        print("             Scheduler log_stats=" + ("True (--log-stats)" if args.log_stats
                                                     else "False (as harness/candidates/vllm/driver_engine_core.py)"))
        if vllm_out["dropped_keys"]:
            print(f"             config keys at their default, not mapped by the driver, dropped: "
                  f"{', '.join(vllm_out['dropped_keys'])}")
    print("  gc         " + ("heap collected and frozen before each scenario (gc.freeze, as "
                             "vLLM's EngineCore after start-up)" if gc_freeze
                             else "left alone (--no-gc-freeze)"))
    print()
    print("scenarios")
    for scenario in scenarios:
        print(f"  {scenario['name']:<11} {scenario['describe']}")
    print()

    if vllm_out is None:
        print(child_log, file=sys.stderr)
        for scenario in scenarios:
            res = ref_results[scenario["name"]]
            s, u = summarise(res["schedule_ns"]), summarise(res["update_ns"])
            print(f"{scenario['name']}: reference schedule {_fmt3(s)}  update {_fmt3(u)} ms "
                  f"(mean p50 p99)")
        return 1

    label = f"vLLM {vllm_out['vllm_version']}"
    print("per-step time in ms: mean, p50, p99; ratio = reference / vLLM (below 1: reference faster)")
    head = (f"{'scenario':<11} {'call':<9} {'steps':>6}  {'reference':^23}  {label:^23}  "
            f"{'ratio ref/vLLM':^20}")
    sub = (f"{'':<11} {'':<9} {'':>6}  {'mean':>7} {'p50':>7} {'p99':>7}  {'mean':>7} {'p50':>7} "
           f"{'p99':>7}  {'mean':>6} {'p50':>6} {'p99':>6}")
    print(head)
    print(sub)
    print("-" * len(sub))
    status = 0
    notes = []
    for scenario in scenarios:
        name = scenario["name"]
        ref, vl = ref_results[name], vllm_out["scenarios"][name]
        both_ref = [a + b for a, b in zip(ref["schedule_ns"], ref["update_ns"])]
        both_vl = [a + b for a, b in zip(vl["schedule_ns"], vl["update_ns"])]
        rows = [("schedule", ref["schedule_ns"], vl["schedule_ns"]),
                ("update", ref["update_ns"], vl["update_ns"]),
                ("sum", both_ref, both_vl)]
        for i, (call, r_ns, v_ns) in enumerate(rows):
            rs, vs = summarise(r_ns), summarise(v_ns)
            print(f"{name if i == 0 else '':<11} {call:<9} {rs['n']:>6}  {_fmt3(rs)}  {_fmt3(vs)}  "
                  f"{_ratio(rs['mean'], vs['mean'])} {_ratio(rs['p50'], vs['p50'])} "
                  f"{_ratio(rs['p99'], vs['p99'])}")
        rt, vt = ref["totals"], vl["totals"]
        same = ref["digests"] == vl["digests"]
        if same:
            verdict = f"identical decisions in all {len(ref['digests']):,} steps"
        else:
            status = 1
            first = next((i for i, (a, b) in enumerate(zip(ref["digests"], vl["digests"])) if a != b),
                         min(len(ref["digests"]), len(vl["digests"])))
            verdict = (f"DECISIONS DIFFER from step {first} (reference {len(ref['digests'])} steps, "
                       f"vLLM {len(vl['digests'])})")
        notes.append(f"  {name:<11} {verdict}; {rt['steps']:,} steps, "
                     f"{rt['scheduled_tokens']:,} scheduled tokens, {rt['preemptions']} preemptions, "
                     f"{rt['finished']} finished; timed steps: {rt['timed_tokens']:,} tokens, "
                     f"{rt['timed_preemptions']} preemptions, {rt['timed_finished']} finished; "
                     f"loop wall reference {rt['wall_s']:.2f} s, vLLM {vt['wall_s']:.2f} s")
        if scenario["mode"] == "decode" and (rt["timed_preemptions"] or rt["timed_finished"]
                                             or len(ref["schedule_ns"]) < scenario["steps"]):
            notes.append(f"  {name:<11} WARNING: the timed window is not pure steady decode")
    print()
    print("runs")
    for line in notes:
        print(line)
    print()
    # Issue 24's goal, on CPU time (thread_time around each call, both sides): the
    # reference's schedule() + update_from_output() per timed step over vLLM's.
    print(f"goal: reference <= {CPU_GOAL:g}x vLLM CPU per step (schedule + update, timed steps)")
    for scenario in scenarios:
        name = scenario["name"]
        rt, vt = ref_results[name]["totals"], vllm_out["scenarios"][name]["totals"]
        n_ref, n_vl = len(ref_results[name]["schedule_ns"]), len(vllm_out["scenarios"][name]["schedule_ns"])
        if not n_ref or not n_vl:
            continue
        ref_us = (rt["schedule_cpu_ns"] + rt["update_cpu_ns"]) / n_ref / 1e3
        vl_us = (vt["schedule_cpu_ns"] + vt["update_cpu_ns"]) / n_vl / 1e3
        ratio = ref_us / vl_us if vl_us > 0 else float("inf")
        print(f"  {name:<11} reference {ref_us:>8.1f} us, vLLM {vl_us:>8.1f} us CPU per step: "
              f"{ratio:.3f}x  goal <= {CPU_GOAL:g}x  {'met' if ratio <= CPU_GOAL else 'NOT MET'}")
        if ratio > CPU_GOAL:
            print(f"  {'':<11} the rest goes to: {reference_profile(scenario, gc_freeze)}")
    total = time.perf_counter() - t_run
    print()
    print(f"wall: {total:.1f} s in all (vLLM subprocess {child_wall:.1f} s, of which import + setup "
          f"{vllm_out['import_s']:.1f} s)")
    return status


if __name__ == "__main__":
    # The --_vllm-child half runs under vLLM's venv (standard library only): no page.
    if sys.argv[1:2] == ["--_vllm-child"]:
        sys.exit(main())
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
    import page
    sys.exit(page.run(main, "bench_vllm"))
