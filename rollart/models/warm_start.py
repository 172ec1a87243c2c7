"""Warm start: teach a fresh tiny model the answer *format* of an environment, not the task.

Supervised steps on contexts built exactly as the env stage builds them (chat template, token-in/
token-out continuations), where every assistant turn is one of the env's action words chosen
uniformly at random and the loss covers the last turn's answer tokens. The model learns to answer
with a single valid move followed by the end-of-turn token; which move is good is left to RL.
"""

from __future__ import annotations

import random
from pathlib import Path


def _example(env_class, chat, rng: random.Random) -> tuple[list[int], int]:
    """One context and the index where its last answer starts."""
    env = env_class()
    observation = env.reset_sync(rng.randrange(1 << 31))
    tokens = chat.initial(env.system_prompt, observation)
    for _ in range(rng.randrange(env.max_turns)):
        answer = chat.tokenizer.encode(rng.choice(env.vocabulary), add_special_tokens=False) + [chat.end_of_turn_id]
        step = env.step_sync(chat.decode_action(answer))
        if step.done:
            break
        tokens = tokens + answer + chat.continuation(step.observation, answer)[1:]
    start = len(tokens)
    answer = chat.tokenizer.encode(rng.choice(env.vocabulary), add_special_tokens=False) + [chat.end_of_turn_id]
    return tokens + answer, start


def warm_start(model_dir: str | Path, env: str, *, steps: int, batch: int = 32, lr: float = 1e-3,
               seed: int = 0) -> float:
    """Train ``model_dir`` in place for ``steps`` supervised steps; returns the last loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollart.envs import resolve_env_class
    from rollart.rollout.chat import ChatFormat

    env_class = resolve_env_class(env)
    chat = ChatFormat.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = chat.tokenizer.pad_token_id
    loss = torch.tensor(0.0)
    for _ in range(steps):
        examples = [_example(env_class, chat, rng) for _ in range(batch)]
        length = max(len(ids) for ids, _ in examples)
        ids = torch.full((batch, length), pad, dtype=torch.long)
        labels = torch.full((batch, length), -100, dtype=torch.long)
        attention = torch.zeros((batch, length), dtype=torch.long)
        for i, (tokens, start) in enumerate(examples):
            ids[i, :len(tokens)] = torch.tensor(tokens)
            labels[i, start:len(tokens)] = torch.tensor(tokens[start:])
            attention[i, :len(tokens)] = 1
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir, safe_serialization=True)
    return float(loss.detach())
