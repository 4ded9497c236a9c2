"""The kit's minimal OpenAI-compatible HTTP front (the embedded default lane)."""
