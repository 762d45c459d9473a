"""The replies every chaos request must get: the same conversations served by vLLM alone.

`Reference.build` runs the multi-turn workload (`kvtier.bench.multiturn.conversation`) on an
engine without kvtier, greedy, turn by turn: turn t of every conversation is one batch, its
replies appended before turn t+1 is asked. It keeps, per conversation and turn, the prompt's token
ids and the reply's token ids. The chaos run sends exactly these prompts (whatever it gets back),
so every request has one right answer. A reference is cached as JSON under
`~/.cache/kvtier/chaos/`, named by a digest of everything that makes it (model, dtype, workload).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec

CACHE_DIR = Path.home() / ".cache" / "kvtier" / "chaos"


@dataclass(frozen=True)
class Turn:
    prompt: tuple[int, ...]
    reply: tuple[int, ...]


@dataclass(frozen=True)
class Reference:
    """`turns[c][t]`: conversation c's turn t (0-based)."""

    turns: tuple[tuple[Turn, ...], ...]

    @staticmethod
    def cache_path(model: Path, dtype: str, spec: WorkloadSpec) -> Path:
        what = json.dumps({"model": str(model.resolve()), "dtype": dtype, "spec": spec.as_json(), "v": 1},
                          sort_keys=True)
        return CACHE_DIR / f"ref-{hashlib.sha256(what.encode()).hexdigest()[:16]}.json"

    @classmethod
    def load_or_build(cls, model: Path, dtype: str, spec: WorkloadSpec, max_model_len: int,
                      engine_options: dict[str, Any]) -> Reference:
        path = cls.cache_path(model, dtype, spec)
        if path.exists():
            raw = json.loads(path.read_text())
            return cls(tuple(tuple(Turn(tuple(p), tuple(r)) for p, r in conv) for conv in raw))
        ref = cls.build(model, dtype, spec, max_model_len, engine_options)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([[[list(t.prompt), list(t.reply)] for t in conv] for conv in ref.turns]))
        tmp.replace(path)
        return ref

    @classmethod
    def build(cls, model: Path, dtype: str, spec: WorkloadSpec, max_model_len: int,
              engine_options: dict[str, Any]) -> Reference:
        from vllm import LLM, SamplingParams

        llm: Any = LLM(model=str(model), dtype=cast(Any, dtype), enforce_eager=True,
                       max_model_len=max_model_len, seed=0, **engine_options)
        try:
            tokenizer: Any = llm.get_tokenizer()
            params = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
            convs = [Conversation(i, spec, tokenizer, "chaos") for i in range(spec.conversations)]
            turns: list[list[Turn]] = [[] for _ in convs]
            for _ in range(spec.turns):
                for conv in convs:
                    conv.ask()
                prompts = [conv.prompt_ids() for conv in convs]
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for conv, prompt, out in zip(convs, prompts, outs, strict=True):
                    reply = out.outputs[0]
                    conv.answer(reply.text)
                    turns[conv.index].append(Turn(tuple(prompt), tuple(reply.token_ids)))
        finally:
            llm.llm_engine.engine_core.shutdown()
        return cls(tuple(tuple(conv) for conv in turns))

    @property
    def longest(self) -> int:
        return max(len(t.prompt) + len(t.reply) for conv in self.turns for t in conv)
