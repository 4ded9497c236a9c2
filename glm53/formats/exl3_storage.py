"""How an EXL3 linear is stored, as names and numbers only: its parts, the Hadamard block and the
widths the kit serves. Torch-free (outside the glm53.exl3 package, whose import loads torch), so the
header-only checks (glm53/formats/checkpoint_rules.py, fetch_weights.sh) use the same facts as the reader
(glm53/exl3/format.py re-exports them)."""
from __future__ import annotations

SERVED_BITS = (2.0, 2.5, 3.0, 3.5, 4.0)
HADAMARD_BLOCK = 128
KNOWN_PARTS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")
