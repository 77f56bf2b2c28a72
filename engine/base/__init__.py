"""The base layer: what every part of the engine speaks and nothing of ours is imported by it.

Requests and their sampling parameters (request.py, sampling.py), the cancel token (cancel.py),
the events every consumer reads (events.py), the errors (errors.py), memory probes (memory.py)
and the KV-cache layout a config predicts (kv.py). tests/engine/test_structure.py checks that
these modules import nothing of ours outside this folder.
"""
