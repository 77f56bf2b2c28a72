"""Making tokens: the engine core (continuous batching), its runners (reference, and the fast path's
paged cache over the KV block pool), sampling, speculative decoding, KV-cache accounting."""
