# SPDX-License-Identifier: BSD-3-Clause
"""A VAE decoder split by rows of H over the ranks of a process group (one image or video per call): diffusers'
AutoencoderKL (--model image) or HunyuanVideo's 5-D causal decoder (--model video). Every GroupNorm becomes
groupnorm_ext.distributed.SpatialGroupNorm (exact whole-tensor statistics, a few KB per layer); every convolution
with padding along H takes halo rows from its neighbours (halo_rows: an all-gather of each rank's first and last
rows only), without a padded copy of the shard (HaloConv2d corrects the zero-padded convolution's edge rows;
HaloCausalConv3d pads in one buffer, repeating the image's own edge rows at its top and bottom); the mid-block attention
takes its queries from this rank's rows and its keys and values from every row (an all-gather of the normalized
latent-resolution tensor; causal over frames for the video decoder). Upsampling (nearest) is local.

    python scripts/bench/parallel_decode.py --check [--model video]   # 2 CPU processes, gloo, a small decoder
    python scripts/bench/parallel_decode.py --size 2048 --gpus 2       # NCCL: one GPU against the split decode
    python scripts/bench/parallel_decode.py --model video --size 512 --frames 17 --gpus 2

Compared in one run: the split decode with gnext's SpatialGroupNorm, the split decode with the all-gather approach
(AllGatherGroupNorm), and one GPU decoding the whole image (eager GroupNorm, and converted to gnext). --check (gloo)
compares the split decodes with the one-process decode (max abs difference, PSNR). The GPU run adds, in rounds of
a random order: wall time per decode (the slowest rank), the speedup over one GPU, GroupNorm's share of the decode
(against the same decode with every GroupNorm(+activation) module replaced by its activation alone), bytes
exchanged per GroupNorm layer, peak memory per GPU. Random weights of the models' shapes (no download)."""
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


def halo_rows(x: torch.Tensor, rows: int, group=None, dim: int = 2) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the `rows` rows before this rank's along `dim`, the `rows` rows after), from its neighbours: an all-gather
    of each rank's first and last rows only. None at the whole tensor's two ends. Every rank must hold at least
    `rows` rows."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[dim]
    edges = torch.cat([x.narrow(dim, 0, rows), x.narrow(dim, n - rows, rows)], dim=dim).contiguous()
    everyone = [torch.empty_like(edges) for _ in range(world)]
    dist.all_gather(everyone, edges, group=group)
    above = everyone[rank - 1].narrow(dim, rows, rows) if rank > 0 else None
    below = everyone[rank + 1].narrow(dim, 0, rows) if rank < world - 1 else None
    return above, below


class HaloConv2d(nn.Module):
    """A stride-1 Conv2d with zero padding p along H computed on a row shard, without a padded copy of the shard:
    the convolution with zero padding along H, then its first and last p rows corrected by what the neighbours' p
    halo rows add (the convolution is linear: the halo rows, next to p zero rows, convolved without bias). The image's
    top and bottom ranks correct only their inner side. Output rows next to a shard boundary are rounded twice (the
    zero-padded convolution and the correction are summed in the output dtype)."""

    def __init__(self, conv: nn.Conv2d, group=None):
        super().__init__()
        assert conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1, conv
        assert conv.padding_mode == "zeros", conv.padding_mode
        self.conv, self.group = conv, group

    def forward(self, x):
        c = self.conv
        ph, pw = c.padding
        out = F.conv2d(x, c.weight, c.bias, 1, (ph, pw))
        if ph:
            above, below = halo_rows(x, ph, self.group)
            zeros = x.new_zeros(*x.shape[:2], ph, x.shape[3])
            if above is not None:  # output rows 0..ph-1 are centred on the slab's rows ph..2ph-1
                out[:, :, :ph] += F.conv2d(torch.cat([above, zeros], dim=2), c.weight, None, 1, (ph, pw))[:, :, ph:]
            if below is not None:
                out[:, :, -ph:] += F.conv2d(torch.cat([zeros, below], dim=2), c.weight, None, 1, (ph, pw))[:, :, :ph]
        return out


