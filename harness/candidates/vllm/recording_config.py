"""Map a recording's vLLM config onto the reference's ``EngineConfig`` (this project's venv).

``map_config`` takes vLLM's names (``scheduler_config.NAME``,
``cache_config.NAME``, ...) to ``EngineConfig`` fields; ``hybrid_config``
names a hybrid model's KV-cache groups as ``sliding_window`` /
``layer_types`` (full attention, sliding window, Mamba in mode "none") and
says why a group the model cannot follow is unmodelled; ``items_unmodelled``
does the same for encoder inputs. Used by ``recording_convert.convert``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from harness.candidates.vllm.recording_steps import read_records


#: The recorded KV-cache specs the harness models (``reference.kv``), by the
#: layer type a model config names for them (``MambaSpec``: mode "none" only,
#: see ``hybrid_config``).
LAYER_TYPE_OF_SPEC = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_attention",
                       "SlidingWindowMLASpec": "sliding_attention", "MambaSpec": "linear_attention"}


def swa_mla_config(groups: list[list]) -> tuple[dict, dict[str, str]]:
    """The config keys of a recording's ``SlidingWindowMLASpec`` groups (its
    fifth entry: ``events.SWA_MLA_SPEC_FIELDS``), as ``hybrid_config`` returns
    them: ``({"swa_bounded_replay": True}, {})`` for DeepSeek-V4.1's bounded
    replay, ``({}, {})`` without it, else ``({}, {feature: why})``.

    vLLM 0.33.0 runs such a group with its ``SlidingWindowManager``
    (``single_type_kv_cache_manager.py``, ``KVCacheSpecRegistry.register``),
    so without bounded replay it schedules as a ``SlidingWindowSpec`` group
    (the MLA page format is the worker's). With ``bounded_replay`` the spec
    is not ``prefix_cacheable`` and its ``prefix_replay_tokens`` is the
    window (``kv_cache_interface.py::SlidingWindowMLASpec``): the reference's
    ``swa_bounded_replay``, checked against the recorded values, not assumed.
    Unmodelled: a recorder that did not describe the fields, a window
    extended by ``extra_retained_tokens``, groups that differ, or a mix with
    ``SlidingWindowSpec`` groups (vLLM groups those apart)."""
    mla = [g for g in groups if g[0] == "SlidingWindowMLASpec"]
    if not mla:
        return {}, {}
    if any(g[0] == "SlidingWindowSpec" for g in groups):
        return {}, {"kv_cache_groups": "SlidingWindowSpec and SlidingWindowMLASpec groups (the model has "
                                       "one sliding-window spec)"}
    described = [g[4] if len(g) > 4 and isinstance(g[4], dict) else None for g in mla]
    if any(f is None or "bounded_replay" not in f for f in described):
        return {}, {"kv_cache_spec": "KV-cache spec SlidingWindowMLASpec recorded without its fields "
                                     "(a recorder before its bounded replay was described)"}
    if any(f.get("extra_retained_tokens", 0) for f in described):
        return {}, {"kv_cache_spec": f"SlidingWindowMLASpec extra_retained_tokens "
                                     f"{sorted({f.get('extra_retained_tokens') for f in described})} "
                                     f"(the model's window has none)"}
    bounded = {bool(f["bounded_replay"]) for f in described}
    if len(bounded) > 1:
        return {}, {"kv_cache_groups": "SlidingWindowMLASpec groups with and without bounded replay"}
    if not bounded.pop():
        return {}, {}
    for g, f in zip(mla, described):
        if f.get("prefix_cacheable") is not False or f.get("prefix_replay_tokens") != g[1]:
            return {}, {"kv_cache_spec": f"SlidingWindowMLASpec bounded replay with prefix_cacheable "
                                         f"{f.get('prefix_cacheable')!r}, prefix_replay_tokens "
                                         f"{f.get('prefix_replay_tokens')!r} (the model has no prefix cache "
                                         f"and a replay of the window, {g[1]})"}
    return {"swa_bounded_replay": True}, {}


def mamba_unmodelled(groups: list[list], max_model_len: int | None, num_speculative_tokens: int,
                      enable_prefix_caching: bool, cache_mamba_mode: str | None) -> str | None:
    """Why the recording's ``MambaSpec`` groups are not the reference's
    (``reference.kv.kv_cache_spec.MambaSpec``: vLLM 0.33.0's
    ``mamba_cache_mode`` "none", one state block of ``max_model_len`` tokens
    plus ``num_speculative_tokens`` blocks), or None when they are.

    vLLM 0.33.0 caches Mamba states in mode "align" when prefix caching is on
    (its default for a hybrid model, ``MambaModelConfig``): the
    ``MambaManager``'s blocks are ``block_size`` tokens, one state cached per
    block boundary, the previous state freed at the next allocation, prefill
    checkpoints (``single_type_kv_cache_manager.py::MambaManager``), and the
    ``Scheduler`` cuts prefill chunks at block boundaries
    (``_mamba_block_aligned_split``, on when ``cache_config.mamba_cache_mode``
    is "align"). None of that is modelled. ``cache_mamba_mode`` is the
    recorded ``cache_config.mamba_cache_mode`` (None: not recorded)."""
    for i, g in enumerate(groups):
        if g[0] != "MambaSpec":
            continue
        fields = g[4] if len(g) > 4 and isinstance(g[4], dict) else None
        if fields is None or "mamba_cache_mode" not in fields:
            return f"group {i}: MambaSpec recorded without its mamba_cache_mode (a recorder before issue 28's Mamba groups)"
        mode = fields["mamba_cache_mode"]
        if mode != "none":
            return (f"group {i}: MambaSpec mamba_cache_mode {mode!r} (vLLM's Mamba prefix caching: a state "
                    f"block per {g[2]} tokens, block-aligned prefill chunks, checkpoints; the model has 'none')")
        if g[2] != max_model_len:
            return (f"group {i}: MambaSpec block_size {g[2]} (mode 'none' keeps the whole state in one "
                    f"block of max_model_len {max_model_len} tokens; the model has only that)")
        blocks = fields.get("num_speculative_blocks", 0)
        if blocks != num_speculative_tokens:
            return (f"group {i}: MambaSpec num_speculative_blocks {blocks} (the model has "
                    f"num_speculative_tokens {num_speculative_tokens})")
    if cache_mamba_mode not in (None, "none"):
        return (f"cache_config.mamba_cache_mode {cache_mamba_mode!r}: vLLM's Scheduler cuts prefill chunks "
                f"at Mamba block boundaries (_mamba_block_aligned_split; the model has 'none')")
    if enable_prefix_caching:
        # vLLM's MambaManager asserts "align" with caching: a recording cannot hold this.
        return "MambaSpec mamba_cache_mode 'none' with prefix caching (vLLM requires 'align' for it)"
    return None


def hybrid_config(groups: list[list] | None, block_size: int, *, max_model_len: int | None = None,
                  num_speculative_tokens: int = 0, enable_prefix_caching: bool = False,
                  cache_mamba_mode: str | None = None) -> tuple[dict, dict[str, str]]:
    """A hybrid recording's KV-cache groups (meta ``kv_cache_groups``:
    ``[spec name, sliding_window, block_size, layers]`` each, group order, a
    ``MambaSpec`` group with its fields fifth: ``events.describe_groups``) as
    the harness's config keys.

    Returns ``({"sliding_window": w, "layer_types": [...], ...}, {})`` when
    one layer per group, grouped as vLLM 0.33.0 groups them
    (``reference.kv.kv_cache_spec.kv_cache_groups_for`` with
    ``max_model_len`` and ``num_speculative_tokens``), gives back the same
    groups in the same order; else ``({}, {feature: why})``: ``kv_cache_spec``
    for a spec the reference does not model (Mamba in any mode but "none",
    ``mamba_unmodelled``; an MLA sliding window the model cannot follow,
    ``swa_mla_config``; chunked local attention, ...), ``kv_cache_groups``
    for groups it models in a shape a config cannot name (block sizes or
    windows that differ, an order the grouping does not give, several
    full-attention groups). ``({}, {})`` for no groups recorded.

    With Mamba groups the keys also set ``block_size``: the attention
    groups' (vLLM's ``Scheduler`` runs on the least common multiple of every
    group's block size, ``kv_cache_utils.resolve_kv_cache_block_sizes``,
    which the recorder writes as ``block_size``; in mode "none" without a KV
    connector it reads it nowhere, as the vLLM driver does,
    ``driver_engine_core.Driver.init``). ``block_size`` is the recorded one."""
    from reference.kv.kv_cache_spec import kv_cache_groups_for

    if not groups:
        return {}, {}
    names = [g[0] for g in groups]
    other = sorted(set(names) - set(LAYER_TYPE_OF_SPEC))
    if other:
        return {}, {"kv_cache_spec": f"KV-cache spec {', '.join(other)} is not modelled"}
    mla_keys, why = swa_mla_config(groups)
    if why:
        return {}, why
    mamba = "MambaSpec" in names
    if mamba:
        why = mamba_unmodelled(groups, max_model_len, num_speculative_tokens, enable_prefix_caching,
                                cache_mamba_mode)
        if why is not None:
            return {}, {"kv_cache_spec": why}
        attention = sorted({g[2] for g in groups if g[0] != "MambaSpec"})
        if len(attention) > 1:
            return {}, {"kv_cache_groups": f"attention block sizes {attention} per group (the model has one)"}
        if attention:
            block_size = attention[0]
    elif any(g[2] != block_size for g in groups):
        return {}, {"kv_cache_groups": f"block sizes {[g[2] for g in groups]} per group "
                                       f"(the model has one, {block_size})"}
    sliding = ("SlidingWindowSpec", "SlidingWindowMLASpec")
    windows = sorted({g[1] for g in groups if g[0] in sliding})
    if len(windows) > 1:
        return {}, {"kv_cache_groups": f"sliding windows {windows} (the model has one)"}
    window = windows[0] if windows else None
    layer_types = tuple(LAYER_TYPE_OF_SPEC[n] for n in names)
    rebuilt = [[type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None)]
               for g in kv_cache_groups_for(layer_types, block_size, window, max_model_len=max_model_len,
                                            num_speculative_tokens=num_speculative_tokens)]
    if rebuilt != [["SlidingWindowSpec", g[1]] if g[0] in sliding else [g[0], None] for g in groups]:
        return {}, {"kv_cache_groups": f"groups {names} in an order vLLM's grouping does not give"}
    if window is not None and set(layer_types) == {"sliding_attention"}:
        return {"sliding_window": window, **mla_keys}, {}  # every layer a sliding-window layer
    if window is None and not mamba:
        return {}, {"kv_cache_groups": f"{len(groups)} full-attention groups"}
    keys: dict = {"layer_types": list(layer_types)}
    if window is not None:
        keys["sliding_window"] = window
    if mamba:
        keys["block_size"] = block_size
    keys.update(mla_keys)
    return keys, {}


#: The recorded encoder config (the budgets vLLM's Scheduler derived, in embeds),
#: mapped onto EngineConfig only for a recording with encoder inputs.
ENCODER_KEYS = ("max_num_encoder_input_tokens", "encoder_cache_size", "disable_chunked_mm_input")
#: The recorder's ``unmodelled`` features under which a request's encoder inputs
#: are left out of the trace (as every recording's were before format 3 kept them).
ENCODER_UNMODELLED = ("encoder_decoder", "mm_encoder_only", "ec_connector", "encoder_cache_manager")


def items_unmodelled(src: Path) -> str | None:
    """Why the recording's encoder inputs cannot be modelled, from its arrivals
    (None: they can): an item with fewer embeds than placeholder tokens (an
    ``is_embed`` mask), or items that are not sorted, non-overlapping spans
    inside the prompt (``RequestSpec.mm_positions``)."""
    for number, rec in read_records(src):
        if rec["t"] != "arrival" or not rec.get("mm_features"):
            continue
        end = 0
        for offset, length, _, num_embeds in rec["mm_features"]:
            if num_embeds != length:
                return f"request {rec['request_id']!r}: an item of {length} tokens has {num_embeds} embeds"
            if offset < end or length < 1 or offset + length > len(rec["prompt_token_ids"]):
                return (f"request {rec['request_id']!r}: items {rec['mm_features']!r:.120} are not sorted, "
                        f"non-overlapping spans of its prompt")
            end = offset + length
    return None


def map_config(meta_rec: dict, engine_config_cls,
                derived_keys: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(values for EngineConfig, unmapped captured values). Names are vLLM's:
    a recorded value under our name wins, then ``scheduler_config.NAME``,
    ``cache_config.NAME``, ``parallel_config.NAME`` and ``vllm_config.NAME``;
    fields with no vLLM counterpart keep their default. The derived
    ``max_concurrent_batches`` (vLLM's ``VllmConfig`` property, or an older
    log's recorded key) is mapped too: ``EngineConfig.from_dict`` checks it
    against ``pipeline_parallel_size`` and ``async_scheduling``."""
    # vLLM's encoder budget keys have no effect on a text-only recording: mapped
    # by ``convert`` only when a request has encoder inputs (ENCODER_KEYS).
    # cache_config.swa_bounded_replay is on by default in vLLM 0.33.0 and acts
    # only through a DeepSeek-V4.1 layer's spec: ``hybrid_config`` maps the
    # recorded spec's bounded_replay (``swa_mla_config``), never the switch.
    fields = ({f.name for f in dataclasses.fields(engine_config_cls)} | set(derived_keys)) - set(
        ENCODER_KEYS) - {"max_loras", "swa_bounded_replay"}
    recorded = meta_rec.get("config", {})
    raw = meta_rec.get("vllm_config", {})
    values = {}
    for name in fields:
        for key, source in ((name, recorded), (f"scheduler_config.{name}", raw),
                            (f"cache_config.{name}", raw), (f"parallel_config.{name}", raw),
                            (f"vllm_config.{name}", raw)):
            if key in source:
                values[name] = source[key]
                break
    unmapped = {k: v for k, v in sorted(raw.items()) if k.split(".", 1)[-1] not in fields}
    unmapped.update({k: v for k, v in recorded.items() if k not in fields})
    return values, unmapped
