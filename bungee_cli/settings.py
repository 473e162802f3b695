"""What the `bungee` command reads from its environment: where the portal is, who is asking, and
where the login is saved. A settings class (pydantic-settings, each field read from the variable
its alias names), so that the configuration reference lists them with the platform's own
(docs/reference/configuration.md). The CLI travels without the runtime, so this class does not
derive from elastic.environ_settings; it keeps the same conventions: an empty value is unset."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CliSettings(BaseSettings):
    """The CLI's environment: read once per command."""

    model_config = SettingsConfigDict(
        frozen=True, case_sensitive=True, env_ignore_empty=True, populate_by_name=True, extra="ignore"
    )

    url: str | None = Field(
        None, validation_alias="BUNGEE_URL",
        description="the portal's address; with BUNGEE_TOKEN it stands for a saved login (`bungee login`)",
    )
    token: str | None = Field(
        None, validation_alias="BUNGEE_TOKEN", description="an API token of yours; with BUNGEE_URL, no login is read",
    )
    config: Path | None = Field(
        None, validation_alias="BUNGEE_CONFIG",
        description="the file `bungee login` saves to and every command reads (mode 0600); default "
        "`bungee/config.json` under XDG_CONFIG_HOME",
    )
    xdg_config_home: Path | None = Field(
        None, validation_alias="XDG_CONFIG_HOME", description="where the login is saved without BUNGEE_CONFIG; default `~/.config`",
    )

    def config_path(self) -> Path:
        """BUNGEE_CONFIG, or bungee/config.json under XDG_CONFIG_HOME (default ~/.config)."""
        if self.config is not None:
            return self.config
        return (self.xdg_config_home or Path.home() / ".config") / "bungee" / "config.json"
