"""`fairbatch serve`: its banner (what a new user needs to reach the API and the dashboard)
and its flags."""

from __future__ import annotations

import pytest

from fairbatch.deployments.serve.cli import banner, dashboard_access

URL, DASH = "http://127.0.0.1:8000", "http://127.0.0.1:8265"


def test_dashboard_access_names_the_token_file_when_ray_token_auth_is_on(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/srv/ray/token")
    text = dashboard_access()
    assert "ray get-auth-token" in text and "/srv/ray/token" in text
    assert "RAY_AUTH_MODE=disabled" in text  # the local-use way out
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("HOME", "/home/u")
    assert "/home/u/.ray/auth_token" in dashboard_access()  # Ray's default token file


def test_dashboard_access_without_token_auth(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert "no token needed" in dashboard_access()


def test_banner_warns_that_the_tiny_model_is_random_and_shows_the_key_to_use():
    tiny = banner(URL, "fairbatch-tiny", DASH, True, True, "no token needed")
    assert "RANDOM weights" in tiny and "Bearer EMPTY" in tiny and DASH in tiny
    real = banner(URL, "llama", DASH, False, False, "no token needed")
    assert "RANDOM" not in real and "Bearer <your API key>" in real and "EMPTY" not in real
    assert "(not running)" in banner(URL, "llama", None, False, False, "x")


def test_the_parser_flags_reach_the_app_args(tmp_path):
    import argparse

    from fairbatch.deployments.serve.app import parse_app_args
    from fairbatch.deployments.serve.cli import add_parser, app_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    config = tmp_path / "app.yaml"
    config.write_text("tool_call_parser: hermes\n")
    for argv, want in [
        (["serve"], None),
        (["serve", "--config", str(config)], "hermes"),
        (["serve", "--config", str(config), "--tool-call-parser", "mistral"], "mistral"),
    ]:
        assert parse_app_args(app_args(parser.parse_args(argv))).tool_call_parser == want
    thinking = parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert parse_app_args(app_args(thinking)).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):  # argparse refuses a format that has no parser
        parser.parse_args(["serve", "--tool-call-parser", "granite"])
    config.write_text("engine: {max_num_seqs: 4}\n")
    bf16 = app_args(parser.parse_args(["serve", "--config", str(config), "--dtype", "bfloat16"]))
    assert bf16["engine"] == {"max_num_seqs": 4, "dtype": "bfloat16"}
    assert parse_app_args(bf16).engine["dtype"] == "bfloat16"


def test_the_engine_settings_reach_the_replicas_engine():
    """dtype, enable_prefix_caching and enforce_eager of the app's `engine` go to the engine a
    replica builds."""
    import torch

    from fairbatch.deployments.cluster.replica_config import ReplicaConfig, build_core

    core = build_core(ReplicaConfig(engine="tiny", dtype="bfloat16", enable_prefix_caching=False))
    assert next(core.runner.model.parameters()).dtype == torch.bfloat16
    assert core.scheduler.kv.enable_prefix_caching is False
    core = build_core(ReplicaConfig(engine="tiny"))
    assert next(core.runner.model.parameters()).dtype == torch.float32  # auto, on CPU
    assert core.scheduler.kv.enable_prefix_caching is True


@pytest.mark.parametrize(
    "engine, field",
    [
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"device": "tpu"}, "device"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"heartbeat_s": 0}, "heartbeat_s"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_a_bad_engine_value_is_refused_where_the_config_is_read(engine, field):
    # (before: accepted, then every replica failed to start, after Ray and Serve were up)
    from fairbatch.deployments.serve.app import ConfigError, parse_app_args

    with pytest.raises(ConfigError, match=field):
        parse_app_args({"engine": engine})
    parse_app_args({"engine": {"device": "cuda:1", "num_cpu_blocks": 0}})  # good values pass


def test_serve_refuses_bad_flags_and_a_missing_model_before_starting_ray(tmp_path, capsys):
    import argparse

    from fairbatch.deployments.serve.cli import add_parser, run

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for argv in (["serve", "--port", "-5"], ["serve", "--port", "70000"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    for argv, field in [
        (["serve", "--replicas", "0"], "num_replicas"),  # (was: 0 read as the default, 2)
        (["serve", "--model", str(tmp_path / "nowhere")], "model"),
    ]:
        assert run(parser.parse_args(argv)) == 2  # returns before importing Ray's init
        assert field in capsys.readouterr().err
    import socket

    with socket.socket() as held:  # a port in use: said, not the next one taken quietly
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert run(parser.parse_args(["serve", "--port", str(port)])) == 2
        assert f"127.0.0.1:{port} is in use" in capsys.readouterr().err
