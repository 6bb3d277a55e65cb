"""The server: its loop, its settings, and the assembly of a running data plane.

`loop` owns the ROUTER socket on the ``kvwarden-loop`` thread and the NORMAL
(``kvwarden-normal``) and transfer (``kvwarden-transfer``) pools; `config` is every setting;
`runtime` builds the data plane from them and is its one read facade (`DataPlane`), typed by
the Protocol in `facade`, which is all the HTTP sidecar sees.
"""
