"""Sparrow speculative decoding: HSR + VATA draft, dynamic draft trees, lossless verification,
draft training, and `generate` (prefill, then plain or speculative decoding)."""

from mmjax.speculative.data import (
                                    Batch,
                                    DataConfig,
                                    Example,
                                    batches,
                                    build_example,
                                    build_examples,
                                    load_examples,
                                    save_examples,
)
from mmjax.speculative.draft import DraftConfig, SparrowDraft
from mmjax.speculative.generate import GenerateOutput, generate
from mmjax.speculative.oracle import TargetDraft
from mmjax.speculative.sampling import Sampling
from mmjax.speculative.train import TrainConfig, TrainState, init_train_state, train_step, write_params
from mmjax.speculative.tree import TreeConfig

__all__ = ["Batch", "DataConfig", "DraftConfig", "Example", "GenerateOutput", "Sampling", "SparrowDraft",
           "TargetDraft", "TrainConfig", "TrainState", "TreeConfig", "batches", "build_example", "build_examples",
           "generate", "init_train_state", "load_examples", "save_examples", "train_step", "write_params"]
