"""Tiny random-weight hybrid models for tests: built locally from a config, never downloaded.

Each model is a transformers `from_config` model with a fixed seed, saved with `save_pretrained`
into ``~/.cache/kvtier/models/tiny-<name>`` (next to SmolLM2; ``KVTIER_MODEL_DIR``'s parent when
that is set), with the SmolLM2 tokenizer copied beside it (so the vocabulary is SmolLM2's). The
directory is published atomically (temp dir + rename) and a complete one is never rebuilt. The
weights are random: the models produce nonsense, deterministically, which is all a reload test
needs. The marker file records the recipe (`recipe_digest`); a directory built from another recipe
is rebuilt. Head sizes are ones vLLM's CPU attention supports (64).

- ``gemma3``: Gemma3 text, 4 layers, sliding window 64 on layers 0-2, full attention on layer 3.
- ``mistral-sliding``: Mistral with ``sliding_window`` 64 on every layer, 2 layers.
- ``deepseek-v2``: DeepSeek-V2 with MLA (kv_lora_rank 512, rope dim 64: what vLLM's CPU_MLA
  backend needs), 2 dense layers, its own output head (vLLM's DeepSeek-V2 never ties it to the
  embeddings: with a tied head the checkpoint has none, and vLLM's logits are all equal).
- ``granite-hybrid``: GraniteMoeHybrid, one Mamba2 layer then one attention layer (dense MLP).
- ``qwen3-next``: Qwen3-Next, bfloat16 (vLLM's CPU gated delta net needs it), gated delta net
  layers 0, 1 and 3 (2 key and 2 value heads of 64: the CPU kernel's head size) and full attention
  (4 KV heads) on layer 2, so a state fits a 64-token attention page; dense MLPs but on layer 3, a
  mixture of 4 experts (vLLM's Qwen3-Next needs one); untied embeddings (vLLM's Qwen3-Next does
  not tie them: with tied ones its head would stay zero and every logit equal).
- ``llama``: Llama, 2 layers of full attention with 4 KV heads (SmolLM2 has 3), so tensor
  parallelism of 2 (and 4) divides them.

Run as ``python -m kvtier.tools.tiny_models NAME...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvtier.tools.models import prepare_smollm2

COMPLETE_MARKER = ".kvtier-complete.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's tokenizer
SLIDING_WINDOW = 64

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": True,
}

# name -> (architecture, config class kwargs, torch dtype)
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            **_COMMON,
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "query_pre_attn_scalar": 64,
        },
        "float32",
    ),
    "mistral-sliding": (
        "MistralForCausalLM",
        {**_COMMON, "model_type": "mistral", "num_hidden_layers": 2, "sliding_window": SLIDING_WINDOW},
        "float32",
    ),
    "deepseek-v2": (
        "DeepseekV2ForCausalLM",
        {
            **_COMMON,
            "model_type": "deepseek_v2",
            "num_hidden_layers": 2,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "first_k_dense_replace": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "tie_word_embeddings": False,
        },
        "float32",
    ),
    "llama": (
        "LlamaForCausalLM",
        {
            **_COMMON,
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
        },
        "float32",
    ),
    "granite-hybrid": (
        "GraniteMoeHybridForCausalLM",
        {
            **_COMMON,
            "model_type": "granitemoehybrid",
            "num_hidden_layers": 2,
            "layer_types": ["mamba", "attention"],
            "num_local_experts": 0,
            "shared_intermediate_size": 256,
            "mamba_n_heads": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
            "position_embedding_type": "rope",
        },
        "float32",
    ),
    "qwen3-next": (
        "Qwen3NextForCausalLM",
        {
            **_COMMON,
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 2 + ["full_attention", "linear_attention"],
            "mlp_only_layers": [0, 1, 2],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "partial_rotary_factor": 0.25,
            "tie_word_embeddings": False,
        },
        "bfloat16",
    ),
}


def tiny_model_dir(name: str) -> Path:
    """Where tiny model `name` lives (it may not be built yet)."""
    base = os.environ.get("KVTIER_MODEL_DIR")
    root = Path(base).expanduser().parent if base else Path.home() / ".cache" / "kvtier" / "models"
    return root / f"tiny-{name}"


def _build_into(out: Path, name: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, kwargs, dtype = MODELS[name]
    kwargs = dict(kwargs)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.architectures = [arch]
    config.dtype = dtype
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer_dir = prepare_smollm2(quiet=True)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out / file)


def recipe_digest(name: str) -> str:
    """A digest of tiny model `name`'s recipe (architecture, config, dtype)."""
    recipe = json.dumps(MODELS[name], sort_keys=True).encode()
    return hashlib.sha256(recipe).hexdigest()[:16]


def _marker(name: str) -> dict[str, str]:
    return {"model": name, "recipe": recipe_digest(name)}


def _is_current(dest: Path, name: str) -> bool:
    try:
        return bool(json.loads((dest / COMPLETE_MARKER).read_text()) == _marker(name))
    except (OSError, ValueError):
        return False


def build_tiny_model(name: str) -> Path:
    """Make sure tiny model `name` (a key of MODELS) exists, built from its current recipe; return
    its directory."""
    if name not in MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(MODELS)}")
    dest = tiny_model_dir(name)
    if _is_current(dest, name):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    stale = dest.with_name(f".{dest.name}.stale-{os.getpid()}")
    try:
        _build_into(tmp, name)
        (tmp / COMPLETE_MARKER).write_text(json.dumps(_marker(name)) + "\n")
        if dest.exists():
            os.rename(dest, stale)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _is_current(dest, name):
                raise
    finally:
        for leftover in (tmp, stale):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.tools.tiny_models", description=__doc__)
    parser.add_argument("names", nargs="+", choices=sorted(MODELS))
    for name in parser.parse_args(argv).names:
        print(build_tiny_model(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
