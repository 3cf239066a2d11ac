"""Scenario files: a bug report's minimal workload, written by hand (docs/scenario-format.md).

A scenario is a TOML file (or JSON with the same structure) carrying its own
engine config and every request's inputs: prompt, sampling parameters,
priority, arrival by time, by step or after another request, abort by step,
the tokens the model samples, encoder items, per-request draft acceptance;
or, instead of the requests, a ``[synthetic]`` table of the seeded
generator's arguments (the canonical scenarios of ``harness/scenarios/``).
``load_scenario(path)`` validates it strictly and returns a :class:`Scenario`
(config dict, seed, :class:`~reference.workload.Workload` in file order).

Validation is a JSON Schema (``SCENARIO_SCHEMA``, checked with the
``jsonschema`` package: declarative, one place for every key's type and
range, and the same document users can point an editor at), plus the
cross-request rules a schema cannot state (duplicate ids, ``after`` naming an
unknown, later or cyclic request, a step before the request can arrive) and
``EngineConfig`` for ``[config]``. Every error is a :class:`ScenarioError`
whose ``str()`` is one line ``file:line: problem``: TOML syntax errors carry
tomllib's line; for the others the line is that of the offending key, found
by scanning the text for its table (``[config]``, ``[synthetic]``, the i-th
``[[requests]]``) and then the key (JSON: the i-th object of ``"requests"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import tomli_w

from reference.config import DERIVED_KEYS, ConfigError, EngineConfig
from reference.engine import check_config_supported
from reference.workload import EOS_TOKEN_ID, MAX_TOKEN_ID, VOCAB_SIZE, RequestSpec, Workload, WorkloadError
from reference.workload import ACTION_KINDS, Action
from reference.words import did_you_mean, missing_file_hint
from workloads.synthetic import synthetic

__all__ = ["FORMAT_VERSION", "SCENARIO_SCHEMA", "Scenario", "ScenarioError", "load_scenario",
           "is_scenario_path", "synthetic_workload"]

#: The format version this harness reads and writes (``format_version``).
FORMAT_VERSION = 1
#: vLLM's SamplingParams default ``max_tokens``.
DEFAULT_MAX_TOKENS = 16
_FIRST_TOKEN_ID = 10  # synthesised prompt tokens are in [10, VOCAB_SIZE), as the loaders'

MAX_INT32 = 2**31 - 1
#: A prompt_len past this (16 Mi tokens) is refused: synthesising it would take minutes and gigabytes,
#: and any prompt of max_model_len tokens or more is only ever rejected at arrival.
MAX_PROMPT_LEN = 2**24


def _bounded(schema: Any) -> Any:
    """``schema`` with every integer bounded to int32 (traces store int32 columns; a larger
    value crashed the writer), unless it sets its own bounds."""
    if isinstance(schema, dict):
        out = {k: _bounded(v) for k, v in schema.items()}
        if out.get("type") == "integer":
            out.setdefault("maximum", MAX_INT32)
            out.setdefault("minimum", -MAX_INT32 - 1)
        return out
    if isinstance(schema, list):
        return [_bounded(v) for v in schema]
    return schema


_token = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_step = {"type": "integer", "minimum": 0}
_REQUEST = {
    "type": "object",
    "additionalProperties": False,
    "required": ["request_id"],
    "properties": {
        # No white space: `after = "<id> finishes"` must name it unambiguously.
        "request_id": {"type": "string", "pattern": "^\\S+$"},
        "prompt_token_ids": {"type": "array", "items": _token, "minItems": 1},
        "prompt_len": {"type": "integer", "minimum": 1, "maximum": MAX_PROMPT_LEN},
        "prefix_group": {"type": "string", "minLength": 1},
        "prefix_len": {"type": "integer", "minimum": 0},
        "max_tokens": {"type": "integer", "minimum": 1},
        "min_tokens": {"type": "integer", "minimum": 0},
        "ignore_eos": {"type": "boolean"},
        "eos_token_id": _token,
        "stop_token_ids": {"type": "array", "items": _token},
        "priority": {"type": "integer"},
        "arrival_time": {"type": "number", "minimum": 0},
        "arrival_step": _step,
        "after": {"type": "string", "pattern": "^\\S+ finishes$"},
        "abort_step": _step,
        "abort_time": {"type": "number", "minimum": 0},
        "output_token_ids": {"type": "array", "items": _token, "minItems": 1},
        "mm_positions": {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                    "items": {"type": "integer", "minimum": 0}}},
        "draft_acceptance_pattern": {"type": "string"},
    },
}
# -- [[actions]] (engine-level events at a step) ---------------------------------
#: Keys each action kind takes besides ``step`` and ``kind``.
_ACTION_KEYS = {"reset_prefix_cache": ("reset_running_requests",), "abort": ("request_ids",)}
_ACTION = {
    "type": "object",
    "additionalProperties": False,
    "required": ["step", "kind"],
    "properties": {
        "step": _step,
        "kind": {"enum": list(ACTION_KINDS)},
        "reset_running_requests": {"type": "boolean"},
        "request_ids": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    },
}
_range = {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 2, "maxItems": 2}
_fraction = {"type": "number", "minimum": 0, "maximum": 1}
#: ``[synthetic]``: exactly the arguments of ``workloads.synthetic`` (its
#: docstring gives each one's meaning); ranges are ``[low, high]``, inclusive.
_SYNTHETIC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["num_requests"],
    "properties": {
        "num_requests": {"type": "integer", "minimum": 1},
        "seed": {"type": "integer"},
        "prompt_len": _range,
        "output_len": _range,
        # TOML's ``inf`` is allowed (every arrival at 0.0); NaN is refused by synthetic().
        "arrival_rate": {"type": "number", "exclusiveMinimum": 0},
        "shared_prefix_len": {"type": "integer", "minimum": 0},
        "shared_prefix_fraction": _fraction,
        "priority_levels": {"type": "integer", "minimum": 1},
        "eos_fraction": _fraction,
        "abort_fraction": _fraction,
        "mm_fraction": _fraction,
        "mm_item_len": {"type": "integer", "minimum": 1},
        "mm_items_per_request": {"type": "integer", "minimum": 1},
        "mm_distinct_items": {"type": "integer", "minimum": 0},
    },
}
#: The JSON Schema of a scenario document (TOML parsed to the same structure).
SCENARIO_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    # format_version may be left out of a hand-written file: it reads as FORMAT_VERSION.
    # The workload: listed requests, or a generator's arguments (_check_workload_tables).
    "oneOf": [{"required": ["requests"]}, {"required": ["synthetic"]}],
    "properties": {
        "format_version": {"const": FORMAT_VERSION, "default": FORMAT_VERSION},
        "description": {"type": "string"},
        "seed": {"type": "integer"},
        "config": {"type": "object"},
        "synthetic": _bounded(_SYNTHETIC),
        "requests": {"type": "array", "items": _bounded(_REQUEST), "minItems": 1},
        "actions": {"type": "array", "items": _bounded(_ACTION)},
    },
}
_ARRIVALS = ("arrival_time", "arrival_step", "after")
_TABLES = ("config", "synthetic")  # the top-level tables whose keys _Lines.find locates


class ScenarioError(WorkloadError):
    """An unusable scenario file; ``str()`` is one line ``file:line: problem``."""


@dataclass(frozen=True)
class Scenario:
    """A loaded scenario: ``description``, ``config`` (the ``[config]`` table,
    validated by EngineConfig), ``seed`` (the scripted model's, default 0)
    and ``workload`` (requests in file order; source ``scenario:<name>``,
    sha256 of the file's bytes, params ``format_version`` and
    ``request_order``; for a ``[synthetic]`` file, ``workloads.synthetic``'s
    workload: source ``synthetic``, its params and their sha256)."""

    path: Path
    description: str
    config: dict[str, Any]
    seed: int
    workload: Workload
    #: The ``[synthetic]`` table as written (None for ``[[requests]]``); the
    #: workload is then ``workloads.synthetic(**synthetic)`` (``seed``
    #: defaulting to the scenario's), with synthetic's provenance.
    synthetic: dict[str, Any] | None = None

    def engine_config(self, overrides: dict[str, str] | None = None) -> EngineConfig:
        """The config, with ``--set`` overrides applied. Raises ConfigError."""
        return EngineConfig.from_dict(self.config).with_overrides(overrides or {})


def is_scenario_path(spec: str) -> bool:
    """Whether a workload spec names a scenario file (``.toml`` or ``.json``)."""
    return spec.lower().endswith((".toml", ".json"))


class _Lines:
    """Finds the line of a key in the scenario text (1-based)."""

    def __init__(self, text: str, is_json: bool) -> None:
        self.lines = text.splitlines()
        self.is_json = is_json
        self.text = text

    def _key_in(self, start: int, end: int, key: str) -> int | None:
        pattern = re.compile(rf'^\s*"?{re.escape(key)}"?\s*[=:]' if not self.is_json
                             else rf'"{re.escape(key)}"\s*:')
        for i in range(start, min(end, len(self.lines))):
            if pattern.search(self.lines[i]):
                return i + 1
        return None

    def _tables(self) -> list[tuple[int, str]]:
        out = []
        for i, line in enumerate(self.lines):
            m = re.match(r"^\s*(\[\[?)\s*([A-Za-z_.]+)\s*\]\]?", line)
            if m:
                out.append((i, m.group(2)))
        return out

    def _request_spans(self, array: str = "requests") -> list[tuple[int, int]]:
        """(first, end) line ranges (0-based, end exclusive) of each element
        of the array of tables ``array`` (``requests`` or ``actions``)."""
        if not self.is_json:
            tables = self._tables()
            spans = []
            for n, (i, name) in enumerate(tables):
                if name == array:
                    end = tables[n + 1][0] if n + 1 < len(tables) else len(self.lines)
                    spans.append((i, end))
            return spans
        # JSON: the objects at depth 2 of the array.
        m = re.search(rf'"{array}"\s*:\s*\[', self.text)
        if m is None:
            return []
        spans, depth, in_str, esc, start = [], 1, False, False, None
        for pos in range(m.end(), len(self.text)):
            ch = self.text[pos]
            if in_str:
                esc = not esc and ch == "\\"
                if ch == '"' and not esc:
                    in_str = False
                continue
            if ch == '"':
                in_str = True
            elif ch in "[{":
                depth += 1
                if depth == 2 and ch == "{":
                    start = self.text.count("\n", 0, pos)
            elif ch in "]}":
                depth -= 1
                if depth == 1 and start is not None:
                    spans.append((start, self.text.count("\n", 0, pos) + 1))
                    start = None
                if depth == 0:
                    break
        return spans

    def find(self, path: list[Any]) -> int:
        """The line of ``path`` (e.g. ``["requests", 2, "after"]``), or of the
        nearest enclosing table/object found; 1 when nothing is."""
        if not path:
            return 1
        if path[0] in ("requests", "actions") and len(path) >= 2 and isinstance(path[1], int):
            spans = self._request_spans(path[0])
            if path[1] >= len(spans):
                return self._key_in(0, len(self.lines), path[0]) or 1
            first, end = spans[path[1]]
            if len(path) >= 3:
                return self._key_in(first, end, str(path[2])) or first + 1
            return first + 1
        if path[0] in _TABLES and not self.is_json:
            for n, (i, name) in enumerate(tables := self._tables()):
                if name == path[0]:
                    end = tables[n + 1][0] if n + 1 < len(tables) else len(self.lines)
                    return (self._key_in(i, end, str(path[1])) if len(path) > 1 else None) or i + 1
        if path[0] in _TABLES and len(path) > 1:
            # JSON: the key's first occurrence after the object's own key.
            start = (self._key_in(0, len(self.lines), str(path[0])) or 1) - 1
            return self._key_in(start, len(self.lines), str(path[1])) or start + 1
        first_table = next((i for i, _ in self._tables()), len(self.lines)) if not self.is_json \
            else len(self.lines)
        # A top-level key, or else a table of that name (a misspelt ``[[request]]``).
        return self._key_in(0, first_table, str(path[0])) or \
            next((i + 1 for i, name in (self._tables() if not self.is_json else ()) if name == path[0]), 1)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (docs/scenario-format.md).

    Returns the :class:`Scenario`. Raises ScenarioError (one line,
    ``file:line: problem``) for an unreadable file, a syntax error, an
    unknown key, a wrong type or range, a duplicate request id, ``after``
    naming an unknown, later or cyclic request, a step before the request
    can arrive, a ``[config]`` EngineConfig refuses, both or neither of
    ``[[requests]]`` and ``[synthetic]``, or a ``[synthetic]`` value
    ``workloads.synthetic`` refuses.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such scenario file{missing_file_hint(p)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}:1: cannot read scenario ({exc.__class__.__name__}: {exc})") from None
    is_json = p.suffix.lower() == ".json"
    lines = _Lines(text, is_json)

    def fail(where: list[Any] | int, problem: str) -> ScenarioError:
        line = where if isinstance(where, int) else lines.find(where)
        return ScenarioError(f"{p}:{line}: {problem}")

    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicate_keys) if is_json else tomllib.loads(text)
    except _DuplicateKey as exc:
        raise fail(_line_of_key(text, str(exc)),
                   f"JSON: duplicate key {str(exc)!r} (TOML refuses it too)") from None
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        problem = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise fail(int(m.group(1)) if m else 1, f"TOML syntax error: {problem}") from None
    except json.JSONDecodeError as exc:
        raise fail(exc.lineno, f"JSON syntax error: {exc.msg}") from None
    _check_workload_tables(doc, fail)
    _validate_schema(doc, fail)
    config = doc.get("config", {})
    if isinstance(config, dict) and "max_concurrent_batches" in config:
        raise fail(["config", "max_concurrent_batches"],
                   "max_concurrent_batches is not a config key: as in vLLM it is derived from "
                   "pipeline_parallel_size and async_scheduling (async_scheduling = true gives 2, "
                   "pipeline_parallel_size = N gives N)")
    try:
        EngineConfig.from_dict(config)
    except ConfigError as exc:
        # An unknown key first (the message may name a known one: "did you mean 'max_num_seqs'?").
        fields = {f.name for f in dataclasses.fields(EngineConfig)} | set(DERIVED_KEYS)
        key = next((k for k in config if k not in fields), None) or \
            next((k for k in config if re.search(rf"\b{re.escape(k)}\b", str(exc))), None)
        raise fail(["config"] + ([key] if key else []), f"bad config: {exc}") from None
    try:
        # Regression (trial finding): a config no engine run accepts (hybrid with a KV connector)
        # passed the loader and was refused later without its file and line (fuzz --scenario,
        # bisect: "ConfigError: ...").
        check_config_supported(EngineConfig.from_dict(config))
    except ConfigError as exc:
        key = next((k for k in ("layer_types", "sliding_window") if k in config), None)
        raise fail(["config"] + ([key] if key else []), f"bad config: {exc}") from None
    if "synthetic" in doc:
        if doc.get("actions"):
            raise fail(["actions", 0], "[[actions]] need [[requests]]: with [synthetic] their request ids "
                                       "and steps cannot be checked when the file is read")
        return _synthetic_scenario(p, doc, fail)
    specs = _requests(doc["requests"], fail)
    actions = _actions(doc.get("actions", []), doc["requests"], config, fail)
    params: dict[str, Any] = {"format_version": FORMAT_VERSION, "request_order": [s.request_id for s in specs]}
    if actions:
        params["actions"] = [a.to_dict() for a in actions]
    workload = Workload(source=f"scenario:{p.name}", sha256=hashlib.sha256(raw).hexdigest(),
                        params=params, requests=tuple(specs), actions=tuple(actions))
    return Scenario(p, doc.get("description", ""), dict(config), doc.get("seed", 0), workload)


class _DuplicateKey(ValueError):
    """A JSON object repeating a key (json.loads keeps the last one silently)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise _DuplicateKey(k)
    return dict(pairs)


def _line_of_key(text: str, key: str) -> int:
    """1-based line of the second ``"key":`` in ``text`` (the repeat), else of the first, else 1."""
    hits = [m.start() for m in re.finditer(rf'"{re.escape(key)}"\s*:', text)]
    return text.count("\n", 0, hits[1] if len(hits) > 1 else hits[0]) + 1 if hits else 1


#: JSON Schema's "integer" admits 2.0; a scenario's counts, steps, seeds and ids must be ints as
#: written (a float seed silently changed the outputs and made the trace unreadable).
_VALIDATOR = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)))


