"""The overrides a deployment run takes: the flows' parameter schema, checked with the validator Prefect's server runs
on submission, refuses an unknown key, a wrong type, a value out of bounds and a malformed store URI, and accepts
what the config accepts; what an override sets (explicit nulls included) is what gets merged."""
from __future__ import annotations

import pytest

from draftline.config import PipelineConfig
from draftline.config_loading import load_config
from draftline.overrides import PipelineOverrides, overrides_dict

pytest.importorskip("prefect")
from prefect.utilities.callables import parameter_schema  # noqa: E402
from prefect.utilities.schema_tools.validation import ValidationError, validate  # noqa: E402

from flows.nightly import nightly_regression  # noqa: E402
from flows.pipeline import pipeline  # noqa: E402

FLOWS = {"pipeline": pipeline, "nightly": nightly_regression}


def _schema(name: str) -> dict:
    return parameter_schema(FLOWS[name].fn).model_dump_for_openapi()


@pytest.mark.parametrize("flow", sorted(FLOWS))
@pytest.mark.parametrize("override, named", [
    ({"train": {"max_stepz": 20}}, "'max_stepz' was unexpected"),
    ({"tarin": {"max_steps": 20}}, "'tarin' was unexpected"),
    ({"train": {"learning_rate": "fast"}}, "overrides.train.learning_rate"),
    ({"train": {"max_steps": 0}}, "overrides.train.max_steps"),
    ({"store": {"root": "s3:/typo"}}, "overrides.store.root"),
    ({"store": {"root": "S3://bucket/x"}}, "overrides.store.root"),
    ({"store": {"root": "gs://bucket/x"}}, "overrides.store.root"),
    ({"eval": {"engines": [{"engine": "vllm", "concurrency": 4}]}}, "overrides.eval.engines[0].concurrency"),
    ({"eval": {"engines": [{"engine": "vllm", "num_spec_tokens": 3}]}}, "'num_spec_tokens' was unexpected"),
])
def test_the_schema_refuses_a_bad_override_naming_it(flow, override, named):
    with pytest.raises(ValidationError) as err:
        validate({"overrides": override}, _schema(flow), raise_on_error=True)
    assert named in str(err.value)


@pytest.mark.parametrize("override", [
    {}, {"run": "try-2", "train": {"max_steps": 40}}, {"store": {"root": "s3://my-bucket/runs"}},
    {"store": {"root": "./runs"}}, {"extract": {"aux_layer_ids": None}},
    {"eval": {"engines": [{"engine": "vllm", "num_speculative_tokens": 3}]}},
])
def test_the_schema_accepts_what_the_config_accepts(override):
    validate({"overrides": override}, _schema("pipeline"), raise_on_error=True)
    merged = load_config("configs/demo.yaml", PipelineConfig, overrides_dict(PipelineOverrides.model_validate(override)))
    assert isinstance(merged, PipelineConfig)


def test_an_override_merges_only_what_it_sets_explicit_nulls_included():
    parsed = PipelineOverrides.model_validate({"train": {"max_steps": 7}, "extract": {"aux_layer_ids": None}})
    assert overrides_dict(parsed) == {"train": {"max_steps": 7}, "extract": {"aux_layer_ids": None}}
    assert overrides_dict(None) == {}


def test_the_run_form_shows_every_field_with_its_description():
    definitions = _schema("pipeline")["definitions"]
    train = definitions["TrainConfigOverride"]["properties"]
    assert train["max_steps"]["description"] == PipelineConfig.model_fields["train"].annotation.model_fields[
        "max_steps"].description
    undescribed = [f"{model}.{name}" for model, spec in definitions.items() if model.endswith("Override")
                   for name, field in spec["properties"].items() if not field.get("description")]
    assert not undescribed, undescribed