class GatherAttention(nn.Module):
    """diffusers' VAE self-attention block (Attention: group_norm, to_q/to_k/to_v, to_out, residual, rescale; 4-D
    input) on a row shard: its GroupNorm split (SpatialGroupNorm), queries from this rank's rows, keys and values from
    every row (the normalized shards all-gathered, at the latent resolution). norm: as parallelize_decoder's."""

    def __init__(self, attn: nn.Module, group=None, norm: str = "gnext"):
        super().__init__()
        self.attn, self.group = attn, group
        gn = attn.group_norm
        self.norm = None if gn is None else _split_norm(gn, group, norm, 2)

    def forward(self, hidden_states, *args, **kwargs):
        a, world = self.attn, dist.get_world_size(self.group)
        N, C, h, W = hidden_states.shape
        x = self.norm(hidden_states) if self.norm is not None else hidden_states
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        kv = torch.cat(parts, dim=2).flatten(2).transpose(1, 2)
        q = a.to_q(x.flatten(2).transpose(1, 2))
        k, v = a.to_k(kv), a.to_v(kv)
        d = q.shape[-1] // a.heads
        q, k, v = (t.view(N, -1, a.heads, d).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, h * W, a.heads * d)
        o = a.to_out[1](a.to_out[0](o)).transpose(1, 2).reshape(N, C, h, W)
        if a.residual_connection:
            o = o + hidden_states
        return o / a.rescale_output_factor


class AllGatherGroupNorm(nn.Module):
    """The all-gather approach (sglang's parallel VAE, written here from its description): gather the whole
    activation to every rank, eager GroupNorm of it, keep this rank's rows along `dim` (equal shards)."""

    def __init__(self, gn: nn.GroupNorm, group=None, dim: int = 2):
        super().__init__()
        self.gn, self.group, self.dim = gn, group, dim

    def forward(self, x):
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        h = x.shape[self.dim]
        return self.gn(torch.cat(parts, dim=self.dim)).narrow(self.dim, rank * h, h)


def parallelize_decoder(decoder: nn.Module, group=None, norm: str = "gnext") -> nn.Module:
    """The decoder with its GroupNorms, 3x3 convolutions and attention blocks made row-parallel (in place).
    norm: "gnext" (SpatialGroupNorm, its default check="once": one host synchronization per layer and shape),
    "gnext_nocheck" (check=False: none), "allgather" (AllGatherGroupNorm) or "none" (the activation alone, _Act:
    not a decoder any more, for GroupNorm's share of the time)."""
    def rule(m):
        if type(m).__name__ == "Attention":
            return GatherAttention(m, group, norm), False
        if isinstance(m, nn.Conv2d) and m.kernel_size[0] > 1:
            assert m.stride == (1, 1), "the decoder has no strided convolutions"
            return HaloConv2d(m, group), False
        return _split_norm_rule(m, group, norm, 2)

    return _replace(decoder, rule)


def _replace(module: nn.Module, rule) -> nn.Module:
    """module, in place: depth first, each descendant m for which rule(m) returns (new, walk) replaced by new (whose
    children are walked too when walk); the children of the others walked."""
    for name, child in list(module.named_children()):
        hit = rule(child)
        if hit is None:
            _replace(child, rule)
        else:
            setattr(module, name, hit[0])
            if hit[1]:
                _replace(hit[0], rule)
    return module


def _split_norm(gn: nn.Module, group, norm: str, dim: int) -> nn.Module:
    from groupnorm_ext.distributed import convert_group_norm_spatial

    return (AllGatherGroupNorm(gn, group, dim) if norm == "allgather" else _Act(gn) if norm == "none" else
            convert_group_norm_spatial(gn, dim=dim, group=group, check=False if norm == "gnext_nocheck" else "once"))


def _split_norm_rule(m: nn.Module, group, norm: str, dim: int):
    """_replace's rule for a GroupNorm not split yet: (its split along dim as `norm` says, False), else None."""
    from groupnorm_ext.distributed import SpatialGroupNorm

    if isinstance(m, nn.GroupNorm) and not isinstance(m, SpatialGroupNorm):
        return _split_norm(m, group, norm, dim), False
    return None


