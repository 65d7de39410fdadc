"""The torch-free core: the request object, the block manager, the scheduler, output
processing, and the hand-off types the device side consumes and produces (``types``).
A leaf: it imports nothing of warmboot's but the top-level configs, sampling params,
outputs and the tokenizer, and never torch."""
