"""Scenario files: a bug report's minimal workload, written by hand (docs/scenario-format.md).

A scenario is a TOML file (or JSON with the same structure) carrying its own
engine config and every request's inputs: prompt, sampling parameters,
priority, arrival by time, by step or after another request, abort by step,
the tokens the model samples, encoder items, per-request draft acceptance.
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
by scanning the text for its table (``[config]``, the i-th ``[[requests]]``)
and then the key (JSON: the i-th object of ``"requests"``).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from reference.config import ConfigError, EngineConfig
from reference.workload import EOS_TOKEN_ID, MAX_TOKEN_ID, VOCAB_SIZE, RequestSpec, Workload, WorkloadError
from reference.workload import ACTION_KINDS, Action

__all__ = ["FORMAT_VERSION", "SCENARIO_SCHEMA", "Scenario", "ScenarioError", "load_scenario",
           "is_scenario_path"]

#: The format version this harness reads and writes (``format_version``).
FORMAT_VERSION = 1
#: vLLM's SamplingParams default ``max_tokens``.
DEFAULT_MAX_TOKENS = 16
_FIRST_TOKEN_ID = 10  # synthesised prompt tokens are in [10, VOCAB_SIZE), as the loaders'

_token = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_step = {"type": "integer", "minimum": 0}
_REQUEST = {
    "type": "object",
    "additionalProperties": False,
    "required": ["request_id"],
    "properties": {
        "request_id": {"type": "string", "minLength": 1},
        "prompt_token_ids": {"type": "array", "items": _token, "minItems": 1},
        "prompt_len": {"type": "integer", "minimum": 1},
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
#: The JSON Schema of a scenario document (TOML parsed to the same structure).
SCENARIO_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["format_version", "requests"],
    "properties": {
        "format_version": {"const": FORMAT_VERSION},
        "description": {"type": "string"},
        "seed": {"type": "integer"},
        "config": {"type": "object"},
        "requests": {"type": "array", "items": _REQUEST, "minItems": 1},
        "actions": {"type": "array", "items": _ACTION},
    },
}
_ARRIVALS = ("arrival_time", "arrival_step", "after")


class ScenarioError(WorkloadError):
    """An unusable scenario file; ``str()`` is one line ``file:line: problem``."""


@dataclass(frozen=True)
class Scenario:
    """A loaded scenario: ``description``, ``config`` (the ``[config]`` table,
    validated by EngineConfig), ``seed`` (the scripted model's, default 0)
    and ``workload`` (requests in file order; source ``scenario:<name>``,
    sha256 of the file's bytes, params ``format_version`` and
    ``request_order``)."""

    path: Path
    description: str
    config: dict[str, Any]
    seed: int
    workload: Workload

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
        if path[0] == "config" and not self.is_json:
            for n, (i, name) in enumerate(tables := self._tables()):
                if name == "config":
                    end = tables[n + 1][0] if n + 1 < len(tables) else len(self.lines)
                    return (self._key_in(i, end, str(path[1])) if len(path) > 1 else None) or i + 1
        if path[0] == "config" and len(path) > 1:
            return self._key_in(0, len(self.lines), str(path[1])) or 1
        first_table = next((i for i, _ in self._tables()), len(self.lines)) if not self.is_json \
            else len(self.lines)
        return self._key_in(0, first_table, str(path[0])) or 1


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (docs/scenario-format.md).

    Returns the :class:`Scenario`. Raises ScenarioError (one line,
    ``file:line: problem``) for an unreadable file, a syntax error, an
    unknown key, a wrong type or range, a duplicate request id, ``after``
    naming an unknown, later or cyclic request, a step before the request
    can arrive, or a ``[config]`` EngineConfig refuses.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}:1: cannot read scenario ({exc.__class__.__name__}: {exc})") from None
    is_json = p.suffix.lower() == ".json"
    lines = _Lines(text, is_json)

    def fail(where: list[Any] | int, problem: str) -> ScenarioError:
        line = where if isinstance(where, int) else lines.find(where)
        return ScenarioError(f"{p}:{line}: {problem}")

    try:
        doc = json.loads(text) if is_json else tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"\(at line (\d+), column \d+\)", str(exc))
        problem = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise fail(int(m.group(1)) if m else 1, f"TOML syntax error: {problem}") from None
    except json.JSONDecodeError as exc:
        raise fail(exc.lineno, f"JSON syntax error: {exc.msg}") from None
    _validate_schema(doc, fail)
    config = doc.get("config", {})
    try:
        EngineConfig.from_dict(config)
    except ConfigError as exc:
        key = next((k for k in config if re.search(rf"\b{re.escape(k)}\b", str(exc))), None)
        raise fail(["config"] + ([key] if key else []), f"bad config: {exc}") from None
    specs = _requests(doc["requests"], fail)
    actions = _actions(doc.get("actions", []), doc["requests"], config, fail)
    params: dict[str, Any] = {"format_version": FORMAT_VERSION, "request_order": [s.request_id for s in specs]}
    if actions:
        params["actions"] = [a.to_dict() for a in actions]
    workload = Workload(source=f"scenario:{p.name}", sha256=hashlib.sha256(raw).hexdigest(),
                        params=params, requests=tuple(specs), actions=tuple(actions))
    return Scenario(p, doc.get("description", ""), dict(config), doc.get("seed", 0), workload)


def _validate_schema(doc: Any, fail) -> None:
    if isinstance(doc, dict):
        # Unknown keys first: the schema's message for them is hard to read.
        for key in doc:
            if key not in SCENARIO_SCHEMA["properties"]:
                raise fail([key], f"unknown key {key!r} (known: "
                                  f"{', '.join(SCENARIO_SCHEMA['properties'])})")
        for i, req in enumerate(doc.get("requests") or []):
            for key in req if isinstance(req, dict) else ():
                if key not in _REQUEST["properties"]:
                    raise fail(["requests", i, key], f"requests[{i}]: unknown key {key!r}")
        _check_action_keys(doc.get("actions"), fail)
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(SCENARIO_SCHEMA).iter_errors(doc))
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
                raise fail(["actions", i, key], f"actions[{i}]: unknown key {key!r}")
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
                                                        f"request {rid!r}")
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
        given = [k for k in _ARRIVALS if k in req]
        if len(given) != 1:
            raise fail(where + given[1:2], f"requests[{i}]: give exactly one of arrival_time, arrival_step "
                                           f"and after, got {', '.join(given) or 'none'}")
        if "after" in req:
            dep = req["after"].rsplit(" ", 1)[0]
            if dep not in index:
                raise fail(where + ["after"], f"requests[{i}]: after names unknown request {dep!r}")
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
