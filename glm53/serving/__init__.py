"""Serving a lane: the composition root (compose.py: an engine with its prefix cache and drafting,
at one rank or several), one rank's entry point (rank.py), the HTTP front (glm53/serving/front/) and the host's
memory guard (memory_guard.py, meminfo.py)."""
