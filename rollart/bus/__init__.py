"""The event bus every stage stands on: producer, consumer loop, DLQ, de-duplication."""

from rollart.bus.consumer import ConsumerLoop, Handler, MessageContext, PermanentError
from rollart.bus.dedup import Deduplicator
from rollart.bus.dlq import DLQ_HEADERS, DeadLetterQueue, DeadLetterRateExceeded
from rollart.bus.producer import BusProducer, NotAuthorized
from rollart.bus.stopping import StopRequest

__all__ = [
    "BusProducer",
    "ConsumerLoop",
    "DLQ_HEADERS",
    "DeadLetterQueue",
    "DeadLetterRateExceeded",
    "Deduplicator",
    "Handler",
    "MessageContext",
    "NotAuthorized",
    "PermanentError",
    "StopRequest",
]
