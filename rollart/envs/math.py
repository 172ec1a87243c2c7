"""Multi-turn arithmetic with a verified answer (GEM-math style).

The task is a prompt with a known answer: from a dataset (the TaskSpec's ``prompt`` with
``labels["answer"]``) or generated from the seed. The agent answers; a wrong answer gets feedback and
another try, up to ``max_turns``. The answer is the content of the last ``\\boxed{...}`` or else the
last number in the text; text with no number gets the format penalty.
"""

from __future__ import annotations

import operator
import random
import re

from rollart.envs.base import FORMAT_PENALTY, StepResult, TextEnv

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def answers_match(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    try:
        return abs(float(given) - float(expected)) < 1e-6
    except ValueError:
        return given.strip() == expected.strip()


def generate_problem(seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    op1, op2 = rng.choice("+-"), rng.choice("+-*")
    apply = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    # '*' binds tighter than '+'/'-'; otherwise left to right
    value = apply[op1](a, b * c) if op2 == "*" else apply[op2](apply[op1](a, b), c)
    return f"What is {a} {op1} {b} {op2} {c}?", str(value)


class ArithmeticMath(TextEnv):
    system_prompt = "Solve the problem. Answer with the number only."
    max_turns = 3
    vocabulary = tuple(str(i) for i in range(10)) + ("-", "What is", "?", "Correct.", "Incorrect. Try again.")

    def __init__(self) -> None:
        self.question = ""
        self.answer = ""

    def reset_sync(self, seed: int, prompt: str = "", labels: dict[str, str] | None = None) -> str:
        if prompt:
            if not labels or "answer" not in labels:
                raise ValueError("a math prompt needs labels['answer']")
            self.question, self.answer = prompt, labels["answer"]
        else:
            self.question, self.answer = generate_problem(seed)
        return self.question

    def episode_labels(self) -> dict[str, str]:
        """Carried on the completed trajectory so reward rules can verify the answer."""
        return {"answer": self.answer, "question": self.question}

    def step_sync(self, action: str) -> StepResult:
        given = extract_answer(action)
        if given is None:
            return StepResult("Answer with a number.", FORMAT_PENALTY, False, {"invalid_action": True})
        if answers_match(given, self.answer):
            return StepResult("Correct.", 1.0, True, {"success": True})
        return StepResult("Incorrect. Try again.", 0.0, False, {"success": False})
