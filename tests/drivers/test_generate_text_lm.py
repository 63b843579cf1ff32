"""`mmjax generate` on a text-only snapshot (tests/models/fixtures/text_lm): a prompt alone, no media."""

import json
import os

import jax.numpy as jnp
import numpy as np

import mmjax
from mmjax.drivers.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN3 = os.path.join(REPO, "tests", "models", "fixtures", "text_lm", "qwen3")
VIDEO = os.path.join(REPO, "tests", "models", "fixtures", "generate", "clip.mp4")


def test_text_prompt_gives_the_greedy_ids_of_mmjax_generate(capsys):
    rc = main(["generate", "--model", QWEN3, "--prompt", "Name a colour.", "--max-new-tokens", "4", "--dtype",
               "float32", "--attention", "dense", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out)
    model, processor = mmjax.load(QWEN3, dtype=jnp.float32)
    text = processor.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    want = mmjax.generate(model, processor(text), max_new_tokens=4, eos_token_id=2)
    assert result["tokens"] == want.tokens[0, :want.num_tokens[0]].tolist() and len(result["tokens"]) >= 1
    assert result["text"] == processor.decode(np.asarray(result["tokens"]))


def test_a_video_for_a_text_model_is_a_one_line_error(capsys):
    rc = main(["generate", "--model", QWEN3, "--video", VIDEO, "--prompt", "hi", "--max-new-tokens", "2"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert "videos: a text-only model's processor takes text only" in err
