"""weft-nixl: push-model prefill/decode disaggregation on NVIDIA's NIXL.

``connector`` holds the KV connector (both roles), ``transfer`` the NIXL agent
and the KV-cache layout it writes, ``side_channel`` the messages a decode
instance and a prefill instance exchange over ZMQ (the handshake, registrations
of the blocks to write, failure notices), ``routes`` the ``GET /kv_transfer``
route a P/D proxy reads this instance's side-channel address from. Importing
this package imports neither torch nor NIXL.
"""
