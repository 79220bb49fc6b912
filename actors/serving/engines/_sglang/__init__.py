"""The ``sglang`` backend: ``sglang.Engine`` (in-process) behind the engine contract, and
``SGLangImageEngine`` on SGLang's diffusion generator for image models."""

from actors.serving.engines._sglang._cli_args import server_args_from_cli
from actors.serving.engines._sglang._diffusion import SGLangImageEngine
from actors.serving.engines._sglang._engine import SGLangEngine, SGLangRequiresAsyncio
from actors.serving.engines._sglang._metrics import SGLangMetricsReader

__all__ = [
    "SGLangEngine",
    "SGLangImageEngine",
    "SGLangMetricsReader",
    "SGLangRequiresAsyncio",
    "server_args_from_cli",
]
