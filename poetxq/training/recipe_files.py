"""Recipe files: YAML loading, composition (``base:``, ``by_model:``, ``MODEL:METHOD``
shorthands), ``key=value`` overrides and the one-line errors (:class:`RecipeError`) that name the
file, the key and what is allowed. :func:`load_recipe` returns the validated
:class:`~poetxq.training.recipe.Recipe`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from poetxq.paths import shown
from poetxq.training.recipe import Recipe, RecipeError


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section that ``loc`` (minus its last item) points into."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        cls = field.annotation
        for arg in typing.get_args(cls) or ():
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                cls = arg
    return list(getattr(cls, "model_fields", {}))


def _source_of(key: str, provenance: dict[str, str] | None, default: str) -> str:
    """The file that set ``key`` (or the closest enclosing key) per ``provenance``; for a whole
    section (an error between its keys), every file and override that set keys in it."""
    if not provenance:
        return default
    parts = key.split(".")
    for i in range(len(parts), 0, -1):  # the key itself, then its enclosing sections
        hit = provenance.get(".".join(parts[:i]))
        if hit is not None:
            return hit
    inner = sorted({v for k, v in provenance.items() if k.startswith(key + ".")})
    return ", ".join(inner) if inner else default


def format_validation_error(
    err: ValidationError, source: str, provenance: dict[str, str] | None = None
) -> str:
    """One line per problem: ``<file>: key 'a.b': <message> (allowed keys: ...)``.

    Args:
        err: pydantic's error for a whole recipe tree.
        source: the recipe as the user named it (used when no provenance applies).
        provenance: dotted key -> the file (or override) that set it, from composition.
    """
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if loc:
            src = _source_of(key, provenance, source)
        else:  # a check across keys: the source of the first key its message names, if any
            prov = provenance or {}
            named = [k for k in re.findall(r"\b[a-z_]+\.[a-z_]+\b", e["msg"]) if k in prov]
            src = prov[named[0]] if named else source
        if e["type"] == "extra_forbidden":
            keys = _allowed_keys(Recipe, loc) + (["base", "by_model"] if len(loc) == 1 else [])
            allowed = ", ".join(keys)
            lines.append(f"{src}: unknown key '{key}' (allowed keys here: {allowed})")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if not loc or isinstance(e.get("input"), dict):  # a whole section: do not dump it
                lines.append(f"{src}: {'' if not loc else f'key {key!r}: '}{msg}")
                continue
            got = repr(e.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            lines.append(f"{src}: key '{key}': {msg} (got {got})")
    return "; ".join(lines)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override '{dotted}': '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key.path=value``; the value is read as YAML (``1e-3``, ``true``, ``[a, b]``)."""
    if "=" not in text:
        raise RecipeError(
            f"override '{text}' must look like section.key=value (e.g. train.max_steps=50)"
        )
    key, raw = text.split("=", 1)
    if not key.strip():
        raise RecipeError(f"override '{text}' has no key before '='; write section.key=value")
    if not raw.strip():
        raise RecipeError(
            f"override '{text}' has no value after '='; write section.key=value "
            f"(section.key=null for an empty value)"
        )
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise RecipeError(
            f"override '{text}': value is not valid YAML ({exc.__class__.__name__})"
        ) from None
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    return key.strip(), value


def merge_overrides(flags: dict[str, tuple[str, Any]], sets: Iterable[str]) -> dict[str, Any]:
    """The recipe overrides of a command line: its flags, then its ``--set KEY=VALUE`` texts.

    Args:
        flags: recipe key -> (the flag as typed, e.g. ``"--bits"``, its value), for the flags
            given.
        sets: the ``--set`` texts, in order (a later one of the same key wins).

    Returns:
        dict: recipe key -> value.

    Raises:
        RecipeError: a ``--set`` names a key a flag also sets, with another value (which one
            should win is the user's call, not ours), or a malformed ``--set``.
    """
    out = {key: value for key, (_, value) in flags.items()}
    for text in sets:
        key, value = parse_override(text)
        if key in flags and flags[key][1] != value:
            flag, given = flags[key]
            raise RecipeError(
                f"--set {text} conflicts with {flag} {given} (both set {key}); give only one"
            )
        out[key] = value
    return out


#: reserved top-level keys of a recipe file, consumed by composition (never reach the schema)
BASE_KEY = "base"
BY_MODEL_KEY = "by_model"