def _validate_schema(doc: Any, fail) -> None:
    if isinstance(doc, dict):
        # Unknown keys first: the schema's message for them is hard to read.
        for key in doc:
            if key not in SCENARIO_SCHEMA["properties"]:
                raise fail([key], _unknown_top_level(key))
        for i, req in enumerate(doc.get("requests") or []):
            for key in req if isinstance(req, dict) else ():
                if key not in _REQUEST["properties"]:
                    raise fail(["requests", i, key], f"requests[{i}]: unknown key {key!r}"
                                                     + did_you_mean(key, _REQUEST["properties"]))
        _check_action_keys(doc.get("actions"), fail)
    error = jsonschema.exceptions.best_match(_VALIDATOR(SCENARIO_SCHEMA).iter_errors(doc))
    if error is None:
        return
    where = list(error.absolute_path)
    name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in where).lstrip(".") or "document"
    message = error.message
    if error.validator == "maximum" and where and "token" in str(where[-2] if isinstance(where[-1], int)
                                                                   else where[-1]):
        message += " (token ids must be < 2**31: traces store int32)"
    if error.validator == "const" and where == ["format_version"]:
        message = f"format_version must be {FORMAT_VERSION} (this harness reads version {FORMAT_VERSION})"
    if error.validator == "pattern" and where[-1:] == ["request_id"]:
        message = f"request_id must have no white space (`after` names it), got {error.instance!r}"
    if error.validator == "pattern" and where[-1:] == ["after"]:
        message = f"after must read \"<request id> finishes\", got {error.instance!r}"
    key_path = ([k for k in where if not isinstance(k, int)] if where[:1] not in (["requests"], ["actions"])
                else where[:3])
    raise fail(key_path, f"{name}: {message}")


