"""What the launcher and a lane's ranks agree on, importable by both without loading an engine."""
from __future__ import annotations

from glm53.settings import env_name

# What a stopping rank 0 gives the requests in flight (glm53.serving.rank --drain-timeout's default);
# the launcher's supervisor waits that long and a margin before it kills rank 0.
DRAIN_TIMEOUT_S = 20.0
API_KEYS_ENV = env_name("api_keys")  # the keys rank 0's front asks of clients (comma-separated)
