"""``models.<name>.quantization`` (cluster/config/model_args.py): a draft may be a weight-only
quantized copy (int8 or int4) of a checkpoint, the target's own for a self-draft; any other
value, or a quantization on a target or a member, is refused at load naming the field."""

from __future__ import annotations

import pathlib

import pytest

from cluster.config import ConfigError, ModelArgs, load_app_args, parse_app_args

REPO = pathlib.Path(__file__).resolve().parents[3]


def _args(**draft) -> dict:
    return {"models": {"target": {"path": "embedded:target", "role": "target"},
                       "draft": {"path": "embedded:target", "role": "draft", **draft}}}


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_a_draft_may_be_a_quantized_copy_of_the_target(quantization):
    group = parse_app_args(_args(quantization=quantization)).freeze()
    draft, target = group.model("draft"), group.model("target")
    assert draft.quantization == quantization and target.quantization is None
    assert draft.path == target.path  # the target's own checkpoint


def test_quantization_is_unset_by_default():
    assert ModelArgs(path="embedded:draft", role="draft").quantization is None


def test_an_unknown_quantization_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"models\.draft\.quantization = 'fp8': Input should be 'int8', 'int4' or 'w8a8'"):
        parse_app_args(_args(quantization="fp8"))


@pytest.mark.parametrize("role", ["target", "member"])
def test_a_quantization_on_a_model_that_defines_the_law_is_refused(role):
    args = _args()
    args["models"]["other"] = {"path": "embedded:partner", "role": "member"}
    name = "target" if role == "target" else "other"
    args["models"][name]["quantization"] = "int8"
    with pytest.raises(ConfigError, match=rf"models\.{name}.*quantization: 'int8' is for a draft model.*a '{role}'"):
        parse_app_args(args)


def test_the_self_draft_deployment_names_an_int8_copy_of_its_target_in_its_worker():
    from cluster.config.placement import resolve_placement

    group = load_app_args(REPO / "deploy" / "self_draft.yaml").freeze()
    assert group.model("draft").quantization == "int8"
    assert group.model("draft").path == group.model("target").path
    assert resolve_placement(group, gpus=0).workers == (("target", "draft"),)  # one process, one tokenizer
