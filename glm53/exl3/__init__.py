"""EXL3 (exllamav3's trellis format): reading groups, the reference decoder, a test encoder, and
mixed-width packing of a layer's experts. See format.py for the tensors and decode.py for the
arithmetic (bit-exact with exllamav3 1.6.5 on the GPU)."""
from .decode import decode_rotated, decode_weight
from .encode import encode_weight, encode_weights
from .format import Exl3Error, Exl3Group, is_exl3_prefix, read_group
from .packing import PackedExperts, expert_forward, experts_forward, pack_layer_experts

__all__ = [
    "Exl3Error", "Exl3Group", "PackedExperts", "decode_rotated", "decode_weight", "encode_weight", "encode_weights",
    "expert_forward", "experts_forward", "is_exl3_prefix", "pack_layer_experts", "read_group",
]
