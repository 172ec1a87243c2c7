"""``rollart replay``: read a topic by offset, time range or trajectory id; print trajectories as text.

Reading never joins a consumer group or commits, so replaying cannot disturb a running job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec

from rollart.bus.reader import ReadStart, read_to_end
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
from rollart.messages import (
    DEFAULT_CODEC,
    Abort,
    CompletedTrajectory,
    GenerationRequest,
    GenerationResult,
    GroupEnded,
    MessageDecodeError,
    ScoredTrajectory,
    TaskSpec,
    VersionAnnouncement,
)
from rollart.messages.arrays import PackedArray


class TokenDecoder:
    """Token ids to text with the model's ``tokenizer.json``, through the ``tokenizers`` library that
    transformers' fast tokenizers wrap: it loads in milliseconds where importing transformers takes
    seconds, and replay is a command people run again and again while debugging."""

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:  # transformers' default
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoder(model_path: Path):
    """A decoder for ``model_path``'s tokenizer (None without a model there). transformers' own
    tokenizer only where ``tokenizer.json`` is missing or its config asks for the space clean-up
    transformers applies after decoding."""
    if not (model_path / "config.json").exists():
        return None
    tokenizer_json, settings = model_path / "tokenizer.json", model_path / "tokenizer_config.json"
    cleans_up = settings.exists() and json.loads(settings.read_text()).get("clean_up_tokenization_spaces", False)
    if tokenizer_json.exists() and not cleans_up:
        return TokenDecoder(tokenizer_json)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@dataclass
class ReplayFilter:
    traj_id: str | None = None
    from_offset: int | None = None
    partition: int | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    limit: int | None = None
    tag: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    abort_reason: str | None = None
    policy_version: int | None = None  # messages with tokens (or an admission/announcement) of this version
    kind: str | None = None  # the message kind's name (ScoredTrajectory, GroupEnded, Abort, ...)

    def keeps(self, record, message: Any) -> bool:
        if self.partition is not None and record.partition != self.partition:
            return False
        if self.from_offset is not None and record.offset < self.from_offset:
            return False
        if self.until_ms is not None and record.timestamp > self.until_ms:
            return False
        if self.traj_id is not None and traj_id_of(message) != self.traj_id:
            return False
        return self.keeps_content(message)

    def keeps_content(self, message: Any) -> bool:
        """The content filters; a message without the field a filter asks about does not pass it."""
        if self.kind is not None and getattr(message, "KIND", None) != self.kind:
            return False
        if self.tag is not None and tag_of(message) != self.tag:
            return False
        if self.min_reward is not None or self.max_reward is not None:
            reward = reward_of(message)
            if reward is None or (self.min_reward is not None and reward < self.min_reward) \
                    or (self.max_reward is not None and reward > self.max_reward):
                return False
        if self.abort_reason is not None and not (isinstance(message, Abort) and message.reason == self.abort_reason):
            return False
        return self.policy_version is None or self.policy_version in versions_of(message)


def tag_of(message: Any) -> str | None:
    if isinstance(message, ScoredTrajectory):
        return message.trajectory.tag
    return getattr(message, "tag", None)


def reward_of(message: Any) -> float | None:
    if isinstance(message, ScoredTrajectory):
        return message.reward
    if isinstance(message, CompletedTrajectory):
        return message.env_reward
    return None


def versions_of(message: Any) -> set[int]:
    if isinstance(message, ScoredTrajectory):
        message = message.trajectory
    if isinstance(message, (CompletedTrajectory, GenerationResult)):
        return set(message.versions) - {-1}
    if isinstance(message, TaskSpec):
        return {message.admitted_version}
    if isinstance(message, VersionAnnouncement):
        return {message.version}
    return set()


def traj_id_of(message: Any) -> str | None:
    if isinstance(message, ScoredTrajectory):
        return message.trajectory.traj_id
    return getattr(message, "traj_id", None)


async def replay(config: RollartConfig, endpoints: Endpoints, topic: str, flt: ReplayFilter) -> AsyncIterator[tuple]:
    """Yield (record, message or MessageDecodeError) of the logical ``topic`` that pass the filter."""
    shown = 0
    start = ReadStart(since_ms=flt.since_ms, offset=flt.from_offset, partition=flt.partition)
    async for record in read_to_end(config, endpoints, f"{config.job}.{topic}", start=start):
        try:
            message = DEFAULT_CODEC.decode(record.value, record.headers).message
        except MessageDecodeError as exc:
            message = exc
        if not flt.keeps(record, message):
            continue
        yield record, message
        shown += 1
        if flt.limit is not None and shown >= flt.limit:
            return


def render_conversation(tokenizer, trajectory: CompletedTrajectory) -> str:
    """The token stream as chat turns; assistant turns are exactly the generated tokens."""
    text = tokenizer.decode(list(trajectory.token_ids), skip_special_tokens=False)
    lines = []
    for chunk in text.split("<|im_start|>"):
        if not chunk.strip():
            continue
        role, _, content = chunk.partition("\n")
        content = content.replace("<|im_end|>", "").rstrip()
        lines.append(f"  [{role}]")
        lines.extend(f"    {line}" for line in content.splitlines() or [""])
    return "\n".join(lines)


def render_text(tokenizer, record, message: Any) -> str:
    where = f"{record.topic}[{record.partition}]@{record.offset}"
    if isinstance(message, MessageDecodeError):
        return f"{where}  UNDECODABLE: {message}"
    if isinstance(message, ScoredTrajectory):
        t = message.trajectory
        parts = ", ".join(f"{k}={v:g}" for k, v in message.reward_components.items())
        head = (f"{where}  {t.traj_id}  tag={t.tag} status={t.status} turns={t.turns} "
                f"reward={message.reward:g} ({parts}) versions={t.start_version}..{t.end_version}")
        return head + "\n" + render_conversation(tokenizer, t)
    if isinstance(message, CompletedTrajectory):
        head = (f"{where}  {message.traj_id}  tag={message.tag} status={message.status} turns={message.turns} "
                f"env_reward={message.env_reward:g}")
        return head + "\n" + render_conversation(tokenizer, message)
    if isinstance(message, Abort):
        replaced = f" replaced by {message.replacement}" if message.replacement else ""
        return f"{where}  {message.traj_id}  ABORT turn={message.turn} reason={message.reason} tag={message.tag}{replaced}"
    if isinstance(message, GroupEnded):
        return (f"{where}  {message.group_id}  GROUP ENDED completed={list(message.completed)} "
                f"aborted={message.aborted} replacements={message.replacements} tag={message.tag}")
    if isinstance(message, GenerationRequest):
        return f"{where}  {message.traj_id}  request turn={message.turn} pool={message.pool} " \
               f"context={len(message.prompt_ids)} tokens reply_partition={message.reply_partition}"
    if isinstance(message, GenerationResult):
        text = tokenizer.decode(list(message.token_ids)) if tokenizer else ""
        return f"{where}  {message.traj_id}  result turn={message.turn} {message.finish_reason}: {text!r}"
    return f"{where}  {type(message).__name__} {message!r}"


def to_json(tokenizer, record, message: Any) -> str:
    out: dict[str, Any] = {"topic": record.topic, "partition": record.partition, "offset": record.offset,
                           "timestamp_ms": record.timestamp}
    if isinstance(message, MessageDecodeError):
        out["error"] = str(message)
    else:
        out["kind"] = message.KIND
        out["message"] = _plain(message)
        trajectory = message.trajectory if isinstance(message, ScoredTrajectory) else message
        if isinstance(trajectory, CompletedTrajectory) and tokenizer is not None:
            out["text"] = tokenizer.decode(list(trajectory.token_ids), skip_special_tokens=False)
    return json.dumps(out)


def _plain(message: Any) -> Any:
    """Plain JSON-able data; packed arrays become lists of numbers."""
    return msgspec.to_builtins(message, enc_hook=lambda obj: obj.tolist() if isinstance(obj, PackedArray) else obj)
