"""weft-hisparse: host-resident sparse decode.

The compressed KV of long requests lives in a pinned host pool; the GPU pages are a write-back
cache over it, and each decode step copies in only the entries the indexer selected.

``connector``    the KV connector (both roles): planner, lent blocks, host pool, sparse reads
``pages``        the scheduler-side page states (dirty, clean, unpinned), spill planning, worker
                 acknowledgements, the durable prefix, and the (eager) resolver of selected entries
``graph_reader`` what captured decode graphs read host entries through: a static page table and a
                 hot buffer on the device, whose LRU runs there
``read_kernel``  the Triton kernel ending a graph's read on CUDA: only the misses load from the host pool
``topk``         speculative (multi-token) decode: logical top-k per step into a strided per-step slice
"""
