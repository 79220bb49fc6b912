"""SGLang's own command-line flags, parsed by SGLang's parser (``actorserve run ... -- FLAGS``).

Only the flags the operator wrote become server args: SGLang's defaults stay SGLang's to apply,
and the backend's forced settings are not overwritten by a default the operator never chose.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["server_args_from_cli"]


def _sglang_add_cli_args() -> Callable[[argparse.ArgumentParser], None]:
    from sglang.srt.server_args import ServerArgs

    add: Callable[[argparse.ArgumentParser], None] = ServerArgs.add_cli_args
    return add


def server_args_from_cli(
    argv: Sequence[str],
    add_cli_args: Callable[[argparse.ArgumentParser], None] | None = None,
) -> dict[str, Any]:
    """SGLang server args from SGLang flags as SGLang spells them (``--model-path M --tp 1``).

    ``add_cli_args`` is ``ServerArgs.add_cli_args`` (imported from SGLang when not given). A flag
    SGLang does not know, or a bad value, raises ``ValueError`` with argparse's message.
    """
    parser = argparse.ArgumentParser(
        prog="actorserve run ... --", add_help=False, allow_abbrev=False, exit_on_error=False
    )
    (add_cli_args or _sglang_add_cli_args())(parser)
    # Required flags (--model-path) may come from the config file instead.
    for action in parser._actions:
        action.required = False
    try:
        namespace, extra = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ValueError(f"SGLang flag: {exc}") from None
    if extra:
        raise ValueError(f"flags SGLang does not know: {' '.join(extra)}")
    given: dict[str, Any] = {}
    for action in parser._actions:
        if any(_written(option, argv) for option in action.option_strings):
            given[action.dest] = getattr(namespace, action.dest)
    return given


def _written(option: str, argv: Sequence[str]) -> bool:
    return any(arg == option or arg.startswith(option + "=") for arg in argv)
