"""Checks on what a candidate hands back, before the engine or the trace uses it.

A candidate is untrusted code: the engine loop (``reference/engine.py``,
through ``reference.guard.Guarded``) passes every value a candidate call returns through
``check_return`` first. A value of the wrong shape would otherwise fail a
line later far from its cause (``"seven" - 1``), or, worse, be stored as
something else (``114.5`` computed tokens written to an int32 column as 114,
which then checks "conformant"). What is checked, against the dataclasses
of ``reference/output.py`` (their field annotations are the schema):

* types, recursively: an ``int`` field takes an int (not a bool, not a
  float, even ``114.0``); a ``list[int]`` a list or tuple of ints; a
  ``RequestStatus`` field a member of that enum; unions and None as
  annotated;
* ranges: every int fits the trace's int32 columns; counts (fields named
  ``num_*``, ``token_budget``) and block ids (``*block_ids``) are >= 0
  (``spec_token_ids`` may hold -1: async scheduling's draft placeholders);
  ``ScheduledRequest.kind`` is ``new``, ``resumed`` or ``running``;
* known ids: every request id a decision names was given to this candidate
  by ``add_request`` (the caller passes the set).

Invariant breaks in well-formed values (a request over budget, a block
held twice) are not refused here: they are recorded and ``harness check``
reports them with a witness. ``CandidateOutputError`` (a TypeError) names
the call and the first offending value by its path, e.g.
``schedule() returned events[2].num_computed_tokens = 114.5 (float), not an int``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers
import types
import typing
from collections.abc import Callable
from typing import Any

from reference import output as _output
from reference.output import SchedulerOutput, SchedulerSnapshot, UpdateResult, PrefixCacheReset, FinishedRequest

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1
_KINDS = frozenset({"new", "resumed", "running"})


class CandidateOutputError(TypeError):
    """A candidate call returned a value the engine cannot use; the message
    is one line naming the call, the value's path and what was expected.
    Recorded as a ``TypeError`` crash with no candidate frame (the fault is
    in the value, not at a line of the candidate: ``crash_type``,
    ``crash_message``, ``crash_where``, read by
    ``reference.candidate.describe_exception``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.crash_type = "TypeError"
        self.crash_message = f"TypeError: {message}"
        self.crash_where = ""


#: What each candidate call must return (``reference.candidate.Candidate``):
#: a type annotation checked by ``conforms``. Calls not listed are not checked.
RETURNS: dict[str, Any] = {
    "schedule": SchedulerOutput,
    "update_from_output": UpdateResult,
    "snapshot": SchedulerSnapshot,
    "reset_prefix_cache": PrefixCacheReset,
    "finish_requests": list[FinishedRequest],
    "update_draft_token_ids": dict[str, list[int]],
    "has_request": bool,
    "get_num_unfinished_requests": int,
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(_output))


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _int_why(value: Any, non_negative: bool) -> str | None:
    """Why ``value`` is not a valid int (None: it is); ``non_negative``: for a
    count or a block id."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            return "not an int"
        value = int(value)  # numpy's integers and the like
    if not INT32_MIN <= value <= INT32_MAX:
        return "outside the int32 range of the trace's columns"
    if value < 0 and non_negative:
        return "negative"
    return None


def _non_negative(field: str) -> bool:
    """Counts (``num_*``, ``token_budget``) and block ids (``*block_ids``) are
    >= 0; draft ids may be -1 (async scheduling's placeholders)."""
    return field != "spec_token_ids" and (field.startswith("num_") or field == "token_budget"
                                          or field.endswith("block_ids"))


#: A compiled check: ``check(value, known)`` -> None, or ``(path parts, reason)``
#: with the path innermost first (built only on failure).
Check = Callable[[Any, Any], "tuple[list[str], str] | None"]


def _bad(value: Any, what: str) -> tuple[list[str], str]:
    return [], f"= {_describe(value)}, {what}"


@functools.cache
def _compile(tp: Any, field: str) -> Check:
    """The check of annotation ``tp`` for a value of dataclass field ``field``
    (which picks the range and id rules), built once per (type, field)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        nullable = len(options) < len(typing.get_args(tp))
        if all(dataclasses.is_dataclass(o) for o in options):
            by_type = {o: _compile(o, field) for o in options}

            def check_union(value, known):
                if value is None and nullable:
                    return None
                sub = by_type.get(type(value)) or next(
                    (c for o, c in by_type.items() if isinstance(value, o)), None)  # a subclass
                if sub is None:
                    return _bad(value, f"not a {' or '.join(_name(o) for o in options)}")
                return sub(value, known)
            return check_union
        subs = [(o, _compile(o, field)) for o in options]

        def check_any(value, known):
            if value is None and nullable:
                return None
            for _, sub in subs:
                if sub(value, known) is None:
                    return None
            return _bad(value, f"not a {' or '.join(_name(o) for o in options)}")
        return check_any
    if tp is int:
        non_negative = _non_negative(field)

        def check_int(value, known):
            if type(value) is int and INT32_MIN <= value <= INT32_MAX and (value >= 0 or not non_negative):
                return None
            why = _int_why(value, non_negative)
            return None if why is None else _bad(value, why)
        return check_int
    if tp is bool:
        return lambda value, known: None if isinstance(value, bool) else _bad(value, "not a bool")
    if tp is str:
        if field == "request_id":
            def check_id(value, known):
                if type(value) is not str:
                    return _bad(value, "not a str")
                if known is not None and value not in known:
                    return [], f"= {value!r}, a request id never added to this candidate"
                return None
            return check_id
        if field == "kind":
            return lambda value, known: (None if value in _KINDS and type(value) is str
                                         else _bad(value, "not one of new, resumed, running"))
        return lambda value, known: None if isinstance(value, str) else _bad(value, "not a str")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda value, known: None if isinstance(value, tp) else _bad(value, f"not a {tp.__name__}")
    if origin in (list, set, frozenset) or (origin is tuple and typing.get_args(tp)[-1:] == (Ellipsis,)):
        item_field = "request_id" if field.endswith("req_ids") or field in _ID_LISTS else field
        sub = _compile(typing.get_args(tp)[0], item_field)

        def check_seq(value, known):
            if not isinstance(value, (list, tuple, set, frozenset)):
                return _bad(value, f"not a {origin.__name__}")
            for i, v in enumerate(value):
                why = sub(v, known)
                if why is not None:
                    why[0].append(f"[{i}]")
                    return why
            return None
        return check_seq
    if origin is tuple:
        subs = [_compile(a, field) for a in typing.get_args(tp)]

        def check_tuple(value, known):
            if not isinstance(value, (list, tuple)) or len(value) != len(subs):
                return _bad(value, f"not a tuple of {len(subs)}")
            for i, (v, sub) in enumerate(zip(value, subs)):
                why = sub(v, known)
                if why is not None:
                    why[0].append(f"[{i}]")
                    return why
            return None
        return check_tuple
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        key_sub, val_sub = _compile(key_tp, "request_id"), _compile(val_tp, field)

        def check_dict(value, known):
            if not isinstance(value, dict):
                return _bad(value, "not a dict")
            for k, v in value.items():
                why = key_sub(k, known)
                if why is not None:
                    why[0].append(" key")
                    return why
                why = val_sub(v, known)
                if why is not None:
                    why[0].append(f"[{k!r}]")
                    return why
            return None
        return check_dict
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        subs_f = [(f.name, _compile(hints[f.name], f.name)) for f in dataclasses.fields(tp)]

        def check_dataclass(value, known):
            if not isinstance(value, tp):
                return _bad(value, f"not a {tp.__name__}")
            for name, sub in subs_f:
                why = sub(getattr(value, name), known)
                if why is not None:
                    why[0].append(f".{name}")
                    return why
            return None
        return check_dataclass
    return lambda value, known: None if isinstance(value, tp) else _bad(value, f"not a {_name(tp)}")


#: Fields holding lists of request ids.
_ID_LISTS = frozenset({"waiting", "running", "running_before", "finished_recving", "request_data_ids"})


def conforms(value: Any, tp: Any, field: str = "", known: frozenset | set | None = None) -> str | None:
    """Why ``value`` does not conform to the annotation ``tp`` (``field``: the
    dataclass field it belongs to, which picks the range rules), as
    ``"path = value (type), reason"``; None when it does. ``known``: the
    request ids a ``request_id`` may name (None: any string)."""
    why = _compile(tp, field)(value, known)
    if why is None:
        return None
    parts, reason = why
    path = "".join(reversed(parts)).lstrip(".")
    return f"{path} {reason}" if path else reason.removeprefix("= ")


def check_return(call: str, value: Any, known: frozenset | set | None) -> None:
    """Raise CandidateOutputError unless ``value``, returned by the candidate's
    ``call``, conforms to ``RETURNS[call]`` (a call not listed passes).
    ``known``: the request ids added to this candidate."""
    expected = RETURNS.get(call)
    if expected is None:
        return
    if dataclasses.is_dataclass(expected) and not isinstance(value, expected):
        raise CandidateOutputError(f"{call}() returned {type(value).__name__}, not a {expected.__name__}")
    why = conforms(value, expected, call, known)
    if why:
        raise CandidateOutputError(f"{call}() returned {why}")
