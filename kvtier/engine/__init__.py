"""The engine-independent request path: lookups and promotions per request, streamed loads,
tails, per-request accounting and latency, copy records.

It speaks to an engine through `kvtier.engine.request.Request`; an engine integration
(`kvtier.integrations.vllm`) adapts its own request and step objects to it.
"""