class HaloCausalConv3d(nn.Module):
    """diffusers' HunyuanVideoCausalConv3d (replicate padding: W and H on both sides, T causally) on a shard of rows
    of H: the H padding is the neighbours' rows (the image's own edge rows, repeated, at its top and bottom). The
    padded input is one buffer, written once (the shard, the halo rows, then the W and T edges as F.pad's replicate
    padding, which is separable), in place of a copy with the halo rows and a second one by F.pad."""

    def __init__(self, conv: nn.Module, group=None):
        super().__init__()
        assert conv.pad_mode in ("replicate", "constant"), conv.pad_mode
        self.conv, self.group = conv, group

    def forward(self, x):
        c = self.conv
        w0, w1, h0, h1, t0, t1 = c.time_causal_padding
        assert h0 == h1, "symmetric padding along H"
        if not h0:
            return c.conv(F.pad(x, (w0, w1, 0, 0, t0, t1), mode=c.pad_mode))
        above, below = halo_rows(x, h0, self.group, dim=3)
        B, C, T, h, W = x.shape
        replicate = c.pad_mode == "replicate"
        buf = x.new_empty(B, C, t0 + T + t1, h0 + h + h1, w0 + W + w1)
        rows = buf[:, :, t0:t0 + T, :, w0:w0 + W]
        rows[:, :, :, h0:h0 + h].copy_(x)
        for halo, dst, edge in ((above, rows[:, :, :, :h0], x[:, :, :, :1]),
                                (below, rows[:, :, :, h0 + h:], x[:, :, :, -1:])):
            if halo is not None:
                dst.copy_(halo)
            elif replicate:
                dst.copy_(edge.expand_as(dst))
            else:
                dst.zero_()

        def pad_edges(d: int, before: int, n: int, after: int, part: torch.Tensor) -> None:
            for lo, hi, src in ((0, before, before), (before + n, before + n + after, before + n - 1)):
                if hi > lo:
                    dst = part.narrow(d, lo, hi - lo)
                    if replicate:
                        dst.copy_(part.narrow(d, src, 1).expand_as(dst))
                    else:
                        dst.zero_()

        pad_edges(4, w0, W, w1, buf[:, :, t0:t0 + T])  # W edges of the shard's frames, halo rows included
        pad_edges(2, t0, T, t1, buf)  # then whole frames
        return c.conv(buf)


class SplitMidBlock3D(nn.Module):
    """diffusers' HunyuanVideoMidBlock3D on a shard of rows of H: its resnets as they are (their convolutions and
    GroupNorms split by parallelize_video_decoder), its attention with queries from this rank's tokens and keys and
    values from every token (the normalized shards all-gathered, at the latent resolution), causal over frames as
    diffusers' prepare_causal_attention_mask (a token attends to the tokens of its own and earlier frames)."""

    def __init__(self, mid: nn.Module, group=None):
        super().__init__()
        self.resnets, self.attentions, self.group = mid.resnets, mid.attentions, group

    def forward(self, x):
        x = self.resnets[0](x)
        for attn, resnet in zip(self.attentions, self.resnets[1:]):
            if attn is not None:
                x = self._attend(attn, x)
            x = resnet(x)
        return x

    def _attend(self, a, x):
        B, C, T, h, W = x.shape
        xn = a.group_norm(x) if a.group_norm is not None else x  # split by parallelize_video_decoder
        parts = [torch.empty_like(xn) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, xn.contiguous(), group=self.group)
        full = torch.cat(parts, dim=3)
        H = full.shape[3]
        q = a.to_q(xn.permute(0, 2, 3, 4, 1).reshape(B, T * h * W, C))
        kv = full.permute(0, 2, 3, 4, 1).reshape(B, T * H * W, C)
        k, v = a.to_k(kv), a.to_v(kv)
        d = q.shape[-1] // a.heads
        q, k, v = (t.view(B, -1, a.heads, d).transpose(1, 2) for t in (q, k, v))
        frame_q = torch.arange(T, device=x.device).repeat_interleave(h * W)
        frame_k = torch.arange(T, device=x.device).repeat_interleave(H * W)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=frame_k[None, :] <= frame_q[:, None])
        o = a.to_out[1](a.to_out[0](o.transpose(1, 2).reshape(B, T * h * W, a.heads * d)))
        o = o.reshape(B, T, h, W, C).permute(0, 4, 1, 2, 3)
        if a.residual_connection:
            o = o + x
        return o / a.rescale_output_factor


