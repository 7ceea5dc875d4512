"""cluster.config: the Serve YAML args schema, its error messages, and the frozen form."""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml
from pydantic import ValidationError

from actors.request_schema import InvalidRequestError, SpeculationParams
from actors.coordination.plan import resolve_plan
from cluster.serving.bringup import model_group_bundles
from cluster.config import ConfigError, GroupConfig, load_app_args, parse_app_args

REPO = pathlib.Path(__file__).resolve().parents[3]

BASE_ARGS = {
    "models": {
        "target": {"path": "embedded:target", "role": "target"},
        "draft": {"path": "embedded:draft", "role": "draft"},
        "partner": {"path": "embedded:partner", "role": "member"},
    },
    "defaults": {"strategy": "sd", "method": "block", "gamma": 4, "members": ["target", "partner"]},
}


def _with(**changes):
    args = copy.deepcopy(BASE_ARGS)
    for dotted, value in changes.items():
        node = args
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return args


def _write(tmp_path, applications) -> pathlib.Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"applications": applications}))
    return path


def test_default_yaml_loads_and_freezes():
    args = load_app_args(REPO / "deploy" / "default.yaml")
    config = args.freeze()
    assert isinstance(config, GroupConfig)
    assert config.roles == {"target": "target", "draft": "draft", "partner": "member", "partner2": "member"}
    assert config.model("target").path == str(REPO / "models" / "embedded" / "target")
    assert config.tokenizer_path == config.model("target").path
    assert config.defaults.strategy == "sd" and config.defaults.method == "block"
    with pytest.raises(ValidationError):
        config.models[0].name = "other"  # frozen


@pytest.mark.parametrize("path", sorted((REPO / "deploy").glob("*.yaml")), ids=lambda p: p.name)
def test_every_deploy_yaml_validates(path):
    document = yaml.safe_load(path.read_text())
    for app in document["applications"]:
        if app.get("import_path") == "cluster.app:build_app":
            parse_app_args(app["args"], where=f"{path.name}:{app['name']}").freeze()


@pytest.mark.parametrize(
    "args,needles",
    [
        (_with(surprise=1), ["surprise", "Extra inputs are not permitted"]),
        (_with(models__draft__role="drafter"), ["models.draft.role", "'drafter'"]),
        (_with(models__draft__dtype="int3"), ["models.draft.dtype", "'int3'"]),
        (_with(models__partner__role="target"), ["at most one model may have role 'target'"]),
        (_with(defaults__gamma=0), ["defaults.gamma", "0"]),
        (_with(defaults__members=["target", "ghost"]), ["defaults.members", "ghost"]),
        (_with(defaults__method="spectr"), ["defaults.method", "spectr"]),
        (_with(defaults__strategy="ensemble", defaults__method=None, defaults__weights=[0.5, 0.6]),
         ["defaults.weights", "sum"]),
        (_with(defaults__strategy="se", defaults__gammas=[2]), ["defaults.gammas", "expected 2"]),
        (_with(resources__per_model={"ghost": {"gpus": 1}}), ["resources.per_model", "ghost"]),
        (_with(limits__max_concurrent_requests=0), ["limits.max_concurrent_requests", "0"]),
        (_with(engine__kv_cache_memory="4 bananas"), ["engine.kv_cache_memory", "'4 bananas'", "4GiB"]),
        (_with(engine__kv_cache_memory=1.5), ["engine.kv_cache_memory", "1.5", "(0, 1]"]),
        (_with(engine__kv_cache_memory=0), ["engine.kv_cache_memory", ">= 1"]),
        (_with(engine__max_model_len=1), ["engine.max_model_len", "1"]),
    ],
    ids=["extra-key", "bad-role", "bad-dtype", "two-targets", "gamma", "members", "method", "weights", "gammas",
         "per-model", "limits", "kv-memory-unit", "kv-memory-fraction", "kv-memory-zero", "max-model-len"],
)
def test_errors_name_the_key_and_value(args, needles):
    with pytest.raises(ConfigError) as raised:
        parse_app_args(args)
    message = str(raised.value)
    for needle in needles:
        assert needle in message, message


