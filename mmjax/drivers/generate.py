"""`mmjax generate`: answer a prompt about videos and images with a local Hugging Face snapshot.

    mmjax generate --model Qwen2.5-VL-7B-Instruct --video clip.mp4 --prompt "What happens?"

Frames are sampled as qwen-vl-utils samples them (``--fps``, ``--min-pixels`` / ``--max-pixels`` per frame), the
prompt is rendered with the snapshot's chat template, and the answer is printed on stdout as it decodes. Progress
bars (frames, vision encoding + prefill, decoding) and a closing summary go to stderr; the bars stay quiet when
stderr is not a terminal. With ``--json`` stdout holds exactly one JSON object: ``tokens`` (generated ids),
``text``, ``ttft_s`` (reading + processor + vision encoding + prefill + first token, compilation included),
``tokens_per_s`` (decoding after the first step, which compiles; null with fewer than two steps) and ``mean_tau``
(tokens per decoding step: the mean accepted length with ``--draft``, 1 without; null with no step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import mmjax
from mmjax import io
from mmjax.drivers.args import positive_int
from mmjax.load import eos_token_ids
from mmjax.parallel import devices_mesh
from mmjax.progress import progress_bar
from mmjax.sparse import SparseConfig
from mmjax.speculative import Sampling, SparrowDraft, TreeConfig
from models.text_stream import TextStream

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmjax generate", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="snapshot directory (config.json, safetensors, tokenizer) or hub-cache models--org--name/")
    p.add_argument("--video", action="append", default=[], metavar="FILE", help="a video file (repeatable)")
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an image file (repeatable)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the question")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="most tokens to generate (default %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16",
                   help="parameter and compute dtype (default %(default)s)")
    p.add_argument("--attention", metavar="dense|cudnn|CONFIG.json",
                   help="prefill attention: dense (XLA), cudnn (GPU) or a SparseConfig JSON from `mmjax search`; "
                        "default cudnn on a GPU, dense otherwise")
    p.add_argument("--matmul", choices=("bf16", "fp8"), default="bf16",
                   help="prefill matmuls: the model's weights, or fp8 GEMMs (mmjax.quantize_fp8; H100 / H200)")
    p.add_argument("--draft", metavar="DIR", help="a Sparrow draft (SparrowDraft.save) for speculative decoding")
    p.add_argument("--tree", default=str(TreeConfig()), metavar="T-D-K",
                   help="draft tree total_tokens-depth-top_k (default %(default)s)")
    p.add_argument("--fps", type=float, default=io.FPS, help="video frames sampled per second (default %(default)s)")
    p.add_argument("--min-pixels", type=float, metavar="P",
                   help=f"least pixels per frame / image (default {io.VIDEO_MIN_PIXELS} for videos, "
                        f"{io.IMAGE_MIN_PIXELS} for images)")
    p.add_argument("--max-pixels", type=float, metavar="P",
                   help="most pixels per frame / image (default: qwen-vl-utils' budgets)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, metavar="P")
    p.add_argument("--top-k", type=int, metavar="K")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--devices", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel over N devices (attention heads split; default %(default)s)")
    p.add_argument("--sequence-parallel", type=positive_int, default=1, metavar="S",
                   help="of the N devices, split the prompt's tokens over S (tp = N / S; default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming the answer")
    return p


# ------------------------------------------------------------------------------------------------ arguments
def _check_args(args) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an int >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.fps) and args.fps > 0):
        raise ValueError(f"--fps: expected a positive number, got {args.fps}")
    for name in ("min_pixels", "max_pixels"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')}: expected a positive number, got {value}")
    if args.max_pixels is not None:
        lowest = args.min_pixels if args.min_pixels is not None else (
            io.VIDEO_MIN_PIXELS if args.video else io.IMAGE_MIN_PIXELS)
        if args.max_pixels < lowest:
            raise ValueError(f"--max-pixels: expected >= --min-pixels ({lowest:g}), got {args.max_pixels:g}")


def _attention(value: str | None, model):
    """"dense", "cudnn" or a SparseConfig read from a JSON file (its shape checked against the model)."""
    if value is None:
        return "cudnn" if jax.default_backend() == "gpu" else "dense"
    if value in ("dense", "cudnn"):
        if value == "cudnn" and jax.default_backend() != "gpu":
            raise ValueError(f"--attention: cudnn needs a GPU; this backend is {jax.default_backend()} (use dense)")
        return value
    if not os.path.isfile(value):
        raise ValueError(f"--attention: expected dense, cudnn or a SparseConfig JSON file, got {value!r}")
    config = SparseConfig.load(value)
    text = model.config.text
    if (config.num_layers, config.num_heads) != (text.num_hidden_layers, text.num_attention_heads):
        raise ValueError(f"--attention {value}: the config has {config.num_layers} layers x {config.num_heads} heads, "
                         f"the model {text.num_hidden_layers} x {text.num_attention_heads}")
    return config


def _draft(path: str, model) -> SparrowDraft:
    """SparrowDraft.load, with errors naming --draft and, for a draft of another model, the differing sizes."""
    try:
        draft = SparrowDraft.load(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"--draft {path}: {e}") from None
    target = model.config.text
    if draft.text != target:
        diff = [f"{f.name} {getattr(draft.text, f.name)} (draft) vs {getattr(target, f.name)} (model)"
                for f in dataclasses.fields(target) if getattr(draft.text, f.name) != getattr(target, f.name)]
        raise ValueError(f"--draft {path}: the draft belongs to another model: {', '.join(diff)}")
    return draft


# ------------------------------------------------------------------------------------------------- the work
def _flag_error(flag: str, path: str, error: ValueError) -> ValueError:
    """The reader's message, led by the flag (and the path when the message does not name it)."""
    return ValueError(f"{flag}: {error}" if path in str(error) else f"{flag} {path}: {error}")


