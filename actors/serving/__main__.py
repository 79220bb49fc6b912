"""``python -m actors.serving``: the ``actorserve`` command without its console script."""

from actors.serving.cli import main

main()
