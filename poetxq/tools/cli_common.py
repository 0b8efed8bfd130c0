"""What the ``poetxq`` sub-commands share (:mod:`poetxq.tools.cli` for export and validation,
:mod:`poetxq.tools.cli_train` for training, :mod:`poetxq.tools.cli_tools` for ``estimate-memory``,
``bench`` and ``report``), so that none of them imports :mod:`poetxq.tools.cli` back: the startup
checks, the launcher's rank, an early SIGTERM as an exception, and a full disk.

Each check runs before any work and raises one line that the CLI prints as
``poetxq: error: ...`` (exit status 2).
"""

from __future__ import annotations

import argparse
import errno
import os
from pathlib import Path
from typing import NoReturn

from poetxq.paths import nearest_existing, writable_dir
from poetxq.training.recipe import RecipeError

#: bytes an atomic write's temporary name ``.<name>.tmp-<pid>`` adds to ``<name>`` (pid ≤ 7 digits)
TMP_NAME_EXTRA_BYTES = len(".") + len(".tmp-") + 7


class CommandParser(argparse.ArgumentParser):
    """The ``poetxq`` parser and, through ``add_subparsers`` (which makes sub-parsers of its
    own class), every sub-command's: an argument error is one line, ``poetxq COMMAND: error:
    ...`` naming the valid choices of the argument it is about, then a pointer to ``--help``;
    exit status 2. The usage summary argparse prints first is left out (``--help`` shows it)."""

    def error(self, message: str) -> NoReturn:
        """Print the one error line and exit with status 2."""
        text = " ".join(self._with_choices(message).splitlines())
        if "--help" not in text:
            text += f"; see {self.prog} --help"
        self.exit(2, f"{self.prog}: error: {text}\n")

    def _with_choices(self, message: str) -> str:
        """``message`` with the valid values of each argument it names that has a fixed set of
        them and whose values it does not list yet: a missing ``COMMAND`` or ``--format``, a
        ``--bits`` without its value."""
        named = {argparse._get_action_name(a): a for a in self._actions if a.choices}
        named.pop(None, None)
        listed = []
        if message.startswith("argument ") and "choose from" not in message:
            name = message.removeprefix("argument ").split(":", 1)[0]
            listed = [name] if name in named else []
        elif message.startswith("the following arguments are required: "):
            wanted = message.split(": ", 1)[1].split(", ")
            listed = [name for name in wanted if name in named]
        extra = [f"{name}: one of {', '.join(map(str, named[name].choices))}" for name in listed]
        return f"{message} ({'; '.join(extra)})" if extra else message


def check_kernels_env() -> None:
    """Refuse a bad ``POETXQ_KERNELS`` at startup, not at the first kernel call (after the data
    was prepared and the model built).

    Raises:
        RecipeError: the variable is set to an unknown mode; the message names the allowed ones.
    """
    from quant_kernels import default_policy

    try:
        default_policy()
    except ValueError as exc:
        raise RecipeError(f"environment variable {exc}") from None


def check_output_file(path: Path, flag: str, error: type[ValueError]) -> None:
    """Refuse an output file that could not be written, before any work: ``path`` is a
    directory, its nearest existing ancestor is a file or a read-only directory (the
    missing folders between are created when the file is written), or a name in it is longer
    than the filesystem takes (the file's own name with room for the temporary file's).

    Raises:
        error: one line naming the flag, the path and what is wrong with it.
    """
    try:  # first: stat() itself fails on a name the filesystem cannot hold
        name_max = os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError):  # no answer from the filesystem: the common limit
        name_max = 255
    # the atomic write's temporary name ".<name>.tmp-<pid>" is the longest name written
    for i, part in enumerate(path.parts):
        extra = TMP_NAME_EXTRA_BYTES if i == len(path.parts) - 1 else 0
        if len(part.encode()) + extra > name_max:
            raise error(
                f"{flag} '{path}' cannot be written: the name '{part[:40]}...' is "
                f"{len(part.encode())} bytes, over the {name_max - extra} this filesystem takes"
                + (" (with room for the temporary file's)" if extra else "")
                + "; choose a shorter name"
            )
    if path.is_dir():
        raise error(f"{flag} '{path}' is a directory; pass a file path, e.g. {path / 'out.json'}")
    parent = nearest_existing(path.parent)
    if not parent.is_dir():
        raise error(
            f"{flag} '{path}' cannot be written: '{parent}' is a file, not a directory; "
            "choose another path"
        )
    if not writable_dir(parent):
        raise error(
            f"{flag} '{path}' cannot be written: directory '{parent}' is not writable; "
            "choose another path"
        )


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk (or quota) while files were written; safetensors reports
    a failed write as its own error."""
    from safetensors import SafetensorError

    if isinstance(exc, SafetensorError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Terminated(KeyboardInterrupt):
    """SIGTERM before a training loop takes the signal over (:class:`poetxq.training.distributed.
    StopSignals`): while data and model are prepared, which write nothing worth resuming."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def launcher_rank() -> tuple[int, int]:
    """``(rank, world size)`` that ``torchrun`` / ``accelerate launch`` put in the environment,
    ``(0, 1)`` without a launcher (read before any process group exists)."""
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
