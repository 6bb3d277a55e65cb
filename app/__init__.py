"""kvwarden HTTP sidecar: FastAPI app serving /status, /health, /metrics and admin routes."""
