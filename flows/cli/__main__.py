"""`python -m rlstages.flows.cli`: the `rlstages` command."""

from rlstages.flows.cli.main import main

main()