def _read_media(args) -> tuple[list, list, list]:
    """(videos uint8 [T, H, W, 3], their VideoMeta, images uint8 [H, W, 3])."""
    pixels = {} if args.min_pixels is None else {"min_pixels": args.min_pixels}
    videos, metas, images = [], [], []
    for path in args.video:
        try:
            frames, meta = io.read_video(path, fps=args.fps, max_pixels=args.max_pixels, **pixels)
        except ValueError as e:
            raise _flag_error("--video", path, e) from None
        videos.append(frames)
        metas.append(meta)
    for path in args.image:
        extra = {} if args.max_pixels is None else {"max_pixels": args.max_pixels}
        try:
            images.append(io.read_image(path, **pixels, **extra))
        except ValueError as e:
            raise _flag_error("--image", path, e) from None
    return videos, metas, images


def _inputs(processor, prompt: str, videos, metas, images) -> dict:
    if not videos and not images:  # text only: string content, which every chat template renders (text LMs too)
        text = processor.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return processor(text=[text])
    content = [{"type": "video"} for _ in videos] + [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": prompt})
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], images=images or None, videos=videos or None,
                     video_metadata=metas or None)


def _check_context(model, inputs: dict, max_new_tokens: int) -> None:
    n = int(inputs["input_ids"].shape[1])
    context = model.config.max_position_embeddings
    if n + max_new_tokens > context:
        visual = int(np.sum(inputs.get("mm_token_type_ids", np.zeros(1)) > 0))
        raise ValueError(f"prompt: {n} tokens ({visual} visual) + --max-new-tokens {max_new_tokens} exceed the "
                         f"model's context of {context} tokens (max_position_embeddings in config.json); lower "
                         "--fps / --max-pixels, shorten the prompt or lower --max-new-tokens")


class _Stream:
    """on_tokens callback: times each step, feeds the bars and prints text as it completes."""

    def __init__(self, processor, out, prefill_bar, decode_bar):
        self.text = TextStream(lambda ids: processor.decode(ids, skip_special_tokens=True))
        self.out, self.prefill_bar, self.decode_bar = out, prefill_bar, decode_bar
        self.times: list[float] = []
        self.counts: list[int] = []

    def __call__(self, new: list[np.ndarray]) -> None:
        self.times.append(time.perf_counter())
        self.counts.append(len(new[0]))
        if len(self.times) == 1:
            self.prefill_bar.update(1)
            self.prefill_bar.close()
        self.decode_bar.update(len(new[0]))
        piece = self.text.push(new[0])
        if self.out is not None and piece:
            self.out.write(piece)
            self.out.flush()

    def tokens_per_s(self) -> float | None:
        """Tokens of decoding steps 2.. over their time (step 1 includes compilation)."""
        if len(self.times) < 3 or self.times[-1] <= self.times[1]:
            return None
        return sum(self.counts[2:]) / (self.times[-1] - self.times[1])


