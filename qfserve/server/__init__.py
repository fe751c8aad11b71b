"""qfserve's HTTP layer: an OpenAI-compatible FastAPI app over the engine's worker."""
