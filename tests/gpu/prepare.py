"""Prepare what the GPU host needs beside the SGLang bundle, in one folder to carry
(``python -m tests.gpu.prepare [DEST]``, default ``.gpucarry``; run here, with network).

- ``model/``: SmolLM2-135M-Instruct's config (bfloat16) and tokenizer, no weights: SGLang's
  dummy weights stand in. The tokenizer travels xz-compressed (carry budget); run.sh unpacks it.
- ``wheels/``: actorserve's dependencies that the GPU image lacks and the bundle does not have.
"""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

from actors.serving.engines import find_smollm2

__all__ = ["WHEELS", "main"]

# On the image: attrs, psutil, rich, typer, numpy, prometheus-client, xxhash, httpx, pytest.
# In the SGLang bundle: msgspec, pyzmq, uvicorn, fastapi, pydantic, openai, sniffio.
WHEELS = (
    *("anyio>=4.6", "cattrs>=24.1", "structlog>=24.1", "httptools>=0.6"),
    *("hypercorn>=0.17", "h2", "hpack", "hyperframe", "priority", "wsproto"),
    # SGLang's own launch_server (the benchmark's baseline) imports these.
    *("jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "python-multipart"),
)
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
_MODEL_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main(dest: Path) -> None:
    source = find_smollm2(None).folder
    model = dest / "model"
    model.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.pop("_model_name_or_path", None)
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config, indent=1))
    for name in _MODEL_FILES:
        shutil.copy(source / name, model / name)
    (model / "tokenizer.json.xz").write_bytes(
        lzma.compress((source / "tokenizer.json").read_bytes(), preset=9)
    )
    wheels = dest / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    platforms = [arg for p in _PLATFORMS for arg in ("--platform", p)]
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    target = ["--python-version", "3.12", "--implementation", "cp", *platforms]
    subprocess.run([*pip, *target, "-d", str(wheels), *WHEELS], check=True)
    print(f"prepared {dest}: model/ (config and tokenizer, no weights), wheels/")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpucarry"))
