"""Local reward rules, computed in the reward bridge's process."""

from __future__ import annotations

from rollart.envs.math import answers_match, extract_answer
from rollart.messages import CompletedTrajectory


def last_turn_tokens(trajectory: CompletedTrajectory) -> list[int]:
    """The token ids of the last LLM turn (the last run of loss_mask == 1)."""
    end = len(trajectory.loss_mask)
    while end > 0 and not trajectory.loss_mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and trajectory.loss_mask[start - 1]:
        start -= 1
    return list(trajectory.token_ids[start:end])


def math_answer(trajectory: CompletedTrajectory, final_text: str, *, format_penalty: float) -> dict[str, float]:
    """1 if the last answer matches ``labels['answer']``, 0 if wrong, the penalty if there is none."""
    expected = trajectory.labels.get("answer")
    if expected is None:
        raise ValueError(f"trajectory {trajectory.traj_id} has no labels['answer'] to check against")
    given = extract_answer(final_text)
    if given is None:
        return {"answer": format_penalty}
    return {"answer": 1.0 if answers_match(given, expected) else 0.0}


def format_rule(trajectory: CompletedTrajectory, final_text: str, *, format_penalty: float) -> dict[str, float]:
    """A penalty for every action the env could not parse."""
    return {"format": format_penalty * trajectory.metrics.get("invalid_actions", 0.0)}


RULES = {"math_answer": math_answer, "format": format_rule}
