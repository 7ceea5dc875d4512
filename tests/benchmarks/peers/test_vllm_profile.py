"""The report half of benchmarks/peers/vllm_profile.py (its run needs vLLM's venv, never installed here:
these tests feed it profiler records of the shape vLLM's engine produces)."""

import pytest

from benchmarks.peers import vllm_profile
from benchmarks.peers.vllm_profile import Record, split_step, table

FORWARD = ("gpu_model_runner: forward",)
HEAD = ("gpu_model_runner: postprocess",)


def _two_steps() -> list[Record]:
    """Two steps' records: scopes with their total time, ops with their own time (us)."""
    records = []
    for _ in range(2):
        records += [
            Record("gpu_model_runner: preprocess", 50.0, 300.0),
            Record("gpu_model_runner: forward", 40.0, 1000.0),
            Record("## Call CompiledFxGraph abc ##", 100.0, 900.0, FORWARD),
            Record("_C::onednn_mm", 400.0, 400.0, ("## Call CompiledFxGraph abc ##", *FORWARD)),
            Record("_C::cpu_attention_with_kv_cache", 300.0, 300.0, ("vllm::unified_attention_with_output", *FORWARD)),
            Record("vllm::unified_attention_with_output", 20.0, 320.0, FORWARD),
            Record("_C::cpu_attn_reshape_and_cache", 30.0, 30.0, FORWARD),
            Record("graph_0_cpp_fused_add_mean_mul_pow_rsqrt_1", 50.0, 50.0, ("## Call CompiledFxGraph abc ##", *FORWARD)),
            Record("gpu_model_runner: postprocess", 10.0, 200.0),
            Record("_C::onednn_mm", 150.0, 150.0, HEAD),
            Record("gpu_model_runner: sample", 20.0, 100.0),
            Record("_C::fused_gumbel_argmax", 80.0, 80.0, ("gpu_model_runner: sample",)),
            Record("schedule: allocate_slots", 30.0, 30.0),
        ]
    return records


def test_a_step_splits_into_its_forward_ops_and_the_rest():
    split = split_step(_two_steps(), steps=2, wall_ms=4.0, bare_step_ms=1.9)
    assert split.step_ms == pytest.approx(2.0) and split.bare_step_ms == 1.9
    # The forward is the model's scope and its head's (postprocess): 1000 + 200 us a step.
    assert split.step == pytest.approx({"forward": 1.2, "sampling": 0.1, "inputs": 0.3, "rest of step": 0.4})
    # Ops under the forward by their own time; the wrappers' own time is the forward's "no op".
    assert split.forward == pytest.approx({"GEMMs": 0.55, "attention": 0.3, "cache writes": 0.03, "kernels": 0.05,
                                           "no op": 1.2 - 0.55 - 0.3 - 0.03 - 0.05})
    assert sum(split.forward.values()) == pytest.approx(split.step["forward"])
    assert sum(split.step.values()) == pytest.approx(split.step_ms)


def test_the_sampler_and_scheduler_ops_stay_out_of_the_forward():
    records = [Record("gpu_model_runner: forward", 10.0, 10.0), Record("_C::fused_gumbel_argmax", 80.0, 80.0,
                                                                      ("gpu_model_runner: sample",))]
    split = split_step(records, steps=1, wall_ms=0.2, bare_step_ms=0.2)
    assert split.forward["kernels"] == 0.0 and split.forward["no op"] == pytest.approx(0.01)


def test_ops_are_classified_by_kind():
    assert vllm_profile.classify("_C::onednn_mm") == "GEMMs"
    assert vllm_profile.classify("_C::cpu_attention_with_kv_cache") == "attention"
    assert vllm_profile.classify("graph_0_cpp_fused_mul_silu_slice_3") == "kernels"
    assert vllm_profile.is_wrapper("## Call CompiledFxGraph xyz ##") and not vllm_profile.is_wrapper("aten::mm")


def test_the_table_has_a_row_per_stream_count_and_every_column():
    split = split_step(_two_steps(), steps=2, wall_ms=4.0, bare_step_ms=1.9)
    lines = table({16: split, 1: split}, "vLLM").splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["1 x 1", "16 x 1"]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert len(header) == 1 + 2 + len(vllm_profile.STEP_COLUMNS) + len(vllm_profile.FORWARD_COLUMNS)
    assert lines[2].split("|")[2].strip() == "1.90" and lines[2].split("|")[4].strip() == "1.20"
