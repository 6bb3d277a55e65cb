"""The wire: what crosses the ZMQ socket, and nothing else.

`messages` declares every payload once as a typed record (its checks in its annotations);
`protocol` frames requests and replies (msgpack, versioned, size-bounded); `checks` holds the
field checks; `errors` the exception tree and the error codes of error replies. No threads, no
locks, no state: both the server and `dataplane.client` build on it.
"""
