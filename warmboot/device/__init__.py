"""The device side: the model runner and what it owns (request slots, the step inputs and
their ping-pong staging sets with the one upload helper, device streams, CUDA graphs, the
sampler) and structured outputs (``grammar_requests`` per request, ``grammar_backend`` on
xgrammar). It consumes and produces ``warmboot.core.types``."""
