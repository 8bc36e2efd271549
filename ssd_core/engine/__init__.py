"""The engine: model forward and KV cache, loading, prompt encoding, skip sets, cheap drafts, the
decode loop and its events. It knows the strategy interface (policies.base), not any strategy."""
