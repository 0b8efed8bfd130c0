"""``python -m poetxq`` runs the ``poetxq`` command."""

import sys

from poetxq.tools.cli import main

sys.exit(main())
