"""A tiny random Qwen2-style model with a tokenizer trained on the environments' own text.

For tests, demos and benchmarks on CPUs: nothing is downloaded. The result is a normal Hugging Face
directory (config, safetensors weights, tokenizer with a chat template), so every code path that
loads it (vLLM, transformers, the trainer) is the one that loads real checkpoints.

Head dim 64: vLLM's CPU attention supports it (16 does not).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def env_corpus() -> list[str]:
    from rollart.envs import BUILTIN_ENVS

    texts = []
    for env_class in BUILTIN_ENVS.values():
        texts.extend(env_class.sample_texts(n=200))
        texts.extend(["user", "assistant", "system"])
    return texts


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_tiny_model(out: str | Path, *, hidden: int = 128, layers: int = 2, heads: int = 2,
                    vocab_size: int = 512, seed: int = 0, max_positions: int = 4096) -> Path:
    """Write a random Qwen2 model and its tokenizer to ``out``; returns the directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(env_corpus(), vocab_size)
    tokenizer.save_pretrained(out)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=im_end,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end, "do_sample": True}))
    return out


def ensure_model(model_config) -> Path:
    """The model directory of ``model_config``; creates the tiny model there if allowed and missing."""
    path = Path(model_config.path)
    if (path / "config.json").exists():
        return path
    if not model_config.init_tiny:
        raise FileNotFoundError(f"model directory {path} has no config.json (and model.init_tiny is false)")
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:  # several stages may start at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").exists():
            tmp = path.with_name(path.name + ".tmp")
            init_tiny_model(tmp)
            if model_config.warm_start_steps:
                from rollart.models.warm_start import warm_start

                warm_start(tmp, model_config.warm_start_env, steps=model_config.warm_start_steps)
            tmp.rename(path)
    return path
