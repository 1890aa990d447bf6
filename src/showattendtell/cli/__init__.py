"""The `sat` command line: `main` builds the parser; one module a subcommand, each parser torch-
free (`sat serve`: service/serve.py)."""
