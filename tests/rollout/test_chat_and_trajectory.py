"""Token-in/token-out contexts and the loss mask."""

from __future__ import annotations

from rollart.messages import Float32Array, GenerationResult, Int32Array, TaskSpec
from rollart.rollout.trajectory import TrajectoryBuilder


def test_appended_context_matches_the_chat_template(chat):
    system, first, second = "rules", "P _ _ _", "_ P _ _"
    generated = chat.tokenizer.encode("Right", add_special_tokens=False)
    context = chat.initial(system, first) + generated + chat.continuation(second, generated)
    rendered = chat.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": first},
         {"role": "assistant", "content": "Right"}, {"role": "user", "content": second}],
        add_generation_prompt=True, tokenize=False)
    assert chat.decode(context) == rendered
    # The model's own end-of-turn token is kept, not doubled.
    ended = generated + [chat.end_of_turn_id]
    assert chat.continuation(second, ended)[0] != chat.end_of_turn_id


def test_a_repeated_observation_is_rendered_once_and_each_context_is_the_callers_own(chat):
    from rollart.rollout.chat import ChatFormat

    fresh = ChatFormat(chat.tokenizer)
    first = fresh.initial("rules", "P _ _ _")
    first += [1, 2, 3]  # a trajectory appends its turns to its context
    again = fresh.initial("rules", "P _ _ _")
    assert again == ChatFormat(chat.tokenizer).initial("rules", "P _ _ _") and again != first
    step = fresh.continuation("_ P _ _", [5])
    step.append(9)
    assert fresh.continuation("_ P _ _", [5]) == step[:-1]
    assert fresh._initial.cache_info().hits == 1 and fresh._encode.cache_info().hits == 1


def test_the_per_turn_fast_path_encodes_and_decodes_as_the_tokenizer_does(chat):
    """continuation / decode go to the Rust tokenizer directly: same ids, same text."""
    import random

    from rollart.rollout.chat import ChatFormat

    assert chat._fast is not None, "the tiny model's tokenizer is a fast one: the per-turn path uses its backend"
    slow = ChatFormat(chat.tokenizer)
    slow._fast = None
    rng = random.Random(1)
    for observation in ("P _ _ _\n_ H _ G", "You fell in a hole! 3 + 4 = ?", "naïve — ünïcode 答案", ""):
        generated = chat.tokenizer.encode(rng.choice(["Right", "Down", "<answer>7</answer>"]), add_special_tokens=False)
        assert chat.continuation(observation, generated) == slow.continuation(observation, generated)
        ids = [rng.randrange(chat.tokenizer.vocab_size) for _ in range(64)] + [chat.end_of_turn_id]
        assert chat.decode(ids) == slow.decode(ids) and chat.decode_action(ids) == slow.decode_action(ids)


def test_loss_mask_covers_only_generated_tokens():
    task = TaskSpec(group_id="g", env="frozenlake", tag="t", group_size=1)
    builder = TrajectoryBuilder("g-0", task)
    builder.add_context([1, 2, 3])
    builder.add_generation(GenerationResult(traj_id="g-0", turn=0, token_ids=Int32Array([7, 8]),
                                            logprobs=Float32Array([-0.5, -0.25]), versions=Int32Array([4, 5]),
                                            finish_reason="stop"))
    builder.add_context([9])
    built = builder.build("done")
    assert list(built.loss_mask) == [0, 0, 0, 1, 1, 0]
    assert list(built.versions) == [-1, -1, -1, 4, 5, -1]
    assert list(built.logprobs) == [0, 0, 0, -0.5, -0.25, 0]
    assert (built.prompt_len, built.turns, built.start_version, built.end_version) == (3, 1, 4, 5)


def test_a_generic_tokenizer_loads_without_torch_and_any_other_through_autotokenizer(tiny_model, tmp_path):
    """The stages that only tokenize (env, reward) load a generic fast tokenizer without AutoTokenizer,
    whose imports pull in torch (seconds of a small machine's CPU at every start); a model-specific
    class still goes through AutoTokenizer. Either way the chat format's tokens are the same."""
    import json
    import shutil
    import subprocess
    import sys

    probe = ("import sys; from rollart.rollout.chat import ChatFormat; "
             f"c = ChatFormat.from_pretrained({str(tiny_model)!r}); "
             "print(int('torch' in sys.modules), type(c.tokenizer).__name__, c.initial('rules', 'P _ _'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    torch_loaded, class_name, ids = done.stdout.split(" ", 2)
    assert torch_loaded == "0" and class_name == "TokenizersBackend", done.stdout

    from transformers import AutoTokenizer

    from rollart.rollout.chat import ChatFormat, load_tokenizer

    specific = shutil.copytree(tiny_model, tmp_path / "qwen2-named")
    config = json.loads((specific / "tokenizer_config.json").read_text())
    (specific / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(specific)) is type(AutoTokenizer.from_pretrained(str(specific)))
    assert ChatFormat.from_pretrained(specific).initial("rules", "P _ _") == json.loads(ids)
