"""The device side: the model runner and what it owns (request slots, the step inputs and
their ping-pong staging sets with the one upload helper, device streams, CUDA graphs, the
sampler and per-request sampling state) and structured outputs (``grammar_requests`` per
request; on xgrammar, ``grammar_limits`` and ``grammar_compiles`` before a request is queued,
``grammar_backend`` and ``grammar_bitmask`` per step). It consumes and produces
``warmboot.core.types``."""
