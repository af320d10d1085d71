"""Every drafter layout teams hold reads into the same head and ids as draftline's own export; `draftline convert`
round-trips through draftline's formats bit for bit; bad drafters are one sentence naming the file and the fix."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftline.config import DrafterConfig
from draftline.drafter.eagle_format import save_eagle_dir
from draftline.drafter.export import FORMATS, convert_drafter, export_drafter
from draftline.drafter.readers import read_drafter
from draftline.drafter.target_sizing import drafter_for_target
from draftline.drafter.train import load_target_head
from draftline.drafter.vocab import build_vocab
from draftline.drafter.warm_start import warm_start, warm_start_config
from draftline.errors import ConfigError
from tests.fixtures.public_drafters import (SCALED, rename_into_eagle_layout, rename_into_speculators_layout,
                                            republish_in_public_layout, write_random_mla_drafter,
                                            write_random_public_drafter)

REPO = Path(__file__).resolve().parents[1]
DEMO_LLAMA = REPO / "assets" / "demo-llama"
DEMO_KIMI = REPO / "assets" / "demo-kimi"
TRAINED_IDS = [2, 4, 5]  # demo-llama's 8 layers: inputs of 2, L//2, L-3 (vLLM convention)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """A drafter for demo-llama as the training stage leaves it ("trained"), and draftline's three exports of it."""
    root = tmp_path_factory.mktemp("readers")
    cfg, embed, _ = load_target_head(DEMO_LLAMA)
    torch.manual_seed(0)
    model = drafter_for_target(cfg, DrafterConfig(draft_vocab_size=512), TRAINED_IDS)
    model.load_target_weights(embed)
    d2t, t2d, _ = build_vocab(torch.arange(cfg["vocab_size"]).flip(0) % 89, 512)
    model.set_vocab(d2t, t2d)
    trained = save_eagle_dir(model, root / "trained")
    (trained / "draftline.json").write_text(json.dumps({"convention": "sglang", "run": "unit"}))
    return {"trained": trained, **export_drafter(trained, DEMO_LLAMA, root / "export")}


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def assert_same_head(read, original, embeddings: bool = True):
    """Every tensor equal bit for bit (the head keeps them in float32, read from bfloat16), and the same ids."""
    ours, theirs = read.model.state_dict(), original.model.state_dict()
    assert set(ours) == set(theirs)
    for key in ours:
        if key == "embed_tokens.weight" and not embeddings:
            continue
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert read.aux_ids == original.aux_ids and read.model.config.aux_layer_ids == TRAINED_IDS


