"""Engines in child processes, driven one request at a time: the `load_policy` benchmarks'
(`bench_choice_slow_tier`, `bench_choice_remote`) way to pair each kvtier request with vLLM alone's
for the same prompt served moments apart, so that a machine shared with other work moves both.

`Child(name, settings)` starts `python -m benchmarks.choice_engines` with `settings` (JSON: the
`LLM` keyword arguments the engine is built with, and `kvtier`, the connector's configuration or
null for vLLM alone). The child builds one in-process engine (SmolLM2, CPU backend), serves a
warm-up request, then answers one JSON line per JSON line on its stdin:
- `{"op": "serve", "prompt": [ids], "max_tokens": n, "reset": r}`: `reset` "device" empties vLLM's
  prefix cache first, "all" the host tier too (`reset_prefix_cache(reset_connector=True)`); answers
  the seconds from adding the request to the step that returned its first token (`ttft_s`), the
  reply's text and kvtier's token split by source (`split`, empty for vLLM alone);
- `{"op": "drain"}`: waits until kvtier's transfers in flight (cascades to secondary tiers) ended;
- `{"op": "metrics", "names": [...], "tier": t}`: kvtier's counters and gauges of that tier (or
  without labels when `tier` is null).
Everything else the child writes to stdout (vLLM's logs) goes to its stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.integrations.vllm.serving.launch import in_process_env, transfer_config
from kvtier.tools.models import model_dir


def _first_token(llm: Any, ask: dict[str, Any], req_id: str) -> dict[str, Any]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    if ask.get("reset"):
        llm.reset_prefix_cache(reset_connector=ask["reset"] == "all")
    params = SamplingParams(temperature=0.0, max_tokens=ask["max_tokens"], ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(req_id, {"prompt_token_ids": ask["prompt"]}, params)
    first, text, split = None, "", {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                text = out.outputs[0].text if out.outputs else ""
                split = (out.kv_transfer_params or {}).get("kvtier", {}).get("tokens", {})
    return {"ttft_s": (first or time.perf_counter()) - start, "text": text,
            "split": {k: int(v) for k, v in split.items()}}


def _planner(llm: Any) -> Any:
    return getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "planner", None)


def child(settings: dict[str, Any]) -> int:
    """The child's loop (see the module docstring)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-choice-", dir="/var/tmp")))
        stack.enter_context(in_process_env(tmp))
        from vllm import LLM

        kvtier = settings.pop("kvtier")
        extra: dict[str, Any] = {} if kvtier is None else {"kv_transfer_config": transfer_config(kvtier)}
        llm = LLM(model=str(model_dir()), dtype="float32", enforce_eager=True, seed=0, **settings, **extra)
        _first_token(llm, {"prompt": llm.get_tokenizer().encode("Warm-up request, not measured."),
                           "max_tokens": 1}, "warm-up")
        print(json.dumps({"ready": True}), file=answers)
        served = 0
        for line in sys.stdin:
            ask = json.loads(line)
            planner = _planner(llm)
            if ask["op"] == "serve":
                served += 1
                print(json.dumps(_first_token(llm, ask, str(served))), file=answers)
            elif ask["op"] == "drain":
                start = time.perf_counter()
                while planner is not None and planner.manager.in_flight:
                    planner.manager.poll()  # what the next engine step would do first
                    time.sleep(0.002)
                print(json.dumps({"drain_s": time.perf_counter() - start}), file=answers)
            elif ask["op"] == "metrics":
                metrics = None if planner is None else planner.manager.metrics
                labels = {"tier": ask["tier"]} if ask.get("tier") else {}
                print(json.dumps({name: None if metrics is None else metrics.value(name, **labels)
                                  for name in ask["names"]}), file=answers)
        llm.llm_engine.engine_core.shutdown()
    return 0


class Child:
    """One engine process (see the module docstring)."""

    def __init__(self, name: str, settings: dict[str, Any]) -> None:
        self.name = name
        argv = [sys.executable, "-m", "benchmarks.choice_engines", json.dumps(settings)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} exited (code {self.proc.wait()})")
        return dict(json.loads(line))

    def ask(self, **ask: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def serve(self, prompt: list[int], max_tokens: int, reset: str | None = None) -> dict[str, Any]:
        return self.ask(op="serve", prompt=prompt, max_tokens=max_tokens, reset=reset)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(120)


if __name__ == "__main__":
    raise SystemExit(child(json.loads(sys.argv[1])))
