"""`omni-pipeline up examples/tiny-pipeline.yaml`: the file `kubectl apply` takes, run as local
processes (what `make demo` runs): requests' KV arrives downstream, the table shows it, and
Ctrl-C stops every stage."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml
from chain import CHAIN_ENV
from procs import http_get, metric_value, wait_until

from omni_runtime.devtools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def processes_with_env(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (every descendant inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue  # gone meanwhile, or not ours
        if marker.encode() in environ.split(b"\0") and "\nState:\tZ" not in status:
            found.append(int(entry.name))
    return found


def test_up_runs_the_tiny_pipeline_and_ctrl_c_stops_every_stage(tmp_path):
    # The example names its model by a path relative to where `up` runs (the repo root for
    # `make demo`); run it from a scratch directory holding that path.
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    model_path = tmp_path / body["spec"]["model"]["path"]
    model_path.parent.mkdir(parents=True)
    shutil.copytree(ensure_tiny_model(), model_path)
    workdir = tmp_path / "run"
    marker = f"OMNI_TEST_RUN={uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_operator.local.cli", "up", str(ROOT / "examples" / "tiny-pipeline.yaml"),
         "--demo", "2", "--workdir", str(workdir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", marker.split("=")[0]: marker.split("=")[1]},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        text = lambda: "".join(lines)  # noqa: E731
        wait_until(lambda: re.search(r"^ar\s+ar\s+yes\s+0/0/0\s+2\s+0", text(), re.M), 300,
                   lambda: f"the table to show 2 deliveries; output so far:\n{text()}" )
        out = text()
        assert out.count("KV arrived at stage receiver") == 1
        assert len(re.findall(r"^  cmpl-\S+: seq_len=\d+ float32\[2, 2, 2, \d+, 32\]", out, re.M)) == 2
        urls = set(re.findall(r"http://127\.0\.0\.1:\d+/metrics", out))
        assert len(urls) == 2
        for url in urls:
            assert http_get(url)[0] == 200
        assert len(processes_with_env(marker)) >= 5, "runner, 2 stages, vLLM, its engine core"
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=120) == 0
        wait_until(lambda: not processes_with_env(marker), 30, "every stage process to be gone")
        for url in urls:
            try:
                status = http_get(url, timeout=2)[0]
            except OSError:
                status = None
            assert status is None, f"{url} still answers after Ctrl-C"
        assert (workdir / "ar.yaml").exists() and (workdir / "receiver.log").exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in processes_with_env(marker):  # whatever survived a failure above
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=10)


@contextlib.contextmanager
def demo_up(example: str, tmp_path: Path, *args: str):
    """``omni-pipeline up examples/<example> --demo 1 ARGS...`` with the tiny model where the example
    names it, on vLLM's one-process executor in each engine core (tests/runtime/chain.py,
    CHAIN_ENV; the tiny pipeline's test above runs `up` on vLLM's default): yields (the
    process, its output so far as a callable, the marker its processes carry). Ctrl-C must
    stop every process (asserted by the caller); whatever is left is killed."""
    body = yaml.safe_load((ROOT / "examples" / example).read_text())
    model_path = tmp_path / body["spec"]["model"]["path"]
    model_path.parent.mkdir(parents=True)
    shutil.copytree(ensure_tiny_model(), model_path)
    marker = f"OMNI_TEST_RUN={uuid.uuid4().hex}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_operator.local.cli", "up", str(ROOT / "examples" / example),
         "--demo", "1", "--workdir", str(tmp_path / "run"), *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        env={**os.environ, **CHAIN_ENV, "PYTHONUNBUFFERED": "1",
             marker.split("=")[0]: marker.split("=")[1]},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        yield proc, lambda: "".join(lines), marker
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The stages lead sessions of their own: a test failing before its Ctrl-C (or a
        # runner killed) leaves them running unless they go here.
        for pid in processes_with_env(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reader.join(timeout=10)


def test_up_runs_the_tiny_chain_behind_its_one_endpoint(tmp_path):
    """examples/tiny-chain.yaml (thinker -> talker -> vocoder) with the operator's own stage
    configs: `up` prints the pipeline's endpoint; an OpenAI client's prompt there comes back
    as the vocoder's payload, whose talker input is the thinker's own answer to the prompt,
    token for token; Ctrl-C stops every process."""
    import openai

    with demo_up("tiny-chain.yaml", tmp_path) as (proc, text, marker):
        wait_until(lambda: re.search(r"^request 0: .* at stage vocoder, from talker$", text(), re.M),
                   300, lambda: f"the demo request's answer; output so far:\n{text()}")
        endpoint = re.search(r"the pipeline's endpoint \(OpenAI API\): (\S+) \(ready\)", text()).group(1)
        thinker = re.search(r"^thinker\s+ar\s+.*(http://\S+)/metrics", text(), re.M).group(1)
        prompt = [31, 32, 33, 34]
        answer = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0).completions.create(
            model="tiny-qwen2", prompt=prompt, max_tokens=6, temperature=0)
        payload = answer.choices[0].model_extra["omni_payload"]
        alone = openai.OpenAI(base_url=thinker + "/v1", api_key="unused").completions.create(
            model="tiny-qwen2", prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"return_token_ids": True})
        assert payload["token_ids"][:payload["prompt_len"]] == \
            prompt + list(alone.choices[0].model_extra["token_ids"])
        assert len(payload["token_ids"]) - payload["prompt_len"] == 16, "the talker's samplingParams"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        wait_until(lambda: not processes_with_env(marker), 30, "every process to be gone")


def test_up_runs_the_streamed_example_and_each_stage_takes_its_input_as_it_comes(tmp_path):
    """examples/tiny-omni-streaming.yaml (thinker -> talker -> vocoder, both edges streamed),
    as `make demo DEMO_ARGS=--streaming` runs it: the demo's request answered streamed, then
    the same pipeline with both edges whole started, asked the same, stopped, and both modes'
    first output's times printed (which one is sooner is a timing, not asserted here: under
    make test's load three requests each way once had the whole one sooner; the streamed
    first output's gain is benchmarks/streaming.py's figure). Then, on the streamed pipeline:
    the talker's first input is the prompt and the thinker's first chunk alone, the vocoder
    takes its stream before the talker has finished, and the vocoder's stream is every token
    the talker said, in the chunks the edge's cadence cuts."""
    import openai

    # Three requests each way: the medians compared, as `make demo` prints them.
    with demo_up("tiny-omni-streaming.yaml", tmp_path, "--streaming", "--demo", "3") as (
            proc, text, marker):
        wait_until(lambda: re.search(r"^request 0: .* in \d+ streamed chunks at stage vocoder, "
                                     r"from talker$", text(), re.M),
                   300, lambda: f"the demo request's answer; output so far:\n{text()}")
        # The comparison: the same request through the same pipeline fed whole.
        wait_until(lambda: "streamed, the first output came" in text(), 420,
                   lambda: f"both modes' first output's times; output so far:\n{text()}")
        out = text()
        assert re.search(r"^whole: request 0: .* and their KV .* at stage vocoder, from talker$",
                         out, re.M), out
        medians = {mode: float(m) for mode, m in re.findall(
            r"^  (streamed|whole hand-offs): +[\d.]+ s, [\d.]+ s, [\d.]+ s \(median ([\d.]+) s\)$",
            out, re.M)}
        assert set(medians) == {"streamed", "whole hand-offs"}, out
        assert re.search(r"^  streamed, the first output came (\d+\.\dx sooner|no sooner)$",
                         out, re.M), out
        # The whole pipeline was only for the comparison: its stages are gone.
        whole_pids = [int(p.read_text()) for p in (tmp_path / "run" / "whole").glob("*.pid")]
        assert len(whole_pids) == 4, "thinker, talker, vocoder, endpoint"
        assert not set(whole_pids) & set(processes_with_env(marker))
        endpoint = re.search(r"the pipeline's endpoint \(OpenAI API\): (\S+) \(ready\)",
                             text()).group(1)
        thinker = re.search(r"^thinker\s+ar\s+.*(http://\S+)/metrics", text(), re.M).group(1)
        prompt, said = [31, 32, 33, 34], 40
        answer = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0).completions.create(
            model="tiny-qwen2", prompt=prompt, max_tokens=said, temperature=0,
            extra_body={"ignore_eos": True})
        payload = answer.choices[0].model_extra["omni_payload"]
        alone = openai.OpenAI(base_url=thinker + "/v1", api_key="unused").completions.create(
            model="tiny-qwen2", prompt=prompt, max_tokens=said, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True})
        thinker_tokens = list(alone.choices[0].model_extra["token_ids"])
        assert payload["streamed"] and payload["outcome"] == "finished"
        # The talker's stream begins with its own first input: the prompt and the thinker's
        # first chunk (4 tokens) alone, as the default input hook passes them on: it started
        # on the first chunk, not on the thinker's whole answer.
        assert payload["token_ids"][:payload["prompt_len"]] == prompt + thinker_tokens[:4]
        # 16 per thinker chunk (4, then 8 each: 6 chunks), less the one a turn ends on where
        # vLLM's session drops a token still in flight.
        talker_said = len(payload["token_ids"]) - payload["prompt_len"]
        assert 16 * 6 - 6 <= talker_said <= 16 * 6
        assert payload["chunks"] == 1 + -(-(talker_said - 4) // 4)
        stages = answer.model_extra["omni"]["stages"]
        # The vocoder took its first chunk before the talker had said its ~96 tokens. (The
        # talker against the thinker's 40 is a timing under make test's load: the talker once
        # took its first chunk half a millisecond after the thinker finished; its first input,
        # above, shows it began on the first chunk.)
        assert stages["vocoder"]["taken_at"] < stages["talker"]["finished_at"]

        # The vocoder (a receiving last stage) stopped mid-stream: it holds its stream's link
        # to the endpoint from its first chunk on, so the endpoint's pings miss it and the
        # client is told, naming it (an outside review: it held no link while streaming, and
        # the error came only once it was resumed, blaming the talker).
        vocoder = re.search(r"^vocoder\s+.*?(http://\S+)/metrics", text(), re.M).group(1)
        vocoder_pid = int((tmp_path / "run" / "vocoder.pid").read_text())
        outcome: dict = {}

        def ask(attempt: int) -> None:
            try:  # 60 tokens: the talker's 16 after each of their chunks fit its 256
                openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=120).completions.create(
                    model="tiny-qwen2", prompt=[41, 42, attempt], max_tokens=60, temperature=0,
                    extra_body={"ignore_eos": True})
            except openai.APIError as exc:
                outcome["error"] = exc

        def open_at_vocoder() -> bool:
            page = http_get(vocoder + "/metrics", timeout=5)[1].decode()
            return metric_value(page, "omni_kv_streams", state="open", from_stage="talker",
                                to_stage="vocoder") >= 1

        for attempt in range(3):  # a stream that ended before the stop took: asked again
            asker = threading.Thread(target=ask, args=(attempt,))
            asker.start()
            wait_until(open_at_vocoder, 60, "the vocoder's stream to open", interval=0.05)
            os.killpg(vocoder_pid, signal.SIGSTOP)
            try:
                # Its link's pings (2/3 of the 15 s gap: lost after ~15 s), or, stopped before
                # its link said it took the stream, the first-chunk deadline (10 s): either
                # names it, long before the 60 s it stays stopped.
                asker.join(60)
                assert not asker.is_alive(), "the client was told while the vocoder was stopped"
            finally:
                os.killpg(vocoder_pid, signal.SIGCONT)
            if "error" in outcome:
                break
        else:
            raise AssertionError("the vocoder's stream ended before it was stopped, 3 times")
        said = str(outcome["error"])
        assert "stage vocoder" in said and ("heartbeat" in said or "did not take the stream" in said), said
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        wait_until(lambda: not processes_with_env(marker), 30, "every process to be gone")
