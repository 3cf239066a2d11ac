#!/usr/bin/env python3
"""Benchmark the torch paged-attention model runner (tokens/s), on CPU and on CUDA when present.

Run from anywhere:  .venv/bin/python bench/bench_torch.py [--device auto|cpu|cuda|all] [--json]

Workloads (engine runs with the reference scheduler and the torch runner, no
trace written):
  decode:  synthetic, 64 requests, prompts 32-128 tokens, 64-128 output
           tokens, max_num_seqs 32 (batched decode, many steps);
  prefill: the first --limit (default 24) requests of the Azure code trace,
           outputs capped at 32 tokens, max_model_len 8192 (long prompts,
           chunked prefill at 2048 tokens per step); without ../shared/data
           (e.g. on a device machine) --limit synthetic prompts of 1024-3072
           tokens instead;
  oracle:  the dense, unbatched greedy forward of the decode workload's
           requests (what `harness verify-outputs` runs).

Figures per (workload, device): wall seconds, steps/s, tokens run through
the model per second (prefill + decode + drafts: what the KV cache wrote),
generated tokens/s, and with --kv-integrity the same with every K/V read
checked. Timings use time.perf_counter, one run each (the first CUDA run
includes warm-up: a short warm-up run precedes it). CPU runs use --threads
intra-op threads (default 1: the model's ops are tiny). Exit 0, or 2 when a
requested device or torch is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.outputs import OutputsError, import_torch
from reference.config import EngineConfig
from reference.engine import Engine
from workloads import load_workload, synthetic

AZURE_CODE = (REPO / ".." / "shared" / "data" / "azure-llm-inference-2023"
              / "AzureLLMInferenceTrace_code.csv").resolve()


def decode_workload(smoke: bool = False):
    if smoke:  # the test suite's run
        wl = synthetic(num_requests=2, seed=0, prompt_len=(8, 16), output_len=(4, 8), arrival_rate=1000.0)
    else:
        wl = synthetic(num_requests=64, seed=0, prompt_len=(32, 128), output_len=(64, 128),
                       arrival_rate=1000.0)
    config = EngineConfig(block_size=16, num_gpu_blocks=1024, max_model_len=512, max_num_seqs=32,
                          max_num_batched_tokens=2048)
    return wl, config


def prefill_workload(limit: int, max_tokens: int = 32, smoke: bool = False):
    if smoke:
        wl = synthetic(num_requests=limit, seed=0, prompt_len=(64, 128), output_len=(4, 8), arrival_rate=1000.0)
    elif AZURE_CODE.exists():
        wl = load_workload(str(AZURE_CODE), limit=limit, time_scale=100)
    else:
        wl = synthetic(num_requests=limit, seed=0, prompt_len=(1024, 3072), output_len=(16, 32),
                       arrival_rate=1000.0)
    wl = dataclasses.replace(wl, requests=tuple(dataclasses.replace(r, max_tokens=min(r.max_tokens, max_tokens))
                                                for r in wl.requests))
    config = EngineConfig(block_size=16, num_gpu_blocks=4096, max_model_len=8192, max_num_seqs=16,
                          max_num_batched_tokens=2048)
    return wl, config


def bench_engine(name: str, wl, config, device: str, integrity: bool, torch) -> dict:
    from reference.runners.torch_runner import TorchRunnerFactory

    factory = TorchRunnerFactory(device=device, kv_integrity=integrity)
    generated = 0

    def on_step(rec) -> None:
        nonlocal generated
        for r in [rec, *rec.peers]:
            generated += sum(len(t) for t in r.sampled.values())
    if factory.device.type == "cuda":  # warm-up: kernels, allocator
        Engine(config, runner_factory=TorchRunnerFactory(device=device)).run(
            dataclasses.replace(wl, requests=wl.requests[:2]))
        torch.cuda.synchronize()
    start = time.perf_counter()
    summary = Engine(config, runner_factory=factory).run(wl, on_step)
    if factory.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(r.num_scheduled_tokens for r in factory.runners)
    return {"workload": name, "device": factory.device.type, "kv_integrity": integrity,
            "requests": summary.finished, "steps": summary.steps, "wall_s": round(wall, 3),
            "steps_per_s": round(summary.steps / wall, 1), "tokens_run": tokens,
            "tokens_run_per_s": round(tokens / wall, 1), "generated": generated,
            "generated_per_s": round(generated / wall, 1), "findings": factory.num_findings}


def bench_oracle(wl, device: str, torch) -> dict:
    from reference.runners.torch_model import (
        SamplingRule,
        TinyModelConfig,
        TinyTransformer,
        dense_generate,
        resolve_device,
    )

    model = TinyTransformer(TinyModelConfig(), resolve_device(device))
    start = time.perf_counter()
    tokens = 0
    for spec in wl.requests:
        out, _ = dense_generate(model, spec.prompt_token_ids, spec.max_tokens, SamplingRule.from_spec(spec))
        tokens += len(out) + len(spec.prompt_token_ids)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"workload": "oracle", "device": model.device.type, "kv_integrity": False,
            "requests": len(wl.requests), "wall_s": round(wall, 3), "tokens_run": tokens,
            "tokens_run_per_s": round(tokens / wall, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda", "all"], default="all",
                        help="all (default): CPU, and CUDA when present")
    parser.add_argument("--limit", type=int, default=24, help="Azure requests for the prefill workload")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    parser.add_argument("--kv-integrity", action="store_true", help="also time integrity mode")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--smoke", action="store_true",
                        help="the test suite's run: CPU, 2 tiny decode requests, 1 short prefill")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.limit = "cpu", 1
    try:
        torch = import_torch()
    except OutputsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.device == "all":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    elif args.device == "auto":
        devices = ["cuda" if torch.cuda.is_available() else "cpu"]
    else:
        devices = [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        print("error: --device cuda: CUDA is not available on this machine", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    if not args.json:
        print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
              f"{args.threads} CPU thread(s), GPU: {gpu}")
    rows = []
    dwl, dconf = decode_workload(args.smoke)
    pwl, pconf = prefill_workload(args.limit, 4 if args.smoke else 32, args.smoke)
    for device in devices:
        for integrity in ([False, True] if args.kv_integrity else [False]):
            rows.append(bench_engine("decode", dwl, dconf, device, integrity, torch))
            rows.append(bench_engine("prefill", pwl, pconf, device, integrity, torch))
        rows.append(bench_oracle(dwl, device, torch))
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        mode = " +integrity" if row["kv_integrity"] else ""
        extra = (f", {row['steps']} steps ({row['steps_per_s']}/s), generated {row['generated']} "
                 f"({row['generated_per_s']}/s)") if "steps" in row else ""
        print(f"{row['workload']:8s} {row['device']:4s}{mode:11s} {row['wall_s']:8.2f} s  "
              f"{row['tokens_run_per_s']:10.1f} tokens/s run ({row['tokens_run']}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_torch"))