def recipes_dir() -> Path:
    """Where ``MODEL:METHOD`` shorthands are looked up: ``$POETXQ_RECIPES`` or the repo's
    ``recipes/`` (next to the ``poetxq`` package in a source checkout)."""
    env = os.environ.get("POETXQ_RECIPES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "recipes"


def _names(folder: Path) -> str:
    found = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    return ", ".join(found) or f"none (no {folder})"


def _shorthand(spec: str) -> list[Path] | None:
    """``llama-60m:poetxq`` -> [recipes/models/llama-60m.yaml, recipes/methods/poetxq.yaml];
    None when ``spec`` is not of that form (or is an existing file)."""
    if ":" not in spec or Path(spec).exists() or "/" in spec or "\\" in spec:
        return None
    model, _, method = spec.partition(":")
    root = recipes_dir()
    paths = [root / "models" / f"{model}.yaml", root / "methods" / f"{method}.yaml"]
    for kind, name, path in (("model", model, paths[0]), ("method", method, paths[1])):
        if not path.is_file():
            raise RecipeError(
                f"recipe '{spec}': unknown {kind} '{name}'; available {kind}s: "
                f"{_names(path.parent)} (MODEL:METHOD, e.g. llama-60m:poetxq)"
            )
    return paths


def _leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, key + ".")
        else:
            yield key


def _merge(tree: dict[str, Any], prov: dict[str, str], other: dict[str, Any], label: str) -> None:
    """Deep-merge ``other`` into ``tree`` (mappings merge, anything else replaces) and record
    ``label`` as the source of every leaf ``other`` sets."""

    def rec(dst: dict[str, Any], src: dict[str, Any], prefix: str) -> None:
        for k, v in src.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                rec(dst[k], v, key + ".")
                continue
            dst[k] = copy.deepcopy(v)
            for old in [p for p in prov if p == key or p.startswith(key + ".")]:
                del prov[old]
            if isinstance(v, dict) and v:
                prov.update({leaf: label for leaf in _leaves(v, key + ".")})
            else:
                prov[key] = label

    rec(tree, other, "")


def _apply_by_model(tree: dict[str, Any], prov: dict[str, str]) -> None:
    """Consume ``by_model``: once the tree has a ``name``, merge ``by_model[name]`` (if any)."""
    table = tree.get(BY_MODEL_KEY)
    if table is None or "name" not in tree:
        return
    label = prov.get(f"{BY_MODEL_KEY}.{tree['name']}") or next(
        (v for k, v in prov.items() if k.startswith(f"{BY_MODEL_KEY}.{tree['name']}.")),
        "by_model",
    )
    del tree[BY_MODEL_KEY]
    for k in [k for k in prov if k == BY_MODEL_KEY or k.startswith(BY_MODEL_KEY + ".")]:
        del prov[k]
    entry = table.get(tree["name"])
    if entry:
        _merge(tree, prov, entry, f"{label} (by_model.{tree['name']})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the
    last one silently, so a recipe would not say what it does)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_mapping(path: Path, included_from: str | None) -> dict[str, Any]:
    where = f" (base of {included_from})" if included_from else ""
    if path.is_dir():
        raise RecipeError(f"recipe path '{path}'{where} is a directory; pass a YAML file")
    if not path.exists():
        shipped = recipes_dir().parent / path
        if not path.is_absolute() and path.parts[:1] == ("recipes",) and shipped.is_file():
            fix = f"the shipped one is '{shipped}' (relative paths start in the current folder)"
        else:
            fix = "pass an existing YAML file"
        raise RecipeError(f"recipe file '{path}'{where} does not exist; {fix}")
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        msg = f"{path}: not valid YAML ({exc.__class__.__name__}: {exc})"
        raise RecipeError(" ".join(msg.split())) from exc
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not UTF-8 text; a recipe is a UTF-8 YAML file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if loaded is None:  # an empty file (or only comments) is a mistake, not "all defaults"
        raise RecipeError(
            f"{path}{where}: the file is empty; a recipe holds at least one section (model, "
            "poet, optim, data, train) or a 'base' to start from"
        )
    if not isinstance(loaded, dict):
        raise RecipeError(
            f"{path}: a recipe must be a mapping of sections, got {type(loaded).__name__}"
        )
    return loaded


