"""The pydantic bases of the recipe sections (:mod:`poetxq.training.recipe`,
:mod:`poetxq.model.config`, :class:`poetxq.data.DataConfig`).

On top of pydantic's checks it refuses three inputs that pydantic's lax mode lets through: a
boolean for an integer or float field (``max_steps: true`` would become 1, since ``bool``
subclasses ``int``), anything but ``true`` / ``false`` for a boolean field (lax mode reads
``"yes"``, ``"on"``, ``1`` or ``"0"`` as booleans), and a non-finite float (``inf`` / ``nan``: no
learning rate, decay or epsilon means anything infinite). The error names the key like every other
schema error.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from poetxq.paths import path_problem


def _number_kind(annotation: Any) -> str | None:
    """``"integer"`` / ``"number"`` when ``annotation`` holds int / float (and not bool), else
    None; looks inside ``X | None``, ``tuple[...]`` and ``list[...]``."""
    if annotation is bool or annotation is Any:
        return None
    if annotation is int:
        return "integer"
    if annotation is float:
        return "number"
    if typing.get_origin(annotation) is typing.Literal:
        return None
    args = typing.get_args(annotation)
    if bool in args:
        return None
    kinds = {_number_kind(a) for a in args} - {None}
    return "number" if "number" in kinds else kinds.pop() if kinds else None


def _bool_field(annotation: Any) -> tuple[bool, tuple[Any, ...]]:
    """Whether ``annotation`` is a boolean field (``bool``, ``bool | None``, ``bool |
    Literal[...]``), and the other values it allows (``None``, the literals)."""
    if annotation is bool:
        return True, ()
    args = typing.get_args(annotation)
    if bool not in args:
        return False, ()
    others: list[Any] = []
    for a in args:
        if a is type(None):
            others.append(None)
        elif typing.get_origin(a) is typing.Literal:
            others.extend(typing.get_args(a))
    return True, tuple(others)


def check_path_key(value: str | None) -> None:
    """The one check of every recipe key that names a path (``train.output_dir``,
    ``data.source``, ``data.tokenizer``, ``data.cache_dir``, ``model.pretrained``; each is
    relative to the working directory, not to the recipe file), called by the sections' field
    validators; None (unset) passes.

    Raises:
        ValueError: the path is empty, holds a NUL or control character, or is longer than a
            file system takes (:func:`poetxq.paths.path_problem`); the schema error names the key.
    """
    if value is not None and (problem := path_problem(value)) is not None:
        raise ValueError(
            f"the path {problem}; give a file or folder path (relative to the working directory)"
        )


class StrictSection(BaseModel):
    """Unknown keys, booleans given for numbers, and ``inf`` / ``nan`` are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        items = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(v, bool) for v in items) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            kind = _number_kind(field.annotation) if field is not None else None
            if kind is not None:
                what = "an integer" if kind == "integer" else "a number"
                raise ValueError(f"Input should be {what}, not a boolean (true/false)")
        field = cls.model_fields.get(info.field_name) if info.field_name is not None else None
        is_bool, others = _bool_field(field.annotation) if field is not None else (False, ())
        if is_bool and not isinstance(value, bool) and value not in others:
            also = "".join(f" or {o!r}" for o in others if o is not None)
            raise ValueError(f"Input should be true or false{also}")
        return value


class Section(StrictSection):
    """A recipe section whose assignments are validated too (the recipe's own checks adjust
    some keys after parsing, e.g. ``poet.bits`` for ``method: poetx``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)
