"""``python -m poetxq`` runs the ``poetxq`` command."""

import sys

from poetxq.tools.console import run

sys.exit(run())
