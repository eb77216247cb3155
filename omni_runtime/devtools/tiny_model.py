"""A tiny random Qwen2 model with a trained byte-level BPE tokenizer, built locally and cached.

Tests and the demo need a real model that vLLM and Hugging Face transformers both load, with
no model hub. This one is small enough to build in a few seconds and run on a CPU, and it
respects vLLM's CPU constraints (attention head size >= 32). The weights are seeded, so the
same files come out on every machine; the directory is keyed by a hash of the recipe, so a
change to the recipe builds a new one instead of reusing a stale cache.

    python -m omni_runtime.devtools.tiny_model [--recipe kv7b] [PATH]   # prints the path

A second recipe, ``kv7b`` (:func:`ensure_kv7b_model`), has the KV shape of a 7B-class thinker
(28 layers, 4 KV heads, head size 128: 112 KiB of float32 KV per token) on a small hidden
size, so that the KV data path is measured at real sizes while the model still runs here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

#: The recipe. Head size = hidden_size / num_attention_heads = 32.
TINY_QWEN2 = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    # Far above the usual 0.02, so that greedy decoding of a random model wanders over the
    # vocabulary instead of repeating one token: comparisons of outputs then mean something.
    "initializer_range": 0.2,
    "seed": 1234,
}

#: The 7B KV shape: hidden 512 over 4 heads (head size 128), 4 KV heads, 28 layers.
KV7B_QWEN2 = {
    **TINY_QWEN2,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    # A 28-layer random model needs the usual scale to stay finite in float32.
    "initializer_range": 0.02,
}
RECIPES = {"tiny": TINY_QWEN2, "kv7b": KV7B_QWEN2}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "An omni pipeline runs an autoregressive stage and hands its KV cache to the next stage.",
    "Kubernetes reconciles the desired state of every pipeline into deployments and services.",
    "Prometheus scrapes metrics; an alert fires when a transfer is stuck for too long.",
    "Hello world! Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: , . ; : ? ! ' \" ( ) [ ] { }",
    "def main():\n    return 42\n",
]
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_cache_dir() -> Path:
    """``$OMNI_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/omni-pipeline`` (~/.cache)."""
    if env := os.environ.get("OMNI_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "omni-pipeline"


def _recipe_key(recipe: str = "tiny") -> str:
    blob = json.dumps({"model": RECIPES[recipe], "corpus": _CORPUS, "special": _SPECIAL_TOKENS})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_kv7b_model(cache_dir: Path | None = None, *, path: Path | None = None) -> Path:
    """The 7B-KV-shaped random model (``KV7B_QWEN2``), built and cached like the tiny one."""
    return ensure_tiny_model(cache_dir, path=path, recipe="kv7b")


def ensure_tiny_model(
    cache_dir: Path | None = None, *, path: Path | None = None, recipe: str = "tiny"
) -> Path:
    """Return the directory of the tiny model, building it once if it is not there.

    By default it lives in ``cache_dir`` (:func:`default_cache_dir`) under a name keyed by the
    recipe; ``path`` puts it at an exact place instead (what an ``OmniPipeline``'s
    ``spec.model.path`` names), rebuilt when the recipe there is not this one."""
    if path is not None:
        target = Path(path)
        root = target.parent
    else:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        target = root / f"{recipe}-qwen2-{_recipe_key(recipe)}"
    key = _recipe_key(recipe)
    marker = target / ".complete"
    if marker.exists() and marker.read_text().strip() == key:
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling and rename, so concurrent callers (pytest workers, the
    # demo) never see a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-qwen2-", dir=root))
    try:
        _build(tmp, RECIPES[recipe])
        (tmp / ".complete").write_text(key + "\n")
        if marker.exists() and marker.read_text().strip() == key:
            return target  # a concurrent caller finished first
        if target.exists():
            shutil.rmtree(target)  # an older recipe's model
        try:
            os.rename(tmp, target)
        except OSError:
            if not marker.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out: Path, spec: dict) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)

    eos_id = fast.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        vocab_size=spec["vocab_size"],
        max_position_embeddings=spec["max_position_embeddings"],
        initializer_range=spec["initializer_range"],
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec["seed"])
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build (once) and print the tiny model's path.")
    parser.add_argument("path", nargs="?", type=Path, help="exact directory (default: the cache)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="tiny")
    args = parser.parse_args(argv)
    print(ensure_tiny_model(path=args.path, recipe=args.recipe))


if __name__ == "__main__":
    main()
