"""One module per message family, each registering its handlers with the server loop.

`management` (HELLO / GET_SERVER_INFO, PING, UNREGISTER_KV_CACHE; owns the reaper thread),
`server_driven` (REGISTER_KV_CACHE / STORE / RETRIEVE: the server copies between the worker's
mapped memory and L1), `engine_pool` (ENGINE_REGISTER / ENGINE_STORE / ENGINE_RETRIEVE: the
worker copies, through a chunk pool the server owns), `one_copy` (ENGINE_RESERVE / COMMIT /
ACQUIRE / RELEASE: the worker copies once, into and out of L1's arena, over the engine-driven
instances), `blend` (BLEND_REGISTER / STORE / RETRIEVE: chunks reused at any position, with
per-instance RoPE tables), `blend_one_copy` (BLEND_RESERVE / ACQUIRE: the worker rotates as it
copies) and `lookup` (LOOKUP and LOOKUP_SCOPE over the instances of both transfer modules).
`base` is what a module gives the server and is given, `transfer_common` what the two transfer
modules share, `leases` the L1 buffers and pins a worker holds between two one-copy requests.

Each transfer module owns a liveness registry (`dataplane.liveness.registry`); the blend
module's tables and each engine-driven instance's leases have a lock of their own. Every lock a
module takes is a leaf, never held across mapping memory, a copy, a storage call or a call into
another component.
"""
