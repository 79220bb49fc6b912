"""``actorserve run --backend sglang`` as a user starts it: SGLang's own flags after ``--``, the
model's tokenizer by flag, one request through the `openai` client, then SIGTERM: exit 0 and
nothing left on the GPU (checked by the module's leak check)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai

from actors.lowlevel import free_port
from tests.gpu.conftest import MODEL, gpu_processes


def test_run_with_sglang_flags_serves_then_stops_cleanly() -> None:
    port = free_port()
    args = [sys.executable, "-m", "actors.serving", "run", "--backend", "sglang"]
    args += ["--mode", "aggregated", "--decode-workers", "1", "--port", str(port)]
    args += ["--loop", "asyncio", "--tokenizer", str(MODEL), "--router", "round_robin"]
    args += ["--", "--model-path", str(MODEL), "--load-format", "dummy"]
    args += ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
    args += ["--grammar-backend", "none", "--disable-cuda-graph"]
    args += ["--mem-fraction-static", "0.3", "--page-size", "16"]
    root = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and root.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ready":
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(1)
        assert root.poll() is None, root.communicate()[0]
        assert gpu_processes(), "the engine holds GPU memory while it serves"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        model = client.models.list().data[0].id
        assert model == str(MODEL)  # SGLang's --model-path names the served model
        answer = client.completions.create(model=model, prompt="Hi", max_tokens=8, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        root.send_signal(signal.SIGTERM)
        output, _ = root.communicate(timeout=120)
        assert root.returncode == 0, output
        assert "stopped cleanly" in output
    finally:
        if root.poll() is None:
            root.kill()
            root.communicate()
