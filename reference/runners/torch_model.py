"""A tiny decoder-only transformer with seeded weights, its attention kernel,
its greedy sampler and a dense (unpaged, unbatched) sequence for the oracle.

Needs torch (``pip install 'sched-harness[torch]'``, which pins torch==2.13.0); nothing else in ``reference/``
imports this module, so the scheduler, the scripted runner and the harness
work without torch.

The model mirrors the layout of vLLM's Llama (``vllm/model_executor/models/
llama.py``): token embedding; per layer RMSNorm -> QKV projection -> rotary
position embedding (RoPE) -> attention with grouped-query heads -> output
projection -> residual, RMSNorm -> gated SiLU MLP -> residual; final RMSNorm
-> LM head. Token ids of a workload (``[0, 32000)``) are mapped into the
model's vocabulary by ``token_id % vocab_size``; sampled ids are in
``[0, vocab_size)`` (a forced EOS keeps the workload's EOS id).

Numerics and batch invariance
-----------------------------
Weights and the KV cache are fp32 (``TinyModelConfig.dtype``). Every
operation is *computed* in float64 from those fp32 values: K and V are
rounded to fp32 when they are stored (paged cache or dense cache), and the
attention reads them back from fp32 storage. float64 results of one
operation differ between kernels (a matmul over 1 row vs 300 rows, a softmax
over 20 vs 24 keys) by about 1e-16 relative, so after rounding to fp32 the
stored K/V are bitwise identical in all but ~1e-9 of the elements, and the
float64 logits differ by ~1e-15: greedy argmax changes only if the top two
logits are that close. Plain fp32 compute would not do (a fp32 matmul's row
depends on how many rows are in the batch, measured here). Attention is
computed per request over its own keys only (no cross-request padding), and
``greedy_sample`` breaks exact ties by the lowest token id. That is what
makes a request's tokens independent of which other requests share its
batch, of chunked-prefill boundaries, and of preemption and recompute.

Errors: ``ValueError`` for a bad ``TinyModelConfig``; ``RuntimeError`` from
``resolve_device("cuda")`` without CUDA.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

with warnings.catch_warnings():
    # torch warns once at import when numpy is absent; nothing here needs numpy.
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    import torch

COMPUTE_DTYPE = torch.float64
# Queries x keys x heads per attention tile (float64 scores): bounds memory
# for long prompts (~32 MiB of scores per tile).
_SCORE_TILE_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape and seed of the tiny transformer.

    ``vocab_size`` tokens; ``hidden_size`` = ``num_heads * head_dim``;
    ``num_kv_heads`` divides ``num_heads`` (grouped-query attention);
    ``intermediate_size``: MLP width; ``rope_theta``: RoPE base;
    ``seed``: the weights are a pure function of it (generated on CPU with
    ``torch.Generator``, then moved to the device); ``dtype``: storage dtype of
    weights and KV cache (``"float32"``). Raises ValueError when inconsistent.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TinyModelConfig.{name} must be an int >= 1, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim (hidden_size / num_heads) must be even for RoPE")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TinyModelConfig:
        """Build from ``to_dict()`` output; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown TinyModelConfig key(s): {', '.join(sorted(unknown))}")
        return cls(**data)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; ``"cuda"`` without CUDA
    raises RuntimeError; ``"cpu"`` is always available."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available on this machine")
    if device not in ("cpu", "cuda"):
        raise RuntimeError(f"unknown device {device!r} (cpu, cuda or auto)")
    return torch.device(device)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


