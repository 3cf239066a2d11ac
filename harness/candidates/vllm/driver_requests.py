"""Requests in and out of vLLM's ``Scheduler`` outside a step: add, abort, finished info, prefix-cache reset.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM inside
functions) only. Mirrors ``EngineCore.add_request`` (the ``Request`` its
input processor builds: ``SamplingParams``, the model's EOS token, the block
hasher; ``vllm/v1/engine/core.py``, ``vllm/v1/request.py``),
``EngineCore.abort_requests`` (``Scheduler.finish_requests``) and
``EngineCore.reset_prefix_cache``.
"""

from __future__ import annotations

from . import events as ev
from .driver_errors import DriverError


class RequestOps:
    """``Driver``'s half that adds and aborts requests (reads ``sched``,
    ``hooks``, ``SamplingParams``, ``Request``, ``RequestStatus``,
    ``block_hasher``, ``_request_params``, ``_request_mm_params``)."""

    def add(self, req: dict) -> dict:
        sched = self._require()
        params = self.SamplingParams(
            max_tokens=req["max_tokens"], min_tokens=req.get("min_tokens", 0),
            ignore_eos=bool(req.get("ignore_eos", False)),
            stop_token_ids=list(req.get("stop_token_ids") or []))
        eos = req.get("eos_token_id")
        kwargs = dict(request_id=req["request_id"], prompt_token_ids=list(req["prompt_token_ids"]),
                      sampling_params=params, pooling_params=None,
                      arrival_time=float(req.get("arrival_time", 0.0)),
                      priority=int(req.get("priority", 0)), block_hasher=self.block_hasher)
        if hasattr(params, "update_from_generation_config"):
            # What vLLM's input processor does with the model's EOS token.
            params.update_from_generation_config({}, eos)
        if "eos_token_id" in self._request_params:  # 0.10-era Request
            kwargs["eos_token_id"] = eos
        for name in self._request_mm_params:
            # Feature probe: releases whose Request takes the multimodal
            # fields as arguments (0.10.0: multi_modal_inputs/_hashes/
            # _placeholders, 0.10.1: multi_modal_kwargs, ...) get "none", as
            # a text-only prompt has.
            kwargs.setdefault(name, None)
        request = self.Request(**{k: v for k, v in kwargs.items() if k in self._request_params})
        if req["request_id"] in sched.requests:
            raise DriverError(f"duplicate request id {req['request_id']!r}")
        sched.add_request(request)
        return {}

    def _finished_info(self, request) -> dict:
        groups = self.hooks.freed_groups.pop(request.request_id, None)
        if self.hooks.hybrid and groups is None:
            groups = [[] for _ in range(self.hooks.num_groups)]
        return ev.finished_info(request, self.hooks.freed.pop(request.request_id, []),
                                self.hooks.fences.pop(request.request_id, None),
                                groups if self.hooks.hybrid else None)

    def abort(self, request_ids: list[str]) -> dict:
        sched = self._require()
        # The Request objects, before vLLM drops them (what finish_requests
        # returns differs across versions: Requests, or (id, client) pairs).
        live = {i: sched.requests.get(i) for i in dict.fromkeys(request_ids)}
        live = {i: r for i, r in live.items() if r is not None and not r.is_finished()}
        sched.finish_requests(list(live), self.RequestStatus.FINISHED_ABORTED)
        # vLLM collects ids into a set: report in the order given, as the harness does.
        out = [self._finished_info(r) for r in live.values()
               if r.status == self.RequestStatus.FINISHED_ABORTED]
        return {"finished": out, "num_unfinished": sched.get_num_unfinished_requests()}

    def reset_prefix_cache(self, reset_running_requests: bool) -> dict:
        """vLLM's own ``Scheduler.reset_prefix_cache(reset_running_requests)``
        (``EngineCore.reset_prefix_cache``'s body; no connector to reset).
        Returns ``{succeeded, running_before, preemptions, snapshot}``: the
        forced preemptions as the hooks saw them (tail of running first),
        each ``{request_id, num_computed_tokens, freed_block_ids, fence}``.
        vLLM's RuntimeError (a forced reset that still fails) propagates."""
        sched = self._require()
        running_before = [r.request_id for r in sched.running]
        self.hooks.seq = []
        # Passed by name: a vLLM without the parameter fails loudly (TypeError).
        ok = sched.reset_prefix_cache(reset_running_requests=reset_running_requests)
        preemptions = [{"request_id": item[1], "num_computed_tokens": item[2],
                        "freed_block_ids": list(item[3]), "fence": item[4] if len(item) > 4 else None,
                        "group_block_ids": item[5] if len(item) > 5 else None}
                       for item in self.hooks.seq if item[0] == "preempt"]
        self.hooks.seq = []
        return {"succeeded": bool(ok), "running_before": running_before, "preemptions": preemptions,
                "snapshot": self.snapshot()}
