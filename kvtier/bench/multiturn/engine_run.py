"""The workload against an in-process vLLM engine (`LLMEngine`), no HTTP in between.

Same scheduling as `endpoint_run` (one FIFO queue of conversations, up to `max_concurrency`
requests in the engine at once), driven by `engine.step()`: a request's TTFT is from just before
`add_request` to the step that returns its first token, its ITL the gaps between later steps
that return tokens for it. Each request's prompt-token split is its own: kvtier's
`kv_transfer_params["kvtier"]["tokens"]` with kvtier's connector, vLLM's `num_cached_tokens` as
device and the rest recomputed with no connector. A baseline connector (vLLM's own tiering,
LMCache) reports no split per request: with it the caller splits a whole point from the change of
vLLM's Prometheus counters (`metrics_text`), as it does for a server. Every configuration runs with
the same engine settings, stats logging on included (those counters count only with it). A
conversation replaying a script's replies (`Conversation.recorded_reply`) asks for one output
token per turn (its TTFT) and is answered with the recorded reply.

The engine runs in this process: the caller enters `kvtier.integrations.vllm.serving.launch.in_process_env`
before vLLM is imported. The baselines' tree (`configs.baselines_root`) is added to `sys.path`
when the configuration loads a baseline connector.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvtier.bench.multiturn.configs import baselines_root
from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec
from kvtier.bench.multiturn.summary import RequestRecord
from kvtier.bench.multiturn.vllm_server import ServerSettings
from kvtier.format.chunks import DEVICE, RECOMPUTED

OnRequest = Callable[[RequestRecord], None]


@dataclass
class _InFlight:
    conv: Conversation
    record: RequestRecord
    last_s: float | None = None
    tokens: int = 0


class InProcessEngine:
    """One `LLM` with the settings of a configuration; `run_point` serves a workload on it."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._llm: Any = None
        self._ids = 0

    def __enter__(self) -> InProcessEngine:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        s = self.settings
        options: dict[str, Any] = {
            "dtype": s.dtype, "enforce_eager": True, "block_size": s.block_size,
            "num_gpu_blocks_override": s.device_blocks,
            "kv_cache_memory_bytes": (s.device_blocks + 1) * s.block_bytes,
            "max_model_len": s.max_model_len, "max_num_seqs": s.max_num_seqs, "seed": 0,
            "disable_log_stats": False,
        }
        transfer = s.kv_transfer_config()
        if transfer is not None:
            options["kv_transfer_config"] = KVTransferConfig(**transfer)
        if s.connector is not None:
            root = str(baselines_root())
            if root not in sys.path:
                sys.path.insert(0, root)
        self._llm = LLM(model=str(s.model), **options)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None

    def metrics_text(self) -> str:
        """vLLM's Prometheus counters in this process (text exposition)."""
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY).decode()

    @property
    def tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def warm_up(self) -> None:
        """One short unmeasured request (kernel and allocator warm-up)."""
        spec = WorkloadSpec(160, 64, 1, 1, 1, 2, seed=-1)
        self.run_point(spec, "warm-up")

    def run_point(self, spec: WorkloadSpec, tag: str, on_request: OnRequest | None = None,
                  conversations: Sequence[Conversation] = ()) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Serve the whole workload: `conversations` (made on `spec`; by default
        `spec.conversations` new ones with text tagged `tag`) in that order, each to its last turn;
        the request records (each with its own token split). Raises ValueError before serving a
        prompt that leaves no room for `spec.output_tokens` within the engine's `max_model_len`."""
        from vllm import SamplingParams

        engine = self._llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
        first_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ready = deque(conversations or (Conversation(i, spec, self.tokenizer, tag)
                                        for i in range(spec.conversations)))
        inflight: dict[str, _InFlight] = {}
        records: list[RequestRecord] = []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while ready or inflight:
            while ready and len(inflight) < spec.max_concurrency:
                conv = ready.popleft()
                conv.ask()
                prompt = conv.prompt_ids()
                if len(prompt) + spec.output_tokens > self.settings.max_model_len:
                    raise ValueError(f"conversation {conv.index} turn {conv.turn}: {len(prompt)} prompt "
                                     f"tokens do not fit max_model_len {self.settings.max_model_len}")
                self._ids += 1
                req_id = f"{tag}-{conv.index}-{conv.turn}-{self._ids}"
                now = time.perf_counter()
                record = RequestRecord(conv.index, conv.turn, now, now, 0.0, len(prompt), 0)
                replay = conv.recorded_reply is not None
                engine.add_request(req_id, {"prompt_token_ids": prompt}, first_token if replay else params)
                inflight[req_id] = _InFlight(conv, record)
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                job = inflight.get(out.request_id)
                if job is None:
                    continue
                produced = len(out.outputs[0].token_ids) if out.outputs else 0
                if produced > job.tokens:
                    if job.last_s is None:
                        job.record.ttft_s = now - job.record.start_s
                    else:
                        job.record.itl_s.append(now - job.last_s)
                    job.last_s, job.tokens = now, produced
                if out.finished:
                    del inflight[out.request_id]
                    self._finish(job, out, now)
                    records.append(job.record)
                    if on_request is not None:
                        on_request(job.record)
                    if not job.conv.finished:
                        ready.append(job.conv)
        wall = time.perf_counter() - wall0
        return records, {"cpu_fraction": (time.process_time() - cpu0) / wall if wall else 0.0,
                         "note": "in-process: client and engine share this process"}

    def _finish(self, job: _InFlight, out: Any, now: float) -> None:
        record = job.record
        record.end_s = now
        record.output_tokens = job.tokens
        reply = job.conv.recorded_reply
        job.conv.answer(reply if reply is not None else (out.outputs[0].text if out.outputs else ""))
        if self.settings.connector is not None:
            return
        if self.settings.kvtier is not None:
            split = ((out.kv_transfer_params or {}).get("kvtier") or {}).get("tokens")
            if split is None:
                record.error = "the finished request carries no kvtier token split"
                return
            record.tokens = {k: int(v) for k, v in split.items()}
        else:
            device = int(out.num_cached_tokens or 0)
            record.tokens = {DEVICE: device, RECOMPUTED: record.prompt_tokens - device}
