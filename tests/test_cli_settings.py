"""The `bungee` command's environment as a settings class (bungee_cli.settings.CliSettings):
where the login is saved, and the address and token that stand in for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bungee_cli.client import CliError, Login
from bungee_cli.settings import CliSettings


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("BUNGEE_URL", "BUNGEE_TOKEN", "BUNGEE_CONFIG", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_the_login_is_saved_under_the_users_config_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert CliSettings().config_path() == tmp_path / "home" / ".config" / "bungee" / "config.json"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert CliSettings().config_path() == tmp_path / "xdg" / "bungee" / "config.json"
    monkeypatch.setenv("BUNGEE_CONFIG", str(tmp_path / "mine.json"))
    assert CliSettings().config_path() == tmp_path / "mine.json"
    monkeypatch.setenv("BUNGEE_CONFIG", "")  # empty is unset, as for every setting
    assert CliSettings().config_path() == tmp_path / "xdg" / "bungee" / "config.json"


def test_an_address_and_a_token_stand_in_for_a_saved_login(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BUNGEE_CONFIG", str(tmp_path / "config.json"))
    with pytest.raises(CliError, match="not logged in"):
        Login.load()
    Login("http://saved:8000", "saved-token").save()
    assert Login.load() == Login("http://saved:8000", "saved-token")
    monkeypatch.setenv("BUNGEE_URL", "http://portal:8000/")
    assert Login.load() == Login("http://portal:8000", "saved-token"), "one variable overrides its half"
    monkeypatch.setenv("BUNGEE_TOKEN", "env-token")
    (tmp_path / "config.json").unlink()
    assert Login.load() == Login("http://portal:8000", "env-token"), "both: no login file is read"
