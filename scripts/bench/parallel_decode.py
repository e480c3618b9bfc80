# SPDX-License-Identifier: BSD-3-Clause
"""A diffusers AutoencoderKL decoder split by rows of H over the ranks of a process group (one image per call):
every GroupNorm becomes groupnorm_ext.distributed.SpatialGroupNorm (exact whole-tensor statistics, a few KB per
layer), every 3x3 convolution exchanges one halo row with its neighbours (halo_exchange: an all-gather of each
rank's first and last rows only), and the mid-block attention gathers the whole (latent-resolution) tensor,
attends, and keeps its rows. Upsampling is local.

    python scripts/bench/parallel_decode.py --check              # 2 CPU processes, gloo, a small random decoder
    python scripts/bench/parallel_decode.py --size 2048 --gpus 2  # NCCL: one GPU against the split decode

--check compares the split decode with the one-process decode (max abs difference). The GPU run reports wall time
per decode (median of --reps, the slowest rank), the speedup over one GPU, peak memory per GPU, and the max abs
difference and PSNR of the decoded image against the one-GPU decode. Random weights of the SD VAE's shape (no
download)."""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import event_ms  # noqa: E402


def halo_exchange(x: torch.Tensor, rows: int, group=None) -> torch.Tensor:
    """x (N, C, h, W), this rank's rows of H, with `rows` rows of each neighbour above and below (zeros at the
    image's top and bottom). Every rank must hold at least `rows` rows."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    edges = torch.cat([x[:, :, :rows], x[:, :, -rows:]], dim=2).contiguous()
    everyone = [torch.empty_like(edges) for _ in range(world)]
    dist.all_gather(everyone, edges, group=group)
    zeros = torch.zeros_like(edges[:, :, :rows])
    above = everyone[rank - 1][:, :, rows:] if rank > 0 else zeros
    below = everyone[rank + 1][:, :, :rows] if rank < world - 1 else zeros
    return torch.cat([above, x, below], dim=2)


class HaloConv2d(nn.Module):
    """A stride-1 Conv2d with padding p along H computed on a row shard: p halo rows from each neighbour, then the
    convolution without padding along H (the conv's own padding along W)."""

    def __init__(self, conv: nn.Conv2d, group=None):
        super().__init__()
        self.conv, self.group = conv, group

    def forward(self, x):
        c = self.conv
        ph, pw = c.padding
        if ph:
            x = halo_exchange(x, ph, self.group)
        return F.conv2d(x, c.weight, c.bias, c.stride, (0, pw), c.dilation, c.groups)


class GatherAttention(nn.Module):
    """An attention block run on the whole tensor: all rows gathered (equal shards), attended, this rank's kept."""

    def __init__(self, attn: nn.Module, group=None):
        super().__init__()
        self.attn, self.group = attn, group

    def forward(self, hidden_states, *args, **kwargs):
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        parts = [torch.empty_like(hidden_states) for _ in range(world)]
        dist.all_gather(parts, hidden_states.contiguous(), group=self.group)
        out = self.attn(torch.cat(parts, dim=2), *args, **kwargs)
        h = hidden_states.shape[2]
        return out[:, :, rank * h:(rank + 1) * h]


def parallelize_decoder(decoder: nn.Module, group=None) -> nn.Module:
    """The decoder with its GroupNorms, 3x3 convolutions and attention blocks made row-parallel (in place)."""
    from groupnorm_ext.distributed import SpatialGroupNorm, convert_group_norm_spatial

    def walk(m):
        for name, child in list(m.named_children()):
            if type(child).__name__ == "Attention":
                setattr(m, name, GatherAttention(child, group))  # its own GroupNorm sees the whole tensor
            elif isinstance(child, nn.Conv2d) and child.kernel_size[0] > 1:
                assert child.stride == (1, 1), "the decoder has no strided convolutions"
                setattr(m, name, HaloConv2d(child, group))
            elif isinstance(child, nn.GroupNorm) and not isinstance(child, SpatialGroupNorm):
                setattr(m, name, convert_group_norm_spatial(child, dim=2, group=group))
            else:
                walk(child)

    walk(decoder)
    return decoder


def _vae(small: bool):
    import diffusers

    if small:
        return diffusers.AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                                       up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                       norm_num_groups=8, latent_channels=4)
    return diffusers.AutoencoderKL(block_out_channels=(128, 256, 512, 512),
                                   down_block_types=("DownEncoderBlock2D",) * 4,
                                   up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4)


def _worker(rank, world, init, args, q):
    backend = "gloo" if args.check else "nccl"
    device = "cpu" if args.check else f"cuda:{rank}"
    if device != "cpu":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    dtype = torch.float32 if args.check else torch.float16
    dec = _vae(args.check).decoder.to(device, dtype).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    lat = args.size // 8
    z = torch.randn(1, 4, lat, lat, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    h = lat // world
    import copy

    single = copy.deepcopy(dec) if rank == 0 else None
    par = parallelize_decoder(dec)
    res = {}
    with torch.no_grad():
        mine = z[:, :, rank * h:(rank + 1) * h]
        out = par(mine)
        parts = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(parts, out.contiguous())
        if rank == 0:
            ref = single(z)
            whole = torch.cat(parts, dim=2)
            diff = (whole.float() - ref.float()).abs().max().item()
            mse = ((whole.float() - ref.float()) ** 2).mean().item()
            rng = (ref.float().max() - ref.float().min()).item()
            res.update(max_abs_diff=diff, psnr=10 * math.log10(rng ** 2 / mse) if mse > 0 else float("inf"))
        if not args.check:
            torch.cuda.reset_peak_memory_stats()
            res["split_ms"] = event_ms(lambda: par(mine), args.reps, across_ranks=True)
            res["split_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
            if rank == 0:
                del par
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                res["single_ms"] = event_ms(lambda: single(z), args.reps)
                res["single_peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
                res["device"] = torch.cuda.get_device_name()
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def run(args) -> dict:
    world = 2 if args.check else args.gpus
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, f"file://{tmp}/store", args, q), nprocs=world, join=True,
                           start_method="spawn")
    return q.get()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="2 CPU processes (gloo), a small decoder, 64x64 image")
    p.add_argument("--size", type=int, default=None, help="image size (default 64 with --check, else 2048)")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    args.size = args.size or (64 if args.check else 2048)
    r = run(args)
    print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
