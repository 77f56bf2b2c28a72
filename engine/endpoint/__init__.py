"""A model served by someone else: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, Ollama,
``transformers serve``, or this project's own ``serve``) as a model source beside local ones.

``endpoint:http://HOST:PORT/v1#MODEL`` loads (connects) like a model path and generates the same
events as a local model, measured on arrival of each server-sent event: TTFT, per-token latency,
E2E, the tokens the server counted, logprobs when it returns them. What a server doesn't say
(its KV-cache bytes, its memory) is ``None``, never a zero.
"""

from engine.endpoint.source import (
    PREFIX,
    EndpointModel,
    EndpointSpec,
    api_key_from_env,
    connect,
    is_endpoint,
    list_models,
    parse_endpoint,
)

__all__ = ["PREFIX", "EndpointModel", "EndpointSpec", "api_key_from_env", "connect", "is_endpoint",
           "list_models", "parse_endpoint"]
