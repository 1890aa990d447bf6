"""`python -m showattendtell.cli` runs `sat`."""

import sys

from showattendtell.cli.main import main

sys.exit(main())
