#!/usr/bin/env python3
"""Real models end to end (issue 5): diffusers AutoencoderKL decoder and UNet2DModel, and a timm
ResNetV2-BiT (GroupNormAct layers), in fp16/bf16, NCHW and channels_last, on a real image
(skimage.data.astronaut()). For each: the difference of the gnext-converted model's output from the
original's (with the original's own fp16/bf16-vs-fp32 difference for scale), and inference times of
original eager, converted eager and torch.compile(original) from one process.

    python scripts/real_models.py --out bench_results     (GPU; diffusers, timm, scikit-image needed)
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import groupnorm_ext as ge  # noqa: E402
from bench import Timer  # noqa: E402


def image(size, n):
    """skimage's astronaut (512x512 RGB) resized to size x size, in [-1, 1], batch n."""
    from skimage import data

    img = torch.from_numpy(data.astronaut()).permute(2, 0, 1).float().div(127.5).sub(1.0)
    img = F.interpolate(img[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return img.repeat(n, 1, 1, 1)


def models():
    """name -> (module in fp32 on cuda, make_input(dtype, fmt) -> args, converter)."""
    from diffusers import AutoencoderKL, UNet2DModel
    import timm

    torch.manual_seed(0)
    out = {}
    # SD-1.x VAE layout (diffusers' AutoencoderKL defaults are a one-level toy): decoder from 64x64 latents.
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=32, layers_per_block=2,
                        block_out_channels=(128, 256, 512, 512),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    vae = vae.cuda().eval()
    with torch.no_grad():  # real latents: the encoder's posterior mean of the image
        lat = vae.encode(image(512, 1).cuda()).latent_dist.mean

    class Decoder(torch.nn.Module):
        def __init__(self, vae):
            super().__init__()
            self.vae = vae

        def forward(self, z):
            return self.vae.decode(z).sample

    out["diffusers AutoencoderKL decoder (SD layout) 1x4x64x64 -> 512x512"] = (
        Decoder(vae), lambda dt, fmt: (lat.to(dt).contiguous(memory_format=fmt),), ge.convert_group_norm)
    unet = UNet2DModel(sample_size=128).cuda().eval()  # diffusers' default config
    img = image(128, 2).cuda()
    t = torch.tensor([500, 500], device="cuda")
    out["diffusers UNet2DModel (default config) 2x3x128x128"] = (
        unet, lambda dt, fmt: (img.to(dt).contiguous(memory_format=fmt), t), ge.convert_group_norm)
    bit = timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=1000).cuda().eval()
    img224 = image(224, 8).cuda()
    out["timm resnetv2_50x1_bit (GroupNormAct) 8x3x224x224"] = (
        bit, lambda dt, fmt: (img224.to(dt).contiguous(memory_format=fmt),), ge.convert_group_norm_act)
    return out


def first(o):
    return o[0] if isinstance(o, (tuple, list)) else getattr(o, "sample", o)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def write(out_dir, meta, rows):
    """real_models.json and real_models.md under out_dir; returns the markdown."""
    lines = [f"Device: {meta['device']} · torch {meta['torch']} · {meta['date']} · {meta['timing']} · "
             f"input: {meta['input']}", "",
             "| model | dtype | format | GNs | original ms | gnext ms | x original | compile(original) ms | "
             "rel diff gnext vs original | rel diff original vs fp32 | rel diff gnext vs fp32 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = f"{r['compile_ms']:.3f}" if "compile_ms" in r else "–"
        lines.append(f"| {r['model']} | {r['dtype']} | {r['format']} | {r['groupnorms']} | {r['original_ms']:.3f} | "
                     f"{r['gnext_ms']:.3f} | {r['original_ms'] / r['gnext_ms']:.2f} | {c} | "
                     f"{r['rel_diff_converted_vs_original']:.1e} | {r['rel_diff_original_vs_fp32']:.1e} | "
                     f"{r['rel_diff_converted_vs_fp32']:.1e} |")
    md = "\n".join(lines) + "\n"
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_models.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "real_models.md").write_text(md)
    return md


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(ROOT / "bench_results"))
    p.add_argument("--compile", default="bfloat16:cl",
                   help="dtype:format pairs that also time torch.compile(original) (compiles are slow)")
    args = p.parse_args()
    timer = Timer("cuda")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "timing": "median of CUDA-event-timed inference calls (torch.no_grad), L2 flushed before each",
            "input": "skimage.data.astronaut() resized; VAE: its encoder's latents"}
    compile_set = set(args.compile.split(","))
    rows = []
    for name, (model, make, convert) in models().items():
        n_gn = sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
        for dt in (torch.float16, torch.bfloat16):
            for fmt_name, fmt in (("nchw", torch.contiguous_format), ("cl", torch.channels_last)):
                orig = copy.deepcopy(model).to(dt).to(memory_format=fmt)
                conv = convert(copy.deepcopy(orig))
                inputs = make(dt, fmt)
                with torch.no_grad():
                    y_ref32 = first(copy.deepcopy(model).to(memory_format=fmt)(*[
                        a.float() if a.is_floating_point() else a for a in inputs]))
                    y_o, y_c = first(orig(*inputs)), first(conv(*inputs))
                    row = {"model": name, "dtype": str(dt).split(".")[1], "format": fmt_name, "groupnorms": n_gn,
                           "rel_diff_converted_vs_original": rel(y_c, y_o),
                           "max_abs_diff_converted_vs_original": (y_c.double() - y_o.double()).abs().max().item(),
                           "rel_diff_original_vs_fp32": rel(y_o, y_ref32),
                           "rel_diff_converted_vs_fp32": rel(y_c, y_ref32),
                           "original_ms": timer(lambda: orig(*inputs)), "gnext_ms": timer(lambda: conv(*inputs))}
                    key = f"{row['dtype']}:{fmt_name}"
                    if key in compile_set:
                        torch._dynamo.reset()
                        comp = torch.compile(orig)
                        comp(*inputs)
                        row["compile_ms"] = timer(lambda: comp(*inputs))
                print(json.dumps(row), flush=True)
                rows.append(row)
                write(args.out, meta, rows)  # after every row: a time limit loses at most one
                del orig, conv
                torch.cuda.empty_cache()
    print()
    print(write(args.out, meta, rows))


if __name__ == "__main__":
    main()
