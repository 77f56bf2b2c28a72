"""A load generator for any OpenAI-compatible server (ours, vLLM, SGLang, llama.cpp…), measured with
vLLM's definitions (``vllm bench serve``): closed-loop concurrency or open-loop arrivals."""
