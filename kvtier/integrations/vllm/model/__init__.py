"""What kvtier reads from a vLLM model: its KV cache groups, layer kinds, KV dtype, backend
layouts and recurrent state groups, as one `EngineGeometry`.
"""
