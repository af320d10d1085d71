"""Image content parts: read from a file, base64 or a URL, checked before any server, refused for a text-only target."""
from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from draftline.config import PipelineConfig, TracesConfig
from draftline.conversations import BadRecord, Origin
from draftline.errors import ConfigError
from draftline.images import engine_messages, engine_part
from draftline.inputs import check_inputs
from draftline.store import open_store
from draftline.traces import generate_traces

ROOT = Path(__file__).resolve().parents[1]
KIMI = ROOT / "assets" / "demo-kimi"
LLAMA = ROOT / "assets" / "demo-llama"
ORIGIN = Origin("prompts.jsonl, line 1", "messages")
PART = "messages[0].content[0]"


def _png(colour: str = "red", size: tuple[int, int] = (28, 28)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def _record(image: dict, rid: str = "img") -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": [image, {"type": "text", "text": "What colour?"}]}]}


def _decoded(part: dict) -> Image.Image:
    url = part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_a_file_base64_and_a_data_url_all_reach_the_engine_as_one_data_url(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(_png())
    b64 = base64.b64encode(_png()).decode()
    forms = [{"type": "image", "image": "pics/red.png"},  # relative to the prompts file's folder
             {"type": "image_url", "image_url": {"url": str(tmp_path / "pics" / "red.png")}},
             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
             {"type": "image", "image": b64}]
    for form in forms:
        part = engine_part(form, ORIGIN, PART, base=tmp_path)
        assert part["type"] == "image_url" and _decoded(part).getpixel((0, 0)) == (255, 0, 0), form
    messages = engine_messages(_record(forms[0]), ORIGIN, tmp_path)
    assert messages[0]["content"][1] == {"type": "text", "text": "What colour?"}


@pytest.mark.parametrize("make, said", [
    (lambda d: {"type": "image", "image": "missing.png"}, "its image cannot be read (no such file"),
    (lambda d: {"type": "image", "image": str(_junk(d))}, "junk.png is not an image Pillow can open"),
    (lambda d: {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}},
     "the image URL http://127.0.0.1:9/cat.png cannot be reached from this worker"),
    (lambda d: {"type": "image_url"}, "names no image"),
])
def test_a_bad_image_is_one_sentence_naming_the_record_and_the_part(tmp_path, make, said):
    with pytest.raises(BadRecord) as err:
        engine_part(make(tmp_path), ORIGIN, PART, base=tmp_path, url_timeout_s=2)
    assert str(err.value).startswith(f"prompts.jsonl, line 1, {PART}: "), str(err.value)
    assert said in str(err.value)
    assert "\n" not in str(err.value)


def _junk(d: Path) -> Path:
    (d / "junk.png").write_bytes(b"this is not a PNG")
    return d / "junk.png"


def test_an_image_larger_than_the_loader_takes_is_named_with_its_size(tmp_path):
    (tmp_path / "big.png").write_bytes(_png(size=(300, 200)))
    with pytest.raises(BadRecord, match=r"big.png is 300x200 pixels, more than the 50000 the image loader takes; "
                                        r"scale it down"):
        engine_part({"type": "image", "image": "big.png"}, ORIGIN, PART, base=tmp_path, max_pixels=50_000)


def _prompts(tmp_path: Path, records: list[dict]) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def test_config_validate_refuses_image_prompts_for_a_text_only_target_in_one_sentence(tmp_path):
    (tmp_path / "red.png").write_bytes(_png())
    prompts = _prompts(tmp_path, [{"id": "t", "prompt": "Hello"}, _record({"type": "image", "image": "red.png"})])
    config = PipelineConfig.model_validate({"run": "r", "store": {"root": str(tmp_path / "s")},
                                            "target": {"path": str(LLAMA)},
                                            "traces": {"prompts": str(prompts)}, "eval": {"prompts": str(prompts)}})
    problems = check_inputs(config, needs=("traces.prompts", "eval.prompts")).problems
    assert problems == [f"{prompts}, line 2, messages[0].content[0]: an image part, but the target {LLAMA} is "
                        "text-only (its config.json has no vision_config); remove the image or use a multimodal "
                        "target"] * 2
    kimi = config.model_copy(update={"target": config.target.model_copy(update={"path": str(KIMI)})})
    assert check_inputs(kimi, needs=("traces.prompts", "eval.prompts")).problems == []


def test_bad_images_stop_the_traces_before_any_server_or_are_skipped_and_counted(tmp_path):
    """The endpoint answers nothing: each refusal comes before a request is sent."""
    (tmp_path / "red.png").write_bytes(_png())
    _junk(tmp_path)
    records = [_record({"type": "image", "image": "red.png"}, "good"),
               _record({"type": "image", "image": "junk.png"}, "unreadable"),
               _record({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, "unreachable")]
    prompts = _prompts(tmp_path, records)
    store = open_store(str(tmp_path / "store"))
    cfg = TracesConfig(prompts=str(prompts), backend="vllm", endpoint="http://127.0.0.1:9/v1")
    with pytest.raises(ConfigError, match=rf"^{prompts}, line 2, messages\[0\].content\[0\]: .*junk.png is not an "
                                          r"image Pillow can open"):
        generate_traces(cfg, KIMI, store, "bad")
    with pytest.raises(ConfigError, match=r"an image part, but the target .*demo-llama is text-only"):
        generate_traces(cfg, LLAMA, store, "text-only")
    assert store.list("bad/") == [] and store.list("text-only/") == []
    # Skipped: the two bad ones are counted; the good one is all that is left, and it needs the (absent) server.
    skip = cfg.model_copy(update={"on_bad_record": "skip"})
    from draftline.errors import EngineError
    with pytest.raises(EngineError):
        generate_traces(skip, KIMI, store, "skip")
    only_bad = _prompts(tmp_path, records[1:] + [{"id": "text", "prompt": "def f(x):"}])
    stats = generate_traces(TracesConfig(prompts=str(only_bad), on_bad_record="skip", max_new_tokens=4), LLAMA,
                            store, "skip-text")
    assert stats["dropped"]["bad_record"] == 2 and stats["skipped"]["count"] == 2
    assert [s["field"] for s in stats["skipped"]["records"]] == ["messages[0].content[0]"] * 2


def test_the_evaluation_sends_each_image_as_a_data_url_as_the_traces_do(tmp_path):
    from draftline.engines.client import load_prompts

    (tmp_path / "red.png").write_bytes(_png())
    prompts = _prompts(tmp_path, [_record({"type": "image", "image": "red.png"}), {"id": "t", "prompt": "Hi"}])
    image, text = load_prompts(prompts)
    assert _decoded(image.messages[0]["content"][0]).getpixel((0, 0)) == (255, 0, 0)
    assert image.messages[0]["content"][1] == {"type": "text", "text": "What colour?"} and text.prompt == "Hi"


def test_the_reference_decoder_refuses_an_image_the_processor_would_resize_in_one_sentence(tmp_path):
    from draftline.media_reference import prompt_media

    (tmp_path / "odd.png").write_bytes(_png(size=(30, 30)))
    (tmp_path / "fits.png").write_bytes(_png(size=(56, 84)))
    ids = [1, 4099, 2]
    expanded, images = prompt_media(KIMI, _record({"type": "image", "image": "fits.png"}), ids, ORIGIN, tmp_path)
    assert expanded == [1] + [4099] * 6 + [2] and images[0][1].tolist() == [[1, 6, 4]]
    with pytest.raises(BadRecord, match=r"^prompts.jsonl, line 1, messages\[0\].content\[0\]: it is 30x30 pixels, "
                                        r"which the target's processor resizes or pads; .* multiples of 28 pixels"):
        prompt_media(KIMI, _record({"type": "image", "image": "odd.png"}), ids, ORIGIN, tmp_path)


def test_the_report_says_how_many_prompts_had_images_on_each_engine_that_served_them():
    from draftline.eval_result import EvalResult
    from draftline.report import rendering_markdown

    def row(engine, status):
        return EvalResult(run="r", engine=engine, engine_version="1", status=status, hardware="cpu", target="t",
                          target_path="t", drafter="d", drafter_path="d", prompt_set="p", num_prompts=8,
                          num_prompts_with_images=6, num_speculative_tokens=3, chat_template={"template": "x"})

    lines = rendering_markdown([row("vllm", "ok"), row("sglang", "skipped")], {"chat_template": {}, "images": 18})
    assert lines[-1] == ("Prompts with images (sent to the engines' chat API): vllm: 6 of its 8 prompts; "
                         "traces: 18 images.")


def test_extraction_sends_one_placeholder_per_image_for_vllm_to_expand_again():
    from draftline.extract_vllm import collapse_runs

    assert collapse_runs([1, 7, 7, 7, 7, 2, 7, 7, 3, 7], 7) == [1, 7, 2, 7, 3, 7]
    assert collapse_runs([1, 2, 3], None) == [1, 2, 3]


def test_an_s3_image_is_read_from_the_store_and_a_missing_one_is_named(s3_uri):
    open_store(s3_uri).put_bytes("pics/red.png", _png())
    part = engine_part({"type": "image", "image": f"{s3_uri}/pics/red.png"}, ORIGIN, PART)
    assert _decoded(part).getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(BadRecord, match=rf"^prompts.jsonl, line 1, {re.escape(PART)}: its image cannot be read \(no "
                                        rf"object at {re.escape(s3_uri)}/pics/blue.png\)"):
        engine_part({"type": "image", "image": f"{s3_uri}/pics/blue.png"}, ORIGIN, PART)