def parallelize_video_decoder(decoder: nn.Module, group=None, norm: str = "gnext") -> nn.Module:
    """diffusers' HunyuanVideo VAE decoder split by rows of H (dim 3 of its 5-D activations), in place: causal
    convolutions with halo rows (HaloCausalConv3d), the mid block's attention over gathered keys (SplitMidBlock3D),
    every GroupNorm split as `norm` says (parallelize_decoder's values, along dim 3). Upsampling (nearest) is local."""
    def rule(m):
        cls = type(m).__name__
        if cls == "HunyuanVideoMidBlock3D":
            return SplitMidBlock3D(m, group), True  # its resnets and attention norm split inside
        if cls == "HunyuanVideoCausalConv3d":
            return HaloCausalConv3d(m, group), False
        return _split_norm_rule(m, group, norm, 3)

    return _replace(decoder, rule)


class _Act(nn.Module):
    """What is left of a GroupNorm(+activation) module without the GroupNorm: its activation (gnext's fused
    GroupNormAct), else nothing. For GroupNorm's share of the decode."""

    def __init__(self, gn: nn.Module):
        super().__init__()
        from groupnorm_ext.convert import _GatedGroupNormAct

        # a norm fused through an activation gate leaves the activation to the gate
        self.act = "identity" if isinstance(gn, _GatedGroupNormAct) else getattr(gn, "activation", "identity")

    def forward(self, x):
        from groupnorm_ext._cpu import apply_act

        return apply_act(x, self.act)


def _without_group_norm(decoder: nn.Module) -> nn.Module:
    """Every GroupNorm (+activation) module replaced by its activation alone (_Act)."""
    return _replace(decoder, lambda m: (_Act(m), False) if isinstance(m, nn.GroupNorm) else None)


def _decode_with_group_norm_bytes(decoder: nn.Module, z: torch.Tensor, world: int) -> tuple[torch.Tensor, dict]:
    """decoder(z), and the bytes each GroupNorm layer of that decode exchanges when split (the largest layer):
    gnext's statistics (an all-gather of world * N * G * 3 float64) against the all-gather approach (the whole
    activation, to every rank)."""
    sizes = []
    hooks = [m.register_forward_pre_hook(lambda m, a: sizes.append((a[0].numel(), a[0].element_size(), m.num_groups)))
             for m in decoder.modules() if isinstance(m, nn.GroupNorm)]
    try:
        out = decoder(z)
    finally:
        for h in hooks:
            h.remove()
    numel, esize, G = max(sizes)
    return out, {"gn_layers": len(sizes), "gnext_bytes_per_layer": world * z.shape[0] * G * 3 * 8,
                 "allgather_bytes_per_layer_max": numel * esize * (world - 1) // world * world}


def _vae(small: bool):
    import diffusers

    if small:
        return diffusers.AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                                       up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                                       norm_num_groups=8, latent_channels=4)
    return diffusers.AutoencoderKL(block_out_channels=(128, 256, 512, 512),
                                   down_block_types=("DownEncoderBlock2D",) * 4,
                                   up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4)


def _video_vae(small: bool):
    import diffusers

    if small:
        return diffusers.AutoencoderKLHunyuanVideo(
            block_out_channels=(32, 32, 32), down_block_types=("HunyuanVideoDownBlock3D",) * 3,
            up_block_types=("HunyuanVideoUpBlock3D",) * 3, layers_per_block=1, norm_num_groups=8,
            latent_channels=4, temporal_compression_ratio=4, spatial_compression_ratio=4)
    return diffusers.AutoencoderKLHunyuanVideo()  # its default layout: 16 latent channels, 8x spatial, 4x temporal