def test_sd_default_without_a_draft_is_rejected():
    args = _with()
    del args["models"]["draft"]
    with pytest.raises(ConfigError, match="needs a draft model"):
        parse_app_args(args)


def test_load_app_args_selects_applications(tmp_path):
    apps = [
        {"name": "one", "import_path": "cluster.app:build_app", "route_prefix": "/a", "args": BASE_ARGS},
        {"name": "two", "import_path": "cluster.app:build_app", "route_prefix": "/b",
         "args": _with(defaults__strategy="ar", defaults__method=None)},
    ]
    path = _write(tmp_path, apps)
    assert load_app_args(path, "two").defaults.strategy == "ar"
    with pytest.raises(ConfigError, match="pass the name"):
        load_app_args(path)
    with pytest.raises(ConfigError, match="no application named 'three'"):
        load_app_args(path, "three")
    with pytest.raises(ConfigError, match="not found"):
        load_app_args(tmp_path / "missing.yaml")


def test_resources_become_bundles():
    args = _with(resources={"gpus_per_model": 1, "cpus_per_model": 2, "per_model": {"draft": {"gpus": 0.5}}})
    assert model_group_bundles(args) == [
        {"CPU": 2.0, "GPU": 1.0},
        {"CPU": 2.0, "GPU": 0.5},
        {"CPU": 2.0, "GPU": 1.0},
    ]
    assert parse_app_args(BASE_ARGS).freeze().models[0].num_gpus is None  # 'auto' until bring-up
    # auto on a machine without GPUs: the draft shares its target's worker (cluster/config/placement.py)
    assert model_group_bundles(BASE_ARGS) == [{"CPU": 0.5}, {"CPU": 0.25}]
    with pytest.raises(ConfigError, match="gpus_per_model"):
        parse_app_args(_with(resources={"gpus_per_model": -1}))


def test_plan_falls_back_to_each_strategys_default_method():
    config = parse_app_args(BASE_ARGS).freeze()
    plan = resolve_plan(SpeculationParams(), config.defaults, config.roles)
    assert (plan.strategy, plan.method, plan.target, plan.draft) == ("sd", "block", "target", "draft")
    plan = resolve_plan(SpeculationParams(strategy="multi_draft"), config.defaults, config.roles)
    assert plan.method == "spectr" and plan.num_drafts == 2
    plan = resolve_plan(SpeculationParams(strategy="se"), config.defaults, config.roles)
    assert plan.method == "token" and plan.members == ("target", "partner") and plan.gammas == (4, 4)  # not sd's block
    assert plan.weights == (0.5, 0.5)
    with pytest.raises(InvalidRequestError) as raised:
        resolve_plan(SpeculationParams(strategy="ensemble", members=["target"]), config.defaults, config.roles)
    assert raised.value.field == "speculation.members"


def test_each_strategy_keeps_its_own_default_proposer():
    default_yaml = load_app_args(REPO / "deploy" / "default.yaml").freeze()
    plan = resolve_plan(SpeculationParams(), default_yaml.defaults, default_yaml.roles)
    assert (plan.strategy, plan.proposer, plan.draft) == ("sd", "draft", "draft")
    plan = resolve_plan(SpeculationParams(strategy="se"), default_yaml.defaults, default_yaml.roles)
    assert (plan.proposer, plan.draft, plan.method, plan.members) == ("draft", "draft", "block", ("target", "partner"))
    plan = resolve_plan(SpeculationParams(strategy="se", proposer="alternate", gammas=[1, 2]),
                        default_yaml.defaults, default_yaml.roles)
    assert (plan.proposer, plan.draft, plan.method, plan.gammas) == ("alternate", None, "token", (1, 2))
    with pytest.raises(InvalidRequestError) as raised:  # gammas are the alternate proposer's
        resolve_plan(SpeculationParams(strategy="se", gammas=[1, 2]), default_yaml.defaults, default_yaml.roles)
    assert raised.value.field == "speculation.gammas"
    ngram_sd = parse_app_args(_with(defaults__proposers={"sd": "ngram"})).freeze()
    assert resolve_plan(SpeculationParams(), ngram_sd.defaults, ngram_sd.roles).proposer == "ngram"
    assert resolve_plan(SpeculationParams(strategy="se"), ngram_sd.defaults, ngram_sd.roles).proposer == "alternate"
    se_default = parse_app_args(_with(defaults__strategy="se", defaults__method=None, defaults__proposer="partner")).freeze()
    assert resolve_plan(SpeculationParams(), se_default.defaults, se_default.roles).proposer == "partner"
    assert resolve_plan(SpeculationParams(strategy="sd"), se_default.defaults, se_default.roles).proposer == "draft"


