"""Dead-letter queue: the original bytes plus headers that say where they came from and why."""

from __future__ import annotations

import time
from collections import deque

from rollart.bus.backend import ConsumerRecord
from rollart.bus.producer import BusProducer
from rollart.topics import TopicNames

H_DLQ_TOPIC = "rollart-dlq-source-topic"
H_DLQ_PARTITION = "rollart-dlq-source-partition"
H_DLQ_OFFSET = "rollart-dlq-source-offset"
H_DLQ_ERROR = "rollart-dlq-error"
H_DLQ_FIELD = "rollart-dlq-error-field"
H_DLQ_STAGE = "rollart-dlq-stage"
H_DLQ_TIME = "rollart-dlq-timestamp"
DLQ_HEADERS = (H_DLQ_TOPIC, H_DLQ_PARTITION, H_DLQ_OFFSET, H_DLQ_ERROR, H_DLQ_FIELD, H_DLQ_STAGE, H_DLQ_TIME)
MAX_ERROR_BYTES = 900  # stays under the codec's header size limit when the DLQ is replayed


def _clip(text: str) -> bytes:
    # Cut on a UTF-8 boundary so the header stays decodable.
    return text.encode()[:MAX_ERROR_BYTES].decode("utf-8", "ignore").encode()


class DeadLetterRateExceeded(RuntimeError):
    """Too many messages were dead-lettered in the last minute: stop rather than empty the topic.

    A bad deploy (a handler bug, an incompatible schema) would otherwise move every message into the
    DLQ and commit past it. The consumer stops with the message uncommitted; a fixed deploy resumes.
    """


class RateWindow:
    """Counts events in a sliding 60-second window."""

    def __init__(self, limit: int, window_s: float = 60.0):
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque()

    def try_take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True


class DeadLetterQueue:
    def __init__(self, producer: BusProducer, *, stage: str, max_per_minute: int):
        self.producer = producer
        self.stage = stage
        self.names: TopicNames = producer.names
        self._rate = RateWindow(max_per_minute)

    async def send(self, record: ConsumerRecord, error: str, field: str = "") -> None:
        """Dead-letter ``record`` and wait for the ack; raises DeadLetterRateExceeded over the limit."""
        if not self._rate.try_take():
            raise DeadLetterRateExceeded(
                f"more than {self._rate.limit} messages dead-lettered in {self._rate.window_s:.0f}s by {self.stage}; "
                f"stopping at {record.topic}[{record.partition}]@{record.offset} without committing it")
        headers = [(k, v) for k, v in (record.headers or ()) if not k.startswith("rollart-dlq-")]
        headers += [
            (H_DLQ_TOPIC, record.topic.encode()),
            (H_DLQ_PARTITION, str(record.partition).encode()),
            (H_DLQ_OFFSET, str(record.offset).encode()),
            (H_DLQ_ERROR, _clip(error)),
            (H_DLQ_FIELD, _clip(field)),
            (H_DLQ_STAGE, self.stage.encode()),
            (H_DLQ_TIME, f"{time.time():.3f}".encode()),
        ]
        future = await self.producer.send_raw(self.names.dlq(record.topic), record.value, key=record.key,
                                              headers=headers)
        await future
