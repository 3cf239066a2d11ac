"""The output oracle: a torch-run trace's tokens vs a dense, unbatched forward.

For every request of a trace recorded with ``--model torch``, the tokens
the paged runner produced (its ``output`` rows, in order: including tokens
past a stop that async scheduling over-scheduled) must equal greedy
generation by the same model (weights from the trace's ``model`` metadata)
over the request's prompt alone, without paging, batching, chunking,
preemption or prefix sharing (``reference.runners.torch_model.dense_generate``).
This is the invariant "output unchanged by preemption, recompute, prefix
hits, chunked prefill, speculative decoding and async scheduling".

A mismatch is reported with the dense model's top-2 logit gap at that
index: below ``NEAR_TIE_GAP`` it could be float64 rounding (never observed),
above it the KV cache fed the model wrong keys/values.

Needs torch (imported lazily: ``import_torch`` raises ``OutputsError`` with a
one-line install hint when it is missing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape

from harness.trace.playback import load_recorded_outputs, trace_model
from harness.replay import workload_from_trace
from harness.trace import Trace
from reference.workload import RequestSpec
from reference.words import plural

NEAR_TIE_GAP = 1e-9
TORCH_PIN = "torch==2.13.0"
# The one line `--model torch` and `verify-outputs` print without torch (exit 2). The extra
# is pinned in pyproject.toml: an unpinned `pip install torch` pulls a multi-GB CUDA build.
TORCH_MISSING = (f"the torch model runner needs torch: pip install 'sched-harness[torch]' "
                 f"(or pip install {TORCH_PIN})")


class OutputsError(Exception):
    """The oracle cannot run: torch missing, not a torch-run trace, bad model
    metadata or device. ``str()`` is one line."""


def import_torch():
    """Import torch (lazily, so the harness works without it) and use one
    intra-op CPU thread: the tiny model's operations are far too small to
    split, and extra threads only add synchronisation (about 20x slower on
    a loaded 2-core machine). Raises OutputsError when torch is missing."""
    try:
        import torch

        import reference.runners.torch_model  # noqa: F401  (silences torch's numpy warning)
    except ImportError:
        raise OutputsError(TORCH_MISSING) from None
    torch.set_num_threads(1)
    return torch


@dataclass
class OutputMismatch:
    """First differing output index of one request: ``expected`` (dense) vs
    ``actual`` (paged), the tokens around it and the dense top-2 logit gap."""

    request_id: str
    index: int
    expected: int
    actual: int
    num_tokens: int
    top2_gap: float
    expected_window: list[int]
    actual_window: list[int]

    @property
    def near_tie(self) -> bool:
        return self.top2_gap < NEAR_TIE_GAP

    def describe(self) -> str:
        tie = " (a near-tie: float rounding?)" if self.near_tie else ""
        return (f"OUTPUT MISMATCH request {self.request_id}, output index {self.index} of "
                f"{self.num_tokens}: dense {self.expected}, paged {self.actual} (dense top-2 logit "
                f"gap {self.top2_gap:.3g}{tie}); dense {self.expected_window} vs paged "
                f"{self.actual_window}")

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.request_id, "index": self.index, "expected": self.expected,
                "actual": self.actual, "num_tokens": self.num_tokens, "top2_gap": self.top2_gap,
                "near_tie": self.near_tie, "expected_window": self.expected_window,
                "actual_window": self.actual_window}


@dataclass
class OutputReport:
    """Result of the oracle over one run: requests and tokens compared, and
    the mismatching requests (first differing index each)."""

    requests: int = 0
    tokens: int = 0
    mismatches: list[OutputMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "requests": self.requests, "tokens": self.tokens,
                "num_mismatches": len(self.mismatches),
                "mismatches": [m.to_dict() for m in self.mismatches]}


def torch_runner_factory(device: str = "auto", kv_integrity: bool = False) -> Any:
    """A ``TorchRunnerFactory`` (default tiny model) on ``device``; raises
    OutputsError when torch or the device is missing."""
    import_torch()
    from reference.runners.torch_runner import TorchRunnerFactory

    try:
        return TorchRunnerFactory(device=device, kv_integrity=kv_integrity)
    except RuntimeError as exc:
        raise OutputsError(str(exc)) from None


def verify_outputs(specs: Iterable[RequestSpec], streams: dict[str, list[int]], model: Any) -> OutputReport:
    """Compare each request's produced tokens (``streams``) with dense greedy
    generation by ``model`` (a ``TinyTransformer``). Requests that produced
    nothing are skipped."""
    from reference.runners.torch_model import SamplingRule, dense_generate

    report = OutputReport()
    for spec in specs:
        actual = streams.get(spec.request_id)
        if not actual:
            continue
        expected, gaps = dense_generate(model, spec.prompt_token_ids, len(actual), SamplingRule.from_spec(spec))
        report.requests += 1
        report.tokens += len(actual)
        if expected != actual:
            i = next(j for j, (e, a) in enumerate(zip(expected, actual)) if e != a)
            lo = max(0, i - 3)
            report.mismatches.append(OutputMismatch(
                spec.request_id, i, expected[i], actual[i], len(actual), gaps[i],
                expected[lo:i + 4], actual[lo:i + 4]))
    return report


def model_from_trace(trace: Trace, device: str = "auto") -> Any:
    """The ``TinyTransformer`` a torch-run trace was recorded with, on
    ``device``. Raises OutputsError (not a torch trace, bad metadata, no
    torch, no such device)."""
    meta = trace_model(trace)
    if meta is None or meta.get("runner") != "torch":
        raise OutputsError(f"{trace.path}: not recorded with the torch model runner "
                           f"(record it with --model torch)")
    import_torch()
    from reference.runners.torch_model import TinyModelConfig, TinyTransformer, resolve_device

    try:
        config = TinyModelConfig.from_dict(meta.get("config") or {})
    except (TypeError, ValueError) as exc:
        raise OutputsError(f"{trace.path}: bad model config in metadata: {exc}") from None
    try:
        return TinyTransformer(config, resolve_device(device))
    except RuntimeError as exc:
        raise OutputsError(str(exc)) from None


def verify_trace_outputs(trace: Trace, device: str = "auto") -> OutputReport:
    """Run the oracle on a torch-run trace (prompts from its ``arrival`` rows,
    produced tokens from its ``output`` rows). Raises OutputsError or
    TraceError."""
    model = model_from_trace(trace, device)
    streams = load_recorded_outputs(trace).streams
    return verify_outputs(workload_from_trace(trace).requests, streams, model)


def render_torch_run(runner_factory: Any, kv_integrity: bool, console: Console) -> bool:
    """Print what a ``--model torch`` recording ran (device, tokens through
    the paged KV cache) and, with ``kv_integrity``, its integrity findings
    by kind and the first in full; True when there is a finding.
    ``runner_factory``: the ``TorchRunnerFactory`` the recording used."""
    tokens = sum(r.num_scheduled_tokens for r in runner_factory.runners)
    console.print(f"model: tiny-transformer (torch, {runner_factory.device.type}), "
                  f"{plural(tokens, 'token')} run through the paged KV cache")
    if not kv_integrity:
        return False
    n = runner_factory.num_findings
    if not n:
        console.print("[bold green]KV integrity: every K/V read matched the dense computation[/]")
        return False
    kinds = runner_factory.findings_by_kind
    console.print(f"[bold red]KV integrity: {plural(n, 'finding')}[/] "
                  f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))}); the first:")
    console.print(escape(runner_factory.findings[0].describe()))
    return True


def render_outputs(report: OutputReport, console: Console) -> bool:
    """Print the output oracle's verdict (the first five mismatches in
    full); True when some request differs."""
    if report.ok:
        console.print(f"[bold green]outputs: {plural(report.requests, 'request')}, {plural(report.tokens, 'token')}, all "
                      f"equal to a dense unbatched forward[/]")
        return False
    verdict = (f"outputs: {len(report.mismatches)} of {plural(report.requests, 'request')} "
               f"{'differs' if len(report.mismatches) == 1 else 'differ'} "
               f"from a dense unbatched forward")
    console.print(f"[bold red]{verdict}[/] ({plural(report.tokens, 'token')} compared)")
    for m in report.mismatches[:5]:
        console.print("  " + escape(m.describe()))
    if report.mismatches:
        console.print(verdict, style="bold red", markup=False)  # the verdict again, last
    return True
