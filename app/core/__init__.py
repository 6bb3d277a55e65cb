"""The sidecar's logic, apart from HTTP: health checks, the status document, metric collectors."""
