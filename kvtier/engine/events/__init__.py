"""KV events for routers, independent of the engine's event format: which engine blocks a chunk
covers (`chunk_blocks`), kept on disk beside an fs tier's chunks (`block_sidecar`)."""
