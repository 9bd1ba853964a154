"""The engine: validation and preparation, the round loop, result rows, callbacks, the client and server runners,
the client-state store, divergence handling, the vectorised executor and cost placement. Ray-free: the backends
(``raysim.backends``) run the runners in this process or in Ray actors."""
