"""Sub-command settings as dataclasses: their flags, `--config FILE.yaml`, and the command line that gives them back.

A settings class is a dataclass whose fields are the flags of a sub-command (`dflash-hf bench`, `make-data`), with
TRL's field conventions: `metadata={"help": ..., "choices": ...}`, plus argparse's `type`, `nargs`, `action` and
`metavar` where a flag needs them. A field `max_new_tokens` is the flag `--max-new-tokens`; a `bool` field is a switch
(`--name` when it defaults to `False`, `--no-name` when it defaults to `True`); a field without a default is a
required flag.

    >>> add_settings(subparsers.add_parser("bench"), BenchSettings)   # the flags and --config
    >>> settings = settings_of(args, BenchSettings)                    # the parsed namespace as settings
    >>> command_line("bench", settings)                                # the flags that give these settings back

`--config FILE.yaml` reads a mapping of field names to values (`num_prompts: 20`, `block_sizes: [4, 8]`); it is read
as the flags it stands for, given before the command line's own, so the command line overrides the file (a
repeatable flag adds to the file's). The sub-command parsers of `dflash-hf` are [`SettingsParser`]s, which read it.
The file is a regular file of at most `CONFIG_MAX_BYTES`, given once; each value is plain (text, a number, or true or
false for a switch), and a list of plain values is taken by the fields that hold a list only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import reprlib
import shlex
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

CONFIG_FLAG = "--config"
CONFIG_MAX_BYTES = 1 << 20  # a settings file, and the flags its values stand for
_PLAIN = (str, int, float)  # a value a flag takes (bool is a switch's)


def flag(field: dataclasses.Field) -> str:
    """The command-line flag of a settings field."""
    name = field.name.replace("_", "-")
    return f"--no-{name}" if _switch(field) and field.default is True else f"--{name}"


def add_fields(parser: argparse.ArgumentParser, settings: type, exclude: Iterable[str] = ()) -> None:
    """Add the flags of the settings class `settings` (less the fields named in `exclude`) to `parser`."""
    hints = typing.get_type_hints(settings)
    for field in dataclasses.fields(settings):
        if field.name not in exclude:
            parser.add_argument(flag(field), dest=field.name, **_argparse_options(field, hints[field.name]))


def add_settings(parser: argparse.ArgumentParser, *settings: type) -> None:
    """Add the flags of the settings classes `settings` to a sub-command's `parser`, and `--config FILE.yaml`."""
    for cls in settings:
        add_fields(parser, cls)
    parser.add_argument(
        CONFIG_FLAG,
        metavar="FILE.yaml",
        help="Read the settings from a YAML mapping whose keys are the flags' names with underscores (e.g. "
        "max_new_tokens: 64; a list for a flag that takes several); flags given as well override the file's values.",
    )
    parser.settings_classes = settings  # read by `SettingsParser` before it parses


def settings_of(args: Any, settings: type[T]) -> T:
    """The settings `settings` held by `args` (a parsed namespace, or any object with the fields as attributes)."""
    return settings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(settings)})


def command_line(command: str, settings: Any) -> str:
    """`dflash-hf COMMAND` with the flags that give back `settings`, in field order.

    A field is left out when it has nothing to say (`None`, an empty value, a switch at its default), when its
    metadata has `"recorded": False` (how a run is shown rather than what it does), or when its metadata names
    `"with"` another field that is left out (e.g. the llama.cpp options without `--llama-cpp`)."""
    fields = dataclasses.fields(settings)
    said = {field.name for field in fields if _says_something(field, getattr(settings, field.name))}
    recorded = {
        field.name: getattr(settings, field.name)
        for field in fields
        if field.name in said
        and field.metadata.get("recorded", True)
        and field.metadata.get("with", field.name) in said
    }
    return shlex.join(["dflash-hf", command, *flags_of(type(settings), recorded)])


def flags_of(settings: type, values: Mapping[str, Any]) -> list[str]:
    """The command-line flags that set the fields `values` (field name to value) of the settings class `settings`."""
    fields = {field.name: field for field in dataclasses.fields(settings)}
    return [word for name, value in values.items() for word in _flags(fields[name], value)]


