"""weft-ray: Weft's Ray executor.

``executor``  :class:`RayExecutor` (``engine.distributed_executor_backend = "ray"``): one Ray actor per
              device, placed with a placement group (one bundle per device), on a local or existing cluster
"""