# -- [[actions]] -------------------------------------------------------------------
def _check_action_keys(actions: Any, fail) -> None:
    """Unknown keys of ``[[actions]]`` tables, and keys of the other kind,
    before the schema (whose messages for them are hard to read)."""
    for i, action in enumerate(actions if isinstance(actions, list) else ()):
        if not isinstance(action, dict):
            continue
        for key in action:
            if key not in _ACTION["properties"]:
                raise fail(["actions", i, key], f"actions[{i}]: unknown key {key!r}"
                                                + did_you_mean(key, _ACTION["properties"]))
        kind = action.get("kind")
        if kind not in _ACTION_KEYS:
            raise fail(["actions", i, "kind"], f"actions[{i}]: kind must be one of "
                                               f"{', '.join(ACTION_KINDS)}, got {kind!r}")
        for key in action:
            if key not in ("step", "kind") and key not in _ACTION_KEYS[kind]:
                raise fail(["actions", i, key], f"actions[{i}]: key {key!r} does not apply to kind "
                                                f"{kind!r} (it takes {', '.join(_ACTION_KEYS[kind])})")


def _actions(actions: list[dict[str, Any]], reqs: list[dict[str, Any]], config: dict[str, Any],
             fail) -> list[Action]:
    """The ``[[actions]]`` tables as :class:`Action`, in file order.

    Cross-table rules: an abort names known request ids, each at a step at
    or after the earliest the request can arrive (``arrival_step``, or one
    step per ``after`` link; a timed arrival may come at any step); an abort
    requires ``request_ids``. ``reset_running_requests`` needs a
    synchronous engine without a KV connector: the reference does not model
    dropping in-flight output (vLLM's ``drop_stale_output``), and vLLM
    raises when a remote KV load keeps blocks through a forced reset.
    """
    earliest: dict[str, int] = {}
    for req in reqs:
        rid = req["request_id"]
        dep = req["after"].rsplit(" ", 1)[0] if "after" in req else None
        earliest[rid] = (req["arrival_step"] if "arrival_step" in req
                         else earliest[dep] + 1 if dep is not None else 0)
    cfg = EngineConfig.from_dict(config)
    out = []
    for i, action in enumerate(actions):
        where = ["actions", i]
        if action["kind"] == "abort":
            if "request_ids" not in action:
                raise fail(where, f"actions[{i}]: an abort action needs request_ids")
            for rid in action["request_ids"]:
                if rid not in earliest:
                    raise fail(where + ["request_ids"], f"actions[{i}]: request_ids names unknown "
                                                        f"request {rid!r}" + did_you_mean(rid, earliest))
                if action["step"] < earliest[rid]:
                    raise fail(where + ["step"], f"actions[{i}]: step {action['step']} is in the past for "
                                                 f"{rid!r}: it arrives at step {earliest[rid]} at the earliest")
        elif action.get("reset_running_requests") and (cfg.async_scheduling or cfg.max_concurrent_batches > 1
                                                        or cfg.kv_connector):
            raise fail(where + ["reset_running_requests"],
                       f"actions[{i}]: reset_running_requests needs a synchronous engine without a KV "
                       f"connector (async_scheduling, batches in flight or kv_connector are not supported)")
        out.append(Action(step=action["step"], kind=action["kind"],
                          reset_running_requests=action.get("reset_running_requests", False),
                          request_ids=tuple(action.get("request_ids", ()))))
    return out


