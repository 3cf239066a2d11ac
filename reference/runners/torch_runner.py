"""The torch model runner: executes each step's SchedulerOutput on the tiny
transformer with a paged KV cache, the way vLLM's GPU worker does
(``vllm/v1/worker/gpu_model_runner.py``: ``_update_states``,
``_prepare_inputs``, ``execute_model``, ``_sample``; block tables as in
``vllm/v1/worker/block_table.py``; the KV write as ``reshape_and_cache``
and the read as the paged attention backends do).

Per step (``execute(output, step)``):

1. forget finished requests (``output.finished_req_ids``); drop the block
   table of preempted ones (``output.preemptions``; their tokens stay: a
   resumed request recomputes them);
2. update block tables: a ``new``/``resumed`` request's ``new_block_ids`` is
   its whole table (prefix-hit blocks first), a ``running`` one's are
   appended;
3. flatten the scheduled tokens (``input_ids``, ``positions``,
   ``slot_mapping`` = ``block_table[pos // block_size] * block_size +
   pos % block_size``, ``query_start_loc``, ``seq_lens``); the tokens are
   the request's known tokens then its drafts (``spec_token_ids``);
4. per layer: write every scheduled token's K/V into its slot, then attend
   per request over positions ``0..seq_len-1`` read back from the cache
   through its block table (prefix-hit blocks were written by another
   request);
5. sample where the step reaches the end of the known tokens: greedy with
   the tie rule of ``greedy_sample``; with drafts, greedy verification (the
   drafts are accepted while they equal the model's token, then one more
   token). A partial prefill chunk samples nothing.

Tokens are produced at execute time, like the scripted runner, so async
scheduling (a step launched before the previous one is processed) finds the
previous token already known. ``batch_done(step)`` is called when the engine
processes the batch launched at ``step``. With ``defer_block_free`` (the
harness's stand-in for vLLM's KV-consumer connector) a step's KV writes are
modelled as still landing until then: they are applied again at
``batch_done``, so a block freed before its fence and handed to another
request is overwritten (and, in integrity mode, reported).

KV integrity mode (``kv_integrity=True``): every K/V the attention reads is
compared with the dense computation of the same request's tokens
(``DenseSequence``): positions computed in earlier steps against the dense
K/V, positions of this step against what this step wrote; tolerance
``|paged - dense| <= KV_ATOL + KV_RTOL * |dense|``. Also: two scheduled
tokens of one step mapped to the same slot, a slot overwritten while its
writing step was in flight, positions without a block. The first findings
(``MAX_FINDINGS``) are kept with the owner history of the block.

Drafts (``propose_drafts``): the dense model's own greedy continuation of
the request (a perfect draft model with its own contiguous KV); a draft
that must not match is replaced by ``(token + 1) % vocab_size``: with the
``random`` pattern a seeded coin per (seed, request, output index) at or
above ``draft_acceptance_rate``, else as ``draft_acceptance_pattern`` says.

Not modelled: the simulated KV connector's remote loads (``kv_connector``
is refused with ValueError).

Deterministic: no global state, no randomness besides the seeded weights
and the hash-based coin.

One file over ~500 lines: the runner's job (execute a SchedulerOutput on a
paged KV cache) and its KV-integrity mode share the per-step state (block
tables, slot mapping, writes in flight, owner history) that the checks read
as each layer runs; the model, the attention and the dense oracle are
already in ``torch_model.py``.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():
    # torch warns once at import when numpy is absent; nothing here needs numpy.
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    import torch

from reference.config import ConfigError, EngineConfig
from reference.runners.scripted import RequestScript
from reference.output import ScheduledRequest, SchedulerOutput
from reference.runners.torch_model import (
    DenseSequence,
    SamplingRule,
    TinyModelConfig,
    TinyTransformer,
    attention,
    greedy_sample,
    resolve_device,
)

KV_ATOL = 1e-4
KV_RTOL = 1e-4
MAX_FINDINGS = 10
HISTORY_LEN = 12  # owner-history events kept per block
PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class KVFinding:
    """A KV-cache integrity failure seen by the runner.

    ``kind``: ``stale-read`` (K/V read for a position computed in an earlier
    step differs from the dense computation), ``same-step-overwrite`` (K/V of
    this step's own token read back differs from what it wrote: another token
    of the step wrote the same slot), ``double-write`` (two tokens of one
    step mapped to one slot), ``overwritten-in-flight`` (a slot changed while
    the step that wrote it was still in flight), ``unmapped`` (a position
    with no block in the table), ``input-gap`` (scheduled positions beyond
    the request's known tokens). ``step`` is the engine step; ``position``
    the token position in the request; ``block_id``/``slot`` where it lives;
    ``max_abs_error`` the largest K/V difference there; ``history`` the
    block's recent owner events (oldest first).
    """

    kind: str
    step: int
    request_id: str
    message: str
    layer: int | None = None
    position: int | None = None
    block_id: int | None = None
    slot: int | None = None
    max_abs_error: float | None = None
    history: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [f"KV {self.kind.upper()} at step {self.step}, request {self.request_id}: {self.message}"]
        if self.block_id is not None:
            lines.append(f"  block {self.block_id} owner history (oldest first):")
            lines += [f"    {h}" for h in self.history] or ["    (none recorded)"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "request": self.request_id,
                "message": self.message, "layer": self.layer, "position": self.position,
                "block_id": self.block_id, "slot": self.slot,
                "max_abs_error": self.max_abs_error, "history": list(self.history)}


def compute_slot_mapping(block_table: Sequence[int], positions: torch.Tensor,
                         block_size: int) -> torch.Tensor:
    """Slots of ``positions`` [N] (int64) through ``block_table`` (block ids):
    ``block_table[p // block_size] * block_size + p % block_size``; -1 where
    the table has no block for p. Mirrors ``BlockTable.compute_slot_mapping``
    (vllm/v1/worker/block_table.py). Returns int64 [N] on positions' device.
    """
    table = torch.tensor(list(block_table) + [-1], dtype=torch.int64, device=positions.device)
    index = torch.clamp(positions // block_size, max=len(block_table))
    blocks = table[index]
    return torch.where(blocks >= 0, blocks * block_size + positions % block_size,
                       torch.full_like(blocks, -1))


def draft_coin(seed: int, request_id: str, output_index: int) -> float:
    """Seeded uniform number in [0, 1) deciding whether the draft at
    ``output_index`` is kept (below the acceptance rate) or corrupted."""
    digest = hashlib.blake2b(f"torch-draft:{seed}:{request_id}:{output_index}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass
class _RequestState:
    """What the worker keeps per request (vLLM ``CachedRequestState``)."""

    spec: Any  # reference.workload.RequestSpec
    rule: SamplingRule
    token_ids: list[int]  # prompt + every sampled token, in order
    num_prompt_tokens: int
    block_table: list[int] = field(default_factory=list)
    sampled_last_step: bool = False
    num_proposals: int = 0  # draft proposals made (pattern "cycle")
    dense: DenseSequence | None = None  # lazily: integrity shadow and drafter

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class _Scheduled:
    """One request's share of the flattened batch."""

    state: _RequestState
    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    spec_token_ids: list[int]
    query_start: int
    ctx_slots: torch.Tensor  # [seq_len] int64, -1 = unmapped
    unmapped: bool
    sample: bool
    logits_start: int = -1

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def query_slice(self) -> slice:
        return slice(self.query_start, self.query_start + self.num_scheduled_tokens)


@dataclass
class _InFlight:
    """A launched step whose KV writes (with a connector) land at batch_done."""

    step: int
    slots: torch.Tensor | None = None  # [W] unique slots written
    owners: list[tuple[str, int]] = field(default_factory=list)  # (request, position) per slot
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [W, KVH, D]
    values: list[torch.Tensor] = field(default_factory=list)


class TorchModelRunner:
    """Paged-attention runner of one data-parallel rank (one KV pool).

    ``config``: the engine config (``num_gpu_blocks``, ``block_size``,
    ``defer_block_free``); ``seed``: the run seed (draft coins); ``model``:
    a ``TinyTransformer`` (shared read-only between ranks) or None to build
    one from ``model_config`` on ``device``; ``kv_integrity``: check every
    K/V read (slower: a dense shadow per request).

    KV cache: per layer ``k_cache[layer]``, ``v_cache[layer]`` of shape
    ``[num_gpu_blocks, block_size, num_kv_heads, head_dim]`` (fp32).

    Interface (``reference.runners.ModelRunner``): ``add_request(spec,
    script)``, ``execute(output, step) -> {request_id: sampled token ids}``,
    ``batch_done(step)``, ``propose_drafts(ids, k, rate)``, ``finish(id)``.
    ``execute`` raises KeyError for a request it was never given.
    ``findings`` / ``num_findings``: integrity findings (first
    ``MAX_FINDINGS`` kept).
    """

    def __init__(self, config: EngineConfig, seed: int = 0, *, model: TinyTransformer | None = None,
                 model_config: TinyModelConfig | None = None, device: str = "cpu",
                 kv_integrity: bool = False) -> None:
        if getattr(config, "kv_connector", False):
            raise ValueError("the torch runner does not model the simulated KV connector's remote "
                             "loads (kv_connector=true) yet")
        self.config = config
        self.seed = seed
        self.model = model if model is not None else TinyTransformer(
            model_config or TinyModelConfig(), resolve_device(device))
        self.device = self.model.device
        self.kv_integrity = kv_integrity
        self.block_size = config.block_size
        self.connector_writes = bool(config.defer_block_free)
        mc = self.model.config
        shape = (config.num_gpu_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=mc.storage_dtype, device=self.device)
                        for _ in range(mc.num_layers)]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self.findings: list[KVFinding] = []
        self.num_findings = 0
        self.findings_by_kind: dict[str, int] = {}
        self.num_scheduled_tokens = 0  # tokens run (for throughput figures)
        self._requests: dict[str, _RequestState] = {}
        self._in_flight: deque[_InFlight] = deque()
        self._history: dict[int, deque[str]] = {}
        self._step = 0
        self._flagged: set[tuple[int, str]] = set()  # (step, request) already reported

    # -- request lifecycle ------------------------------------------------------------
    def add_request(self, spec: Any, script: RequestScript | None = None) -> None:
        """Register a request (its RequestSpec: prompt, sampling parameters)."""
        self._requests[spec.request_id] = _RequestState(
            spec=spec, rule=SamplingRule.from_spec(spec), token_ids=list(spec.prompt_token_ids),
            num_prompt_tokens=len(spec.prompt_token_ids))

    def finish(self, request_id: str) -> None:
        """Forget a finished or aborted request (its blocks are the scheduler's)."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._log_blocks(state.block_table, f"{request_id} released it (finished)")

    # -- execute --------------------------------------------------------------------------
    def execute(self, output: SchedulerOutput, step: int) -> dict[str, list[int]]:
        """Run one step's scheduled tokens; return {request_id: sampled ids}
        for every scheduled request ([] for a partial prefill chunk)."""
        self._step = step
        for req_id in sorted(output.finished_req_ids):
            self.finish(req_id)
        for pre in output.preemptions:
            state = self._requests.get(pre.request_id)
            if state is not None:
                fence = f", free fenced until step seq {pre.fence}" if pre.fence is not None else ""
                self._log_blocks(state.block_table, f"{pre.request_id} released it (preempted{fence})")
                state.block_table = []
        for req_id in output.preempted_req_ids:
            if req_id in self._requests:
                self._requests[req_id].block_table = []
        in_flight = _InFlight(step)
        self._in_flight.append(in_flight)
        scheduled = output.scheduled
        if not scheduled:
            return {}
        batch, input_ids, positions, slot_mapping = self._prepare_inputs(scheduled)
        keep = self._unique_slots(batch, slot_mapping)
        self.num_scheduled_tokens += int(positions.shape[0])

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k32, v32 = k.to(self.k_cache[layer].dtype), v.to(self.v_cache[layer].dtype)
            flat_k = self.k_cache[layer].view(-1, *k32.shape[1:])
            flat_v = self.v_cache[layer].view(-1, *v32.shape[1:])
            if keep.numel():
                flat_k[slot_mapping[keep]] = k32[keep]
                flat_v[slot_mapping[keep]] = v32[keep]
                if self.connector_writes:
                    in_flight.keys.append(k32[keep].clone())
                    in_flight.values.append(v32[keep].clone())
            out = torch.empty_like(q)
            for item in batch:
                ctx_k, ctx_v = self._gather(flat_k, flat_v, item)
                if self.kv_integrity:
                    self._check_reads(layer, item, ctx_k, ctx_v, k32[item.query_slice],
                                      v32[item.query_slice])
                out[item.query_slice] = attention(q[item.query_slice], positions[item.query_slice],
                                                  ctx_k, ctx_v)
            return out

        if self.connector_writes and keep.numel():
            in_flight.slots = slot_mapping[keep].clone()
            owners = [(item.request_id, item.num_computed_tokens + j)
                      for item in batch for j in range(item.num_scheduled_tokens)]
            in_flight.owners = [owners[i] for i in keep.tolist()]
        hidden = self.model.forward(input_ids, positions, attend)
        rows = [i for item in batch if item.sample
                for i in range(item.logits_start, item.logits_start + len(item.spec_token_ids) + 1)]
        logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)]) \
            if rows else None
        return self._sample(batch, logits)

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]):
        """Update block tables and flatten the batch (vLLM ``_update_states``
        + ``_prepare_inputs``)."""
        batch: list[_Scheduled] = []
        tokens: list[int] = []
        pos: list[int] = []
        for rec in scheduled:
            state = self._requests[rec.request_id]
            self._update_block_table(state, rec)
            c, n, drafts = rec.num_computed_tokens, rec.num_scheduled_tokens, list(rec.spec_token_ids)
            end = c + n - len(drafts)  # first draft position
            known = len(state.token_ids)
            if end > known and self.kv_integrity:
                self._report(KVFinding("input-gap", self._step, rec.request_id,
                                       f"scheduled positions {known}-{end - 1} have no token "
                                       f"(the request has {known}); they run as token {PAD_TOKEN_ID}"))
            for p in range(c, c + n):
                if p < end:
                    tokens.append(state.token_ids[p] if p < known else PAD_TOKEN_ID)
                else:
                    tokens.append(drafts[p - end])
                pos.append(p)
            ctx_slots = compute_slot_mapping(state.block_table,
                                             torch.arange(c + n, dtype=torch.int64, device=self.device),
                                             self.block_size)
            item = _Scheduled(state, rec.request_id, c, n, drafts, len(pos) - n, ctx_slots,
                              bool((ctx_slots < 0).any()), sample=end >= known and n > len(drafts))
            if item.sample:
                item.logits_start = item.query_start + n - len(drafts) - 1
            state.sampled_last_step = item.sample
            if self.kv_integrity:
                self._extend_dense(state, min(c, known))
                self._log_writes(item)
                if item.unmapped:
                    first = int(torch.nonzero(ctx_slots < 0)[0])
                    self._report(KVFinding("unmapped", self._step, rec.request_id,
                                           f"position {first} has no block (table of "
                                           f"{len(state.block_table)} blocks, block_size "
                                           f"{self.block_size})", position=first))
            batch.append(item)
        positions = torch.tensor(pos, dtype=torch.int64, device=self.device)
        slot_mapping = torch.cat([item.ctx_slots[item.num_computed_tokens:] for item in batch])
        return batch, self.model.to_vocab(tokens), positions, slot_mapping

    def _update_block_table(self, state: _RequestState, rec: ScheduledRequest) -> None:
        if rec.kind in ("new", "resumed"):
            state.block_table = list(rec.new_block_ids)
            if self.kv_integrity:
                hits = rec.num_prefix_hit_tokens // self.block_size
                self._log_blocks(state.block_table[:hits], f"{rec.request_id} prefix hit ({rec.kind})")
                self._log_blocks(state.block_table[hits:], f"{rec.request_id} allocated it ({rec.kind})")
        else:
            state.block_table.extend(rec.new_block_ids)
            self._log_blocks(rec.new_block_ids, f"{rec.request_id} allocated it (running)")

    def _unique_slots(self, batch: list[_Scheduled], slot_mapping: torch.Tensor) -> torch.Tensor:
        """Indices of the tokens whose write lands: one per slot, the last
        one in batch order (vLLM leaves duplicate slots undefined; here they
        are deterministic and, in integrity mode, reported)."""
        slots = slot_mapping.tolist()
        last: dict[int, int] = {}
        for i, s in enumerate(slots):
            if s >= 0:
                last[s] = i
        valid = sum(1 for s in slots if s >= 0)
        if len(last) < valid and self.kv_integrity:
            owners = [(item.request_id, item.num_computed_tokens + j)
                      for item in batch for j in range(item.num_scheduled_tokens)]
            seen: dict[int, int] = {}
            for i, s in enumerate(slots):
                if s < 0:
                    continue
                if s in seen:
                    (r1, p1), (r2, p2) = owners[seen[s]], owners[i]
                    block = s // self.block_size
                    self._report(KVFinding(
                        "double-write", self._step, r2,
                        f"slot {s} (block {block}) is written twice in one step: by {r1} "
                        f"position {p1} and by {r2} position {p2}",
                        position=p2, block_id=block, slot=s, history=self._history_of(block)))
                    break
                seen[s] = i
        return torch.tensor(sorted(last.values()), dtype=torch.int64, device=self.device)

    def _gather(self, flat_k: torch.Tensor, flat_v: torch.Tensor, item: _Scheduled):
        slots = item.ctx_slots
        if not item.unmapped:
            return flat_k[slots], flat_v[slots]
        ok = (slots >= 0)[:, None, None]
        safe = slots.clamp(min=0)
        return (torch.where(ok, flat_k[safe], torch.zeros((), dtype=flat_k.dtype, device=self.device)),
                torch.where(ok, flat_v[safe], torch.zeros((), dtype=flat_v.dtype, device=self.device)))

    def _sample(self, batch: list[_Scheduled], logits: torch.Tensor | None) -> dict[str, list[int]]:
        """Greedy sampling and greedy draft verification (vLLM ``_sample`` +
        ``RejectionSampler`` with temperature 0)."""
        sampled: dict[str, list[int]] = {}
        row = 0
        for item in batch:
            if not item.sample:
                sampled[item.request_id] = []
                continue
            state, drafts = item.state, item.spec_token_ids
            first = state.num_output_tokens
            block = logits[row:row + len(drafts) + 1]
            row += len(drafts) + 1
            candidates = greedy_sample(block, [first + j for j in range(len(drafts) + 1)], state.rule)
            tokens: list[int] = []
            for j, draft in enumerate(drafts):
                tokens.append(candidates[j])
                if candidates[j] != draft:
                    break
            else:
                tokens.append(candidates[len(drafts)])
            state.token_ids.extend(tokens)
            sampled[item.request_id] = tokens
        return sampled

    # -- in-flight steps -----------------------------------------------------------------
    def batch_done(self, step: int) -> None:
        """The batch launched at ``step`` completed (the engine processes it
        now; FIFO). With the connector model its KV writes land again here."""
        if not self._in_flight or self._in_flight[0].step != step:
            expected = self._in_flight[0].step if self._in_flight else None
            raise RuntimeError(f"batch_done({step}) but the oldest batch in flight is {expected}")
        done = self._in_flight.popleft()
        if done.slots is None:
            return
        for layer in range(len(self.k_cache)):
            flat_k = self.k_cache[layer].view(-1, *done.keys[layer].shape[1:])
            flat_v = self.v_cache[layer].view(-1, *done.values[layer].shape[1:])
            if self.kv_integrity and layer == 0:
                changed = (flat_k[done.slots] != done.keys[layer]).flatten(1).any(1) | \
                          (flat_v[done.slots] != done.values[layer]).flatten(1).any(1)
                if bool(changed.any()):
                    i = int(torch.nonzero(changed)[0])
                    slot = int(done.slots[i])
                    block = slot // self.block_size
                    req_id, position = done.owners[i]
                    err = float((flat_k[slot] - done.keys[layer][i]).abs().max())
                    self._report(KVFinding(
                        "overwritten-in-flight", step, req_id,
                        f"block {block} slot {slot} (position {position} of {req_id}, written by "
                        f"step {step}) was overwritten before step {step} completed; its K/V "
                        f"write is still landing (deferred-free fence)",
                        layer=layer, position=position, block_id=block, slot=slot,
                        max_abs_error=err, history=self._history_of(block)))
            flat_k[done.slots] = done.keys[layer]
            flat_v[done.slots] = done.values[layer]

    # -- drafts ------------------------------------------------------------------------------
    def propose_drafts(self, request_ids: list[str], num_speculative_tokens: int,
                       acceptance_rate: float, pattern: str = "random") -> dict[str, list[int]]:
        """``num_speculative_tokens`` drafts per request that sampled in its
        last step: the dense model's greedy continuation, where a draft that
        must not match is replaced by ``(token + 1) % vocab_size``. Which
        drafts match follows ``pattern`` as in the scripted proposer
        (``random``: a seeded coin per (seed, request, output index) below
        ``acceptance_rate``; ``all``, ``none``, ``prefix-N``, ``cycle``).
        Requests still prefilling get none (the scheduler would drop them).
        Raises ValueError for an unknown pattern."""
        from reference.runners.scripted import parse_draft_acceptance_pattern

        kind, prefix = parse_draft_acceptance_pattern(pattern)
        drafts: dict[str, list[int]] = {}
        vocab = self.model.config.vocab_size
        for req_id in request_ids:
            state = self._requests.get(req_id)
            if state is None or not state.sampled_last_step or num_speculative_tokens <= 0:
                continue
            if kind == "cycle":
                prefix = state.num_proposals % (num_speculative_tokens + 1)
                state.num_proposals += 1
            dense = self._dense(state)
            committed = len(state.token_ids) - 1
            if dense.length > committed:
                dense.truncate(committed)
            dense.extend(state.token_ids[dense.length:committed])
            logits = dense.extend([state.token_ids[-1]])
            first = state.num_output_tokens
            proposal: list[int] = []
            for j in range(num_speculative_tokens):
                token = greedy_sample(logits[-1:], [first + j], state.rule)[0]
                if kind == "random":
                    matches = draft_coin(self.seed, req_id, first + j) < acceptance_rate
                else:
                    matches = j < prefix
                proposal.append(token if matches else (token + 1) % vocab)
                if j + 1 < num_speculative_tokens:
                    logits = dense.extend([token])
            dense.truncate(committed)
            drafts[req_id] = proposal
        return drafts

    # -- integrity ---------------------------------------------------------------------------
    def _dense(self, state: _RequestState) -> DenseSequence:
        if state.dense is None:
            state.dense = DenseSequence(self.model)
        return state.dense

    def _extend_dense(self, state: _RequestState, length: int) -> None:
        dense = self._dense(state)
        if dense.length < length:
            dense.extend(state.token_ids[dense.length:length])

    def _check_reads(self, layer: int, item: _Scheduled, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                     own_k: torch.Tensor, own_v: torch.Tensor) -> None:
        """Compare what attention reads with what it should read."""
        key = (self._step, item.request_id)
        if key in self._flagged:
            return
        c = item.num_computed_tokens
        dense = item.state.dense
        m = min(c, dense.length if dense is not None else 0)
        if m:
            ref_k, ref_v = dense.keys(layer)[:m], dense.values(layer)[:m]
            bad = self._mismatch(ctx_k[:m], ref_k) | self._mismatch(ctx_v[:m], ref_v)
            if bool(bad.any()):
                p = int(torch.nonzero(bad)[0])
                err = max(float((ctx_k[p] - ref_k[p]).abs().max()),
                          float((ctx_v[p] - ref_v[p]).abs().max()))
                self._report_read("stale-read", layer, item, p, err,
                                  "differs from the dense computation of its tokens")
                return
        own = item.ctx_slots[c:] >= 0
        bad = ((ctx_k[c:] != own_k).flatten(1).any(1) | (ctx_v[c:] != own_v).flatten(1).any(1)) & own
        if bool(bad.any()):
            p = c + int(torch.nonzero(bad)[0])
            err = float((ctx_k[p] - own_k[p - c]).abs().max())
            self._report_read("same-step-overwrite", layer, item, p, err,
                              "is not what this step wrote there (another token of the step "
                              "wrote the same slot)")

    @staticmethod
    def _mismatch(paged: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        err = (paged.to(torch.float64) - dense.to(torch.float64)).abs()
        return (err > KV_ATOL + KV_RTOL * dense.to(torch.float64).abs()).flatten(1).any(1)

    def _report_read(self, kind: str, layer: int, item: _Scheduled, position: int, err: float,
                     why: str) -> None:
        self._flagged.add((self._step, item.request_id))
        slot = int(item.ctx_slots[position])
        block = slot // self.block_size
        self._report(KVFinding(
            kind, self._step, item.request_id,
            f"layer {layer} read K/V of position {position} from block {block} "
            f"(offset {position % self.block_size}), which {why} (max |error| {err:.3g}, "
            f"tolerance {KV_ATOL:g} + {KV_RTOL:g}*|dense|)",
            layer=layer, position=position, block_id=block, slot=slot, max_abs_error=err,
            history=self._history_of(block)))

    def _report(self, finding: KVFinding) -> None:
        self.num_findings += 1
        self.findings_by_kind[finding.kind] = self.findings_by_kind.get(finding.kind, 0) + 1
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(finding)

    # -- owner history -------------------------------------------------------------------------
    def _log_blocks(self, block_ids: Sequence[int], what: str) -> None:
        if not self.kv_integrity:
            return
        for block in block_ids:
            self._history.setdefault(block, deque(maxlen=HISTORY_LEN)).append(f"step {self._step}: {what}")

    def _log_writes(self, item: _Scheduled) -> None:
        c, n = item.num_computed_tokens, item.num_scheduled_tokens
        p = c
        while p < c + n:
            index = p // self.block_size
            stop = min(c + n, (index + 1) * self.block_size)
            if index < len(item.state.block_table):
                block = item.state.block_table[index]
                self._history.setdefault(block, deque(maxlen=HISTORY_LEN)).append(
                    f"step {self._step}: {item.request_id} wrote positions {p}-{stop - 1}")
            p = stop

    def _history_of(self, block: int) -> tuple[str, ...]:
        return tuple(self._history.get(block, ()))


class TorchRunnerFactory:
    """Builds one ``TorchModelRunner`` per data-parallel rank (the engine's
    ``runner_factory``), sharing one model; keeps the runners it built in
    ``runners`` so the caller can read their findings. The model is built
    on first use, on ``device`` ("cpu", "cuda" or "auto")."""

    def __init__(self, model_config: TinyModelConfig | None = None, device: str = "auto",
                 kv_integrity: bool = False) -> None:
        self.model_config = model_config or TinyModelConfig()
        self.device = resolve_device(device)
        self.kv_integrity = kv_integrity
        self.runners: list[TorchModelRunner] = []
        self._model: TinyTransformer | None = None

    @property
    def model(self) -> TinyTransformer:
        if self._model is None:
            self._model = TinyTransformer(self.model_config, self.device)
        return self._model

    def __call__(self, config: EngineConfig, seed: int) -> TorchModelRunner:
        if config.async_scheduling and config.num_speculative_tokens:
            # The worker's drafts never reach the trace (no `draft` rows), so
            # the playback runner could not replay such a run.
            raise ConfigError("the torch model runner does not support async scheduling with "
                              "speculative decoding (its drafts could not be played back)")
        runner = TorchModelRunner(config, seed, model=self.model, kv_integrity=self.kv_integrity)
        self.runners.append(runner)
        return runner

    def metadata(self) -> dict[str, Any]:
        """What a trace records about the model (key ``model``)."""
        return {"runner": "torch", "name": "tiny-transformer",
                "config": self.model_config.to_dict(), "device": self.device.type,
                "kv_integrity": self.kv_integrity}

    @property
    def findings(self) -> list[KVFinding]:
        return [f for r in self.runners for f in r.findings]

    @property
    def num_findings(self) -> int:
        return sum(r.num_findings for r in self.runners)

    @property
    def findings_by_kind(self) -> dict[str, int]:
        """Integrity findings of all runners together, by kind (all of them,
        not only the first ``MAX_FINDINGS`` kept)."""
        kinds: dict[str, int] = {}
        for r in self.runners:
            for k, v in r.findings_by_kind.items():
                kinds[k] = kinds.get(k, 0) + v
        return kinds
