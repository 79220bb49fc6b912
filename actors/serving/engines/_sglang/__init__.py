"""The ``sglang`` backend: ``sglang.Engine`` (in-process) behind the engine contract."""

from actors.serving.engines._sglang._engine import SGLangEngine, SGLangRequiresAsyncio
from actors.serving.engines._sglang._metrics import SGLangMetricsReader

__all__ = ["SGLangEngine", "SGLangMetricsReader", "SGLangRequiresAsyncio"]