def _check_workload_tables(doc: Any, fail) -> None:
    """Exactly one of ``[[requests]]`` and ``[synthetic]``, and no unknown
    ``[synthetic]`` key: checked before the schema, whose messages for these
    (``oneOf``, ``additionalProperties``) name neither the table nor the key."""
    if not isinstance(doc, dict):
        return
    if "requests" not in doc and "synthetic" not in doc:
        # A misspelt table (``[[request]]``) is named, with what it should read, before "neither".
        for key in doc:
            if key not in SCENARIO_SCHEMA["properties"]:
                raise fail([key], _unknown_top_level(key))
    if ("requests" in doc) == ("synthetic" in doc):
        raise fail(["synthetic" if "synthetic" in doc else "format_version"],
                   "give exactly one of [[requests]] and [synthetic], got "
                   + ("both" if "requests" in doc else "neither"))
    table = doc.get("synthetic")
    for key in table if isinstance(table, dict) else ():
        if key not in _SYNTHETIC["properties"]:
            raise fail(["synthetic", key], f"synthetic: unknown key {key!r}"
                                           + (did_you_mean(key, _SYNTHETIC["properties"])
                                              or f" (known: {', '.join(_SYNTHETIC['properties'])})"))


def _unknown_top_level(key: str) -> str:
    """"unknown table [[request]]; did you mean [[requests]]?" (a table's name
    as written in TOML: ``[config]``, ``[[requests]]``), or the same for a key."""
    tables = {"config": "[config]", "synthetic": "[synthetic]", "requests": "[[requests]]",
              "actions": "[[actions]]"}
    known = list(SCENARIO_SCHEMA["properties"])
    hint = did_you_mean(key, known)
    for name, written in tables.items():
        hint = hint.replace(repr(name), written)
    close = hint.startswith("; did you mean")
    if not close:
        hint = f" (known: {', '.join(tables.get(k, k) for k in known)})"
    return f"unknown key {key!r}{hint}"


