"""nanoserve: a compact LLM inference server with a two-tier prefix cache."""
from typing import TYPE_CHECKING, Any

from nanoserve.config import EngineConfig
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from nanoserve.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "InvalidRequest"]


def __getattr__(name: str) -> Any:
    # LLM brings the whole engine (torch, the model code): the API process imports this package
    # but runs no model, so it stays torch-free
    # (tests/test_structured_server.py::test_api_process_runs_without_torch)
    if name == "LLM":
        from nanoserve.llm import LLM
        return LLM
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
