"""Run one in-process vLLM engine with the KVTierConnector in a fresh Python process.

`python -m tests.integrations.engine_child` reads a JSON request on stdin: `model`,
`extra_configs` (kvtier's `kv_connector_extra_config`s, one engine each, one after the other),
`llm` (more `LLM(...)` arguments), `prompts` (token id lists, served one at a time, greedy) and
`max_tokens`. It prints one JSON line on stdout: a list with, per config, `{"results": [{"tokens",
"cached", "kvtier"}, ...]}`, or `{"error": "..."}` (the exception and its causes) when the engine
failed to start. The caller sets vLLM's environment (see `conftest.py`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvtier.integrations.vllm.serving.launch import transfer_config


def _describe(exc: BaseException) -> str:
    parts = []
    seen: BaseException | None = exc
    while seen is not None:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)


def run(request: dict[str, Any], extra_config: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=request["model"], kv_transfer_config=transfer_config(extra_config),
                  **request["llm"])
    except Exception as exc:
        return {"error": _describe(exc)}
    params = SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 8))
    results = []
    for prompt in request["prompts"]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        results.append({
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens,
            "kvtier": (out.kv_transfer_params or {}).get("kvtier"),
        })
    llm.llm_engine.engine_core.shutdown()
    return {"results": results}


def main() -> None:
    request: dict[str, Any] = json.load(sys.stdin)
    runs = [run(request, config) for config in request["extra_configs"]]
    print(json.dumps(runs), flush=True)


if __name__ == "__main__":
    main()
