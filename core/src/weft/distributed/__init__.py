"""Running one model over several processes, devices and nodes, on torch.distributed.

``placement``      where this launcher sits: nodes, node rank, the rendezvous address (weft.toml or
                   torchrun's variables); torch-free
``rendezvous``     the store every rank meets at and the engine's step channel addresses published in it
``state``          this process's parallel groups: tensor-parallel collectives, pipeline sends, the token broadcast
``messages``       what the engine core and worker processes say to each other
``workers``        what the executors that start worker processes share (layout checks, exit causes)

The processes that run the model live above this package, since they build the runner that
imports it: a worker process's main function is :mod:`weft.runner.worker_process`, the launcher
of a node other than node 0 is :mod:`weft.entrypoints.node`.
"""