def synthetic_workload(table: dict[str, Any], seed: int = 0) -> Workload:
    """The workload of a ``[synthetic]`` table: ``workloads.synthetic(**table)``
    with ``seed`` (the scenario's) unless the table gives its own. So a
    canonical scenario's file builds exactly the workload (requests,
    ``source="synthetic"``, params, sha256) its golden was recorded from.
    Raises WorkloadError (synthetic's) for a value out of range."""
    return synthetic(**{"seed": seed, **table})


def _synthetic_scenario(p: Path, doc: dict[str, Any], fail) -> Scenario:
    """The :class:`Scenario` of a schema-valid ``[synthetic]`` document;
    a value synthetic() refuses (e.g. a range with low > high) fails at its key."""
    table, seed = dict(doc["synthetic"]), doc.get("seed", 0)
    try:
        workload = synthetic_workload(table, seed)
    except WorkloadError as exc:
        key = next((k for k in table if str(exc).startswith(k)), None)
        raise fail(["synthetic"] + ([key] if key else []), f"synthetic: {exc}") from None
    return Scenario(p, doc.get("description", ""), dict(doc.get("config", {})), seed, workload,
                    synthetic=table)


def _prompt(req: dict[str, Any]) -> tuple[int, ...]:
    """``prompt_token_ids``, or ``prompt_len`` tokens: the first ``prefix_len``
    (default: all) from the ``prefix_group``'s stream, the rest from the
    request's own, both seeded by name (blake2b), in [10, VOCAB_SIZE)."""
    if "prompt_token_ids" in req:
        return tuple(req["prompt_token_ids"])

    def stream(name: str, n: int) -> list[int]:
        rng = random.Random(hashlib.blake2b(name.encode(), digest_size=8).digest())
        return [rng.randrange(_FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(n)]
    n = req["prompt_len"]
    group = req.get("prefix_group")
    shared = min(n, req.get("prefix_len", n)) if group is not None else 0
    return tuple(stream(f"group:{group}", shared) + stream(f"request:{req['request_id']}", n)[shared:])


def _requests(reqs: list[dict[str, Any]], fail) -> list[RequestSpec]:
    index: dict[str, int] = {}
    for i, req in enumerate(reqs):
        rid = req["request_id"]
        if rid in index:
            raise fail(["requests", i, "request_id"], f"duplicate request_id {rid!r} (first at "
                                                      f"requests[{index[rid]}])")
        index[rid] = i
    deps: dict[str, str] = {}
    for i, req in enumerate(reqs):
        where = ["requests", i]
        if ("prompt_token_ids" in req) == ("prompt_len" in req):
            raise fail(where, f"requests[{i}]: give exactly one of prompt_token_ids and prompt_len")
        for key in ("prefix_group", "prefix_len"):
            if key in req and "prompt_len" not in req:
                raise fail(where + [key], f"requests[{i}]: {key} needs prompt_len")
        if "prefix_len" in req and "prefix_group" not in req:
            raise fail(where + ["prefix_len"], f"requests[{i}]: prefix_len needs prefix_group")
        if req.get("prefix_len", 0) > req.get("prompt_len", 0):
            raise fail(where + ["prefix_len"], f"requests[{i}]: prefix_len {req['prefix_len']} is longer "
                                               f"than the prompt ({req['prompt_len']} tokens)")
        given = [k for k in _ARRIVALS if k in req]
        if len(given) != 1:
            raise fail(where + given[1:2], f"requests[{i}]: give exactly one of arrival_time, arrival_step "
                                           f"and after, got {', '.join(given) or 'none'}")
        if "after" in req:
            dep = req["after"].rsplit(" ", 1)[0]
            if dep not in index:
                raise fail(where + ["after"], f"requests[{i}]: after names unknown request {dep!r}"
                                              + did_you_mean(dep, index))
            deps[req["request_id"]] = dep
    for i, req in enumerate(reqs):
        if "after" not in req:
            continue
        chain, rid = [req["request_id"]], deps[req["request_id"]]
        while rid in deps and rid not in chain:
            chain.append(rid)
            rid = deps[rid]
        if rid in chain or rid == req["request_id"]:
            raise fail(["requests", i, "after"], f"requests[{i}]: after: cycle "
                                                 f"{' -> '.join(chain + [rid])}")
        dep = deps[req["request_id"]]
        if index[dep] > i:
            raise fail(["requests", i, "after"], f"requests[{i}]: after names {dep!r}, which comes later "
                                                 f"in the file (requests[{index[dep]}]): a request may only "
                                                 f"wait for an earlier one")
    earliest: dict[str, int] = {}  # the earliest step each request can arrive at
    specs = []
    for i, req in enumerate(reqs):
        rid = req["request_id"]
        earliest[rid] = (req["arrival_step"] if "arrival_step" in req
                         else earliest[deps[rid]] + 1 if rid in deps else 0)
        if "abort_step" in req and req["abort_step"] < earliest[rid]:
            raise fail(["requests", i, "abort_step"], f"requests[{i}]: abort_step {req['abort_step']} is in "
                                                      f"the past: the request arrives at step "
                                                      f"{earliest[rid]} at the earliest")
        if "abort_time" in req and req["abort_time"] < req.get("arrival_time", 0.0):
            raise fail(["requests", i, "abort_time"], f"requests[{i}]: abort_time is before arrival_time")
        try:
            specs.append(RequestSpec(
                request_id=rid,
                arrival_time=float(req.get("arrival_time", 0.0)),
                prompt_token_ids=_prompt(req),
                max_tokens=req.get("max_tokens", DEFAULT_MAX_TOKENS),
                min_tokens=req.get("min_tokens", 0),
                ignore_eos=req.get("ignore_eos", False),
                eos_token_id=req.get("eos_token_id", EOS_TOKEN_ID),
                stop_token_ids=tuple(req.get("stop_token_ids", ())),
                priority=req.get("priority", 0),
                abort_time=req.get("abort_time"),
                mm_positions=tuple(tuple(p) for p in req.get("mm_positions", ())),
                arrival_step=req.get("arrival_step"),
                after=deps.get(rid),
                abort_step=req.get("abort_step"),
                output_token_ids=tuple(req["output_token_ids"]) if "output_token_ids" in req else None,
                draft_acceptance_pattern=req.get("draft_acceptance_pattern"),
            ))
        except WorkloadError as exc:
            problem = str(exc).split(": ", 1)[-1]
            key = next((k for k in req if problem.startswith(k)), None)
            raise fail(["requests", i] + ([key] if key else []), f"requests[{i}]: {problem}") from None
    return specs


# --- Writing scenario files -------------------------------------------------------------------------
__all__ += ["dump_scenario", "request_table", "write_scenario", "write_scenario_text"]
# The order keys are written in: the loader's table order (docs/scenario-format.md), so a written file
# reads like a hand-written one and the same inputs always give the same bytes.
_WRITE_ORDER = ("request_id", "prompt_token_ids", "max_tokens", "min_tokens", "ignore_eos", "eos_token_id",
                "stop_token_ids", "priority", "arrival_time", "arrival_step", "after", "abort_step",
                "abort_time", "output_token_ids", "mm_positions", "draft_acceptance_pattern")


def request_table(spec: RequestSpec) -> dict[str, Any]:
    """The ``[[requests]]`` table that loads back to ``spec`` (``load_scenario``).

    Keys at the loader's default are left out (``min_tokens = 0``, ``ignore_eos
    = false``, ``eos_token_id = 2``, ``priority = 0``, no stops); ``max_tokens``
    is always written. Arrival is exactly one of ``arrival_step``, ``after =
    "<id> finishes"`` or ``arrival_time`` (a step or ``after`` request's
    ``arrival_time`` is the clock the engine gave it: not an input, dropped).

    Raises WorkloadError for a field the format cannot express:
    ``scripted_output_len`` (fix ``output_token_ids`` instead) and
    ``eos_token_id = None``.
    """
    if spec.scripted_output_len is not None:
        raise WorkloadError(f"{spec.request_id}: scripted_output_len has no scenario key "
                            f"(fix output_token_ids instead)")
    if spec.eos_token_id is None:
        raise WorkloadError(f"{spec.request_id}: eos_token_id None has no scenario key")
    table: dict[str, Any] = {"request_id": spec.request_id, "prompt_token_ids": list(spec.prompt_token_ids),
                             "max_tokens": spec.max_tokens}
    optional = {"min_tokens": (spec.min_tokens, 0), "ignore_eos": (spec.ignore_eos, False),
                "eos_token_id": (spec.eos_token_id, EOS_TOKEN_ID),
                "stop_token_ids": (list(spec.stop_token_ids), []), "priority": (spec.priority, 0),
                "abort_step": (spec.abort_step, None), "abort_time": (spec.abort_time, None),
                "output_token_ids": (None if spec.output_token_ids is None else list(spec.output_token_ids),
                                     None),
                "mm_positions": ([list(p) for p in spec.mm_positions], []),
                "draft_acceptance_pattern": (spec.draft_acceptance_pattern, None)}
    table.update({k: v for k, (v, default) in optional.items() if v != default})
    if spec.arrival_step is not None:
        table["arrival_step"] = spec.arrival_step
    elif spec.after is not None:
        table["after"] = f"{spec.after} finishes"
    else:
        table["arrival_time"] = float(spec.arrival_time)
    return {k: table[k] for k in _WRITE_ORDER if k in table}


def dump_scenario(requests: list[RequestSpec] | tuple[RequestSpec, ...], config: dict[str, Any], *,
                  seed: int = 0, description: str = "", comments: list[str] | tuple[str, ...] = (),
                  actions: list[Action] | tuple[Action, ...] = ()) -> str:
    """A scenario file's text (TOML, written with ``tomli_w``): ``comments``
    as ``# `` lines at the top (provenance), then ``format_version``,
    ``description``, ``seed``, ``[config]`` (keys sorted) and one
    ``[[requests]]`` table per request in the given order (``request_table``).

    Deterministic: the same arguments give the same bytes. ``load_scenario``
    of the text gives back ``requests`` (for a step or ``after`` request, with
    ``arrival_time`` 0.0), ``config`` and ``seed``. Raises WorkloadError as
    ``request_table`` does, or if ``requests`` is empty.
    """
    if not requests:
        raise WorkloadError("a scenario needs at least one request")
    doc: dict[str, Any] = {"format_version": FORMAT_VERSION}
    if description:
        doc["description"] = description
    doc["seed"] = seed
    if config:
        doc["config"] = {k: config[k] for k in sorted(config)}
    doc["requests"] = [request_table(s) for s in requests]
    if actions:  # [[actions]] after the requests they name (Action.to_dict: step, kind, its key)
        doc["actions"] = [a.to_dict() for a in actions]
    head = "".join(f"# {line}".rstrip() + "\n" for c in comments for line in c.splitlines())
    return head + _fold_int_arrays(tomli_w.dumps(doc))


#: A multi-line array of plain ints as tomli_w writes it (one item a line, past 100 characters).
_INT_ARRAY = re.compile(r"= \[\n((?:    -?\d+,\n)+)\]")
_INTS_PER_LINE = 16


def _fold_int_arrays(text: str) -> str:
    """Reflow tomli_w's one-id-a-line arrays (prompts, outputs) to 16 ids a line, so a
    scenario stays readable; the TOML value is unchanged."""
    def fold(m: re.Match[str]) -> str:
        ids = [line.strip().rstrip(",") for line in m.group(1).splitlines()]
        rows = [", ".join(ids[i:i + _INTS_PER_LINE]) + "," for i in range(0, len(ids), _INTS_PER_LINE)]
        return "= [\n" + "".join(f"    {row}\n" for row in rows) + "]"
    return _INT_ARRAY.sub(fold, text)


def write_scenario(path: str | Path, requests: list[RequestSpec] | tuple[RequestSpec, ...],
                   config: dict[str, Any], **kwargs: Any) -> Path:
    """Write ``dump_scenario(requests, config, **kwargs)`` to ``path`` (via a
    temp file renamed into place: a failed write leaves nothing). Returns the path."""
    return write_scenario_text(path, dump_scenario(requests, config, **kwargs))


def write_scenario_text(path: str | Path, text: str) -> Path:
    """Write a scenario's ``text`` to ``path`` via a temp file in the same folder renamed
    into place; on any failure the temp file is removed and nothing is left. Missing parent
    folders are created (as every ``-o``). Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p
