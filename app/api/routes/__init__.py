"""One small router per concern."""