def _summary(args, metas, inputs, out, ttft, tps, model_s) -> str:
    lines = []
    for path, meta in zip(args.video, metas):
        lines.append(f"video {os.path.basename(path)}: {len(meta.indices)} frames of {meta.total_frames} "
                     f"({meta.sample_fps:.2f} fps sampled), {meta.width}x{meta.height}")
    n = int(inputs["input_ids"].shape[1])
    visual = int(np.sum(inputs.get("mm_token_type_ids", np.zeros(1)) > 0))  # text-only processors give none
    lines.append(f"prompt: {n} tokens, {visual} visual; model loaded in {model_s:.2f} s")
    lines.append(f"time to first token: {ttft:.2f} s (reading, processor, vision encoding + prefill, compilation "
                 "included)")
    speed = f"{tps:.1f} tokens/s after the first step" if tps is not None else "too few steps to time"
    lines.append(f"generated {int(out.num_tokens[0])} tokens; {speed}")
    if args.draft:
        lines.append(f"mean accepted length: {out.mean_tau:.2f} tokens per step (tree {args.tree})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _check_args(args)
    mesh = devices_mesh(args.devices, args.sequence_parallel)
    if mesh is not None and args.draft:
        raise ValueError("--draft: speculative decoding runs on one device; drop --devices / --sequence-parallel")
    if mesh is not None and args.matmul == "fp8":
        raise ValueError("--matmul fp8: the fp8 weights run on one device; drop --devices / --sequence-parallel")
    tree = TreeConfig.parse(args.tree)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)

    t0 = time.perf_counter()
    videos, metas, images = _read_media(args)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with progress_bar(total=1, desc="loading model") as bar:
        try:
            model, processor = mmjax.load(args.model, dtype=DTYPES[args.dtype], mesh=mesh)
        except ValueError as e:
            raise _flag_error("--model", args.model, e) from None
        if args.matmul == "fp8":
            model = mmjax.quantize_fp8(model)
        bar.update(1)
    model_s = time.perf_counter() - t0
    attention = _attention(args.attention, model)
    draft = _draft(args.draft, model) if args.draft else None

    t0 = time.perf_counter()
    inputs = _inputs(processor, args.prompt, videos, metas, images)
    process_s = time.perf_counter() - t0
    _check_context(model, inputs, args.max_new_tokens)

    stream_text = not args.json
    decode_bar_on = not (stream_text and sys.stdout.isatty())  # the streamed text is the progress on a terminal
    with progress_bar(total=1, desc="vision encoding + prefill") as prefill_bar, \
            progress_bar(total=args.max_new_tokens, desc="decoding", enabled=decode_bar_on, unit="tok") as decode_bar:
        stream = _Stream(processor, sys.stdout if stream_text else None, prefill_bar, decode_bar)
        t0 = time.perf_counter()
        out = mmjax.generate(model, inputs, args.max_new_tokens, sampling, draft, tree, attention=attention,
                             eos_token_id=eos_token_ids(args.model, processor) or None, on_tokens=stream, mesh=mesh)
    ttft = read_s + process_s + (stream.times[0] - t0)
    tokens = [int(t) for t in out.tokens[0, :int(out.num_tokens[0])]]
    text = processor.decode(tokens, skip_special_tokens=True)
    tps = stream.tokens_per_s()
    tau = out.mean_tau
    if stream_text:
        sys.stdout.write(stream.text.flush() + "\n")
        sys.stdout.flush()
    else:
        print(json.dumps({"tokens": tokens, "text": text, "ttft_s": ttft, "tokens_per_s": tps,
                          "mean_tau": None if math.isnan(tau) else tau}))
    print(_summary(args, metas, inputs, out, ttft, tps, model_s), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
