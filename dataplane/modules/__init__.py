"""One module per message family, each registering its handlers with the server loop.

`management` (HELLO, PING, UNREGISTER; owns the reaper thread), `transfer` (server-driven
REGISTER / STORE / RETRIEVE), `engine` (engine-driven, through a pool the server owns),
`lookup` (LOOKUP over both transfer modules). Each transfer module owns a liveness registry
(`dataplane.liveness.registry`), whose leaf lock is the only lock a module holds.
"""
