"""omni_kv_config validation: bad settings fail start-up with an error naming the key."""

from __future__ import annotations

import pytest

from omni_runtime.transfers.config import OmniKVConfigError, parse_omni_kv_config, raw_omni_kv_config
from omni_runtime.transfers.ledger import DEFAULT_TIMEOUT_SECONDS, Trigger


def test_absent_config_means_transfers_off():
    cfg = parse_omni_kv_config(None)
    assert not cfg.need_send_cache and cfg.criteria is None
    assert cfg.timeout_seconds == DEFAULT_TIMEOUT_SECONDS


def test_full_config():
    cfg = parse_omni_kv_config(
        {
            "need_send_cache": True,
            "kv_transfer_criteria": {"type": "special_token", "token_id": 7},
            "timeout_seconds": 2.5,
            "stage_name": "thinker",
        },
        vocab_size=512,
    )
    assert (cfg.need_send_cache, cfg.criteria, cfg.token_id, cfg.timeout_seconds, cfg.stage_name) == (
        True,
        Trigger.SPECIAL_TOKEN,
        7,
        2.5,
        "thinker",
    )


def test_the_telemetry_interval_defaults_to_a_tenth_of_a_second_and_zero_means_every_step():
    assert parse_omni_kv_config({"need_send_cache": True}).telemetry_interval_seconds == 0.1
    assert parse_omni_kv_config(
        {"need_send_cache": True, "telemetry_interval_seconds": 0}).telemetry_interval_seconds == 0.0


def test_stage_name_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("OMNI_STAGE_NAME", "talker")
    assert parse_omni_kv_config({"need_send_cache": True}).stage_name == "talker"


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"kv_transfer_criteria": {"type": "whenever"}}, "kv_transfer_criteria.type"),
        ({"kv_transfer_criteria": {"type": "special_token"}}, "kv_transfer_criteria.token_id"),
        (
            {"kv_transfer_criteria": {"type": "special_token", "token_id": 512}},
            "kv_transfer_criteria.token_id",
        ),
        (
            {"kv_transfer_criteria": {"type": "special_token", "token_id": -1}},
            "kv_transfer_criteria.token_id",
        ),
        (
            {"kv_transfer_criteria": {"type": "special_token", "token_id": "7"}},
            "kv_transfer_criteria.token_id",
        ),
        (
            {"kv_transfer_criteria": {"type": "prefill_finished", "token_id": 3}},
            "kv_transfer_criteria.token_id",
        ),
        ({"kv_transfer_criteria": "prefill_finished"}, "kv_transfer_criteria"),
        ({"timeout_seconds": -1}, "timeout_seconds"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"timeout_seconds": float("inf")}, "timeout_seconds"),
        ({"timeout_seconds": "30s"}, "timeout_seconds"),
        ({"telemetry_interval_seconds": -0.1}, "telemetry_interval_seconds"),
        ({"telemetry_interval_seconds": 60}, "telemetry_interval_seconds"),
        ({"telemetry_interval_seconds": float("nan")}, "telemetry_interval_seconds"),
        ({"telemetry_interval_seconds": True}, "telemetry_interval_seconds"),
        ({"telemetry_interval_seconds": "100ms"}, "telemetry_interval_seconds"),
        ({"need_send_cache": "yes"}, "need_send_cache"),
        ({"need_send_cach": True}, "unknown key"),
        (["need_send_cache"], "must be a mapping"),
    ],
)
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(OmniKVConfigError, match=key.replace(".", r"\.")):
        parse_omni_kv_config(raw, vocab_size=512)


def test_vllm_omni_keys_are_tolerated():
    cfg = parse_omni_kv_config({"need_send_cache": True, "need_recv_cache": False, "omni_to_stage": 1})
    assert cfg.need_send_cache


def test_raw_config_prefers_additional_config_then_model_config():
    class Obj:
        pass

    vc = Obj()
    vc.additional_config = {"omni_kv_config": {"need_send_cache": True}}
    vc.model_config = Obj()
    vc.model_config.omni_kv_config = {"need_send_cache": False}
    assert raw_omni_kv_config(vc) == {"need_send_cache": True}
    vc.additional_config = {}
    assert raw_omni_kv_config(vc) == {"need_send_cache": False}
