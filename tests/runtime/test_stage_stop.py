"""How an AR stage stops (pure parts; the stop under load is in test_soak.py): vLLM gets the
grace period as its --shutdown-timeout, so its engine drains instead of aborting (vLLM
0.32's default, 0); the stage owns that flag."""

from __future__ import annotations

import pytest

from omni_runtime.stages.ar import shutdown_timeout_flag, vllm_command
from omni_runtime.stages.config import StageConfigError, parse_stage_config

BASE = {
    "pipeline": "p", "stage": "thinker", "role": "ar",
    "model": {"name": "m", "path": "/models/m"},
    "kvTransfer": {"send": True, "timeoutSeconds": 45},
    "downstream": [{"stage": "talker", "endpoint": "p-talker:9600"}],
}


def test_vllm_drains_for_the_grace_period():
    argv = vllm_command(parse_stage_config(BASE), "0.0.0.0", python="python", grace_seconds=45)
    assert argv[argv.index("--shutdown-timeout") + 1] == "45"


@pytest.mark.parametrize("grace, flag", [(0.2, "1"), (2.5, "3"), (30, "30")])
def test_the_shutdown_timeout_is_whole_seconds_and_never_abort(grace, flag):
    assert shutdown_timeout_flag(grace) == ["--shutdown-timeout", flag]


def test_a_shutdown_timeout_in_engine_args_is_refused():
    # Refused when the config is read (the stage contract), before any command is built.
    with pytest.raises(StageConfigError, match="shutdown-timeout|shutdown_timeout"):
        parse_stage_config({**BASE, "engineArgs": {"shutdown-timeout": 0}})


def test_print_command_shows_the_drain_flag(tmp_path, capsys):
    import yaml

    from omni_runtime.stages.main import main

    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert main(["--config", str(path), "--print-command", "--grace-seconds", "12"]) == 0
    assert "--shutdown-timeout 12" in capsys.readouterr().out
