"""The ``poetxq`` console script: :func:`run` imports the command line (torch, transformers:
seconds) inside its own handler, so a Ctrl-C during those imports is the same one line and exit
status 130 as one a moment later, not a traceback through torch's import."""

from __future__ import annotations

import sys


def run() -> int:
    """Import :mod:`poetxq.tools.cli` and run its :func:`~poetxq.tools.cli.main` on ``sys.argv``.

    Returns:
        The exit status: ``main``'s, or 130 when interrupted while importing.
    """
    try:
        from poetxq.tools.cli import main
    except KeyboardInterrupt:
        print("poetxq: interrupted", file=sys.stderr)
        return 130
    return main()
