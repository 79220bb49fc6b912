"""The mock engine's implementation (private; the public names live in
``actors.serving.engines``)."""
