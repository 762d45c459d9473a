"""kvtier: tiered KV-cache offloading for LLM serving.

KV chunks evicted from accelerator memory are kept in a shared-memory host tier and cascaded to
slower, larger secondary tiers (local disk, object storage, Redis, peers), then promoted back
through host memory instead of being recomputed.
"""

__version__ = "0.1.0"