def _model(args):
    """(decoder, latents (whole), split dim, parallelize function) of --model."""
    g = torch.Generator().manual_seed(1)
    if args.model == "video":
        vae = _video_vae(args.check)
        lat = args.size // vae.spatial_compression_ratio
        frames = (args.frames - 1) // vae.temporal_compression_ratio + 1
        z = torch.randn(1, vae.config.latent_channels, frames, lat, lat, generator=g)
        return vae.decoder, z, 3, parallelize_video_decoder
    z = torch.randn(1, 4, args.size // 8, args.size // 8, generator=g)
    return _vae(args.check).decoder, z, 2, parallelize_decoder


def _profile_split(split, mine, rank, world) -> dict:
    """GPU time per decode by kernel kind (torch.profiler, one decode after a warm-up) of the split decode with
    gnext's GroupNorm (check=False) and without GroupNorm, on every rank: {variant: [per rank {kind: (calls, ms)}]}
    (kinds: nccl, gnext, other; "busy" the sum, "wall" the decode's wall time)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in ("gnext_nocheck", "none"):
        split[name](mine)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            split[name](mine)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kinds: dict = {"nccl": [0, 0.0], "gnext": [0, 0.0], "other": [0, 0.0]}
        for e in prof.key_averages():
            ms = getattr(e, "device_time_total", 0) / 1e3
            if ms <= 0:
                continue
            low = e.key.lower()
            k = "nccl" if "nccl" in low else "gnext" if "gnext" in low or "group_norm" in low else "other"
            kinds[k][0] += e.count
            kinds[k][1] += ms
        kinds["busy"] = [0, sum(v[1] for v in kinds.values())]
        kinds["wall"] = [0, wall * 1e3]
        every = [None] * world
        dist.all_gather_object(every, kinds)
        out[name] = every
    return out


def _worker(rank, world, init, args, q):
    import copy
    import random

    backend = "gloo" if args.check else "nccl"
    device = "cpu" if args.check else f"cuda:{rank}"
    if device != "cpu":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    dtype = torch.float32 if args.check else torch.float16
    dec, z, dim, parallelize = _model(args)
    dec = dec.to(device, dtype).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    z = z.to(device, dtype)
    h = z.shape[dim] // world
    mine = z.narrow(dim, rank * h, h)
    import groupnorm_ext

    single = copy.deepcopy(dec) if rank == 0 else None
    # gnext's variants fuse GroupNorm+SiLU (convert_group_norm_act; blocks without a rule by tracing) before the
    # split: the split keeps the activation.
    fused = groupnorm_ext.convert_group_norm_act(copy.deepcopy(dec), example_inputs=(z,))
    split = {"gnext": parallelize(copy.deepcopy(fused)), "allgather": parallelize(copy.deepcopy(dec), norm="allgather")}
    res = {}
    with torch.no_grad():
        outs = {}
        for name, m in split.items():
            out = m(mine)
            parts = [torch.empty_like(out) for _ in range(world)]
            dist.all_gather(parts, out.contiguous())
            outs[name] = torch.cat(parts, dim=dim) if rank == 0 else None
        if rank == 0:
            ref, nbytes = _decode_with_group_norm_bytes(single, z, world)
            ref = ref.float()
            res.update(nbytes)
            rng = (ref.max() - ref.min()).item()
            for name, whole in outs.items():
                diff = (whole.float() - ref).abs().max().item()
                mse = ((whole.float() - ref) ** 2).mean().item()
                res[f"{name}_max_abs_diff"] = diff
                res[f"{name}_psnr_dB"] = 10 * math.log10(rng ** 2 / mse) if mse > 0 else float("inf")
        del outs
        if not args.check:
            split["gnext_nocheck"] = parallelize(copy.deepcopy(fused), norm="gnext_nocheck")
            split["none"] = parallelize(copy.deepcopy(fused), norm="none")
            singles = {}
            if rank == 0:
                singles = {"eager": single, "gnext": copy.deepcopy(fused), "none": _without_group_norm(fused)}
            del dec
            # Rounds in a random order (the same on every rank): each split variant on all ranks, then rank 0
            # alone decodes the whole image with each single-GPU variant while the others wait.
            times: dict = {f"split_{k}": [] for k in split} | {f"single_{k}": [] for k in ("eager", "gnext", "none")}
            peaks: dict = {}
            order = random.Random(0)
            for _ in range(args.rounds):
                names = list(split)
                order.shuffle(names)
                for name in names:
                    torch.cuda.reset_peak_memory_stats()
                    times[f"split_{name}"].append(event_ms(lambda: split[name](mine), 1, across_ranks=True))
                    peaks[f"split_{name}"] = torch.cuda.max_memory_allocated() / 1e9
                if rank == 0:
                    names = list(singles)
                    order.shuffle(names)
                    for name in names:
                        torch.cuda.reset_peak_memory_stats()
                        times[f"single_{name}"].append(event_ms(lambda: singles[name](z), 1))
                        peaks[f"single_{name}"] = torch.cuda.max_memory_allocated() / 1e9
                else:
                    order.shuffle(list(singles or ("eager", "gnext", "none")))  # keep the generators in step
                dist.barrier()
            if rank == 0:
                res["device"] = torch.cuda.get_device_name()
                res["torch"] = torch.__version__
                res["times_ms"] = times
                res["peak_GB"] = peaks
            if args.profile:
                res["profile"] = _profile_split(split, mine, rank, world)
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()
    # A spawned rank now and then dies in std::terminate at the interpreter's teardown after its work is done
    # (SIGABRT, "terminate called without an active exception"; as tests/test_distributed.py's ranks): the result
    # is flushed to the parent, then the rank leaves without that teardown.
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report(r: dict, args) -> None:
    import statistics

    print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()
           if k not in ("times_ms", "peak_GB", "profile")})
    if "times_ms" not in r:
        return
    t = {k: v for k, v in r["times_ms"].items() if v}
    med = {k: statistics.median(v) for k, v in t.items()}
    what = (f"HunyuanVideo VAE decoder {args.frames} frames of {args.size}^2" if args.model == "video" else
            f"AutoencoderKL decoder {args.size}^2")
    print(f"{r['device']} x{args.gpus}, torch {r['torch']}, {what} fp16, "
          f"{args.rounds} rounds:")
    print("| variant | median ms | min-max ms | peak GB (rank 0) |\n|---|---:|---:|---:|")
    for k, v in t.items():
        print(f"| {k} | {med[k]:.1f} | {min(v):.1f}-{max(v):.1f} | {r['peak_GB'][k]:.1f} |")
    share = lambda a, b: 1 - med[b] / med[a]  # noqa: E731  (b: the same decode without its GroupNorms)
    ratios = [a / b for a, b in zip(t["single_gnext"], t["split_gnext"])]
    print(f"speedup of the split decode over one GPU (gnext GroupNorm both): {med['single_gnext'] / med['split_gnext']:.2f}x "
          f"(per round {min(ratios):.2f}-{max(ratios):.2f}); over one GPU eager: "
          f"{med['single_eager'] / med['split_gnext']:.2f}x")
    for name, ranks in r.get("profile", {}).items():
        print(f"profile, split {name}: GPU ms per decode by rank (calls): " + "; ".join(
            f"rank {i}: " + ", ".join(f"{k} {ms:.1f}" + (f" ({n})" if n else "") for k, (n, ms) in kinds.items())
            for i, kinds in enumerate(ranks)))
    print(f"GroupNorm's share of the decode: one GPU (gnext) {share('single_gnext', 'single_none'):.1%}, split gnext "
          f"{share('split_gnext', 'split_none'):.1%} (check='once'; check=False: {share('split_gnext_nocheck', 'split_none'):.1%}), "
          f"split all-gather {share('split_allgather', 'split_none'):.1%}; "
          f"split all-gather / split gnext: {med['split_allgather'] / med['split_gnext']:.2f}x")


def run(args) -> dict:
    world = 2 if args.check else args.gpus
    if not args.check and not 1 <= world <= torch.cuda.device_count():
        raise SystemExit(f"parallel_decode: --gpus {world} with {torch.cuda.device_count()} visible GPU(s); it needs "
                         "1 <= --gpus <= the visible GPUs (--check runs on CPUs)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, f"file://{tmp}/store", args, q), nprocs=world, join=True,
                           start_method="spawn")
    return q.get()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="2 CPU processes (gloo), a small decoder (default 64x64)")
    p.add_argument("--model", choices=("image", "video"), default="image",
                   help="image: AutoencoderKL (4-D, split along H); video: HunyuanVideo's (5-D, split along H)")
    p.add_argument("--size", type=int, default=None, help="image size (default 64 with --check, else 2048)")
    p.add_argument("--frames", type=int, default=17, help="video: decoded frames (4k + 1; default 17)")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--profile", action="store_true",
                   help="also the GPU time per decode by kernel kind (NCCL, gnext, other) on every rank")
    args = p.parse_args()
    args.size = args.size or (64 if args.check else 2048)
    r = run(args)
    if args.json:
        import datetime
        import json

        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        meta = {"device": f"{r.get('device', 'cpu')} x{args.gpus}", "torch": r.get("torch", torch.__version__),
                "date": date}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "args": vars(args), **r}, f, indent=1)
    _report(r, args)


if __name__ == "__main__":
    main()
