"""CLI commands, one module per command family, each exposing `register(app)` (listed in `mixlens.cli`).

`options` (shared options and input handling) and `output` (tables, progress) are helpers, not commands.
Command modules import only typer and the standard library at module level, so `--help` stays cheap.
"""
