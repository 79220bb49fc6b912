"""Prepare what the GPU host needs beside the SGLang bundle, in one folder to carry
(``python -m tests.gpu.prepare [DEST [BUNDLE]]``, defaults ``.gpucarry`` and ``.sglbundle``; run
here, with network).

- ``model/``: SmolLM2-135M-Instruct's config (bfloat16) and tokenizer, no weights: SGLang's
  dummy weights stand in. The tokenizer travels xz-compressed (carry budget); run.sh unpacks it.
- ``wheels/``: actorserve's dependencies that the GPU image lacks and the bundle does not have.

It also trims the bundle's nixl tarball to what SGLang's KV transfer loads (the UCX plugin and
the libraries it needs), and the memory saver's wheel to the image's CUDA, so that the bundle,
this folder and the checkout fit one call's carry.
"""

from __future__ import annotations

import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from actors.serving.engines import find_smollm2

__all__ = ["WHEELS", "main", "trim_memory_saver", "trim_nixl"]

# On the image: attrs, psutil, rich, typer, numpy, prometheus-client, xxhash, httpx, pytest,
# pytest-xdist.
# In the SGLang bundle: msgspec, pyzmq, uvicorn, fastapi, pydantic, openai, sniffio.
WHEELS = (
    *("anyio>=4.6", "cattrs>=24.1", "structlog>=24.1", "httptools>=0.6"),
    *("hypercorn>=0.17", "h2", "hpack", "hyperframe", "priority", "wsproto"),
    # SGLang's own launch_server (the benchmark's baseline) imports these.
    *("jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "python-multipart"),
    # SGLang's memory saver (release/resume of weights and KV cache).
    "torch-memory-saver>=0.0.9.post1",
    # The grammar engines' (imported by every engine module).
    "llguidance",
)
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
_MODEL_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")
#: What SGLang's NIXL transfer never loads: every plugin but UCX (with the storage and cloud
#: libraries only those plugins link), and UCX's perftest modules.
_NIXL_UNUSED = re.compile(
    r"(^|/)(nixl_cu13\.libs/nixl|\.nixl_cu13\.mesonpy\.libs/plugins)/(?!libplugin_UCX\.so$)"
    r"|/ucx/libucx_perftest"
    r"|nixl_cu13\.libs/lib(aws-cpp-sdk-s3|azure-|xml2-|aio-|pull-|gusli_clnt-|uring-)"
)


#: The memory saver's builds for other runtimes than the GPU image's (torch +cu130 loads the
#: ``_cu13`` ones).
_SAVER_UNUSED = re.compile(r"^torch_memory_saver_hook_mode_\w+?(?<!_cu13)\.abi3\.so$")


def trim_memory_saver(wheels: Path) -> None:
    """Drop :data:`_SAVER_UNUSED` from the torch-memory-saver wheel, in place (idempotent)."""
    for wheel in wheels.glob("torch_memory_saver-*.whl"):
        trimmed = wheel.with_suffix(".trimmed")
        with (
            zipfile.ZipFile(wheel) as src,
            zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as out,
        ):
            for item in src.infolist():
                if not _SAVER_UNUSED.match(item.filename):
                    out.writestr(item, src.read(item))
        trimmed.replace(wheel)


def trim_nixl(tarball: Path) -> None:
    """Drop what :data:`_NIXL_UNUSED` names from the nixl tarball, in place (idempotent)."""
    trimmed = tarball.with_suffix(".trimmed")
    with tarfile.open(tarball, "r:xz") as src, tarfile.open(trimmed, "w:xz", preset=9) as out:
        for member in src:
            if _NIXL_UNUSED.search(member.name):
                continue
            out.addfile(member, src.extractfile(member) if member.isfile() else None)
    trimmed.replace(tarball)


def main(dest: Path, bundle: Path) -> None:
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
    trim_memory_saver(wheels)
    nixl = bundle / "nixl-site.tar.xz"
    if nixl.exists():
        trim_nixl(nixl)
    print(f"prepared {dest}: model/ (config and tokenizer, no weights), wheels/; trimmed {nixl}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0] if args else ".gpucarry"), Path(args[1] if len(args) > 1 else ".sglbundle"))
