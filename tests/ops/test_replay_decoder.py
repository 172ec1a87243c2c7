"""Replay decodes token ids with the model's tokenizer.json directly (no transformers import):
the text must be what transformers' tokenizer of the same model gives."""

from __future__ import annotations

import json
import random

from rollart.replay import TokenDecoder, load_decoder


def test_replay_decodes_as_transformers_does(tiny_model):
    from transformers import AutoTokenizer

    decoder, reference = load_decoder(tiny_model), AutoTokenizer.from_pretrained(str(tiny_model))
    assert isinstance(decoder, TokenDecoder)
    rng = random.Random(0)
    ids = [rng.randrange(reference.vocab_size) for _ in range(300)]
    ids += reference.encode("<|im_start|>assistant\nI move right.<|im_end|>\n")
    for skip in (False, True):
        assert decoder.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert decoder.decode(ids) == reference.decode(ids), "the same default: special tokens kept"


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_by_transformers(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "clean_up_tokenization_spaces": True}))
    assert not isinstance(load_decoder(model), TokenDecoder)
    assert load_decoder(tmp_path / "nothing-here") is None
