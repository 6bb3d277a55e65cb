"""KV events: what this server holds, published for KV-aware routers in vLLM's KV-event format."""
