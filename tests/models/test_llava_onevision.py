"""LLaVA-OneVision parity against transformers 5.23 goldens (tests/models/fixtures/llava_onevision, written by
tools/make_llava_onevision_golden.py): logits (images with anyres tiling, multi-image rows, videos, text), the three
tensor layouts and the snapshot styles, the NumPy processor, greedy generate with and without a Sparrow draft,
orbax round trip, sparse / injected attention with modality, chunked prefill."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmjax
from mmjax.speculative import (
    DataConfig,
    SparrowDraft,
    TargetDraft,
    TrainConfig,
    TreeConfig,
    batches,
    build_examples,
    init_train_state,
    train_step,
)
from models import llava_onevision as lo
from models.llava_onevision.model import visual_inputs
from tests.snapshots import hub_tree

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "llava_onevision")
KEYS = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
_MODELS = {}


def model_of(case, dtype=jnp.float32):
    key = (case, jnp.dtype(dtype).name)
    if key not in _MODELS:
        _MODELS[key] = lo.from_hf(os.path.join(FIXTURES, case), dtype=dtype)
    return _MODELS[key]


def load_case(case):
    d = dict(np.load(os.path.join(FIXTURES, f"{case}.npz")))
    inputs = {k: d[k] for k in KEYS}
    for k in ("pixel_values", "pixel_values_videos"):
        inputs[k] = inputs[k].astype(np.float32)
    return inputs, d


def row0(case, inputs, d):
    """Row 0 alone, unpadded, with its own media (as in the golden generate call)."""
    keep = inputs["attention_mask"][0].astype(bool)
    out = {"input_ids": inputs["input_ids"][:1, keep], "pixel_values_videos": inputs["pixel_values_videos"][:1]}
    if case == "ov":
        out.update(pixel_values=inputs["pixel_values"][:1], image_sizes=inputs["image_sizes"][:1],
                   batch_num_images=inputs["batch_num_images"][:1])
    else:
        out.update({k: inputs[k] for k in ("pixel_values", "image_sizes", "batch_num_images")})
    return out


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(params=["ov", "ov_pool"])
def case(request):
    return request.param


def test_features_and_logits_fp32(case):
    inputs, d = load_case(case)
    model = model_of(case)
    img, vid = visual_inputs(model, lo.prepare_inputs(model.config, **inputs))
    np.testing.assert_allclose(np.asarray(img), d["image_features"], atol=2e-5)
    np.testing.assert_allclose(np.asarray(vid), d["video_features"], atol=2e-5)
    if case == "ov":  # tiles / frames through the tower in chunks of 2 (remainders included) change nothing
        img2, vid2 = visual_inputs(model, lo.prepare_inputs(model.config, **inputs), frames_per_chunk=2)
        np.testing.assert_allclose(np.asarray(img2), np.asarray(img), atol=1e-5)
        np.testing.assert_allclose(np.asarray(vid2), np.asarray(vid), atol=1e-5)
    logits = np.asarray(lo.forward(model, **inputs))
    mask = inputs["attention_mask"].astype(bool)
    assert np.abs(logits[mask] - d["logits"][mask]).max() <= 2e-4
    text = np.asarray(lo.forward(model, input_ids=d["text_input_ids"]))
    assert np.abs(text - d["text_logits"]).max() <= 2e-4


def test_frame_tokens_count_each_frames_features():
    """`frame_tokens` (the stride Grid heads get from `mmjax.prefill`): each video's features are its frames'
    ``frame_tokens`` features each, then one newline; None without a video."""
    inputs, _ = load_case("ov")
    model = model_of("ov")
    p = lo.prepare_inputs(model.config, **inputs)
    _, vid = visual_inputs(model, p)
    n, f = inputs["pixel_values_videos"].shape[:2]
    assert vid.shape[0] == n * (f * lo.model.frame_tokens(model.config, p) + 1)
    no_video = lo.prepare_inputs(model.config, input_ids=inputs["input_ids"][:, :4])
    assert lo.model.frame_tokens(model.config, no_video) is None


def test_anyres_max_shrink_of_a_tiled_image():
    _, d = load_case("ov_pool")  # anyres_max_1: the 8 x 5 unpadded feature grid is shrunk bilinearly to 6 x 3
    model = model_of("ov_pool")
    single = {k[len("single_"):]: d[k] for k in d if k.startswith("single_") and k[7:] in KEYS}
    single["pixel_values"] = single["pixel_values"].astype(np.float32)
    p = lo.prepare_inputs(model.config, **single)
    assert p.image_layouts[0].resized == (6, 3) and p.image_layouts[0].crop == (1, 9, 0, 5)
    img, _ = visual_inputs(model, p)
    np.testing.assert_allclose(np.asarray(img), d["single_image_features"], atol=2e-5)
    assert np.abs(np.asarray(lo.forward(model, **single)) - d["single_logits"]).max() <= 2e-4
    proc = lo.Processor.from_pretrained(os.path.join(FIXTURES, "ov_pool"))
    out = proc(text=["<|im_start|>user\n<image>\nhow?<|im_end|>\n<|im_start|>assistant\n"], images=[d["image_0"]])
    np.testing.assert_array_equal(out["input_ids"], d["single_input_ids"])
    np.testing.assert_allclose(out["pixel_values"], single["pixel_values"], atol=1e-3)


def test_original_llava_next_layout_loads_the_same_model_and_processor():
    inputs, d = load_case("ov")
    orig, proc = mmjax.load(os.path.join(FIXTURES, "ov_original"), dtype=jnp.float32)
    assert orig.config == model_of("ov").config
    logits = np.asarray(lo.forward(orig, **inputs))
    mask = inputs["attention_mask"].astype(bool)
    assert np.abs(logits[mask] - d["logits"][mask]).max() <= 2e-4
    # its tokenizer has no <image> / <video>: the text around them is tokenized apart, ids from config.json
    assert not proc.placeholders_in_vocab and proc.image_token_id == orig.config.image_token_id
    out = proc(text=[str(t) for t in d["texts"]], images=[d["image_0"], d["image_1"]], videos=[d["video_0"]],
               padding=True, padding_side="left")
    np.testing.assert_array_equal(out["input_ids"], d["input_ids"])
    np.testing.assert_array_equal(out["attention_mask"], d["attention_mask"])
    # SigLIP normalisation (mean = std = 0.5) of the same tiles transformers made with the CLIP values
    mean = np.asarray([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = np.asarray([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    real = np.abs(d["pixel_values"]).reshape(2, 7, -1).max(-1) > 0  # tiles padded for batching are zeros in both
    np.testing.assert_allclose((out["pixel_values"] * 0.5 + 0.5)[real],
                               (d["pixel_values"].astype(np.float32) * std + mean)[real], atol=5e-4)


def test_mmjax_load_plain_sharded_single_file_andhub_tree(tmp_path):
    inputs, d = load_case("ov_pool")
    hub_tree(os.path.join(FIXTURES, "ov_pool"), str(tmp_path / "models--t--ov_pool"))
    single, processor = mmjax.load(os.path.join(FIXTURES, "ov_pool"), dtype=jnp.float32)
    hub, _ = mmjax.load(str(tmp_path / "models--t--ov_pool"), dtype=jnp.float32)
    assert isinstance(single, lo.LlavaOnevision) and isinstance(processor, lo.Processor)
    a = mmjax.prefill(single, inputs).logits
    b = mmjax.prefill(hub, inputs).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(a) - d["logits"][:, -1]).max() <= 2e-4
    sharded, _ = mmjax.load(os.path.join(FIXTURES, "ov"), dtype=jnp.float32)  # ten shards + index
    assert sharded.config.text.num_hidden_layers == 2 and not sharded.config.text.tie_word_embeddings
    assert mmjax.load(os.path.join(FIXTURES, "ov"))[0].language_model.embed[...].dtype == jnp.bfloat16


def test_processor_matches_transformers(case):
    _, d = load_case(case)
    proc = lo.Processor.from_pretrained(os.path.join(FIXTURES, case))
    images = [d["image_0"], d["image_1"]]
    out = proc(text=[str(t) for t in d["texts"]], images=[images] if bool(d["multi_image"]) else images,
               videos=[d["video_0"]], padding=True, padding_side="left")
    for k in ("input_ids", "attention_mask", "image_sizes", "batch_num_images"):
        np.testing.assert_array_equal(out[k], d[k])
    # images: Pillow as transformers' PIL processor (the fixture holds float16 values)
    np.testing.assert_allclose(out["pixel_values"], d["pixel_values"].astype(np.float32), atol=1e-3)
    # videos: transformers resizes with torchvision; at most one uint8 level apart (1 / (255 * std))
    diff = np.abs(out["pixel_values_videos"] - d["pixel_values_videos"].astype(np.float32))
    assert diff.max() <= 1 / (255 * 0.2613) + 1e-3 and diff.mean() < 1e-3
    text = proc(text="<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n")
    np.testing.assert_array_equal(text["input_ids"], d["text_input_ids"])
    with pytest.raises(ValueError, match="images: the text has 0 <image> tokens but 1 images"):
        proc(text="no placeholder", images=[d["image_0"]])


def test_greedy_generate_matches_transformers(case):
    inputs, d = load_case(case)
    model = model_of(case)
    want = d["generate_row0_tokens"]
    plain = mmjax.generate(model, row0(case, inputs, d), len(want))
    np.testing.assert_array_equal(plain.tokens[0], want)
    if case == "ov":
        text = mmjax.generate(model, {"input_ids": d["text_input_ids"]}, len(d["generate_text_tokens"]))
        np.testing.assert_array_equal(text.tokens[0], d["generate_text_tokens"])


@pytest.mark.parametrize("draft", ["sparrow", pytest.param("target", marks=pytest.mark.slow)])
def test_greedy_speculative_generate_matches_transformers(draft):
    inputs, d = load_case("ov_pool")
    model = model_of("ov_pool")
    want = d["generate_row0_tokens"]
    dr = SparrowDraft.init(model, jax.random.key(0)) if draft == "sparrow" else TargetDraft()
    spec = mmjax.generate(model, row0("ov_pool", inputs, d), len(want), draft=dr, tree=TreeConfig(12, 3, 3))
    np.testing.assert_array_equal(spec.tokens[0], want)
    assert spec.tau.sum() == len(want) - 1  # every token after the first comes from a speculative step
    if draft == "target":
        assert spec.mean_tau > 2  # the target as its own draft accepts whole paths


def test_orbax_round_trip(tmp_path):
    model = model_of("ov_pool")
    lo.save(model, str(tmp_path / "ckpt"))
    back = lo.load(str(tmp_path / "ckpt"))
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_attention_sees_visual_modality():
    inputs, d = load_case("ov")
    model = model_of("ov")
    prompt = row0("ov", inputs, d)
    seen = []

    def attn(q, k, v, *, layer, q_positions, kv_valid, modality):
        jax.debug.callback(lambda m: seen.append(np.asarray(m)), modality)
        return mmjax.inference.resolve_attention("dense").for_layer(layer)(
            q, k, v, layer=layer, q_positions=q_positions, kv_valid=kv_valid, modality=modality)

    want = d["logits"][0, -1]  # row 0 is the batch's longest row: its last token ends the fixture's rows
    custom = mmjax.prefill(model, prompt, attention=[attn, attn])
    assert np.abs(np.asarray(custom.logits)[0] - want).max() <= 2e-4
    ids = prompt["input_ids"]
    types = np.where(ids == model.config.image_token_id, 1, np.where(ids == model.config.video_token_id, 2, 0))
    assert len(seen) == 2 and all(np.array_equal(s, types) for s in seen)
    assert (types == 1).sum() > 0 and (types == 2).sum() > 0
    sparse = mmjax.prefill(model, prompt, attention=mmjax.SparseConfig.uniform(
        mmjax.sparse.patterns.Dense(), num_layers=2, num_heads=4))
    assert np.abs(np.asarray(sparse.logits)[0] - want).max() <= 2e-4


@pytest.mark.slow
def test_chunked_prefill_agrees():
    inputs, d = load_case("ov")
    model = model_of("ov")
    prompt = row0("ov", inputs, d)
    chunked = mmjax.prefill(model, prompt, chunk_tokens=64)
    np.testing.assert_allclose(np.asarray(chunked.logits), np.asarray(mmjax.prefill(model, prompt).logits), atol=1e-4)


def test_bad_inputs_name_the_argument():
    inputs, _ = load_case("ov")
    model = model_of("ov")
    with pytest.raises(ValueError, match="input_ids: expected 258 image placeholder tokens"):
        lo.prepare_inputs(model.config, **{**inputs, "input_ids": np.where(
            inputs["input_ids"] == model.config.image_token_id, 0, inputs["input_ids"])})
    with pytest.raises(ValueError, match="pixel_values_videos: expected"):
        lo.prepare_inputs(model.config, **{**inputs, "pixel_values_videos": inputs["pixel_values_videos"][0]})
    with pytest.raises(ValueError, match="pixel_values: expected"):
        lo.prepare_inputs(model.config, **{**inputs, "pixel_values": inputs["pixel_values"][:, :, :, :60]})
    with pytest.raises(ValueError, match="batch_num_images"):
        lo.prepare_inputs(model.config, **{**inputs, "batch_num_images": np.array([3])})


@pytest.mark.slow
def test_sparrow_draft_trains_on_a_llava_target():
    inputs, d = load_case("ov_pool")
    model = model_of("ov_pool")
    examples = build_examples(model, [row0("ov_pool", inputs, d)], DataConfig(max_new_tokens=8))
    assert (examples[0].token_types > 0).sum() == (examples[0].input_ids == model.config.image_token_id).sum() + \
        (examples[0].input_ids == model.config.video_token_id).sum() > 0
    draft = SparrowDraft.init(model, jax.random.key(0))
    cfg = TrainConfig(learning_rate=3e-3, warmup_steps=1, total_steps=4)
    state = init_train_state(draft, cfg)
    batch = next(batches(examples, 1))
    losses = []
    for _ in range(3):
        state, metrics = train_step(state, draft, model, batch, cfg)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
