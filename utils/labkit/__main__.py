"""`python -m labkit COMMAND ...`: the same as the `labkit` command."""
import sys

from labkit.tools.cli import main

sys.exit(main())
