"""The OpenAI-compatible HTTP API: jaxserve.http.app (FastAPI), served by jaxserve.server.server on uvicorn."""
