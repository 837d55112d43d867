"""Running one model over several processes, devices and nodes, on torch.distributed.

``placement``      where this launcher sits: nodes, node rank, the rendezvous address (weft.toml or torchrun's variables);
                   torch-free
``rendezvous``     the store every rank meets at and the engine's step channel addresses published in it
``state``          this process's parallel groups: tensor-parallel collectives, pipeline sends, the token broadcast
``messages``       what the engine core and worker processes say to each other
``worker_process`` the main function of a worker process (``mp`` executor, and the launcher of every other node)
``node``           the launcher of a node other than node 0: starts its workers and watches them
"""
