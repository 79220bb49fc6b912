"""``actorserve run``'s options from the command line, the environment (``ACTORSERVE_<NAME>``)
and the config file, in that order of precedence; ``actorserve --version``."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import actors.serving.root
from actors.serving import ModelConfig, ServeConfig, cli


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``run`` would start with (the logging setup, the config, the shutdown budgets),
    recorded instead of starting a root."""
    seen: dict[str, Any] = {}
    load = actors.serving.root.load_config

    def load_config(*args: Any, **kwargs: Any) -> ServeConfig:
        seen["config"] = load(*args, **kwargs)
        return seen["config"]

    def budgets(**kwargs: Any) -> None:
        seen["budgets"] = kwargs

    monkeypatch.setattr(actors.serving.root, "load_config", load_config)
    monkeypatch.setattr(cli, "Budgets", budgets)
    monkeypatch.setattr(cli, "configure_logging", lambda *log: seen.setdefault("log", log))
    monkeypatch.setattr(cli, "run_on", lambda loop, main: None)
    return seen


def _run(*args: str, env: dict[str, str] | None = None) -> None:
    result = CliRunner().invoke(cli.app, ["run", "--backend", "mock", *args], env=env)
    assert result.exit_code == 0, result.output


def test_version() -> None:
    result = CliRunner().invoke(cli.app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"actorserve {version('actorserve')}\n"


def test_an_environment_variable_sets_an_option(started: dict[str, Any]) -> None:
    env = {"ACTORSERVE_MIGRATION_LIMIT": "5", "ACTORSERVE_LOG_FORMAT": "json"}
    env["ACTORSERVE_DRAIN_BUDGET"] = "12.5"
    _run(env=env)
    assert started["config"].migration_limit == 5
    assert started["log"] == ("warning", "json")
    assert started["budgets"]["drain"] == 12.5


def test_flag_beats_environment_beats_config_file(started: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    # A field of the config (migration_limit), options the command line alone has (log_level,
    # grace_period, drain_budget), and a field with no option at all (stall_timeout).
    path.write_text(
        "migration_limit = 1\nlog_level = 'info'\ngrace_period = 4.0\ndrain_budget = 9.0\n"
        "stall_timeout = 7.0\n"
    )
    env = {"ACTORSERVE_MIGRATION_LIMIT": "2", "ACTORSERVE_LOG_LEVEL": "error"}
    env["ACTORSERVE_GRACE_PERIOD"] = "3.0"
    _run("--config", str(path), "--migration-limit", "3", "--grace-period", "1.0", env=env)
    config = started["config"]
    assert config.migration_limit == 3  # flag over environment over file
    assert started["budgets"]["grace"] == 1.0  # flag over environment over file
    assert started["log"] == ("error", "console")  # environment over file
    assert started["budgets"]["drain"] == 9.0  # file over default
    assert config.stall_timeout == 7.0


def test_the_config_file_comes_from_the_environment_too(
    started: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("log_format: json\nmigration_limit: 4\n")
    _run(env={"ACTORSERVE_CONFIG": str(path)})
    assert started["config"].migration_limit == 4
    assert started["log"] == ("warning", "json")


def test_a_typo_in_the_config_file_is_still_refused(
    started: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text("migration_limt = 1\n")
    result = CliRunner().invoke(cli.app, ["run", "--backend", "mock", "--config", str(path)])
    assert result.exit_code == 2
    assert "migration_limt" in result.output


def test_a_bad_log_format_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "run_on", lambda loop, main: None)
    result = CliRunner().invoke(cli.app, ["run", "--backend", "mock", "--log-format", "xml"])
    assert result.exit_code == 2
    assert "xml" in result.output


def test_kinds_and_more_models_from_the_flags_and_the_file(
    started: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[ServeConfig] = []
    real = actors.serving.root.Serving

    def serving(config: ServeConfig) -> Any:
        served.append(config)
        return real(config)

    monkeypatch.setattr(actors.serving.root, "Serving", serving)
    _run("--kind", "image", "--with-embeddings")
    assert [(m.model, m.kind, m.mode) for m in served[-1].served()] == [
        ("mock-image", "image", "aggregated"),
        ("mock-embedding", "embedding", "aggregated"),
    ]
    path = tmp_path / "serve.toml"
    path.write_text(
        "[[models]]\nmodel = 'painter'\nkind = 'image'\nbackend = 'mock'\ndecode_workers = 3\n"
    )
    _run("--config", str(path), "--with-embeddings")
    assert [(m.model, m.kind, m.decode_workers) for m in served[-1].served()] == [
        ("mock", "chat", 2),
        ("painter", "image", 3),
        ("mock-embedding", "embedding", 1),
    ]
    twice = CliRunner().invoke(
        cli.app, ["run", "--backend", "mock", "--kind", "embedding", "--with-embeddings"]
    )
    assert twice.exit_code == 2
    assert "models served twice: mock-embedding" in twice.output
    unserved = CliRunner().invoke(cli.app, ["run", "--backend", "hf", "--kind", "dllm"])
    assert unserved.exit_code == 2
    assert "serves chat, embedding, image models, not dllm" in unserved.output


def test_model_names_the_weights_and_served_model_name_the_name(
    started: dict[str, Any], tmp_path: Path
) -> None:
    _run("--backend", "sglang", "--model", "org/m")
    config = started["config"]
    assert (config.model, config.engine_args) == ("org/m", {"model_path": "org/m"})  # SGLang's
    _run("--backend", "sglang", "--model", "org/m", env={"ACTORSERVE_SERVED_MODEL_NAME": "foo"})
    config = started["config"]
    assert (config.model, config.engine_args) == ("foo", {"model_path": "org/m"})
    path = tmp_path / "serve.toml"
    path.write_text("backend = 'sglang'\nweights = 'org/m'\nmodel = 'bar'\n")
    _run("--config", str(path), "--backend", "sglang")
    config = started["config"]
    assert (config.model, config.engine_args) == ("bar", {"model_path": "org/m"})
    _run("--config", str(path), "--backend", "sglang", "--served-model-name", "baz")
    assert started["config"].model == "baz"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "m"], "the mock backend loads no weights"),
        (["--backend", "hf", "--model", "/no/such/model"], "no such folder"),
        (
            ["--backend", "sglang", "--model", "a", "--engine-arg", "model_path=b"],
            "weights 'a' and engine_args model_path name other weights",
        ),
    ],
)
def test_weights_the_backend_cannot_load_are_refused(
    started: dict[str, Any], args: list[str], message: str
) -> None:
    result = CliRunner().invoke(cli.app, ["run", "--backend", "mock", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_hf_loads_a_folder_or_its_packaged_model_by_name(tmp_path: Path) -> None:
    folder = ModelConfig(backend="hf", weights=str(tmp_path))
    assert folder.engine_args == {"model_dir": str(tmp_path)}
    assert folder.model == str(tmp_path)  # served under the name it was given, as vLLM does
    packaged = ModelConfig(backend="hf", kind="embedding", weights="all-minilm-l6-v2")
    assert (packaged.model, packaged.engine_args) == ("all-minilm-l6-v2", {})
