"""nanoserve: a compact LLM inference server with a two-tier prefix cache."""
from nanoserve.config import EngineConfig
from nanoserve.llm import LLM
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import InvalidRequest, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "InvalidRequest"]
