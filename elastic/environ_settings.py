"""What the settings classes of the portal (portal.config), the agent (agent.settings) and the
worker (elastic.worker.settings) share: pydantic-settings reading each field from the environment
variable named by its alias, and a refusal that quotes the variable and the value.

Every field names its variable as its `validation_alias`, spelled out, so that the public names
(in the docs, the deployment files, the Slurm scripts) are greppable where they are read. A
settings class reads `os.environ` when built with no arguments, or the mapping given to
`from_environ` (tests, and the agent inside a Slurm allocation); an empty value is taken as
unset, as it always was.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Self

from pydantic import ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("environ", default=None)
"""The mapping `from_environ` reads instead of os.environ, while it builds its settings."""


class SettingsError(ValueError):
    """A setting holds a value its component cannot use; the message quotes each one."""

    def __init__(self, message: str, error: ValidationError) -> None:
        super().__init__(message)
        self.error = error
        """What pydantic found, for a caller that names the values otherwise (the agent's flags)."""


class _MappingSource(EnvSettingsSource):
    """The environment source, reading the mapping given to `from_environ` if there is one."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        environ = _ENVIRON.get()
        return parse_env_vars(
            os.environ if environ is None else environ,
            self.case_sensitive,
            self.env_ignore_empty,
            self.env_parse_none_str,
        )


@contextmanager
def _reading(environ: Mapping[str, str]) -> Iterator[None]:
    token = _ENVIRON.set(environ)
    try:
        yield
    finally:
        _ENVIRON.reset(token)


class EnvironSettings(BaseSettings):
    """A component's settings: each field read from the variable of its alias, frozen once read."""

    model_config = SettingsConfigDict(
        frozen=True,
        case_sensitive=True,
        env_ignore_empty=True,
        populate_by_name=True,
        extra="ignore",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Values given by name first (the agent's flags, tests), then the environment; no .env
        # file and no secrets directory: a deployment sets the environment.
        return init_settings, _MappingSource(settings_cls)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, **values: Any) -> Self:
        """The settings from `environ` (None: os.environ), `values` (by field name) winning over
        it. Raises SettingsError, quoting every bad value with its variable."""
        try:
            if environ is None:
                return cls(**values)
            with _reading(environ):
                return cls(**values)
        except ValidationError as err:
            raise SettingsError(refusal(cls, err), err) from None

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of field `name`, where a command line is built from the settings
        (the agent's, `python -m agent.simulate`'s)."""
        return "--" + name.replace("_", "-")

    @classmethod
    def variable(cls, name: str) -> str:
        """The environment variable of field `name`."""
        alias = cls.model_fields[name].validation_alias
        if not isinstance(alias, str):
            raise TypeError(f"{cls.__name__}.{name} names no environment variable (validation_alias)")
        return alias


def refusal(
    cls: type[EnvironSettings], error: ValidationError, names: Mapping[str, str] | None = None
) -> str:
    """One clause per bad value, `VARIABLE='value': what is wrong`; `names` gives the name to
    quote for a field instead of its variable (the agent's flag when the value came from one)."""
    clauses = []
    for problem in error.errors():
        where = str(problem["loc"][0]) if problem["loc"] else ""
        field = where if where in cls.model_fields else _field_of(cls, where)
        shown = (names or {}).get(field or "") or (cls.variable(field) if field else where)
        reason = problem["msg"].removeprefix("Value error, ")
        clauses.append(f"{shown}={problem['input']!r}: {reason}")
    return "; ".join(clauses)


def _field_of(cls: type[EnvironSettings], variable: str) -> str | None:
    return next(
        (name for name, field in cls.model_fields.items() if field.validation_alias == variable), None
    )
