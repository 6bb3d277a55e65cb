"""Worker liveness: who is tracked, who went silent, and the one way an instance is released.

`target` is the protocol every holder of per-instance state speaks; `registry` keeps one
transfer module's instances with their liveness fields behind one leaf lock; `release` is the
single cleanup path of UNREGISTER, the reaper and the admin reap (remove, fan out
``drop_instance_state``, count); `reaper` is the thread (``kvwarden-worker-reaper``) that paces
reaps and scans closed connections. Releases run on short-lived ``kvwarden-release`` threads,
each bounded, so a stuck one never wedges the reaper.
"""
