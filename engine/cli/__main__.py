"""``python -m engine.cli``: the command line without the window's launcher."""

import sys

from engine.cli.main import main

sys.exit(main())
