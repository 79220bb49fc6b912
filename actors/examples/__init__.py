"""Small programs that embed a supervision tree in an ordinary application.

``python -m actors.examples.embed_asyncio`` and ``python -m actors.examples.embed_trio``.
"""