# ---- every layout reads into the same head ---------------------------------------------------------------------------
LAYOUTS = {
    # name: (writer, read options, embeddings shipped, words of the ids' source sentence)
    "eagle-midlayer-bin-no-ids": (lambda e, o, t: rename_into_eagle_layout(e, o, weights="bin"),
                                  {"aux_layer_ids": [2, 4, 5], "convention": "vllm"}, False, "as given"),
    "specforge-layers0-sglang-ids": (lambda e, o, t: rename_into_eagle_layout(e, o, layer_prefix="layers.0.",
                                                                              ids_convention="sglang", embeddings=True),
                                     {}, True, "inferred: ids only in eagle_config"),
    "specforge-midlayer-vllm-ids": (lambda e, o, t: rename_into_eagle_layout(e, o, ids_convention="vllm"),
                                    {}, False, "inferred: ids at the config's top level"),
    "speculators": (lambda e, o, t: rename_into_speculators_layout(e, o, t), {}, True,
                    "which the speculators format states"),
    "kimi-public-no-ids": (lambda e, o, t: republish_in_public_layout(e, o),
                           {"aux_layer_ids": [1, 3, 4], "convention": "sglang"}, False, "sglang convention"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_reads_into_the_same_head_and_ids_as_draftlines_export(exports, tmp_path, layout):
    writer, options, embeddings, said = LAYOUTS[layout]
    original = read_drafter(exports["sglang"], DEMO_LLAMA)
    assert original.layout == "draftline" and "draftline.json states" in original.ids_source
    folder = writer(exports["sglang"], tmp_path / layout, DEMO_LLAMA)
    read = read_drafter(folder, DEMO_LLAMA, **options)
    assert read.layout in ("eagle", "speculators") and read.lineage == {}
    assert_same_head(read, original, embeddings)
    assert read.has_embeddings is embeddings and read.dtype == torch.bfloat16
    assert said in read.ids_source and "[2, 4, 5] in vLLM's convention" in read.ids_source, read.ids_source


def test_draftlines_own_exports_and_training_output_read_alike(exports):
    original = read_drafter(exports["trained"], DEMO_LLAMA)
    for fmt in FORMATS:
        read = read_drafter(exports[fmt], DEMO_LLAMA)
        assert_same_head(read, original)
        assert read.layout == ("speculators" if fmt == "speculators" else "draftline")


def test_a_drafter_without_ids_is_refused_naming_both_flags_never_given_engine_defaults(exports, tmp_path):
    public = republish_in_public_layout(exports["sglang"], tmp_path / "public")
    with pytest.raises(ConfigError, match=r"public/config.json names no aux-layer ids .* silently feed the drafter its "
                                          r"own default layers; pass the layers it was trained on with --aux-layer-ids "
                                          r"and --convention vllm\|sglang"):
        read_drafter(public, DEMO_LLAMA)
    with pytest.raises(ConfigError, match="--aux-layer-ids needs --convention vllm|sglang"):
        read_drafter(public, DEMO_LLAMA, aux_layer_ids=[2, 4, 5])
    # The same numbers in the two conventions are one layer apart.
    assert read_drafter(public, DEMO_LLAMA, aux_layer_ids=[2, 4, 5], convention="sglang").aux_ids.as_list() == [3, 5, 6]


def test_explicit_flags_come_before_the_drafters_own_ids_and_say_so(exports, tmp_path):
    specforge = rename_into_eagle_layout(exports["sglang"], tmp_path / "sf", ids_convention="sglang")
    same = read_drafter(specforge, DEMO_LLAMA, aux_layer_ids=[2, 4, 5], convention="vllm")
    assert same.aux_ids.as_list() == TRAINED_IDS and "its config.json names the same layers" in same.ids_source
    other = read_drafter(specforge, DEMO_LLAMA, aux_layer_ids=[1, 2, 3], convention="vllm")
    assert other.aux_ids.as_list() == [1, 2, 3] and "replace the [1, 3, 4] its config.json names" in other.ids_source
    # --convention alone reads the drafter's own ids in that convention.
    as_vllm = read_drafter(specforge, DEMO_LLAMA, convention="vllm")
    assert as_vllm.aux_ids.as_list() == [1, 3, 4] and "as given (--convention)" in as_vllm.ids_source


# ---- draftline convert ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source_fmt", FORMATS)
def test_convert_round_trips_through_draftlines_formats_bit_for_bit(exports, tmp_path, source_fmt):
    for fmt in FORMATS:
        out = convert_drafter(exports[source_fmt], fmt, tmp_path / f"{source_fmt}-to-{fmt}", DEMO_LLAMA)
        theirs, ours = tensors_of(exports[fmt]), tensors_of(out)
        assert set(ours) == set(theirs)
        assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours), fmt
        assert json.loads((out / "config.json").read_text()) == json.loads((exports[fmt] / "config.json").read_text())
        lineage = json.loads((out / "draftline.json").read_text())
        assert lineage["format"] == fmt and lineage["source"] == str(exports[source_fmt])
        assert lineage["aux_layer_ids_vllm"] == TRAINED_IDS and lineage["run"] == "unit"
        assert "aux-layer ids" in lineage["aux_layer_ids_source"]


def test_convert_writes_a_public_drafter_with_the_ids_explicit_in_each_engines_convention(exports, tmp_path):
    public = rename_into_eagle_layout(exports["sglang"], tmp_path / "eagle", weights="bin")
    with pytest.raises(ConfigError, match="pass the target's checkpoint folder with --target"):
        convert_drafter(public, "vllm", tmp_path / "no-target")
    written = {}
    for fmt in FORMATS:
        written[fmt] = convert_drafter(public, fmt, tmp_path / fmt, DEMO_LLAMA, aux_layer_ids=[1, 3, 4],
                                       convention="sglang")
        lineage = json.loads((written[fmt] / "draftline.json").read_text())
        assert lineage["source_layout"] == "eagle" and lineage["aux_layer_ids_vllm"] == TRAINED_IDS
        said = lineage["aux_layer_ids_source"]
        assert "aux-layer ids [1, 3, 4] as given (--aux-layer-ids, sglang convention)" in said
        # The weights are the export's, without the embeddings the source did not ship (engines take the target's).
        theirs, ours = tensors_of(exports[fmt]), tensors_of(written[fmt])
        assert set(theirs) - set(ours) == {"embed_tokens.weight"}
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((written["vllm"] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    sglang = json.loads((written["sglang"] / "config.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    with pytest.raises(ConfigError, match="already exists and is not empty; give the converted drafter a new folder"):
        convert_drafter(public, "vllm", written["vllm"], DEMO_LLAMA, aux_layer_ids=[2, 4, 5], convention="vllm")


# ---- MLA heads and the Kimi public shape -----------------------------------------------------------------------------
def test_an_mla_head_reads_converts_and_reads_back_bit_for_bit(tmp_path):
    mla = write_random_mla_drafter(DEMO_KIMI, tmp_path / "mla")
    with pytest.raises(ConfigError, match="names no aux-layer ids"):
        read_drafter(mla, DEMO_KIMI)
    # SGLang's DeepSeek models (Kimi-K2.5's) add one only to a list starting at 1.
    read = read_drafter(mla, DEMO_KIMI, aux_layer_ids=[1, 3, 4], convention="sglang")
    assert read.layout == "eagle-mla" and read.aux_ids.as_list() == [2, 4, 5]
    assert read.model.config.attention == "mla" and read.model.config.kv_lora_rank == 512
    source = load_file(str(mla / "model.safetensors"))
    for fmt in ("vllm", "sglang"):
        out = convert_drafter(mla, fmt, tmp_path / fmt, DEMO_KIMI, aux_layer_ids=[2, 4, 5], convention="vllm")
        written = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(out / "model.safetensors")).items()}
        assert written.keys() == source.keys()
        assert all(torch.equal(written[k], source[k]) for k in written)
        back = read_drafter(out, DEMO_KIMI)
        assert_same_head(back, read, embeddings=False)
        assert json.loads((out / "draftline.json").read_text())["convention"] == ("vllm" if fmt == "vllm" else
                                                                                   "sglang-deepseek")
    with pytest.raises(ConfigError, match="speculators format describes Llama-layer heads only"):
        convert_drafter(mla, "speculators", tmp_path / "spec", DEMO_KIMI, aux_layer_ids=[2, 4, 5], convention="vllm")


def test_the_kimi_public_shape_reads_with_its_heads(tmp_path):
    public = write_random_public_drafter(DEMO_KIMI, tmp_path / "kimi", draft_vocab_size=1024)
    read = read_drafter(public, DEMO_KIMI, aux_layer_ids=[2, 4, 5], convention="vllm")
    assert {k: getattr(read.model.config, k) for k in SCALED} == SCALED
    assert read.model.config.rope_theta == 1e6 and not read.has_embeddings and read.layout == "eagle"


# ---- warm starts take every layout ----------------------------------------------------------------------------------
def test_a_warm_start_takes_its_weights_from_any_layout(exports, tmp_path):
    cfg, embed, _ = load_target_head(DEMO_LLAMA)
    target_cfg = json.loads((DEMO_LLAMA / "config.json").read_text())
    original = read_drafter(exports["sglang"], DEMO_LLAMA)
    for source in (rename_into_speculators_layout(exports["sglang"], tmp_path / "spec", DEMO_LLAMA),
                   rename_into_eagle_layout(exports["sglang"], tmp_path / "sf", layer_prefix="layers.0.",
                                            ids_convention="sglang"),
                   republish_in_public_layout(exports["sglang"], tmp_path / "kimi")):
        from draftline.drafter.model import Eagle3Drafter

        model = Eagle3Drafter(warm_start_config(str(source), target_cfg, DrafterConfig(draft_vocab_size=512),
                                                TRAINED_IDS))
        model.load_target_weights(embed)
        record = warm_start(model, str(source), embed, False, target_cfg)
        assert record["rows_copied"] == 512
        ours, theirs = model.state_dict(), original.model.state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), source.name


# ---- bad input: one sentence naming the file and the fix, before any server ------------------------------------------
def test_bad_drafters_are_one_sentence_naming_the_file_and_the_fix(exports, tmp_path):
    def copy(name: str) -> Path:
        return Path(shutil.copytree(exports["vllm"], tmp_path / name))

    def edit(folder: Path, **fields) -> Path:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(fields)
        (folder / "config.json").write_text(json.dumps(cfg))
        return folder

    empty = copy("empty")
    (empty / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"drafter .*/empty: no weights beside config.json \(model.safetensors or "
                                          r"pytorch_model.bin\); copy the drafter's weight files into the folder"):
        read_drafter(empty, DEMO_LLAMA)
    with pytest.raises(ConfigError, match=r"whole/config.json: architectures \['LlamaForCausalLM'\] is not an EAGLE-3 "
                                          r"drafter; pass a folder whose config.json names LlamaForCausalLMEagle3"):
        read_drafter(edit(copy("whole"), architectures=["LlamaForCausalLM"]), DEMO_LLAMA)
    with pytest.raises(ConfigError, match=r"vocab/config.json: vocab_size 8192 but the target .* has 4096, so its "
                                          r"token ids would name other tokens; use a drafter made for this target's "
                                          r"tokenizer"):
        read_drafter(edit(copy("vocab"), vocab_size=8192), DEMO_LLAMA)
    with pytest.raises(ConfigError, match=r"wide/config.json: target_hidden_size 512 .* but the target .* has "
                                          r"hidden_size 256; evaluate the drafter with the target it was trained for"):
        read_drafter(edit(copy("wide"), target_hidden_size=512), DEMO_LLAMA)
    with pytest.raises(ConfigError, match=r"hidden/config.json: hidden_size 128 but the target .* has 256"):
        read_drafter(edit(copy("hidden"), hidden_size=128), DEMO_LLAMA)
    far = copy("far")
    (far / "draftline.json").unlink()
    far = edit(far, eagle_aux_hidden_state_layer_ids=[2, 4, 9], eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                                              [2, 4, 9]})
    with pytest.raises(ConfigError, match=r"far: aux-layer ids \[2, 4, 9\] from config.json name layers \[2, 4, 9\] "
                                          r"\(vLLM convention\) but the target .* has 8 layers, so \[9\] are out of "
                                          r"range; pass the layers the drafter was trained on with --aux-layer-ids"):
        read_drafter(far, DEMO_LLAMA)
    with pytest.raises(ConfigError, match=r"--aux-layer-ids: aux-layer ids \[2, 2, 5\] must be three distinct"):
        read_drafter(far, DEMO_LLAMA, aux_layer_ids=[2, 2, 5], convention="vllm")
    shapes = copy("shapes")
    tensors = tensors_of(shapes)
    tensors["fc.weight"] = tensors["fc.weight"][:, :512].contiguous()
    save_file(tensors, str(shapes / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"shapes/model.safetensors: fc.weight has shape \[256, 512\] but config.json "
                                          r"describes \[256, 768\]; the weights and config.json come from different"):
        read_drafter(shapes, DEMO_LLAMA)
    with pytest.raises(ConfigError, match=r"speculators 'eagle' drafter, not EAGLE-3"):
        read_drafter(edit(copy("eagle1"), speculators_model_type="eagle"), DEMO_LLAMA)
    with pytest.raises(ConfigError, match="no-such: no such folder"):
        read_drafter(tmp_path / "no-such", DEMO_LLAMA)


def test_heads_that_do_not_divide_the_hidden_size_take_the_targets_head_dim_and_round_trip(tmp_path):
    """A target whose heads times head_dim is not its hidden size (6 heads of 64 beside 320) gets a head of those
    heads and that head_dim: it drafts, and its export reads back with the same head_dim."""
    from draftline.drafter.eagle_format import load_eagle_dir
    from draftline.drafter.target_sizing import config_for_target

    target = {"hidden_size": 320, "vocab_size": 512, "num_hidden_layers": 8, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 640}
    head = drafter_for_target(target, aux_layer_ids=[2, 4, 5])
    assert (head.config.num_attention_heads, head.config.num_key_value_heads, head.config.head_dim) == (6, 2, 64)
    logits, hidden_out, _ = head(torch.randint(0, 512, (1, 5)), torch.randn(1, 5, 320), torch.arange(5)[None])
    assert logits.shape == (1, 5, 512) and hidden_out.shape == (1, 5, 320)
    back = load_eagle_dir(save_eagle_dir(head, tmp_path / "head"))
    assert back.config.head_dim == 64
    with pytest.raises(ConfigError, match="^the target's num_attention_heads 6 does not divide the target's "
                                          "hidden_size 320 and the target names no head_dim; set "
                                          "drafter.num_attention_heads to a divisor of 320$"):
        config_for_target({k: v for k, v in target.items() if k != "head_dim"})
