"""warmboot: an LLM inference server for GPUs that are started and stopped on demand."""

from warmboot.engine.llm import LLM
from warmboot.outputs import CompletionOutput, Logprob, RequestOutput
from warmboot.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
