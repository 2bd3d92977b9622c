"""`python -m h2o_chat.bench SUBCOMMAND`."""

from . import main

main()
