"""Settings precedence: CLI flag > LINSERVE_* environment > YAML file > default."""

from __future__ import annotations

import pytest

from linserve.server.settings import Settings


def test_precedence(tmp_path, monkeypatch):
    config = tmp_path / "server.yaml"
    config.write_text("port: 9000\nnum_slots: 7\nhost: 0.0.0.0\nmax_n: 3\n")
    monkeypatch.setenv("LINSERVE_PORT", "9100")
    monkeypatch.setenv("LINSERVE_NUM_SLOTS", "11")
    monkeypatch.setenv("LINSERVE_API_KEYS", '["k1", "k2"]')
    settings = Settings.load(config, host="10.0.0.1", num_slots=None)
    assert settings.host == "10.0.0.1"  # CLI beats YAML
    assert settings.port == 9100 and settings.num_slots == 11  # env beats YAML
    assert settings.max_n == 3  # YAML beats default
    assert settings.api_keys == ["k1", "k2"]
    assert settings.max_waiting == Settings.model_fields["max_waiting"].default


def test_invalid_values_and_missing_file_are_errors(tmp_path):
    with pytest.raises(ValueError):
        Settings.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_slots: 0\n")
    with pytest.raises(ValueError):
        Settings.load(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("num_slot: 3\n")
    with pytest.raises(ValueError):
        Settings.load(typo)


def test_the_example_config_loads_and_holds_only_defaults():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "server.example.yaml"
    loaded = Settings.load(path)  # unknown keys would raise (extra="forbid")
    assert loaded.model_dump() == Settings().model_dump()
