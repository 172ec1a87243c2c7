"""Fault injection and the audit that proves a run survived it (``rollart chaos``)."""
