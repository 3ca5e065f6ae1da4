"""A pydantic settings model as a command line: its flags, its help, and its argv.

A verb's settings are written once, as fields of a model: the field's type gives the
flag's parser and its choices, its default the flag's default, its docstring the help.
``add_flags`` puts them on an ``argparse`` parser, each value checked as it is parsed (a
bad one is a usage error naming the flag); ``from_flags`` builds the model from the
parsed values, and its cross-field checks become a ``FlagError`` naming the flag.
``to_argv`` writes a model back as the flags a child process parses into the same model.

A field takes a ``Flag`` in its ``Annotated`` metadata to name its flag differently
from its field, to join a help group, or to be no flag at all (``NOT_A_FLAG``).
"""

from __future__ import annotations

import argparse
import enum
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)

__all__ = ["NOT_A_FLAG", "Flag", "FlagError", "add_flags", "flag_name", "from_flags", "to_argv"]


@dataclass(frozen=True, slots=True)
class Flag:
    """How one field of a settings model appears on the command line."""

    name: str | None = None
    """The flag (``--seal-grace``); None: the field's name, dashed (``--max-tokens``)."""
    metavar: str | None = None
    group: str | None = None
    """The help section it is listed under; None: the parser's own options."""
    positional: bool = False
    choices: Sequence[str] | None = None
    """For a ``str`` field whose values are named elsewhere; a ``Literal`` or ``Enum`` says its own."""
    parse: Callable[[str], Any] | None = None
    """Reads the text into the field's value when that is more than a conversion (a file's contents)."""
    cli: bool = True


NOT_A_FLAG = Flag(cli=False)
"""A setting the command line does not carry (built from other flags, or given in code)."""


class FlagError(ValueError):
    """Settings that do not go together; the message names the flags."""


def _flag(info: FieldInfo) -> Flag:
    return next((item for item in info.metadata if isinstance(item, Flag)), Flag())


def _flag_fields(model: type[BaseModel]) -> Iterable[tuple[str, FieldInfo, Flag]]:
    for name, info in model.model_fields.items():
        flag = _flag(info)
        if flag.cli:
            yield name, info, flag


def flag_name(model: type[BaseModel], field: str) -> str:
    """The command-line name of ``field``: its flag, or its own name for a positional."""
    flag = _flag(model.model_fields[field])
    if flag.positional:
        return field
    return flag.name or "--" + field.replace("_", "-")


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        kept = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(kept) == 1:
            return kept[0]
    return annotation


def _choices(annotation: Any, flag: Flag) -> list[Any] | None:
    if flag.choices is not None:
        return list(flag.choices)
    inner = _without_none(annotation)
    if get_origin(inner) is Literal:
        return list(get_args(inner))
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return list(inner)
    return None


def _item_type(annotation: Any) -> Any | None:
    """The item type of a list field (a flag given once per item), else None."""
    inner = _without_none(annotation)
    if get_origin(inner) is list and get_args(inner):
        return get_args(inner)[0]
    return None


def _converter(annotation: Any, info: FieldInfo, flag: Flag) -> Callable[[str], Any]:
    """Parses one value of the flag as the field's type with the field's own constraints,
    so a bad value is refused by ``argparse`` (exit 2) with the constraint's words."""
    constraints = [item for item in info.metadata if not isinstance(item, Flag)]
    adapter: TypeAdapter[Any] = TypeAdapter(
        Annotated[annotation, *constraints] if constraints else annotation
    )

    def convert(text: str) -> Any:
        try:
            return adapter.validate_python(flag.parse(text) if flag.parse is not None else text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(
                "; ".join(str(error["msg"]).removeprefix("Value error, ") for error in exc.errors())
            ) from None
        except (ValueError, OSError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _help(info: FieldInfo, default: Any) -> str | None:
    text = (info.description or "").replace("%", "%%").strip()
    if default is not None and default is not False and "default" not in text:
        shown = default.value if isinstance(default, enum.Enum) else default
        text = f"{text} (default: {shown})".strip()
    return " ".join(text.split()) or None


def add_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], *, groups: Iterable[str | None] | None = None
) -> None:
    """The model's fields as ``parser``'s arguments (only those of ``groups``, if given)."""
    wanted = None if groups is None else set(groups)
    sections: dict[str, Any] = {}
    for name, info, flag in _flag_fields(model):
        if wanted is not None and flag.group not in wanted:
            continue
        target: Any = parser
        if flag.group is not None:
            if flag.group not in sections:
                sections[flag.group] = parser.add_argument_group(flag.group)
            target = sections[flag.group]
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        options: dict[str, Any] = {"help": _help(info, default)}
        item = _item_type(info.annotation)
        choices = _choices(info.annotation, flag)
        if flag.positional:
            target.add_argument(
                name,
                type=_converter(info.annotation, info, flag),
                choices=choices,
                metavar=flag.metavar,
                **options,
            )
            continue
        options |= {"dest": name, "default": default, "required": info.is_required()}
        if flag.metavar is not None or _without_none(info.annotation) is not bool:
            options["metavar"] = (
                flag.metavar or flag_name(model, name).removeprefix("--").replace("-", "_").upper()
            )
        if _without_none(info.annotation) is bool:
            action = "store_true" if not default else argparse.BooleanOptionalAction
            target.add_argument(flag_name(model, name), action=action, **options)
            continue
        if item is not None:
            options |= {"action": "append", "type": _converter(item, FieldInfo(), flag)}
        else:
            options["type"] = _converter(info.annotation, info, flag)
            if choices is not None:
                options |= {"choices": choices, "metavar": flag.metavar}
        target.add_argument(flag_name(model, name), **options)


def from_flags(model: type[M], args: argparse.Namespace, **given: Any) -> M:
    """The model from parsed flags (those ``add_flags`` added) and ``given`` settings that
    are no flags. Raises ``FlagError`` naming the flag of every refused value."""
    values = {name: getattr(args, name) for name, _, _ in _flag_fields(model) if hasattr(args, name)}
    try:
        return model(**(values | given))
    except ValidationError as exc:
        raise FlagError(_explain(model, exc)) from None


def _explain(model: type[BaseModel], exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        field = error["loc"][0] if error["loc"] else None
        if isinstance(field, str) and field in model.model_fields:
            message = f"{flag_name(model, field)}: {message}"
        else:  # a check across fields: it names the field first (``name: ...``)
            named, _, rest = message.partition(": ")
            if rest and named in model.model_fields:
                message = f"{flag_name(model, named)}: {rest}"
        lines.append(message)
    return "; ".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def to_argv(settings: BaseModel) -> list[str]:
    """The flags that parse back into ``settings``: positionals first, then every flag
    whose value is not its default (a default goes unsaid)."""
    model = type(settings)
    positional: list[str] = []
    argv: list[str] = []
    for name, info, flag in _flag_fields(model):
        value = getattr(settings, name)
        if flag.positional:
            positional.append(_text(value))
            continue
        if value == info.get_default(call_default_factory=True):
            continue
        option = flag_name(model, name)
        if value is None or flag.parse is not None:  # a file's contents cannot be said as its name
            raise ValueError(f"{option}: {value!r} cannot be written as a command line")
        if isinstance(value, bool):
            argv.append(option if value else "--no-" + option.removeprefix("--"))
        elif _item_type(info.annotation) is not None:
            for item in value:
                argv += [option, _text(item)]
        else:
            argv += [option, _text(value)]
    return positional + argv
