"""Sparrow speculative decoding: HSR + VATA draft, dynamic draft trees, lossless verification."""

from mmjax.speculative.draft import DraftConfig, SparrowDraft
from mmjax.speculative.oracle import TargetDraft
from mmjax.speculative.sampling import Sampling
from mmjax.speculative.tree import TreeConfig

__all__ = ["DraftConfig", "Sampling", "SparrowDraft", "TargetDraft", "TreeConfig"]
from mmjax.speculative.data import Batch, DataConfig, Example, batches, build_example, build_examples, load_examples, save_examples  # noqa: E402,E501
from mmjax.speculative.train import TrainConfig, TrainState, init_train_state, train_step, write_params  # noqa: E402
__all__ += ["Batch", "DataConfig", "Example", "TrainConfig", "TrainState", "batches", "build_example", "build_examples",
            "init_train_state", "load_examples", "save_examples", "train_step", "write_params"]
