"""weft-mooncake: a KV connector that keeps full prefix blocks in Mooncake's distributed store.

``connector`` holds the connector (both roles), ``store`` the Mooncake client with
its outage handling, ``local`` a master and storage node on loopback ports for
tests, benchmarks and trying it out. Importing this package imports neither
torch nor Mooncake.
"""
