"""The dtype of the bytes kvtier stores for vLLM's KV cache (`kv_cache_dtype`).

kvtier stores KV pages as the engine holds them, never converted. The canonical layout and the
model fingerprint name the stored format by a torch dtype:

- "auto" (the model's dtype), "float16", "bfloat16", "float32": the KV cache's own dtype;
- "fp8_e5m2": `torch.float8_e5m2`;
- "fp8" and "fp8_e4m3" (vLLM's names for the same format): the platform's e4m3 dtype
  (`float8_e4m3fn`, or `float8_e4m3fnuz` on ROCm, whose bits mean other values).

vLLM keeps an fp8 cache in uint8 tensors and quantizes with one scale per layer for K and one for V
(`k_scale`, `v_scale`: 1.0, or the checkpoint's, so part of the model); fp8 chunks therefore mean
the same values in every engine serving the same model, whatever its TP degree or backend. Two
engines share chunks only with equal formats: an fp8 chunk never loads into a float32 engine, nor
an e5m2 chunk into an e4m3 one (the keys and the layout fingerprint differ).

Refused at startup with a ConfigError naming the key, the value and what kvtier holds: the other
quantized caches (per-token-head scales, nvfp4, turboquant, fp8_ds_mla, ...), whose pages carry
scales or packing the canonical layout does not describe, and `kv_cache_dtype_skip_layers` with a
quantized cache (layers of two dtypes in one row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError

UNQUANTIZED = ("auto", "float16", "bfloat16", "float32")
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
HELD = UNQUANTIZED + FP8


def _e4m3() -> torch.dtype:
    from vllm.platforms import current_platform

    return current_platform.fp8_dtype()


def stored_kv_dtype(
    cache_dtype: str, engine_dtype: torch.dtype, skip_layers: Sequence[str] = ()
) -> torch.dtype:
    """The dtype naming the bytes kvtier stores for a KV cache of vLLM's `cache_dtype` whose
    tensors are `engine_dtype`; ConfigError for a cache kvtier does not hold."""
    if cache_dtype in UNQUANTIZED:
        return engine_dtype
    if cache_dtype not in FP8:
        raise ConfigError(
            "kv_cache_dtype", cache_dtype,
            f"one kvtier holds ({', '.join(HELD)}): its pages carry scales or packing kvtier's "
            "canonical layout does not describe yet",
        )
    if skip_layers:
        raise ConfigError(
            "kv_cache_dtype_skip_layers", list(skip_layers),
            f"empty with kv_cache_dtype {cache_dtype!r}: kvtier stores every layer in one dtype",
        )
    return torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else _e4m3()


def holds(engine_dtype: torch.dtype, stored: torch.dtype) -> bool:
    """Whether KV tensors of `engine_dtype` hold the stored dtype `stored` as they are: the same
    dtype, or vLLM's uint8 storage of an fp8 format."""
    fp8 = stored.itemsize == 1 and stored.is_floating_point
    return engine_dtype == stored or (engine_dtype == torch.uint8 and fp8)