def test_se_with_a_model_proposer_has_its_own_default_block():
    """defaults.se_draft_gamma: the block of se with a model proposer when a request gives none;
    sd, multi_draft and the alternate proposer keep defaults.gamma; a request's gamma wins."""
    default_yaml = load_app_args(REPO / "deploy" / "default.yaml").freeze()
    defaults, roles = default_yaml.defaults, default_yaml.roles
    assert (defaults.gamma, defaults.se_draft_gamma) == (4, 5)
    assert resolve_plan(SpeculationParams(strategy="se"), defaults, roles).gamma == 5
    assert resolve_plan(SpeculationParams(strategy="se", gamma=3), defaults, roles).gamma == 3
    assert resolve_plan(SpeculationParams(strategy="sd"), defaults, roles).gamma == 4
    assert resolve_plan(SpeculationParams(strategy="se", proposer="alternate"), defaults, roles).gammas == (4, 4)
    auto = defaults.model_copy(update={"se_draft_gamma": "auto", "gamma_max": 6})
    plan = resolve_plan(SpeculationParams(strategy="se"), auto, roles)
    assert plan.adaptive is not None and plan.gamma == 6
    unset = parse_app_args(BASE_ARGS).freeze()
    assert unset.defaults.se_draft_gamma is None
    assert resolve_plan(SpeculationParams(strategy="se", proposer="draft"), unset.defaults, unset.roles).gamma == 4
    with pytest.raises(ConfigError, match="se_draft_gamma"):
        parse_app_args(_with(defaults__se_draft_gamma=0))


@pytest.mark.parametrize(("args", "needles"), [
    (_with(defaults__proposers={"se": "ghost"}), ["defaults.proposers.se", "ghost"]),
    (_with(defaults__proposers={"sd": "lookup"}), ["defaults.proposers.sd", "lookup"]),
    (_with(defaults__proposer="ngram", defaults__proposers={"sd": "draft"}), ["disagree", "proposers.sd"]),
], ids=["unknown-se-model", "unknown-sd-proposer", "disagreeing"])
def test_bad_default_proposers_are_named(args, needles):
    with pytest.raises(ConfigError) as raised:
        parse_app_args(args)
    for needle in needles:
        assert needle in str(raised.value), str(raised.value)


def test_gamma_auto_resolves_to_adaptive_settings_for_speculative_strategies():
    config = parse_app_args(
        _with(defaults__gamma="auto", defaults__gamma_max=6, defaults__draft_cost_ratio=0.2, defaults__gammas=[3, 3])
    ).freeze()
    plan = resolve_plan(SpeculationParams(), config.defaults, config.roles)
    assert plan.adaptive is not None and plan.gamma == 6
    assert (plan.adaptive.gamma_max, plan.adaptive.draft_cost_ratio) == (6, 0.2)
    plan = resolve_plan(SpeculationParams(strategy="multi_draft", gamma_max=3), config.defaults, config.roles)
    assert plan.adaptive.gamma_max == 3 and plan.gamma == 3
    plan = resolve_plan(SpeculationParams(gamma=5), config.defaults, config.roles)
    assert plan.adaptive is None and plan.gamma == 5
    # the alternate proposer's gamma "auto": its gammas (else 1 each), plain ensemble steps where they do not pay
    plan = resolve_plan(SpeculationParams(strategy="se"), config.defaults, config.roles)
    assert plan.adaptive is not None and plan.gammas == (3, 3)
    no_gammas = config.defaults.model_copy(update={"gammas": None})
    plan = resolve_plan(SpeculationParams(strategy="se"), no_gammas, config.roles)
    assert plan.adaptive is not None and plan.gammas == (1, 1)
    plan = resolve_plan(SpeculationParams(strategy="se", gamma=2), no_gammas, config.roles)
    assert plan.adaptive is None and plan.gammas == (2, 2)


