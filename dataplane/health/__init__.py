"""The health monitor: periodic checks of the remote tier and the data plane, and the fallback
policies that keep inference running while a check fails (see `monitor`)."""
