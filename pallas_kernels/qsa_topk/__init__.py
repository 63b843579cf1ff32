"""MOMO's fused kernel: query-sparse attention of every gamma-th query with an online
top-k of key blocks (exact, tournament or estimated)."""

from pallas_kernels.qsa_topk.api import qsa_topk
from pallas_kernels.qsa_topk.common import QSATopKResult

__all__ = ["QSATopKResult", "qsa_topk"]