def _compose(
    loaded: dict[str, Any], label: str, base_dir: Path, stack: tuple[Path, ...]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve ``base`` (paths relative to ``base_dir``), then ``by_model``, then own keys."""
    own = dict(loaded)
    bases = own.pop(BASE_KEY, None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(
            f"{label}: key 'base' must be a path or a list of paths (relative to the file), "
            f"got {bases!r}"
        )
    by_model = own.get(BY_MODEL_KEY)
    if by_model is not None and not (
        isinstance(by_model, dict) and all(isinstance(v, dict) for v in by_model.values())
    ):
        raise RecipeError(
            f"{label}: key 'by_model' must map model names (e.g. llama-60m) to overrides, "
            f"got {by_model!r}"
        )
    tree: dict[str, Any] = {}
    prov: dict[str, str] = {}
    for b in bases:
        path = (base_dir / b).resolve()
        if path in stack:
            chain = " -> ".join(str(p) for p in (*stack, path))
            raise RecipeError(f"{label}: recipe bases form a cycle ({chain}); remove one 'base'")
        sub, sub_prov = _compose(_read_mapping(path, label), str(path), path.parent, (*stack, path))
        _merge(tree, prov, sub, "")
        prov.update({k: v for k, v in sub_prov.items() if k in set(_leaves(sub))})
    _apply_by_model(tree, prov)
    _merge(tree, prov, own, label)
    return tree, prov


def _shown_value(value: Any) -> str:
    """An override's value as an error names it: as YAML reads it (null, true/false; 1 stays
    1); a long text, or one with a NUL byte or line break, quoted and cut
    (:func:`poetxq.paths.shown`) so the error stays one short line."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, str) and (len(value) > 80 or not value.isprintable()):
        return shown(value)
    return str(value)


def compose_recipe_tree(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, str], str]:
    """The recipe as a plain tree after composition, before validation.

    Composition (documented in README "Recipes"): a file may name ``base:`` files (a path or a
    list, relative to the file); they are deep-merged in order, then the method file's
    ``by_model[<name>]`` overrides for the composed model ``name`` are applied, then the file's own
    keys. ``path`` may also be the shorthand ``MODEL:METHOD`` (``recipes/models/MODEL.yaml`` +
    ``recipes/methods/METHOD.yaml``). Overrides (``{"train.max_steps": 50}``) come last.

    Returns:
        ``(tree, provenance, source)``: the merged mapping, dotted leaf key -> the file or
        override that set it, and the recipe's display name.

    Raises:
        RecipeError: missing file, bad YAML, bad ``base``/``by_model``, unknown shorthand name.
    """
    tree: dict[str, Any] = {}
    prov: dict[str, str] = {}
    source = "default recipe"
    if path is not None:
        source = str(path)
        parts = _shorthand(str(path))
        if parts is not None:
            loaded: dict[str, Any] = {BASE_KEY: [str(p) for p in parts]}
            tree, prov = _compose(loaded, source, Path.cwd(), ())
        else:
            p = Path(path)
            tree, prov = _compose(_read_mapping(p, None), str(p), p.parent, (p.resolve(),))
    if BY_MODEL_KEY in tree:  # never met a model name: not applicable
        del tree[BY_MODEL_KEY]
        for k in [k for k in prov if k == BY_MODEL_KEY or k.startswith(BY_MODEL_KEY + ".")]:
            del prov[k]
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)  # an explicit None (``--set key=``) sets null
        prov[key] = f"override {key}={_shown_value(value)}"
    return tree, prov, source


def load_recipe(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    labels: dict[str, str] | None = None,
) -> Recipe:
    """Load a recipe (file, ``MODEL:METHOD`` shorthand, or the embedded default when ``path`` is
    None), compose its ``base`` files and apply overrides.

    Args:
        path: YAML file (read with ``yaml.safe_load``), ``MODEL:METHOD``, or None.
        overrides: ``{"train.max_steps": 50, ...}``; a ``None`` value sets the key to null.
        labels: how an error names the override of a key, e.g. ``{"train.max_steps":
            "--max-steps 0"}`` for one a command-line flag set (default ``override KEY=VALUE``).

    Returns:
        The validated :class:`Recipe`; its :attr:`~Recipe.overridden` names the keys of
        ``overrides``.

    Raises:
        RecipeError: missing/unreadable file, bad YAML, unknown key or invalid value (one line,
            naming the file that set the offending key).
    """
    for key in overrides or {}:
        if key.split(".")[0] in ("base", "by_model"):
            raise RecipeError(
                f"override {key}: 'base' and 'by_model' compose recipe files and are read from a "
                "file only; write them in a recipe YAML and pass it with --recipe"
            )
    tree, prov, source = compose_recipe_tree(path, overrides)
    prov.update({k: v for k, v in (labels or {}).items() if k in (overrides or {})})
    try:
        recipe = Recipe.model_validate(tree)
        recipe.mark_overridden(set(overrides or {}))  # a memory plan says which it kept
        return recipe
    except ValidationError as exc:
        if overrides and not set(overrides) <= set(labels or {}):
            source += " (with overrides " + ", ".join(
                f"{k}={_shown_value(v)}" for k, v in overrides.items()
            )
            source += ")"
        raise RecipeError(format_validation_error(exc, source, prov)) from None
