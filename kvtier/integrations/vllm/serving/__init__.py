"""Serving with vLLM: `kvtier serve`, the connector config it builds, vLLM's native tiering
config mapped to kvtier's, start-up sizing, and `kvtier trace record`.
"""
