"""``python -m supervisors._cli_main``: the ``actorserve`` command without its console script."""

from supervisors._cli import main

main()
