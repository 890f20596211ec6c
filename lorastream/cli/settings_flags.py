"""Command-line flags generated from a settings class, so that each setting is declared once.

``@with_settings(WorkerSettings)`` gives a typer command one option per field of a
pydantic-settings class (as vLLM's ``arg_utils`` derives its flags from its config classes):

- the flag is the field's name with dashes (``copy_turn_ms`` -> ``--copy-turn-ms``), less a
  trailing ``_s`` whose unit the metavar then says (``poll_interval_s`` ->
  ``--poll-interval SECONDS``); a list field takes one item per flag, repeated, and is named in
  the singular (``workers`` -> ``--worker A --worker B``);
- its help is the field's description, then the environment variables the field reads and its
  default, both taken from the field;
- a bool is a switch, ``--x`` or ``--no-x`` (as typer's and vLLM's flags are; its variable
  still takes true or false); a ``Literal`` takes one of its values;
- a field marked ``CliSuppress`` (a token that would show in process listings) has no flag:
  only the environment sets it.

The options carry text and leave every check to the settings class, so a value reads the same
from a flag as from the environment. A flag given wins over the environment, which wins over
the default (pydantic-settings' order: init arguments, then environment variables). A value the
class refuses, from a flag or from the environment, is reported in one line naming where it
came from, the value and what was expected, and the command exits 2, as for a usage error.
"""

from __future__ import annotations

import functools
import inspect
import os
import shlex
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import typer
from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticUndefined
from pydantic_settings import BaseSettings, SettingsError
from pydantic_settings.sources import CLI_SUPPRESS

from lorastream.cli.common import refuse

S = TypeVar("S", bound=BaseSettings)

