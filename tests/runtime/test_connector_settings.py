"""The connector's ``kv_connector_extra_config`` checked at the engine's start, naming the key
(an outside review with plain ``vllm serve``: an ``http://`` peer started and its sender
thread died at the first transfer while /health said 200; unknown keys passed; wrong types
were Python errors deep in vLLM's worker traceback); the connector refused under vLLM's own
scheduler (it served as a silent no-op); a transfer nobody answered resolved ``expired``;
our log lines where vLLM's go."""
from __future__ import annotations

import logging

import pytest

from omni_runtime.kv.connector_config import ConnectorConfigError, connector_settings, kv_transfer_config
from omni_runtime.sched.handoff import Answer
from omni_runtime.transfers.ledger import Outcome


def test_the_settings_the_stage_writes_are_read_back():
    extra = kv_transfer_config({"talker": "talker-kv:9600", "vocoder": "tcp://[::1]:9601"}, "demo",
                               io_cpus="3", revision="abc", loads=True)["kv_connector_extra_config"]
    settings = connector_settings(extra)
    assert settings.endpoints == {"talker": "tcp://talker-kv:9600", "vocoder": "tcp://[::1]:9601"}
    assert settings.to_stages == ("talker", "vocoder")
    assert (settings.pipeline, settings.revision, settings.io_cpus, settings.loads,
            settings.host_huge_pages) == ("demo", "abc", "3", True, True)
    assert connector_settings(None).endpoints == {}
    assert connector_settings({"endpoints": {"a": "h:1"}, "to_stages": ["a", "b"]}).to_stages == ("a", "b")


@pytest.mark.parametrize("extra, key, said", [
    ({"endpoints": {"next": "http://127.0.0.1:19601"}}, "endpoints.next", "tcp://HOST:PORT"),
    ({"endpoints": {"next": "127.0.0.1"}}, "endpoints.next", "got '127.0.0.1'"),
    ({"endpoints": {"next": "127.0.0.1:0"}}, "endpoints.next", "tcp://HOST:PORT"),
    ({"endpoints": {"next": 19601}}, "endpoints.next", "got 19601"),
    ({"endpoints": ["tcp://127.0.0.1:19601"]}, "endpoints", "must be a mapping"),
    ({"endpoints": "tcp://127.0.0.1:19601"}, "endpoints", "must be a mapping"),
    ({"pipline": "p"}, "", "'pipline' (did you mean 'pipeline'?)"),
    ({"timeout_seconds": -1}, "", "unknown key(s) 'timeout_seconds'"),
    ({"to_stages": "next"}, "to_stages", "must be a list of stage names"),
    ({"to_stages": 5}, "to_stages", "must be a list of stage names"),
    ({"pipeline": {"a": 1}}, "pipeline", "must be a string"),
    ({"revision": [1]}, "revision", "must be a string"),
    ({"loads": "yes"}, "loads", "must be true or false"),
    ({"host_huge_pages": 1}, "host_huge_pages", "must be true or false"),
    ("endpoints", "", "must be a mapping"),
])
def test_a_bad_setting_is_refused_naming_the_key(extra, key, said):
    with pytest.raises(ConnectorConfigError) as refused:
        connector_settings(extra)
    where = "kv_transfer_config.kv_connector_extra_config" + (f".{key}" if key else "")
    assert str(refused.value).startswith(where) and said in str(refused.value), refused.value


def test_the_connector_that_sends_refuses_vllms_own_scheduler():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from omni_runtime.devtools.sched_harness import make_vllm_config
    from omni_runtime.kv.connector import OmniKVConnector

    config = make_vllm_config({"need_send_cache": True})
    assert OmniKVConnector(config, KVConnectorRole.SCHEDULER).scheduler_half is not None
    config.scheduler_config.scheduler_cls = None  # vLLM's Scheduler
    with pytest.raises(ConnectorConfigError, match="vllm.v1.core.sched.scheduler.Scheduler, which never hands "
                                                   "a request off: add --scheduler-cls omni_runtime.sched"):
        OmniKVConnector(config, KVConnectorRole.SCHEDULER)


def test_an_unanswered_transfer_resolves_expired_and_is_recorded_so():
    from omni_runtime.transfers.ledger import TransferLedger, Trigger

    clock = [0.0]
    ledger = TransferLedger(timeout_seconds=10, clock=lambda: clock[0])
    for rid in ("hung", "refused", "fine"):
        ledger.mark(rid, Trigger.PREFILL_FINISHED, 4, [1])
    attempt = {t.request_id: t.attempt for t in ledger.hand_off_pending()}
    resolved = {t.request_id: t.outcome for t in ledger.resolve_answers({
        "hung": Answer(attempt["hung"], "no ack from stage next within 9.5s", expired=True),
        "refused": Answer(attempt["refused"], "stage next refused it"),
        "fine": Answer(attempt["fine"], nbytes=8)})}
    assert resolved == {"hung": Outcome.EXPIRED, "refused": Outcome.FAILED, "fine": Outcome.ACKED}
    assert [a.outcome for a in (Answer(0, "x", expired=True), Answer(0, "x"), Answer(0))] == \
        ["expired", "failed", "acked"]


def test_a_tensor_parallel_rank_that_expired_makes_the_transfer_expired():
    from omni_runtime.kv.metadata import ShardAnswers

    shards = ShardAnswers(2)
    shards.expect("r", 0)
    resolved, _ = shards.combine({0: {"r": Answer(0, nbytes=4)}, 1: {"r": Answer(0, "no ack", expired=True)}})
    assert resolved["r"].outcome == "expired" and resolved["r"].reason.startswith("tensor-parallel rank 1")


def test_our_log_lines_go_where_vllms_go(monkeypatch):
    """Under a plain `vllm serve` (no handler on the root logger): vLLM's handlers and level."""
    from omni_runtime.observability.logs import log_like_vllm

    package, vllm = logging.getLogger("omni_runtime"), logging.getLogger("vllm")
    handler = logging.StreamHandler()
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(package, "handlers", [])
    monkeypatch.setattr(package, "propagate", True)
    monkeypatch.setattr(package, "level", logging.NOTSET)
    monkeypatch.setattr(vllm, "handlers", [handler])
    monkeypatch.setattr(vllm, "level", logging.INFO)
    log_like_vllm()
    assert package.handlers == [handler] and package.level == logging.INFO and not package.propagate
    log_like_vllm()  # once
    assert package.handlers == [handler]
