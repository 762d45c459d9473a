"""vLLM's per-layer KV cache layouts, as `EngineLayout`s over the canonical format.

Read from the installed vLLM 0.32.0 sources:

- vLLM CPU (`vllm/v1/attention/backends/cpu_attn.py`): `CPUAttentionBackend.
  supported_kv_cache_layouts()` is `(KVCacheLayout.LBHNC,)`, the identity stride order of the
  logical per-layer shape `(B, H, N, C)` built by `compute_layer_kv_cache_shape_bytes` in
  `vllm/v1/kv_cache_interface.py`, with `C = (head_size + head_size_v) * itemsize`
  (`AttentionSpec.state_content_size_bytes`). So `register_kv_caches` sees a contiguous
  `[num_blocks, H_local, block_size, 2 * head_dim]` tensor. `CPUAttentionBackendImpl.forward`
  and `.do_kv_cache_update` reinterpret it as `kv.view(num_blocks, H, 2 * block_size, -1)` and
  split it with `.chunk(2, dim=2)`: per block and head, the first `block_size * head_dim`
  elements hold K, the next ones V. Inside the K half, the compiled kernel
  (`torch.ops._C.cpu_attn_reshape_and_cache`) stores K TRANSPOSED, `[head_dim, block_size]`,
  while V is `[block_size, head_dim]`: checked by writing known keys through that op with the
  "vec" and "vec16" ISAs (fp32/bf16, head_dim 64/128, block_size 16..128), see
  tests/format/test_layout.py. Element `[b, h, t, :head_dim]` of the 4-D tensor is NOT K of token t.
  The "amx", "neon", "vsx", "vxe" and "rvv" ISAs (`_get_attn_isa`) could not be checked here and
  may pack K differently: `VllmCpuLayout` is only known right for "vec" and "vec16".
- vLLM 0.32 FlashAttention (`flash_attn.py`, `FlashAttentionImpl.forward`): logical
  `(B, H, N, 2 * D)`, split per token by `kv.transpose(1, 2).split(head_size, dim=-1)`: K is
  `[..., :D]`, V is `[..., D:]`, whatever the physical stride order.
- Older vLLM FlashAttention: `[2, num_blocks, block_size, H, D]` (K stack, then V stack).
- vLLM 0.32 MLA: the logical layer view is `[num_blocks, 1, block_size, head_size]` (one "head";
  `MLACommonBackend.get_kv_cache_shape` gives the same without it), one latent row per token,
  `kv_c` (kv_lora_rank values) then `k_pe` (rope values): the CPU_MLA backend (`cpu_mla.py`,
  `do_kv_cache_update`) writes `kv_cache.view(-1, kv_lora_rank + pe_dim)[slot]`. Seen on CPU: a
  contiguous `[num_blocks, 1, 16, 576]` float32 tensor per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ConfigError, unknown_name_message
from kvtier.transfer.copy_plan import EngineLayout


def _check_4d(layout: EngineLayout, kv: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    if kv.dim() != 4 or kv.shape[3] != 2 * head_dim:
        raise ValueError(
            f"{layout.name}: layer tensor {tuple(kv.shape)} is not "
            f"[num_blocks, H, block_size, {2 * head_dim}]"
        )
    return kv.shape[0], kv.shape[1], kv.shape[2]


class VllmCpuLayout(EngineLayout):
    """vLLM CPU ("vec"/"vec16" ISAs): `[num_blocks, H, block_size, 2*D]` whose memory per block
    and head is K transposed `[D, block_size]`, then V `[block_size, D]`."""

    name = "vllm_cpu"

    def kv_views(self, kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, n = _check_4d(self, kv, head_dim)
        try:
            halves = kv.view(b, h, 2, n * head_dim)
        except RuntimeError as exc:
            raise ValueError(f"{self.name}: block interiors must be contiguous: {exc}") from exc
        k = halves[:, :, 0].view(b, h, head_dim, n).transpose(2, 3)
        return k, halves[:, :, 1].view(b, h, n, head_dim)


class VllmFlashAttnLayout(EngineLayout):
    """vLLM 0.32 FlashAttention: logical `[num_blocks, H, block_size, 2*D]`, K|V per token."""

    name = "vllm_flash_attn"

    def kv_views(self, kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        _check_4d(self, kv, head_dim)
        return kv[..., :head_dim], kv[..., head_dim:]


class StackedKVLayout(EngineLayout):
    """Older FlashAttention: `[2, num_blocks, block_size, H, D]`."""

    name = "stacked_kv"

    def kv_views(self, kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if kv.dim() != 5 or kv.shape[0] != 2 or kv.shape[4] != head_dim:
            raise ValueError(
                f"{self.name}: layer tensor {tuple(kv.shape)} is not "
                f"[2, num_blocks, block_size, H, {head_dim}]"
            )
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


class VllmMlaLayout(EngineLayout):
    """vLLM 0.32 MLA: `[num_blocks, 1, block_size, D]` (or without the 1), one latent row of D
    values per token."""

    name = "vllm_mla"
    latent = True

    def kv_views(self, kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
        latent = kv.unsqueeze(1) if kv.dim() == 3 else kv
        if latent.dim() != 4 or latent.shape[1] != 1 or latent.shape[3] != head_dim:
            raise ValueError(
                f"{self.name}: layer tensor {tuple(kv.shape)} is not [num_blocks, 1, block_size, {head_dim}]"
            )
        return (latent,)


ENGINE_LAYOUTS: dict[str, type[EngineLayout]] = {
    cls.name: cls for cls in (VllmCpuLayout, VllmFlashAttnLayout, StackedKVLayout, VllmMlaLayout)
}


def engine_layout(name: str) -> EngineLayout:
    """The engine layout registered under `name`."""
    if name not in ENGINE_LAYOUTS:
        raise ConfigError("engine_layout", name, unknown_name_message(name, ENGINE_LAYOUTS))
    return ENGINE_LAYOUTS[name]()


def engine_layout_name(device_type: str, shape: Sequence[int], latent: bool = False) -> str:
    """The engine layout of a vLLM layer KV tensor of `shape` on `device_type`.

    vLLM 0.32 hands every attention backend a logical `[num_blocks, H, block_size, C]` layer view
    (`vllm/v1/kv_cache_layout.py`, whatever the physical stride order). The CPU backend packs K
    transposed into C (`vllm_cpu`); the CUDA backends for a plain KV dtype (FlashAttention,
    FlashInfer, Triton, FlexAttention) split C per token as K | V (`vllm_flash_attn`). A 5-D
    `[2, num_blocks, block_size, H, D]` tensor is older vLLM's FlashAttention (`stacked_kv`). An MLA
    model's (`latent`) tensors are latent caches (`vllm_mla`) on either device.
    """
    if device_type in ("cpu", "cuda") and latent:
        return "vllm_mla"
    if device_type == "cpu":
        return "vllm_cpu"
    if device_type == "cuda" and len(shape) == 4:
        return "vllm_flash_attn"
    if device_type == "cuda" and len(shape) == 5 and shape[0] == 2:
        return "stacked_kv"
    raise NotImplementedError(f"kvtier: no engine layout for a KV tensor {tuple(shape)} on {device_type}")
