"""`python -m h2o_chat.bench SUBCOMMAND`: see cli.py."""

from .cli import main

main()
