"""Making tokens: the engine core (continuous batching), its runners (reference and the fast slot cache), sampling, speculative decoding, KV-cache accounting."""
