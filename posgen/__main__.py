"""``python -m posgen`` runs the CLI."""

from posgen.cli import main

main()
