"""``inference-workbench`` on the command line: one module per family of subcommands.

``main.py`` parses and dispatches (bench, compare, sweep, estimate, hardware, models),
``serve.py`` serves a model and drives load against a server, ``quality.py`` measures perplexity,
``text.py`` words the results for a terminal. The window imports none of this: what both need
(sizes and units, how a served answer was counted) lives in the layer they share.
"""

from engine.cli.main import build_parser, command_lines, main

__all__ = ["build_parser", "command_lines", "main"]
