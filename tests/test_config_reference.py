"""The config reference: every config field is described, and docs/reference/config.md is what the models generate."""
from pathlib import Path

import pytest

from draftline.config import PipelineConfig
from draftline.docs_reference import (CONFIG_PAGE, REGENERATE, config_models, config_reference, config_sections, main,
                                      stale_pages, write_config_reference)

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_description():
    missing = [f"{model.__name__}.{name}" for model in config_models()
               for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not missing, ("these config fields have no Field(description=...) in draftline/config.py, so neither the "
                         f"config reference nor the Prefect run form can explain them: {', '.join(missing)}")


def test_the_config_reference_page_is_what_the_models_generate():
    page = ROOT / CONFIG_PAGE
    assert page.is_file(), f"{CONFIG_PAGE} is missing; generate it with: {REGENERATE}"
    assert page.read_text(encoding="utf-8") == config_reference(), (
        f"{CONFIG_PAGE} is stale (the config models changed since it was written); regenerate it with: {REGENERATE}")


def test_the_page_has_a_section_per_yaml_section_and_a_row_per_key():
    text = config_reference()
    paths = [path for path, _ in config_sections()]
    assert paths[:5] == ["", "store", "target", "traces", "traces.vllm"]
    assert {"eval.engines[]", "eval.reference", "extract.vllm", "child_runs"} <= set(paths)
    for path, model in config_sections():
        assert (f"## `{path}`" if path else "## Top level") in text
        for name in model.model_fields:
            assert f"| `{path + '.' if path else ''}{name}` |" in text
    # Required keys, bounds, literal choices and list defaults as a YAML writer reads them.
    assert "| `target.path` | string | required |" in text
    assert "| `train.ttt_steps` | integer (≥ 1, ≤ 16) | `7` |" in text
    assert "| `eval.parity_threshold` | number or `auto` | `auto` |" in text
    assert '| `eval.engines` | list of sections | `[{"engine": "vllm"}, {"engine": "sglang"}]` |' in text
    # Angle brackets are text, not HTML tags.
    assert "<run>" not in text and "&lt;run>" in text


def test_check_mode_fails_on_a_stale_page_and_passes_once_written(tmp_path, capsys):
    assert CONFIG_PAGE in stale_pages(tmp_path)
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--root", str(tmp_path)]) == 0 and stale_pages(tmp_path) == []
    write_config_reference(tmp_path / CONFIG_PAGE)
    assert main(["--check", "--root", str(tmp_path)]) == 0
    (tmp_path / CONFIG_PAGE).write_text(config_reference().replace("Optimizer steps", "Steps"), encoding="utf-8")
    assert main(["--check", "--root", str(tmp_path)]) == 1


@pytest.mark.prefect
def test_the_prefect_run_form_shows_the_same_descriptions():
    """Flows that take `config: PipelineConfig` expose the models' schema, descriptions included, as their form."""
    pytest.importorskip("prefect")
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline

    definitions = parameter_schema(pipeline.fn).model_dump()["definitions"]
    for model in {m for _, m in config_sections(PipelineConfig)}:
        properties = definitions[model.__name__]["properties"]
        for name, field in model.model_fields.items():
            assert properties[name].get("description") == field.description, f"{model.__name__}.{name}"
