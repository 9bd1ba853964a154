"""The runner side: what computes in any process that hosts clients or the server — the runners
(:mod:`~raysim.runner.runners`), the executors that run a client step for a runner's clients
(:mod:`~raysim.runner.executors`, with the vectorised form :mod:`~raysim.runner.vectorized` and the grouped networks
:mod:`~raysim.runner.grouped`), the client-state store, the per-client reports, the divergence and machine-fault
checks, the training footprint and the runner's settings. It imports nothing of the driver side
(:mod:`raysim.engine`: round loops, preparation, callbacks, records); the driver and the backends build on it."""
