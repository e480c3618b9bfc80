#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Real models with and without gnext, the way users run them: eager and torch.compile, inference and
training steps. Rows (random weights, real image input from skimage.data.astronaut()):

  vae-fp16-nchw / vae-fp16-cl   diffusers AutoencoderKL decoder, SD-1.x layout, fp16, 1x4x64x64 latents
                                (the encoder's posterior mean of the image) -> 1x3x512x512
  vae-enc-fp16-nchw / -cl       its encoder, fp16, 4x3x512x512 images -> 4x8x64x64 moments
  vae[-enc]-1024-fp16-nchw / -cl  the decoder (1x4x128x128 latents) or encoder (4x3x1024x1024) at 1024²
  unet2d-train-bf16             diffusers UNet2DModel (block_out_channels 128,256,256,512), bf16, batch 8
                                of 64x64: one training step (forward + backward of a mean-square loss)
  sd15-unet-fp16                diffusers UNet2DConditionModel, SD-1.5 layout, fp16, 2x4x64x64 latents and
                                2x77x768 text states: inference
  bit-train-bf16                timm resnetv2_50x1_bit (GroupNormAct layers), bf16, batch 32 of 224x224: one
                                training step
  hunyuan-video-fp16            diffusers AutoencoderKLHunyuanVideo decoder (its default layout: 5-D causal conv
                                blocks, 16 latent channels), fp16, 1x16x5x64x64 random latents -> 17 frames of
                                512x512 (the converter traces it with example_inputs: its blocks have no rule)
  hunyuan-video-fp16-cl         the same, model and latents in channels_last_3d
  hunyuan-video-fp16-33f        the same decoder (default layout), 1x16x9x64x64 latents -> 33 frames
  cogvideox-fp16                diffusers AutoencoderKLCogVideoX decode (default layout; its GroupNorms feed a
                                spatial modulation, then a SiLU: the converter traces it and runs both in
                                group_norm_act_modulate, written into the causal convolutions' inputs by its
                                blocks' rule), fp16, 1x16x5x64x64 random latents -> 17 frames of
                                512x512, through vae.decode (frame batches with its conv cache)

Variants: original eager; gnext eager (groupnorm_ext.convert_group_norm_act, which also fuses diffusers'
ResnetBlock2D pairs); gnext-aten: the original model, unedited, with groupnorm_ext.enable_aten_kernels() on
while it runs (PyTorch's GroupNorm and C++ autograd on gnext's kernels); torch.compile(original);
torch.compile(original) with groupnorm_ext.enable_compile_fusion() active while it compiles
(--variants: a subset, e.g. eager,gnext,gnext-aten without the compiles). Named only: gnext-nopad, the converter
with pad_into_conv=False (no padded outputs, and CogVideoX's blocks on their own forward); gnext-nomod, the
converter with CogVideoX's spatial norms and blocks back on their own forwards; gnext-nofold, the converter with
its convolutions adding their own bias (none left to the norm after them); gnext-padrows, the converter with
its padded outputs written by the row kernel (GNEXT_PAD_TILE=0) instead of the tile kernel; gnext-nostream, the
converter with every HunyuanVideo block adding its convolutions' biases (none carried down the residual stream);
gnext-noblocks, the converter with HunyuanVideo's resnet blocks and up-samplers on their own forwards;
compile+fusion-nomove, the pass without its data-movement rules (up-sampler gathers, zero pads);
compile+fusion-noshare, the pass moving a convolution's bias into the op only where the GroupNorm is the output's
one reader (not past shortcut convolutions and residual adds); compile+fusion-nocat, the pass leaving a modulated
chain's concatenation along time (CogVideoX's causal convolutions) to Inductor; compile+fusion-nostrided, the pass
leaving modulated chains whose input is a strided view (CogVideoX's up-samplers' outputs) to Inductor. Timing: wall time
(host + GPU) of a batch of calls between two synchronizations, per call; after warm-up (compiles included) the variants are
timed in rounds, each once per round in a random order (recorded per round), and the median and min-max
over rounds are reported, with the per-round ratios of the variant pairs. --compile-mode reduce-overhead
compiles both compiled variants with CUDA graphs (the host out of their steps). Output columns:
relative L2 difference of each variant's output from the float32 original's.

    python scripts/bench models [--rows vae-fp16-nchw,...] [--rounds 5] [--out bench_results]
                              [--fusion-when always] [--compile-mode reduce-overhead]
    python scripts/bench models --smoke        (CPU, tiny configs: checks the script, times nothing real)
Needs diffusers, timm and scikit-image (the benchmark only; gnext does not depend on them).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import pathlib
import random
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import groupnorm_ext as ge  # noqa: E402
from groupnorm_ext import compile_fusion  # noqa: E402
from timing import with_tuning  # noqa: E402

VARIANTS = ("eager", "gnext", "gnext-aten", "compile", "compile+fusion")
# Run when named (--variants): the converter without its padded outputs (convert_group_norm_act(pad_into_conv=False)),
# without its modulated spatial norms (CogVideoX's, back on their own forwards), with every convolution adding
# its own bias, and with its padded outputs written by the row kernel (GNEXT_PAD_TILE=0); compile + fusion with
# every convolution keeping its bias (the pass's input_bias move off), with the compiled graphs calling the ops
# through their Python Autograd kernels (the post-grad retarget to the *_no_autograd twins off), and with every F.pad
# after a rewritten chain left to Inductor (the pass's group_norm_act_pad off).
EXTRA_VARIANTS = ("gnext-nopad", "gnext-nomod", "gnext-nofold", "gnext-padrows", "gnext-nostream",
                  "gnext-noblocks", "compile+fusion-nobias", "compile+fusion-autograd", "compile+fusion-nopad",
                  "compile+fusion-nomove", "compile+fusion-noshare", "compile+fusion-nocat",
                  "compile+fusion-nostrided")


def image(size, n):
    """skimage's astronaut (512x512 RGB) resized to size x size, in [-1, 1], batch n."""
    import importlib.util

    import numpy as np
    from PIL import Image

    # The PNG that skimage.data.astronaut() reads, opened with Pillow: importing skimage.data pulls in
    # skimage.io and scipy, which the GPU machines lack.
    png = importlib.util.find_spec("skimage").submodule_search_locations[0] + "/data/astronaut.png"
    img = torch.from_numpy(np.asarray(Image.open(png).convert("RGB")).copy()).permute(2, 0, 1).float().div(127.5).sub(1.0)
    img = F.interpolate(img[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return img.repeat(n, 1, 1, 1)


class Decoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z).sample


class Encoder(torch.nn.Module):
    """The VAE's encoder alone (its decoder is neither converted, compiled nor kept in memory)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, x):
        return self.encoder(x)


def _sample(o):
    return o[0] if isinstance(o, (tuple, list)) else getattr(o, "sample", o)


def build(row, dev, smoke):
    """(fp32 model on dev, inputs in fp32, dtype, memory format, train). diffusers is imported for its rows
    only (the timm row runs without it)."""
    if row.startswith("bit"):
        import timm
    else:
        from diffusers import (AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLHunyuanVideo, UNet2DConditionModel,
                               UNet2DModel)

    torch.manual_seed(0)
    s = 8 if smoke else 1  # smoke: channel and size divisor
    if row.startswith("vae"):  # vae[-enc][-1024]-fp16-{nchw,cl}: the decoder (1 latent) or the encoder (4 images)
        ch = tuple(c // s for c in (128, 256, 512, 512))
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=32 // s,
                            layers_per_block=2, block_out_channels=ch, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4).to(dev).eval()
        size = (1024 if "-1024-" in row else 512) // s
        fmt = torch.channels_last if row.endswith("cl") else torch.contiguous_format
        if "-enc-" in row:
            return Encoder(vae.encoder), (image(size, 4).to(dev),), torch.float16, fmt, False
        with torch.no_grad():  # real latents: the encoder's posterior mean of the image
            lat = vae.encode(image(size, 1).to(dev)).latent_dist.mean
        return Decoder(vae), (lat,), torch.float16, fmt, False
    if row == "unet2d-train-bf16":
        ch = tuple(c // s for c in (128, 256, 256, 512))
        unet = UNet2DModel(sample_size=64 // s, block_out_channels=ch, norm_num_groups=32 // s,
                           down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                           up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D")).to(dev).train()
        n = 2 if smoke else 8
        return unet, (image(64 // s, n).to(dev), torch.linspace(10, 900, n).long().to(dev)), torch.bfloat16, \
            torch.contiguous_format, True
    if row == "sd15-unet-fp16":
        ch = tuple(c // s for c in (320, 640, 1280, 1280))
        unet = UNet2DConditionModel(sample_size=64 // s, block_out_channels=ch, norm_num_groups=32 // s,
                                    cross_attention_dim=768 // s, attention_head_dim=8).to(dev).eval()
        torch.manual_seed(1)
        lat = F.interpolate(image(512 // s, 2), scale_factor=1 / 8, mode="area")
        lat = torch.cat([lat, lat.mean(1, keepdim=True)], 1).to(dev)  # 4 latent channels from the image
        text = torch.randn(2, 77, 768 // s, device=dev)
        return unet, (lat, torch.tensor([500, 500], device=dev), text), torch.float16, torch.contiguous_format, False
    if row == "bit-train-bf16":
        bit = timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=1000).to(dev).train()
        n, size = (2, 64) if smoke else (32, 224)
        return bit, (image(size, n).to(dev),), torch.bfloat16, torch.contiguous_format, True
    if row.startswith("hunyuan-video-fp16"):
        ch = tuple(c // s for c in (128, 256, 512, 512))
        vae = AutoencoderKLHunyuanVideo(block_out_channels=ch, norm_num_groups=32 // s).to(dev).eval()
        t = 2 if smoke else (9 if row.endswith("-33f") else 5)  # latent frames: 4 (t - 1) + 1 decoded
        z = torch.randn(1, 16, t, 64 // s, 64 // s, generator=torch.Generator().manual_seed(2))
        fmt = torch.channels_last_3d if row.endswith("-cl") else torch.contiguous_format
        return VideoDecoder(vae), (z.to(dev),), torch.float16, fmt, False
    if row == "cogvideox-fp16":
        ch = tuple(c // s for c in (128, 256, 256, 512))
        vae = AutoencoderKLCogVideoX(block_out_channels=ch, norm_num_groups=32 // s).to(dev).eval()
        z = torch.randn(1, 16, 5 if not smoke else 2, 64 // s, 64 // s, generator=torch.Generator().manual_seed(2))
        return Decoder(vae), (z.to(dev),), torch.float16, torch.contiguous_format, False
    raise ValueError(f"unknown row {row!r}")


class VideoDecoder(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.decoder = vae.decoder

    def forward(self, z):
        return self.decoder(z)


ROWS = ("vae-fp16-nchw", "vae-fp16-cl", "unet2d-train-bf16", "sd15-unet-fp16", "bit-train-bf16")
# Further AutoencoderKL rows, run when named: the encoder (batch 4) and 1024² images.
VAE_ROWS = ("vae-enc-fp16-nchw", "vae-enc-fp16-cl", "vae-1024-fp16-nchw", "vae-1024-fp16-cl",
            "vae-enc-1024-fp16-nchw", "vae-enc-1024-fp16-cl")
# Rows whose blocks the converter has no rule for: it traces them (convert_group_norm_act(example_inputs=...)).
TRACED_ROWS = ("hunyuan-video-fp16", "hunyuan-video-fp16-cl", "hunyuan-video-fp16-33f", "cogvideox-fp16")


def _cast(args, dtype, fmt):
    dims = 5 if fmt == torch.channels_last_3d else 4
    return tuple(a.to(dtype).contiguous(memory_format=fmt) if a.is_floating_point() and a.dim() == dims
                 else a.to(dtype) if a.is_floating_point() else a for a in args)


def step_fn(model, args, train, graphs=False):
    """One call as the user makes it: inference under no_grad, or forward + backward. graphs: the
    model is compiled with CUDA graphs (mode="reduce-overhead"): each call starts a new step
    (torch.compiler.cudagraph_mark_step_begin) and returns a clone, since the graph's output buffers
    are overwritten by the next replay."""
    mark = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)
    keep = (lambda t: t.clone()) if graphs else (lambda t: t)
    if not train:
        def run():
            mark()
            with torch.no_grad():
                return keep(_sample(model(*args)))
        return run

    def run():
        mark()
        for p in model.parameters():
            p.grad = None
        out = _sample(model(*args))
        out.float().square().mean().backward()
        return keep(out.detach())
    return run


def compile_fusion_variant(model, mode=None, marker="fx_graph_cache"):
    """torch.compile(model) as a user calls it with enable_compile_fusion() on: the default Inductor
    backend. The options dict ({"fx_graph_cache": False}) makes Dynamo treat this backend as another one
    than plain torch.compile's (its BACKEND_MATCH guard compares the options), so this model cannot be
    handed that variant's code; compile its first calls under no_caches() so that the pass runs on
    every graph and its rewrites are counted (a graph from the on-disk caches skips the pass; the code
    is the same). (Before: a backend function of its own calling compile_fx, which is not the path
    users take; two runs put it at 0.89-0.98x of plain torch.compile on graphs the pass left unchanged.)"""
    if mode is None:
        return torch.compile(model, options={marker: False})
    # mode and options are exclusive in torch.compile: the mode's options plus the marker
    return torch.compile(model, options={**torch._inductor.list_mode_options(mode), marker: False})


@contextlib.contextmanager
def fusion_pass(when, move_bias=True, no_autograd=True, pad=True, move=True, share=True, cat=True, strided=True):
    """enable_compile_fusion(when) for what compiles inside; move_bias=False: with the pass's convolution-bias move
    (input_bias) off; no_autograd=False: with its post-grad retarget to the ops' twins of no Autograd kernel off;
    pad=False: with its padded outputs (group_norm_act_pad) off; move=False: with its data-movement rules (up-sampler
    gathers, zero pads dropped) off; share=False: a convolution's bias moved only where the GroupNorm is its output's
    one reader; cat=False: modulated chains not written into their concatenation along time; strided=False: modulated
    chains whose input is a strided view left to Inductor."""
    ge.enable_compile_fusion(when=when)
    try:
        with contextlib.ExitStack() as stack:
            if not move_bias:
                stack.enter_context(mock.patch.object(compile_fusion, "_take_conv_bias", lambda x, xm, chain: None))
            if not share:
                def alone(x, xm, chain):
                    return [] if all(u is chain[0] for u in x.users) else None
                stack.enter_context(mock.patch.object(compile_fusion, "_bias_moves", alone))
            if not no_autograd:
                stack.enter_context(mock.patch.object(compile_fusion, "_retarget", lambda graph: 0))
            if not pad:
                stack.enter_context(mock.patch.object(compile_fusion, "_take_pad", lambda act_node, xm: None))
            if not cat:
                stack.enter_context(mock.patch.object(compile_fusion, "_take_cat", lambda last, xm: None))
            if not strided:
                modulation = compile_fusion._modulation

                def contiguous_only(gn, xm):
                    return "modulated chain with a strided x (left by compile+fusion-nostrided)" \
                        if not xm.is_contiguous() else modulation(gn, xm)
                stack.enter_context(mock.patch.object(compile_fusion, "_modulation", contiguous_only))
            if not move:
                stack.enter_context(mock.patch.object(compile_fusion, "rewrite_movement",
                                                      lambda graph, stats, applies: 0))
            yield
    finally:
        ge.disable_compile_fusion()


def no_caches():
    """Inductor's and AOTAutograd's caches off (torch.compiler.config.force_disable_caches)."""
    return torch.compiler.config.patch(force_disable_caches=True)


# Per-round ratios: (variant, its baseline); the two ran in the same round, so slow phases of the shared
# machine that span a round cancel.
PAIRS = (("gnext", "eager"), ("gnext-aten", "eager"), ("compile", "eager"), ("compile+fusion", "compile"),
         ("gnext-nopad", "eager"), ("gnext", "gnext-nopad"), ("gnext-nomod", "eager"), ("gnext", "gnext-nomod"),
         ("gnext", "gnext-nofold"), ("gnext", "gnext-padrows"), ("gnext", "gnext-nostream"),
         ("gnext", "gnext-noblocks"), ("compile+fusion-nobias", "compile"),
         ("compile+fusion", "compile+fusion-nobias"), ("compile+fusion-autograd", "compile"),
         ("compile+fusion", "compile+fusion-autograd"), ("compile+fusion-nopad", "compile"),
         ("compile+fusion", "compile+fusion-nopad"), ("compile+fusion-nomove", "compile"),
         ("compile+fusion", "compile+fusion-nomove"), ("compile+fusion", "compile+fusion-noshare"),
         ("compile+fusion", "compile+fusion-nocat"), ("compile+fusion", "compile+fusion-nostrided"))


def paired(times):
    """For each pair run: median [min, max] over rounds of baseline time / variant time, and rounds won."""
    out = {}
    for v, base in PAIRS:
        if v not in times or base not in times:
            continue
        ratios = [b / t for b, t in zip(times[base], times[v])]
        out[f"{v} vs {base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                 "wins": sum(x > 1 for x in ratios), "rounds": len(ratios)}
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def wall_ms(fn, sync, iters):
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e3


def run_row(row, dev, smoke, rounds, when, progress, mode=None, variants=VARIANTS):
    model32, args32, dtype, fmt, train = build(row, dev, smoke)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    with torch.no_grad() if not train else torch.enable_grad():
        ref = step_fn(model32.to(memory_format=fmt), _cast(args32, torch.float32, fmt), train)().float()
    args = _cast(args32, dtype, fmt)
    orig = copy.deepcopy(model32).to(dtype).to(memory_format=fmt)
    conv, counts = ge.convert_group_norm_act(copy.deepcopy(orig), return_counts=True,
                                             example_inputs=args if row in TRACED_ROWS else None)
    fns, info = {}, {"converted": counts}
    # gnext-aten: the unedited model while gnext's kernels serve aten::native_group_norm(_backward); switched
    # on around each of its calls and timings only (the switch itself is not timed).
    aten_on = {v: ge.aten_kernels if v == "gnext-aten" else contextlib.nullcontext for v in variants}
    fns["eager"] = step_fn(orig, args, train)
    fns["gnext"] = step_fn(conv, args, train)
    fns["gnext-aten"] = step_fn(orig, args, train)
    if "gnext-nopad" in variants:
        nopad, info["converted_nopad"] = ge.convert_group_norm_act(
            copy.deepcopy(orig), return_counts=True, pad_into_conv=False,
            example_inputs=args if row in TRACED_ROWS else None)
        fns["gnext-nopad"] = step_fn(nopad, args, train)
    if "gnext-nomod" in variants:  # the converter without its spatial norms (CogVideoX): their own forwards back,
        nomod = copy.deepcopy(conv)  # and their blocks' (which write the norms into the convolutions' inputs)
        for m in nomod.modules():
            if type(m).__name__ in ("CogVideoXSpatialNorm3D", "CogVideoXResnetBlock3D"):
                m.__dict__.pop("forward", None)
        fns["gnext-nomod"] = step_fn(nomod, args, train)
    if "gnext-nofold" in variants:  # the converter with each convolution adding its own bias
        nofold = copy.deepcopy(conv)
        for m in nofold.modules():
            if "_gnext_fold_block" in m.__dict__:
                m.__dict__.pop("forward", None)
            m.__dict__.pop("_gnext_conv1_bias_to_norm2", None)  # ResnetBlock2D: conv1 adds its own bias
        fns["gnext-nofold"] = step_fn(nofold, args, train)
    if "gnext-padrows" in variants:  # the converter, its padded outputs on the row kernel instead of the tile kernel
        fns["gnext-padrows"] = with_tuning(step_fn(conv, args, train), GNEXT_PAD_TILE=0)
    if "gnext-nostream" in variants:  # the converter with each block adding its own biases
        nostream = copy.deepcopy(conv)
        for m in nostream.modules():
            m.__dict__.pop("_gnext_stream_block", None)
        fns["gnext-nostream"] = step_fn(nostream, args, train)
    if "gnext-noblocks" in variants:  # the converter with HunyuanVideo's blocks on their own forwards
        noblocks = copy.deepcopy(conv)
        for m in noblocks.modules():
            if "_gnext_stream_block" in m.__dict__ or type(m).__name__ in ("HunyuanVideoResnetBlockCausal3D",
                                                                             "HunyuanVideoUpsampleCausal3D"):
                m.__dict__.pop("_gnext_stream_block", None)
                m.__dict__.pop("forward", None)
        fns["gnext-noblocks"] = step_fn(noblocks, args, train)
    outs, t_compile = {}, {}
    graphs = mode is not None and bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs"))
    if "compile" in variants:
        torch._dynamo.reset()
        fns["compile"] = step_fn(torch.compile(copy.deepcopy(orig), mode=mode), args, train, graphs)
    for v in [v for v in variants if not v.startswith("compile+fusion")]:
        t0 = time.perf_counter()
        with aten_on[v]():
            outs[v] = fns[v]()
        t_compile[v] = time.perf_counter() - t0
        progress(f"{row}: {v} first call {t_compile[v]:.1f} s")
    info["fusion_rewrites"] = None
    # The fusion variants under options of their own (each a backend Dynamo tells apart from the others');
    # -nobias with the pass's convolution-bias move off, -autograd with its post-grad retarget off, -nopad with its
    # padded outputs off.
    for v, marker in (("compile+fusion", "fx_graph_cache"), ("compile+fusion-nobias", "fx_graph_remote_cache"),
                      ("compile+fusion-autograd", "autotune_local_cache"),
                      ("compile+fusion-nopad", "autotune_remote_cache"),
                      ("compile+fusion-nomove", "bundled_autotune_remote_cache"),
                      ("compile+fusion-noshare", "search_autotune_cache"),
                      ("compile+fusion-nocat", "autotune_in_subproc"),
                      ("compile+fusion-nostrided", "bundle_triton_into_fx_graph_cache")):
        if v not in variants:
            continue
        before = dict(compile_fusion.compile_fusion_stats)
        with fusion_pass(when, move_bias=not v.endswith("-nobias"), no_autograd=not v.endswith("-autograd"),
                         pad=not v.endswith("-nopad"), move=not v.endswith("-nomove"),
                         share=not v.endswith("-noshare"), cat=not v.endswith("-nocat"),
                         strided=not v.endswith("-nostrided")):
            fns[v] = step_fn(compile_fusion_variant(copy.deepcopy(orig), mode, marker), args, train, graphs)
            t0 = time.perf_counter()
            with no_caches():
                outs[v] = fns[v]()
                fns[v]()  # a second call under the pass: recompiles (if any) get it too
            progress(f"{row}: {v} first calls {time.perf_counter() - t0:.1f} s")
        key = "fusion_rewrites" + v.removeprefix("compile+fusion").replace("-", "_")  # "", "_nobias", "_autograd", ...
        info[key] = compile_fusion.compile_fusion_stats["group_norm_act"] - before["group_norm_act"]
        if v == "compile+fusion":
            for k in ("input_bias", "no_autograd", "pad", "modulate", "unmatched", "gather", "zero_pad"):
                info[f"fusion_{k}"] = compile_fusion.compile_fusion_stats[k] - before[k]

    def timed(v, n):
        with aten_on[v]():
            return wall_ms(fns[v], sync, n)

    for v in variants:  # warm-up, and the number of calls per timing (~0.25 s each)
        with aten_on[v]():
            fns[v]()
    iters = {v: max(1, min(50, int(250 / max(timed(v, 1), 1e-3)))) for v in variants}
    if smoke:
        iters = dict.fromkeys(variants, 1)
    peak = {}
    if dev == "cuda":  # torch.cuda.max_memory_allocated over one call of each variant (weights and inputs included)
        for v in variants:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with aten_on[v]():
                fns[v]()
            torch.cuda.synchronize()
            peak[v] = torch.cuda.max_memory_allocated() / 2**30
    times, orders = {v: [] for v in variants}, []
    rng = random.Random(0)
    for r in range(rounds):
        # A fresh order every round: with a rotation each variant always followed the same one, and
        # compile+fusion with 0 rewrites (the same code as compile) came out 0.89-0.93x of compile
        # in two H100 runs, an order effect or a real one that a fixed order cannot tell apart.
        order = list(variants)
        rng.shuffle(order)
        orders.append(order)
        for v in order:
            times[v].append(timed(v, iters[v]))
        progress(f"{row}: round {r + 1}/{rounds} " + " ".join(f"{v} {times[v][-1]:.2f}" for v in variants))
    res = {"row": row, "dtype": str(dtype).split(".")[1], "format": "nchw" if fmt == torch.contiguous_format else "cl",
           "train": train, "iters_per_timing": iters, **info,
           "ms": {v: statistics.median(times[v]) for v in variants},
           "ms_min": {v: min(times[v]) for v in variants}, "ms_max": {v: max(times[v]) for v in variants},
           "ms_rounds": times, "orders": orders, "peak_GiB": peak,
           "rel_diff_vs_fp32": {v: rel(outs[v].float(), ref) for v in variants}}
    del fns, orig, conv
    torch._dynamo.reset()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return res


LABELS = {"eager": "eager ms", "gnext": "gnext eager ms (x)", "gnext-aten": "gnext-aten eager ms (x)",
          "compile": "compile ms (x)", "compile+fusion": "compile + fusion ms (x)",
          "gnext-nopad": "gnext eager, no padded outputs ms (x)",
          "gnext-nomod": "gnext eager, no modulated norms ms (x)",
          "gnext-nofold": "gnext eager, convolutions add their bias ms (x)",
          "gnext-padrows": "gnext eager, padded outputs by the row kernel ms (x)",
          "gnext-nostream": "gnext eager, no biases carried down the residual stream ms (x)",
          "gnext-noblocks": "gnext eager, HunyuanVideo blocks on their own forwards ms (x)",
          "compile+fusion-nobias": "compile + fusion, convolutions keep their bias ms (x)",
          "compile+fusion-autograd": "compile + fusion, ops through their Python Autograd kernels ms (x)",
          "compile+fusion-nopad": "compile + fusion, pads left to Inductor ms (x)",
          "compile+fusion-nomove": "compile + fusion, no data-movement rules ms (x)",
          "compile+fusion-noshare": "compile + fusion, a convolution's bias moved only where the GroupNorm is its one "
                                    "reader ms (x)",
          "compile+fusion-nocat": "compile + fusion, concatenations along time left to Inductor ms (x)",
          "compile+fusion-nostrided": "compile + fusion, strided modulated inputs left to Inductor ms (x)"}


def write(out_dir, meta, rows, name="real_models"):
    """<name>.json, <name>.md and <name>.png (bars: speed-up over original eager) under out_dir. Columns: the
    variants any row has (a row without one shows "–")."""
    have = [v for v in VARIANTS + EXTRA_VARIANTS if any(v in r["ms"] for r in rows)]
    fusion = "compile+fusion" in have and "compile" in have
    head = [LABELS[v] for v in have] + (["fusion vs compile", "rewrites"] if fusion else [])
    head += [f"peak GiB: {' / '.join(have)}"]
    lines = [f"{meta['device']} · torch {meta['torch']} · {meta['date']} · {meta['timing']}", "",
             "| model | " + " | ".join(head) + f" | rel diff vs fp32: {' / '.join(have)} |",
             "|---|" + "---:|" * len(head) + "---|"]
    for r in rows:
        ms, lo, hi = r["ms"], r["ms_min"], r["ms_max"]

        def cell(v):
            if v not in ms:
                return "–"
            c = f"{ms[v]:.2f} [{lo[v]:.2f}–{hi[v]:.2f}]"
            return c if v == "eager" or "eager" not in ms else f"{c} ({ms['eager'] / ms[v]:.2f}x)"

        cells = [cell(v) for v in have]
        if fusion:
            both = "compile" in ms and "compile+fusion" in ms
            cells += [f"{ms['compile'] / ms['compile+fusion']:.2f}x" if both else "–", str(r["fusion_rewrites"])]
        pk = r.get("peak_GiB") or {}
        cells += [" / ".join(f"{pk[v]:.2f}" if v in pk else "–" for v in have)]
        d = r["rel_diff_vs_fp32"]
        lines.append(f"| {r['row']} | " + " | ".join(cells) + " | "
                     + " / ".join(f"{d[v]:.1e}" if v in d else "–" for v in have) + " |")
    lines += ["", "Times: median [min–max] over rounds, ms per call (host + GPU). (x): speed-up over original eager. "
              "rewrites: GroupNorm+activation chains the compile pass rewrote; converted layers per row in the JSON."]
    pairs = [(v, b) for v, b in PAIRS if v in have and b in have]
    lines += ["", "Per-round ratios (baseline time / variant time within one round): median [min–max], rounds won.", "",
              "| model | " + " | ".join(f"{v} vs {b}" for v, b in pairs) + " |", "|---|" + "---:|" * len(pairs)]
    for r in rows:
        pr = paired(r["ms_rounds"])
        cells = [(lambda q: f"{q['median']:.3f} [{q['min']:.2f}–{q['max']:.2f}] {q['wins']}/{q['rounds']}")(
            pr[f"{v} vs {b}"]) if f"{v} vs {b}" in pr else "–" for v, b in pairs]
        order = "random order" if "orders" in r else "rotating order"
        lines.append(f"| {r['row']} ({order}) | " + " | ".join(cells) + " |")
    lines += [f"- {r['row']}: {r['note']}" for r in rows if r.get("note")]
    md = "\n".join(lines) + "\n"
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 3.6))
        bars = [v for v in have if v != "eager"]
        w = 0.8 / max(1, len(bars))
        for i, v in enumerate(bars):
            rs = [r for r in rows if v in r["ms"] and "eager" in r["ms"]]
            ks = [k for k, r in enumerate(rows) if v in r["ms"] and "eager" in r["ms"]]
            ys = [r["ms"]["eager"] / r["ms"][v] for r in rs]
            err = [[y - r["ms"]["eager"] / r["ms_max"][v] for y, r in zip(ys, rs)],
                   [r["ms"]["eager"] / r["ms_min"][v] - y for y, r in zip(ys, rs)]]
            ax.bar([k + (i - (len(bars) - 1) / 2) * w for k in ks], ys, w, yerr=err, capsize=2, label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), [r["row"] for r in rows], fontsize=8)
        ax.set_ylabel("speed-up over original eager")
        ax.set_title(f"{meta['device']}, torch {meta['torch']}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
    except ImportError:
        pass
    return md


def merge(files, wanted):
    """(meta, rows) of one table from the JSON of earlier runs: the rows named in `wanted`, in that order,
    each from the last file that has it. Each row keeps the date and timing of the run that made it
    (a merged file's rows carry theirs), and the table's date and timing list them per group of rows."""
    data = [json.loads(pathlib.Path(f).read_text()) for f in files]
    for d in data:
        for r in d["rows"]:
            r.setdefault("date", d["meta"]["date"])
            r.setdefault("timing", d["meta"]["timing"])
    by_row = {r["row"]: r for d in data for r in d["rows"]}
    rows = [by_row[w] for w in wanted if w in by_row]
    groups = {}
    for r in rows:
        groups.setdefault((r["date"], r["timing"]), []).append(r["row"])
    meta = dict(data[0]["meta"], date=" / ".join(dict.fromkeys(date for date, _ in groups)),
                timing=" / ".join(f"{timing} ({', '.join(names)})" for (_, timing), names in groups.items()))
    return meta, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {','.join(ROWS + VAE_ROWS + TRACED_ROWS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench_out"))
    p.add_argument("--name", default="real_models")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny configs, when='always'")
    p.add_argument("--fusion-when", choices=("auto", "always"), default="auto",
                   help="enable_compile_fusion(when=...) of the compile + fusion variant: 'always' also "
                        "rewrites training graphs (to measure them against the rule)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of both compiled variants (e.g. reduce-overhead: CUDA graphs, "
                        "which take the host out of the compiled steps); default: torch.compile's default")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS + EXTRA_VARIANTS)} (eager is the baseline of "
                        "the ratios)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no run: one table (in --rows order) from the rows of JSON files of earlier runs "
                        "(rows run in separate processes or device calls); meta from the first file")
    args = p.parse_args()
    if args.merge:
        meta, rows = merge(args.merge, args.rows.split(","))
        print(write(args.out, meta, rows, args.name))
        return
    dev = "cpu" if args.smoke else "cuda"
    when = "always" if args.smoke else args.fusion_when
    try:
        from tqdm import tqdm

        progress = tqdm.write
    except ImportError:
        progress = print
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "timing": f"wall time per call, {args.rounds} interleaved rounds"
                      + ("" if when == "auto" else f", compile + fusion with when={when!r}")
                      + ("" if args.compile_mode is None else f", torch.compile mode={args.compile_mode!r}"),
            "input": "skimage.data.astronaut(); VAE: its encoder's latents"}
    rows = []
    for row in args.rows.split(","):
        variants = tuple(v for v in VARIANTS + EXTRA_VARIANTS if v in args.variants.split(","))
        res = run_row(row, dev, args.smoke, args.rounds, when, progress, args.compile_mode, variants)
        keys = ("row", "ms", "converted", "fusion_rewrites", "fusion_input_bias", "fusion_no_autograd", "fusion_pad",
                "fusion_modulate", "fusion_unmatched")
        print(json.dumps({k: res[k] for k in keys if k in res}), flush=True)
        rows.append(res)
        write(args.out, meta, rows, args.name)  # after every row: a time limit loses at most one
    print()
    print(write(args.out, meta, rows, args.name))


if __name__ == "__main__":
    main()
