"""The HTTP server: the FastAPI app, its routes (OpenAI-compatible, captioning, dashboard, alerts), schemas,
errors, images, streaming, metrics and the bridge to the engine."""
