"""`mixlens families`: the model families mixlens reads, their layouts and the methods each runs or refuses."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    app.command("families")(list_families)


def list_families(
    as_json: bool = typer.Option(False, "--json", help="Print the catalog as JSON."),
) -> None:
    """List every model family: its model types, its layout and which methods run or refuse on it (and why; a
    method that reads a model head also needs that head). A model type not listed is tried against these layouts
    (`--family NAME` forces one)."""
    from mixlens.catalog import family_lines, load_families

    catalog = load_families()
    print(json.dumps(catalog, indent=1, ensure_ascii=False) if as_json else "\n".join(family_lines(catalog)))
