"""Reliability: the server under resource pressure (a small segment directory, ...)."""