@pytest.mark.parametrize("value", [0, 33, "fast", True, 2.5])
def test_bad_gamma_is_named_with_both_accepted_forms(value):
    with pytest.raises(ConfigError) as raised:
        parse_app_args(_with(defaults__gamma=value))
    assert "defaults.gamma" in str(raised.value) and '"auto"' in str(raised.value)
    with pytest.raises(ValidationError) as invalid:
        SpeculationParams(gamma=value)
    assert invalid.value.errors()[0]["loc"] == ("gamma",)


def test_overlap_auto_is_on_only_when_every_worker_has_a_gpu():
    config = parse_app_args(BASE_ARGS).freeze()
    assert config.overlap == "auto" and not config.uses_overlap  # GPUs not settled: none
    on_gpus = config.model_copy(update={"models": tuple(m.model_copy(update={"num_gpus": 1.0}) for m in config.models)})
    assert on_gpus.uses_overlap
    shared = config.model_copy(update={"models": tuple(m.model_copy(update={"num_gpus": 0.5}) for m in config.models)})
    assert not shared.uses_overlap
    on_cpu = config.model_copy(update={"models": tuple(m.model_copy(update={"num_gpus": 0.0}) for m in config.models)})
    assert not on_cpu.uses_overlap
    for forced in (True, False):
        assert parse_app_args(_with(engine={"overlap": forced})).freeze().uses_overlap is forced
    with pytest.raises(ConfigError, match="engine.overlap"):
        parse_app_args(_with(engine={"overlap": "sometimes"}))


def test_sampling_precision_auto_is_float32_when_a_worker_has_a_gpu():
    config = parse_app_args(BASE_ARGS).freeze()
    assert config.sampling_precision == "auto" and config.row_precision == "float64"  # GPUs not settled: none
    one_gpu = config.model_copy(update={"models": (config.models[0].model_copy(update={"num_gpus": 1.0}),
                                                   *(m.model_copy(update={"num_gpus": 0.0}) for m in config.models[1:]))})
    assert one_gpu.row_precision == "float32"
    on_cpu = config.model_copy(update={"models": tuple(m.model_copy(update={"num_gpus": 0.0}) for m in config.models)})
    assert on_cpu.row_precision == "float64"
    for forced in ("float32", "float64"):
        assert parse_app_args(_with(engine={"sampling_precision": forced})).freeze().row_precision == forced
    with pytest.raises(ConfigError, match="engine.sampling_precision"):
        parse_app_args(_with(engine={"sampling_precision": "float16"}))


@pytest.mark.parametrize(
    "value,expected",
    [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29), (" 64 kib ", 64 * 1024),
     ("1000", 1000), (123456789, 123456789), (0.9, 0.9), (1.0, 1.0)],
)
def test_kv_cache_memory_reads_bytes_and_fractions(value, expected):
    config = parse_app_args(_with(engine__kv_cache_memory=value, engine__max_model_len=512)).freeze()
    assert config.kv_cache_memory == expected and type(config.kv_cache_memory) is type(expected)
    assert config.max_model_len == 512


def test_kv_settings_and_dtype_default_to_unset():
    config = parse_app_args(_with()).freeze()
    assert (config.kv_cache_memory, config.max_model_len) == (None, None)
    assert {model.dtype for model in config.models} == {None}  # the checkpoint's on a GPU, float32 on CPU
    explicit = parse_app_args(_with(models__target__dtype="float32")).freeze()
    assert explicit.model("target").dtype == "float32"


def test_torch_threads_takes_a_count_or_auto_and_names_the_field_otherwise():
    assert parse_app_args(_with()).resources.torch_threads == 1
    for value in (3, "auto"):
        config = parse_app_args(_with(resources__torch_threads=value)).freeze()
        assert {model.torch_threads for model in config.models} == {value}  # every worker gets it as given
    for bad in (0, "many", 1.5):
        with pytest.raises(ConfigError, match="resources.torch_threads"):
            parse_app_args(_with(resources__torch_threads=bad))
