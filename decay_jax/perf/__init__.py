"""Performance tools over the trainer's own step (``train.setup``): lowering for other platforms
(``export``), ahead-of-time memory reports (``memory``) and profile tables (``trace_table``). The
commands ``cli.lower``, ``cli.memory``, ``cli.bench`` and ``cli.trace_table`` use them."""
