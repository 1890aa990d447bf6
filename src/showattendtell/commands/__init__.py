"""One module per `sat` subcommand, each with ``add_parser(sub)`` (its top level imports no
torch, so `sat --help` is fast): caption, evaluate, data, train (and features), export, models.
`sat serve` lives with the web service (showattendtell.service.serve)."""
