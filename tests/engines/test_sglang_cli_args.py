"""SGLang's own flags after ``--`` (parsed by a parser built like SGLang's ``add_cli_args``)."""

from __future__ import annotations

import argparse

import pytest

from actors.serving.engines import server_args_from_cli


def _add_cli_args(parser: argparse.ArgumentParser) -> None:
    # The shapes SGLang's ServerArgs.add_cli_args uses: a required path, typed values with
    # defaults, store_true switches and choices.
    parser.add_argument("--model-path", "--model", type=str, required=True)
    parser.add_argument("--tp-size", "--tp", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--attention-backend", choices=["triton", "fa3"], default=None)


def test_only_the_flags_written_become_server_args() -> None:
    args = server_args_from_cli(
        ["--model-path", "/m", "--tp", "2", "--disable-cuda-graph"], _add_cli_args
    )
    assert args == {"model_path": "/m", "tp_size": 2, "disable_cuda_graph": True}
    assert server_args_from_cli(["--mem-fraction-static=0.5"], _add_cli_args) == {
        "mem_fraction_static": 0.5
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-such-flag", "1"], "does not know"),
        (["--tp", "two"], "invalid int"),
        (["--attention-backend", "magic"], "invalid choice"),
        (["--model-pa", "/m"], "does not know"),  # no abbreviations: what is written is meant
    ],
)
def test_bad_flags_are_refused_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        server_args_from_cli(argv, _add_cli_args)
