"""``python -m poetxq`` runs the ``poetxq`` command."""

import sys

from poetxq.cli import main

sys.exit(main())
