"""mmjax: modality-aware sparse attention and speculative decoding for long-context VLMs.

Public entry points are listed in ../shared/DESIGN.md; this module re-exports them as they land.
"""

__version__ = "0.1.0"
