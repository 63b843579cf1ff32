"""mmjax: modality-aware sparse attention and speculative decoding for long-context VLMs.

Public entry points are listed in ../shared/DESIGN.md.
"""

from mmjax import patterns
from mmjax.attention import attention_recall, build_layout, sparse_attention
from mmjax.inference import PrefillOutput, decode_step, prefill
from mmjax.layout_ops import LayoutSet

__version__ = "0.1.0"

__all__ = ["LayoutSet", "PrefillOutput", "attention_recall", "build_layout", "decode_step", "patterns",
           "prefill", "sparse_attention"]
from mmjax.modality import Modality  # noqa: E402
__all__ += ["Modality"]
from mmjax.sparse_config import SparseConfig  # noqa: E402
__all__ += ["SparseConfig"]
from mmjax import speculative  # noqa: E402
from mmjax.generate import GenerateOutput, generate  # noqa: E402
__all__ += ["GenerateOutput", "generate", "speculative"]
from mmjax.pattern_search import Calibration, CalibrationRecorder, SearchSpace, search  # noqa: E402
__all__ += ["Calibration", "CalibrationRecorder", "SearchSpace", "search"]
