"""Teach demo-kimi's vision tower to describe a few small images, so that its answers depend on the image.

  python -m draftline.demo.kimi_vision [--steps 300]   (CPU, a minute or two; then commit the result)

The images are drawn here (shapes in colours, and letters rendered into pixels, 56 x 56: one 4 x 4 grid of patches,
four media tokens), written to assets/prompts/images/ with prompts that ask about them (train and eval sets, text
prompts mixed in). Only the MoonViT tower and the projector learn; the language model is demo-deepseek's, frozen, and
the answers are its tokens ("a red circle", "the letter A"). Writes assets/demo-kimi/model-vision.safetensors (the
tuned tensors, kept in git: 150 KB) and records the run in training.json; `python -m draftline.demo.kimi --rebuild`
keeps that file.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from draftline.demo import kimi

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "assets" / "prompts" / "images"
SIZE = 56
SHAPES = {"red-circle": ("red", "circle"), "blue-square": ("blue", "square"), "green-triangle": ("green", "triangle"),
          "yellow-square": ("yellow", "square"), "blue-circle": ("blue", "circle"), "red-triangle": ("red", "triangle")}
LETTERS = ("A", "B", "K")
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?")
TEXT_PROMPTS = ("def add(a, b):", "Write a function that reverses a list.", "What does a linked list hold?",
                "def is_even(n):")


def draw(name: str) -> Image.Image:
    """One demo image by name: a shape in a colour on white, or a black letter on white."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    if name.startswith("letter-"):
        font = ImageFont.load_default(size=40)
        pen.text((SIZE // 2, SIZE // 2), name[-1], fill="black", font=font, anchor="mm")
        return image
    colour, shape = SHAPES[name]
    box = (8, 8, SIZE - 8, SIZE - 8)
    if shape == "circle":
        pen.ellipse(box, fill=colour)
    elif shape == "square":
        pen.rectangle(box, fill=colour)
    else:
        pen.polygon([(SIZE // 2, 6), (SIZE - 6, SIZE - 8), (6, SIZE - 8)], fill=colour)
    return image


def answer(name: str) -> str:
    if name.startswith("letter-"):
        return f"the letter {name[-1]}"
    colour, shape = SHAPES[name]
    return f"a {colour} {shape}"


def image_names() -> list[str]:
    return list(SHAPES) + [f"letter-{c}" for c in LETTERS]


def write_images_and_prompts(out: Path = IMAGES) -> dict[str, Path]:
    """Every image as a PNG, and train/eval prompt sets that ask about them (paths relative to the prompts files)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in image_names():
        draw(name).save(out / f"{name}.png", optimize=True)
    rows = {"train": [], "eval": []}
    for n, name in enumerate(image_names()):
        for q, question in enumerate(QUESTIONS):
            split = "eval" if q == n % len(QUESTIONS) else "train"
            rows[split].append({"id": f"image-{name}-{q}", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"images/{name}.png"}},
                {"type": "text", "text": question}]}]})
    for i, text in enumerate(TEXT_PROMPTS):
        rows["train" if i % 2 else "eval"].append({"id": f"text-{i}", "messages": [{"role": "user", "content": text}]})
    paths = {}
    for split, records in rows.items():
        paths[split] = out.parent / f"{split}_image_prompts.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


def train(steps: int, seed: int = 0, lr: float = 3e-3) -> dict:
    """Train the tower and projector of demo-kimi (float32) to answer each image's question; returns the metrics."""
    from draftline.media_reference import MediaFeed, expand, pixel_patches, processor_config
    from draftline.target import load_target

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    model, tok = load_target(kimi.OUT, "float32", "cpu")
    proc, placeholder = processor_config(kimi.OUT), json.loads((kimi.OUT / "config.json").read_text())[
        "media_placeholder_token_id"]
    for name, p in model.named_parameters():
        p.requires_grad_(".vision_tower." in f".{name}" or "mm_projector" in name)
    params = [p for p in model.parameters() if p.requires_grad]
    pixels = {}
    for name in image_names():
        import io

        buf = io.BytesIO()
        draw(name).save(buf, "PNG")
        pixels[name] = pixel_patches(buf.getvalue(), proc)
    examples = []
    for name in image_names():
        for question in QUESTIONS:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            ids = expand(ids, placeholder, [pixels[name][0].shape[0] // 4])
            target = tok(answer(name), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            examples.append((name, ids, target))
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    feed = MediaFeed(model, placeholder)
    feed.attach()
    rng, started, losses = random.Random(seed), time.monotonic(), []
    try:
        for step in range(steps):
            batch = rng.sample(examples, min(8, len(examples)))
            width = max(len(i) + len(t) for _, i, t in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            labels = torch.full((len(batch), width), -100)
            for r, (_, prompt, target) in enumerate(batch):
                seq = prompt + target
                ids[r, :len(seq)] = torch.tensor(seq)
                labels[r, len(prompt) - 1:len(seq) - 1] = torch.tensor(target)
            feed.rows = [[pixels[name]] for name, _, _ in batch]
            logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step % 25 == 0 or step == steps - 1:
                print(f"step {step}/{steps} loss {loss.item():.4f} ({time.monotonic() - started:.0f} s)", flush=True)
        answers = greedy_answers(model, tok, feed, pixels, placeholder)
    finally:
        feed.detach()
    tensors = checkpoint_tensors(model.state_dict())
    return {"tensors": tensors, "final_loss": sum(losses[-10:]) / len(losses[-10:]), "answers": answers,
            "steps": steps, "seconds": round(time.monotonic() - started, 1), "lr": lr, "seed": seed}


@torch.no_grad()
def greedy_answers(model, tok, feed, pixels, placeholder) -> dict[str, str]:
    from draftline.media_reference import expand

    out = {}
    for name in image_names():
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}]
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        ids = expand(ids, placeholder, [pixels[name][0].shape[0] // 4])
        feed.rows = [[pixels[name]]]
        got = []
        for _ in range(8):
            nxt = int(model(input_ids=torch.tensor([ids + got])).logits[0, -1].argmax())
            got.append(nxt)
            if nxt == tok.eos_token_id:
                break
        out[name] = tok.decode(got, skip_special_tokens=True)
    return out


# transformers' names of the tower and projector -> Kimi-K2.5's checkpoint names (the layout vLLM reads).
_RENAMES = (("model.mm_projector.in_proj.", "mm_projector.proj.0."),
            ("model.mm_projector.out_proj.", "mm_projector.proj.2."), ("model.mm_projector.", "mm_projector."), ("model.vision_tower.final_layernorm.",
                                                        "vision_tower.encoder.final_layernorm."),
            ("model.vision_tower.patch_embed.pos_emb.position_embeddings", "vision_tower.patch_embed.pos_emb.weight"),
            ("model.vision_tower.patch_embed.", "vision_tower.patch_embed."))
_BLOCK = {"attn.proj.": "wo.", "mlp.fc1.": "mlp.fc0.", "mlp.fc2.": "mlp.fc1.", "norm1.": "norm0.", "norm2.": "norm1."}


def _rope_layout(t: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows from transformers' rotary layout (two halves per head) back to the checkpoint's (interleaved
    pairs), the inverse of what transformers does when it loads wqkv."""
    rows = t.shape[0]
    half = rows // heads // 2
    return t.reshape(heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def checkpoint_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tower's and projector's tensors under the checkpoint's names, bfloat16, q, k and v fused into wqkv."""
    out = {}
    for name, t in state.items():
        t = t.detach().to(torch.bfloat16).contiguous()
        if name.startswith("model.vision_tower.layers."):
            block, rest = name[len("model.vision_tower.layers."):].split(".", 1)
            pre = f"vision_tower.encoder.blocks.{block}."
            if rest.startswith("attn.q_proj."):
                kind = rest.rsplit(".", 1)[1]
                parts = [state[name.replace("q_proj", p)].detach().to(torch.bfloat16)
                         for p in ("q_proj", "k_proj", "v_proj")]
                heads = kimi.VISION["num_attention_heads"]
                parts[:2] = [_rope_layout(x, heads) for x in parts[:2]]
                out[f"{pre}wqkv.{kind}"] = torch.cat(parts).contiguous()
            elif not rest.startswith(("attn.k_proj.", "attn.v_proj.")):
                new = next((rest.replace(a, b, 1) for a, b in _BLOCK.items() if rest.startswith(a)), rest)
                out[pre + new] = t
            continue
        for a, b in _RENAMES:
            if name.startswith(a):
                out[b + name[len(a):]] = t
                break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    write_images_and_prompts()
    result = train(args.steps)
    print(json.dumps(result["answers"], indent=1))
    kimi.write_vision(result["tensors"], {k: v for k, v in result.items() if k != "tensors"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
