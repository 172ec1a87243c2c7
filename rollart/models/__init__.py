"""Model helpers: the tiny local test/demo model."""
