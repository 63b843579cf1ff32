"""Offline modality-aware pattern search (MMInference Algorithm 4): `search`,
`SearchSpace`, `Calibration`, `CalibrationRecorder`."""

from mmjax.sparse.pattern_search.algorithm import DEFAULT_BUDGET, search
from mmjax.sparse.pattern_search.calibration import Calibration, CalibrationRecorder, as_calibration
from mmjax.sparse.pattern_search.space import BOUNDARIES, SearchSpace

__all__ = ["BOUNDARIES", "Calibration", "CalibrationRecorder", "DEFAULT_BUDGET", "SearchSpace", "as_calibration",
           "search"]