# attend(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> attention output [T, H, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyTransformer:
    """The model: seeded fp32 weights on ``device``, float64 compute.

    ``forward(token_ids, positions, attend)`` runs the flattened tokens of a
    batch ([T] int64 ids already in the vocabulary, [T] int64 positions) and
    delegates the KV-cache write and the attention of each layer to
    ``attend`` (the paged runner and the dense sequence differ only there);
    returns the final hidden states [T, hidden] (float64). ``logits(hidden)``
    -> [N, vocab] float64. Mirrors ``LlamaForCausalLM.forward`` +
    ``compute_logits`` in vLLM.
    """

    def __init__(self, config: TinyModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        h, hd, kvh = config.hidden_size, config.head_dim, config.num_kv_heads
        dtype = config.storage_dtype

        def weight(rows: int, cols: int, scale: float) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale
            return w.to(dtype).to(self.device)

        def norm(n: int) -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)
            return w.to(dtype).to(self.device)

        self.embed_tokens = weight(config.vocab_size, h, 1.0)
        self.layers: list[_Layer] = []
        for _ in range(config.num_layers):
            self.layers.append(_Layer(
                attn_norm=norm(h),
                wq=weight(h, config.num_heads * hd, 1.0 / math.sqrt(h)),
                wk=weight(h, kvh * hd, 1.0 / math.sqrt(h)),
                wv=weight(h, kvh * hd, 1.0 / math.sqrt(h)),
                wo=weight(config.num_heads * hd, h, 1.0 / math.sqrt(h)),
                mlp_norm=norm(h),
                w_gate=weight(h, config.intermediate_size, 1.0 / math.sqrt(h)),
                w_up=weight(h, config.intermediate_size, 1.0 / math.sqrt(h)),
                w_down=weight(config.intermediate_size, h, 1.0 / math.sqrt(config.intermediate_size)),
            ))
        self.final_norm = norm(h)
        # A sharp LM head (scale 4/sqrt(h)) keeps the top-2 logit gap wide.
        self.lm_head = weight(h, config.vocab_size, 4.0 / math.sqrt(h))
        half = hd // 2
        self._inv_freq = (config.rope_theta ** (
            -torch.arange(half, dtype=COMPUTE_DTYPE) / half)).to(self.device)

    # -- building blocks ---------------------------------------------------------
    def to_vocab(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Workload token ids -> model ids (``id % vocab_size``), int64 [T] on
        the model's device. Negative ids (spec-decode padding) map to 0."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        ids = torch.where(ids < 0, torch.zeros_like(ids), ids % self.config.vocab_size)
        return ids.to(self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.config.rms_norm_eps) * weight.to(COMPUTE_DTYPE)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (neox style) of x [T, heads, D] at ``positions`` [T]."""
        angles = positions.to(COMPUTE_DTYPE)[:, None] * self._inv_freq[None, :]
        cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """Hidden states [T, hidden] (float64) of the flattened batch."""
        cfg = self.config
        t = token_ids.shape[0]
        x = self.embed_tokens[token_ids].to(COMPUTE_DTYPE)
        for index, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            q = (h @ layer.wq.to(COMPUTE_DTYPE)).view(t, cfg.num_heads, cfg.head_dim)
            k = (h @ layer.wk.to(COMPUTE_DTYPE)).view(t, cfg.num_kv_heads, cfg.head_dim)
            v = (h @ layer.wv.to(COMPUTE_DTYPE)).view(t, cfg.num_kv_heads, cfg.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            attn = attend(index, q, k, v)
            x = x + attn.reshape(t, -1) @ layer.wo.to(COMPUTE_DTYPE)
            h = self._rms_norm(x, layer.mlp_norm)
            gate = torch.nn.functional.silu(h @ layer.w_gate.to(COMPUTE_DTYPE))
            x = x + (gate * (h @ layer.w_up.to(COMPUTE_DTYPE))) @ layer.w_down.to(COMPUTE_DTYPE)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits [N, vocab] (float64) of hidden states [N, hidden]."""
        return self._rms_norm(hidden, self.final_norm) @ self.lm_head.to(COMPUTE_DTYPE)


def attention(q: torch.Tensor, q_positions: torch.Tensor, k_ctx: torch.Tensor,
              v_ctx: torch.Tensor) -> torch.Tensor:
    """Causal attention of one request's queries over its own context.

    ``q`` [n, H, D] (float64) at ``q_positions`` [n]; ``k_ctx``, ``v_ctx``
    [L, KVH, D] hold the keys/values of positions 0..L-1 (any float dtype,
    computed in float64); query at position p sees keys 0..p. Grouped-query:
    head h uses KV head ``h // (H // KVH)``. Returns [n, H, D] float64.
    Queries are processed in tiles so the scores never exceed
    ``_SCORE_TILE_ELEMENTS``. The role of vLLM's attention backends
    (``vllm/v1/attention/backends/``), without their batching.
    """
    n, num_heads, head_dim = q.shape
    length, num_kv_heads, _ = k_ctx.shape
    group = num_heads // num_kv_heads
    k = k_ctx.to(COMPUTE_DTYPE).repeat_interleave(group, dim=1)  # [L, H, D]
    v = v_ctx.to(COMPUTE_DTYPE).repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim)
    key_pos = torch.arange(length, device=q.device)
    tile = max(1, _SCORE_TILE_ELEMENTS // max(1, num_heads * length))
    out = []
    for start in range(0, n, tile):
        qt = q[start:start + tile]
        scores = torch.einsum("nhd,lhd->nhl", qt, k) * scale
        mask = key_pos[None, :] > q_positions[start:start + tile, None]  # [t, L]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out.append(torch.einsum("nhl,lhd->nhd", probs, v))
    return torch.cat(out, dim=0) if len(out) != 1 else out[0]


# -- sampling -------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingRule:
    """How greedy sampling treats one request (from its RequestSpec).

    ``forced_eos_index``: 0-based output index at which the token is
    ``eos_token_id`` whatever the logits (the workload's scripted EOS:
    ``scripted_output_len - 1``; None = never); ``min_tokens``: before this
    many output tokens the EOS (unless ``ignore_eos``) and ``stop_token_ids``
    are masked, as vLLM's min-tokens logits processor does.
    """

    eos_token_id: int | None = None
    ignore_eos: bool = True
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    forced_eos_index: int | None = None

    @classmethod
    def from_spec(cls, spec: Any) -> SamplingRule:
        """The rule of a ``reference.workload.RequestSpec``."""
        forced = None
        if spec.scripted_output_len is not None and spec.eos_token_id is not None:
            forced = spec.scripted_output_len - 1
        return cls(eos_token_id=spec.eos_token_id, ignore_eos=spec.ignore_eos,
                   min_tokens=spec.min_tokens, stop_token_ids=tuple(spec.stop_token_ids),
                   forced_eos_index=forced)


def greedy_sample(logits: torch.Tensor, output_indices: Sequence[int], rule: SamplingRule) -> list[int]:
    """Greedy tokens for logits [N, vocab] at 0-based output indices [N].

    Tie rule: among equal maximal logits the lowest token id wins (computed
    explicitly, not left to the backend's argmax). ``rule`` applies the
    min-tokens mask and the forced EOS. Returns N ints.
    """
    if logits.shape[0] == 0:
        return []
    vocab = logits.shape[-1]
    logits = logits.clone()
    masked = [t for t in rule.stop_token_ids if 0 <= t < vocab]
    if not rule.ignore_eos and rule.eos_token_id is not None and 0 <= rule.eos_token_id < vocab:
        masked.append(rule.eos_token_id)
    if masked and rule.min_tokens:
        rows = [i for i, idx in enumerate(output_indices) if idx < rule.min_tokens]
        if rows:
            sel = torch.tensor(rows, device=logits.device)
            cols = torch.tensor(masked, device=logits.device)
            logits[sel[:, None], cols[None, :]] = float("-inf")
    is_max = logits == logits.max(dim=-1, keepdim=True).values
    ids = torch.arange(vocab, device=logits.device).expand_as(logits)
    tokens = torch.where(is_max, ids, torch.full_like(ids, vocab)).min(dim=-1).values.tolist()
    if rule.forced_eos_index is not None:
        tokens = [rule.eos_token_id if idx == rule.forced_eos_index else tok
                  for idx, tok in zip(output_indices, tokens)]
    return tokens


def top2_gap(logits_row: torch.Tensor) -> float:
    """Difference between the two largest logits of a [vocab] row (a near-tie
    diagnostic for the output oracle)."""
    top = torch.topk(logits_row, 2).values
    return float(top[0] - top[1])


# -- the dense oracle ----------------------------------------------------------------------

@dataclass
class DenseSequence:
    """One request's tokens run densely: unbatched, unpaged, a contiguous fp32
    K/V buffer per layer, the same model and attention kernel.

    ``extend(token_ids)`` computes the new positions (chunked, so a long
    prompt never builds a huge score matrix) and returns their logits
    [n, vocab] (float64); ``truncate(length)`` forgets positions >= length
    (used by the drafter's look-ahead); ``keys(layer)``/``values(layer)``
    give [length, KVH, D] fp32. The oracle of output equality and of KV
    integrity.
    """

    model: TinyTransformer
    chunk: int = 512
    length: int = 0
    _k: list[torch.Tensor] = field(default_factory=list)
    _v: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.model.config
        shape = (16, cfg.num_kv_heads, cfg.head_dim)
        self._k = [torch.empty(shape, dtype=cfg.storage_dtype, device=self.model.device)
                   for _ in range(cfg.num_layers)]
        self._v = [torch.empty_like(k) for k in self._k]

    def _reserve(self, length: int) -> None:
        capacity = self._k[0].shape[0]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        for buffers in (self._k, self._v):
            for i, old in enumerate(buffers):
                new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[:self.length] = old[:self.length]
                buffers[i] = new

    def extend(self, token_ids: Sequence[int]) -> torch.Tensor:
        outs = []
        for start in range(0, len(token_ids), self.chunk):
            outs.append(self._extend(token_ids[start:start + self.chunk]))
        if not outs:
            return torch.empty((0, self.model.config.vocab_size), dtype=COMPUTE_DTYPE,
                               device=self.model.device)
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

    def _extend(self, token_ids: Sequence[int]) -> torch.Tensor:
        n, start = len(token_ids), self.length
        self._reserve(start + n)
        positions = torch.arange(start, start + n, device=self.model.device)

        def attend(layer: int, q, k, v):
            self._k[layer][start:start + n] = k.to(self._k[layer].dtype)
            self._v[layer][start:start + n] = v.to(self._v[layer].dtype)
            return attention(q, positions, self._k[layer][:start + n], self._v[layer][:start + n])

        hidden = self.model.forward(self.model.to_vocab(token_ids), positions, attend)
        self.length = start + n
        return self.model.logits(hidden)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def keys(self, layer: int) -> torch.Tensor:
        return self._k[layer][:self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self._v[layer][:self.length]


def dense_generate(model: TinyTransformer, prompt_token_ids: Sequence[int], num_tokens: int,
                   rule: SamplingRule) -> tuple[list[int], list[float]]:
    """Greedy generation of ``num_tokens`` tokens after the prompt, one
    request alone, no paging (the output oracle). Generation does not stop
    at EOS: the paged runner also produces tokens past a stop (async
    over-scheduling), and they are compared too. Returns (tokens, the top-2
    logit gap at each output index)."""
    seq = DenseSequence(model)
    tokens: list[int] = []
    gaps: list[float] = []
    if num_tokens <= 0:
        return tokens, gaps
    logits = seq.extend(list(prompt_token_ids))[-1:]
    for index in range(num_tokens):
        tokens += greedy_sample(logits, [index], rule)
        gaps.append(top2_gap(logits[0]))
        if index + 1 < num_tokens:
            logits = seq.extend([tokens[-1]])
    return tokens, gaps
