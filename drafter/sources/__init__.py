"""Draft sources: anything that proposes the next few tokens of a request.

Every source implements `DraftSource`. A source only proposes; exactness comes from
`drafter.verify`, so a bad source costs speed, never correctness.
"""
from .base import DraftSource, Sampler
from .copy import CopySource
from .mtp import MtpAdapter, MtpSource

__all__ = ["DraftSource", "Sampler", "CopySource", "MtpAdapter", "MtpSource"]