_METAVARS: dict[type, str] = {int: "INTEGER", float: "FLOAT", str: "TEXT", Path: "PATH"}
_UNITS = (1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")


@dataclass(frozen=True)
class SettingFlag:
    """One settings field as a command-line option."""

    field: str
    flag: str  # --copy-turn-ms
    env: tuple[str, ...]  # the variables the field reads, the first set one wins
    default: str | None  # as --help shows it; None: the field has no default value to show
    description: str
    metavar: str  # "" for a switch
    repeated: bool  # a list field: one item per flag
    switch: bool = False  # a bool field: --x or --no-x, no value

    @property
    def off(self) -> str:
        """A switch's second flag, which sets the field false: ``--no-fetch-process``."""
        return "--no-" + self.flag.removeprefix("--")

    @property
    def usage(self) -> str:
        """The flag as --help shows it: ``--port INTEGER``, ``--fetch-process /
        --no-fetch-process``."""
        return f"{self.flag} / {self.off}" if self.switch else f"{self.flag} {self.metavar}"

    @property
    def help(self) -> str:
        """The description, then click's bracket of what else the option reads and its default."""
        default = "" if self.default is None else f"; default: {self.default}"
        return f"{self.description}  [env var: {', '.join(self.env)}{default}]"


def env_names(settings: type[BaseSettings], name: str) -> tuple[str, ...]:
    """The environment variables field ``name`` of ``settings`` reads, in the order they count."""
    alias = settings.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return tuple(choice for choice in alias.choices if isinstance(choice, str))
    if isinstance(alias, str):
        return (alias,)
    return (f"{settings.model_config.get('env_prefix', '')}{name}".upper(),)


def setting_flags(settings: type[BaseSettings]) -> list[SettingFlag]:
    """The options of ``settings``' fields, in declaration order (``CliSuppress`` ones left out)."""
    return [
        _setting_flag(settings, name, info)
        for name, info in settings.model_fields.items()
        if CLI_SUPPRESS not in info.metadata
    ]


def _setting_flag(settings: type[BaseSettings], name: str, info: FieldInfo) -> SettingFlag:
    kind = _without_none(info.annotation)
    repeated = get_origin(kind) is list
    switch = kind is bool
    stem = name.removesuffix("_s")
    metavar = "SECONDS" if stem != name else _metavar(get_args(kind)[0] if repeated else kind)
    if repeated:
        stem = stem.removesuffix("s")
    return SettingFlag(
        field=name,
        flag="--" + stem.replace("_", "-"),
        env=env_names(settings, name),
        default=_shown_default(name, info),
        description=info.description or "",
        metavar=metavar,
        repeated=repeated,
        switch=switch,
    )


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        kept = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(kept) == 1:
            return kept[0]
    return annotation


def _metavar(kind: Any) -> str:
    if kind is bool:
        return ""
    if get_origin(kind) is Literal:
        return "[" + "|".join(str(value) for value in get_args(kind)) + "]"
    return _METAVARS.get(kind, "TEXT")


def _shown_default(name: str, info: FieldInfo) -> str | None:
    """The default as the help and the docs show it: ``on`` (a switch), ``0.5``,
    ``1048576 (1 MiB)``, ``~/.cache/...``; None when there is none to show (None, an empty list)."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]  # pydantic allows a factory taking the data; these take none
    elif info.default is PydanticUndefined:
        return None
    else:
        value = info.default
    if value is None or value == []:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Path):
        home = Path.home()
        return f"~/{value.relative_to(home)}" if value.is_relative_to(home) else str(value)
    if isinstance(value, int) and name.endswith("_bytes"):
        for size, unit in _UNITS:
            if value and value % size == 0:
                return f"{value} ({value // size} {unit})"
    return str(value)


def with_settings(
    settings: type[S],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command ``f(settings: S, **own_options)``: typer sees one option per field of
    ``settings`` before the command's own options, and the command receives the settings built
    from the flags given and the environment (or the command exits 2 naming what was wrong)."""
    flags = setting_flags(settings)

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        first, *own = inspect.signature(command, eval_str=True).parameters.values()
        clash = {flag.field for flag in flags} & {param.name for param in own}
        if first.name != "settings" or clash:
            raise TypeError(
                f"{command.__name__} must take `settings` first and no option named like a "
                f"field of {settings.__name__} (clash: {sorted(clash)})"
            )

        @functools.wraps(command)
        def run(**options: Any) -> None:
            given: dict[str, Any] = {}
            for flag in flags:
                value = options.pop(flag.field)
                if value not in (None, [], ()):
                    given[flag.field] = list(value) if flag.repeated else value
            command(load_settings(settings, given), **options)

        del run.__wrapped__  # typer reads __signature__, not the command's own
        parameters = [
            *(_parameter(flag) for flag in flags),
            *(param.replace(kind=inspect.Parameter.KEYWORD_ONLY) for param in own),
        ]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # mypy's function type has no __signature__; typer reads it
        run.__annotations__ = {param.name: param.annotation for param in parameters}
        return run

    return decorate


def _parameter(flag: SettingFlag) -> inspect.Parameter:
    if flag.switch:  # None unless given: the variable or the default decides
        option = typer.Option(None, f"{flag.flag}/{flag.off}", help=flag.help, show_default=False)
        kind: Any = bool | None
    else:
        option = typer.Option(None, flag.flag, help=flag.help, metavar=flag.metavar,
                              show_default=False)
        kind = list[str] | None if flag.repeated else str | None
    return inspect.Parameter(
        flag.field, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind
    )


def load_settings(settings: type[S], given: dict[str, Any]) -> S:
    """``settings(**given)`` over the environment; a refused value is one line per error (the flag
    or variable, the value, what was expected), then exit 2."""
    try:
        return settings(**given)
    except ValidationError as exc:
        refuse(_explain(settings, given, error) for error in exc.errors())
    except SettingsError as exc:
        refuse([f"{exc}: {exc.__cause__}" if exc.__cause__ else str(exc)])


def _explain(settings: type[BaseSettings], given: dict[str, Any], error: ErrorDetails) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "bool_parsing":  # only a variable: a switch takes no value
        message = "Input should be true or false"
    name = _field_of(settings, error["loc"][0]) if error["loc"] else None
    if name is None:
        return message
    if name in given:
        flag = next(f for f in setting_flags(settings) if f.field == name)
        values = given[name] if flag.repeated else [given[name]]
        return " ".join(f"{flag.flag} {shlex.quote(str(v))}" for v in values) + f": {message}"
    variable = _variable_set(env_names(settings, name))
    if variable is None:
        return f"{name}: {message}"
    return f"{variable}={shlex.quote(os.environ[variable])}: {message}"


def _field_of(settings: type[BaseSettings], loc: str | int) -> str | None:
    """The field an error location names: the field itself or one of its variables."""
    if loc in settings.model_fields:
        return str(loc)
    for name in settings.model_fields:
        if str(loc).upper() in env_names(settings, name):
            return name
    return None


def _variable_set(names: tuple[str, ...]) -> str | None:
    """The first of ``names`` set in the environment (pydantic-settings ignores case)."""
    by_upper = {key.upper(): key for key in os.environ}
    return next((by_upper[name] for name in names if name in by_upper), None)
