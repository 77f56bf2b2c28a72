"""Serving the loaded model over an OpenAI-compatible HTTP API (FastAPI + uvicorn), on the engine core."""
