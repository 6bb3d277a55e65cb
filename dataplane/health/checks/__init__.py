"""Every module here (names not starting with ``_``) is imported by the monitor at start, and
every `HealthCheck` subclass defined in it is asked to ``create`` its checks."""
