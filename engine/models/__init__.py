"""Finding, fetching and loading models: sources (default, folders, GGUF, hub ids), precisions and quantization, devices; one load at a time."""
