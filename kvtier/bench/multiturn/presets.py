"""Named benchmark shapes: the workload, the conversations swept, the configurations compared and
the engine's cache sizes.

- `paper`: the reference experiment (12,000 initial tokens + 4,000 per turn, 8 turns, at most 64
  requests in flight, 16 to 256 conversations). Meant for a real accelerator and a long-context
  model behind `--endpoint`, or with `--model` and `--device-blocks` when the sweep starts servers.
- `cpu`: the same shape scaled for SmolLM2-135M on 2 CPU cores: the device cache holds about
  `DEVICE_CONVERSATIONS` conversations, the host tier about twice that, the fs tier everything,
  and the points cover all three regimes; the whole sweep takes at most ~30 minutes.
- `gpu`: the paper's conversations (12,000 + 4,000 per turn, 8 turns, 100 output tokens) on one
  accelerator, caches and concurrency scaled by 1/4 so that a single machine holds them: the
  device cache holds `GPU_DEVICE_CONVERSATIONS` conversations at their last turn (the paper's
  HBM held about 64), the host tier twice that, at most that many requests in flight, and the
  points cover the three regimes (device, host, fs). `scripts/gpu_bench.sh` runs it; with a
  32 KiB/token model (Llama-3.2-1B, bf16) a conversation is about 1.25 GiB at its last turn.
- `smoke`: a few seconds of work per configuration (tests).
- `mini`: the mini multi-turn (16 conversations x 4 turns, 800 + 200 tokens, 16 output
  tokens, 64 device blocks of 128 tokens, at most 4 in flight): prefix caching alone, kvtier's
  host tier (large enough for everything), and a device cache that holds everything.

Sizes derived from the workload (`Sizing`): blocks one conversation needs at its last turn, the
`all-fits` device cache, and a host tier holding every conversation when a preset says "all".
Bytes come from the model's geometry (`kv_bytes_per_token`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvtier.bench.multiturn.conversation import WorkloadSpec

DEVICE_CONVERSATIONS = 4
GPU_DEVICE_CONVERSATIONS = 16


@dataclass(frozen=True)
class Preset:
    """A benchmark shape; `device_conversations`/`host_conversations` size the caches in whole
    conversations at their last turn (None: `device_blocks`/`host_chunks` as given, or all)."""

    name: str
    workload: WorkloadSpec
    sweep: tuple[int, ...]
    configs: tuple[str, ...]
    block_size: int = 128
    device_blocks: int | None = None
    device_conversations: float | None = None
    host_chunks: int | None = None
    host_conversations: float | None = None
    dtype: str = "float32"


@dataclass(frozen=True)
class Sizing:
    """Cache sizes (engine blocks; one chunk is one block) for a workload and a block size."""

    max_model_len: int
    blocks_per_conversation: int
    device_blocks: int
    all_fits_blocks: int
    host_chunks: int


def sizing(preset: Preset, spec: WorkloadSpec, sweep: tuple[int, ...], *,
           device_blocks: int | None = None, host_chunks: int | None = None) -> Sizing:
    """The preset's cache sizes for `spec` swept over `sweep` (explicit counts win)."""
    block = preset.block_size
    longest = spec.max_prompt_tokens() + spec.output_tokens
    max_model_len = math.ceil((longest + block) / block) * block
    per_conv = math.ceil(longest / block)
    everything = max(sweep) * per_conv + spec.max_concurrency + 2
    min_device = math.ceil(max_model_len / block) + 1  # vLLM wants one max-length request + 1
    if device_blocks is None:
        device_blocks = preset.device_blocks
    if device_blocks is None and preset.device_conversations is not None:
        device_blocks = round(preset.device_conversations * per_conv)
    if device_blocks is None:
        raise ValueError(f"preset {preset.name}: give --device-blocks (the accelerator's KV cache)")
    if host_chunks is None:
        host_chunks = preset.host_chunks
    if host_chunks is None and preset.host_conversations is not None:
        host_chunks = round(preset.host_conversations * per_conv)
    if host_chunks is None:
        host_chunks = everything
    if device_blocks < min_device:
        raise ValueError(f"--device-blocks {device_blocks}: must hold one max-length request "
                         f"({max_model_len} tokens: at least {min_device} blocks of {block})")
    return Sizing(max_model_len, per_conv, device_blocks, max(everything, device_blocks), host_chunks)


PRESETS: dict[str, Preset] = {
    "paper": Preset(
        "paper", WorkloadSpec(12000, 4000, 8, 256, 64, 100),
        sweep=(16, 32, 64, 96, 128, 192, 256), configs=("no-offload", "host", "host+fs"),
        block_size=16, dtype="bfloat16"),
    "cpu": Preset(
        "cpu", WorkloadSpec(384, 128, 6, 16, 4, 16),
        sweep=(2, 4, 8, 16), configs=("no-offload", "host", "host+fs", "all-fits"),
        block_size=64, device_conversations=DEVICE_CONVERSATIONS,
        host_conversations=2 * DEVICE_CONVERSATIONS),
    "gpu": Preset(
        "gpu", WorkloadSpec(12000, 4000, 8, 256, GPU_DEVICE_CONVERSATIONS, 100),
        sweep=(8, 16, 32, 48, 64), configs=("no-offload", "host", "host+fs"),
        block_size=16, dtype="bfloat16", device_conversations=GPU_DEVICE_CONVERSATIONS,
        host_conversations=2 * GPU_DEVICE_CONVERSATIONS),
    "smoke": Preset(
        "smoke", WorkloadSpec(160, 64, 3, 4, 2, 4),
        sweep=(4,), configs=("no-offload", "host"), block_size=32, device_blocks=14,
        host_chunks=64),
    "mini": Preset(
        "mini", WorkloadSpec(800, 200, 4, 16, 4, 16),
        sweep=(16,), configs=("no-offload", "host", "all-fits"), block_size=128, device_blocks=64),
}


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
"""`layer_types` entries of hybrid configs (Gemma3, Qwen3-Next, GraniteMoeHybrid) with per-token KV."""


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    """KV bytes per token of the model directory `model` in `dtype` (all attention layers, K and
    V; for an MLA model, its latent: kv_lora_rank + rope values per layer). Recurrent layers (gated
    delta net, Mamba2: `layer_types` other than attention) keep no per-token KV: not counted."""
    config = json.loads((model / "config.json").read_text())
    types = config.get("layer_types")
    layers = sum(t in ATTENTION_LAYER_TYPES for t in types) if types else config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    if config.get("kv_lora_rank"):
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return int(layers * latent * itemsize)
    return int(layers * 2 * config["num_key_value_heads"] * head_dim * itemsize)


def preset(name: str) -> Preset:
    """The preset called `name`; ValueError lists the known ones."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name}: unknown (known: {', '.join(PRESETS)})")
    return PRESETS[name]


def with_overrides(spec: WorkloadSpec, **overrides: int | None) -> WorkloadSpec:
    """`spec` with the given fields replaced (None keeps the preset's value), checked."""
    out = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    out.check()
    return out