class SettingsParser(argparse.ArgumentParser):
    """The parser class of `dflash-hf`'s sub-commands: one with settings classes ([`add_settings`]) reads
    `--config FILE.yaml` as the flags it stands for, given before the command line's own."""

    settings_classes: tuple[type, ...] = ()

    def parse_known_args(self, args=None, namespace=None):
        if self.settings_classes and args is not None:
            args = self._with_config(list(args))
        return super().parse_known_args(args, namespace)

    def _with_config(self, args: list[str]) -> list[str]:
        """`args` with `--config FILE` replaced by the flags of the file's settings, put first."""
        finder = argparse.ArgumentParser(add_help=False)
        finder.add_argument(CONFIG_FLAG, action="append")
        found, rest = finder.parse_known_args(args)
        if found.config is None:
            return args
        if len(found.config) > 1:
            raise ValueError(
                f"{CONFIG_FLAG} is given {len(found.config)} times ({', '.join(found.config)}): pass one settings "
                "file (merge them into one, or give the other settings as flags)."
            )
        path = found.config[0]
        values = read_config(path)
        fields = {field.name: cls for cls in self.settings_classes for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(
                f"{CONFIG_FLAG} {path}: unknown setting(s) {', '.join(unknown)}; `{self.prog}` takes "
                f"{', '.join(fields)}."
            )
        try:
            for name, value in values.items():
                _check_config_value(fields[name], name, value)
            flags = [word for name, value in values.items() for word in flags_of(fields[name], {name: value})]
        except ValueError as err:
            raise ValueError(f"{CONFIG_FLAG} {path}: {err}.") from err
        return flags + rest


def read_config(path: str) -> dict[str, Any]:
    """The settings mapping of the YAML file `path`; a `ValueError` naming the file when it is no regular file of at
    most `CONFIG_MAX_BYTES` or holds no such mapping."""
    import yaml

    try:
        values = yaml.safe_load(_read_settings_file(path).decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{CONFIG_FLAG} {path} is not a valid YAML file ({err}): fix the file.") from err
    except RecursionError as err:
        raise ValueError(f"{CONFIG_FLAG} {path} is nested too deeply to be a settings file: fix the file.") from err
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(key, str) for key in values):
        raise ValueError(
            f"{CONFIG_FLAG} {path} holds no mapping of settings: write one `name: value` line per setting, e.g. "
            "`max_new_tokens: 64`."
        )
    return values


def _read_settings_file(path: str) -> bytes:
    """The bytes of the settings file `path`, once it is known to be a regular file of at most `CONFIG_MAX_BYTES`
    (opened without blocking: a pipe or a device is refused, never read)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ValueError(f"{CONFIG_FLAG} {path} is not a regular file (a folder, pipe or device): name a YAML file.")
    with os.fdopen(descriptor, "rb") as handle:
        data = handle.read(CONFIG_MAX_BYTES + 1)
    if len(data) > CONFIG_MAX_BYTES:
        raise ValueError(
            f"{CONFIG_FLAG} {path} is larger than {CONFIG_MAX_BYTES} bytes, far more than settings take: name the "
            "settings file."
        )
    return data


def _check_config_value(settings: type, name: str, value: Any) -> None:
    """Raise a `ValueError` when `value` of the settings file is not of the shape of the field `name` of `settings`:
    true or false for a switch, else a plain value, or for a field that holds a list a list of plain values; written
    out as flags, at most `CONFIG_MAX_BYTES` characters (YAML aliases can repeat a value without end)."""
    field = next(field for field in dataclasses.fields(settings) if field.name == name)
    if value is None or _switch(field):
        return  # no flags, or a switch's own check (`_flags`)
    holds_list = typing.get_origin(_unwrapped(typing.get_type_hints(settings)[name])) is list
    items = value if holds_list and isinstance(value, list) else [value]
    wrong = [item for item in items if isinstance(item, bool) or not isinstance(item, _PLAIN)]
    if wrong:
        kind = "a list of plain values (text or numbers)" if holds_list else "one plain value (text or a number)"
        got = _shape(value) if wrong[0] is value else f"a list holding {_shape(wrong[0])}"
        raise ValueError(f"the setting {name} takes {kind}, got {got}")
    if sum(len(str(item)) + 1 for item in items) > CONFIG_MAX_BYTES:
        raise ValueError(
            f"the setting {name} is more than {CONFIG_MAX_BYTES} characters written out (YAML aliases repeating a "
            "value?)"
        )


def _shape(value: Any) -> str:
    """What a settings file's `value` is, in a few words (never a list or mapping written out: YAML aliases can make
    it endless)."""
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "a mapping"
    if value is None or isinstance(value, bool):
        return "null" if value is None else f"{str(value).lower()} (quote it for text)"
    if isinstance(value, _PLAIN):
        return reprlib.repr(value)
    return f"a {type(value).__name__} (quote it for text)"


def _unwrapped(hint: Any) -> Any:
    """`X` of a field annotated `X | None`, else `hint`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _switch(field: dataclasses.Field) -> bool:
    return isinstance(field.default, bool)


def _says_something(field: dataclasses.Field, value: Any) -> bool:
    if _switch(field):
        return value != field.default
    return value is not None and value != "" and value != [] and value != ()


def _argparse_options(field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """`add_argument`'s keyword arguments for a settings field: its metadata, its default, and its type."""
    options = dict(field.metadata)
    options.pop("recorded", None)
    options.pop("with", None)
    if _switch(field):
        return {**options, "action": "store_false" if field.default else "store_true"}
    if field.default is not dataclasses.MISSING:
        options["default"] = field.default
    elif field.default_factory is not dataclasses.MISSING:
        options["default"] = field.default_factory()
    else:
        options["required"] = True
    if "type" not in options:
        options["type"] = _scalar(hint)
    return options


def _scalar(hint: Any) -> type:
    """The argparse type of a field annotated `hint`: the annotation itself, or `X` of `X | None`."""
    hint = _unwrapped(hint)
    if hint not in (str, int, float, Path):
        raise TypeError(f"A settings field of type {hint} needs an argparse `type` in its metadata.")
    return hint


def _flags(field: dataclasses.Field, value: Any) -> list[str]:
    """The flags that set `field` to `value`: a switch or nothing, one flag per item of a repeatable flag, the items
    of an `nargs="+"` flag, or one flag with the items comma-separated; nothing for `None` or no items."""
    if _switch(field):
        if not isinstance(value, bool):
            raise ValueError(f"the setting {field.name} is true or false, got {_shape(value)}")
        return [flag(field)] if value != field.default else []
    items = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        return []
    if field.metadata.get("action") == "append":
        return [word for item in items for word in (flag(field), str(item))]
    if field.metadata.get("nargs") == "+":
        return [flag(field), *map(str, items)]
    return [flag(field), ",".join(map(str, items))]


def field_of(settings: type, name: str, metadata: Mapping[str, Any] | None = None) -> Any:
    """A new field like the field `name` of the settings class `settings` (the same default and flag, its metadata
    updated with `metadata`), for another settings class that takes that flag too."""
    field = next(field for field in dataclasses.fields(settings) if field.name == name)
    return dataclasses.field(
        default=field.default, default_factory=field.default_factory, metadata={**field.metadata, **(metadata or {})}
    )
