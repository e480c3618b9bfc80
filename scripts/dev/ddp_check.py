#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""DistributedDataParallel check (issue: reliability): one training step of a small model built from
every gnext op, on 2 GPUs with NCCL, must give the same parameter gradients as the same step on one
GPU over the whole batch (DDP averages the per-rank gradients of a per-rank mean loss).

    torchrun --nproc_per_node=2 scripts/dev/ddp_check.py
Prints one line per rank and exits non-zero on a mismatch."""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__) + "/../..")
import groupnorm_ext as ge  # noqa: E402


class LseHead(nn.Module):
    """GroupNorm + tanh_hardswish + residual + logsumexp over channels (group_norm_act_logsumexp)."""

    def __init__(self, C, G):
        super().__init__()
        self.norm = nn.GroupNorm(G, C)
        self.bias = nn.Parameter(torch.randn(C) * 0.1)

    def forward(self, x):
        n = self.norm
        return ge.group_norm_act_logsumexp(x, n.num_groups, n.weight, n.bias, n.eps, "tanh_hardswish", True,
                                           self.bias)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        ge.GroupNormAct(8, 32, activation="silu"),
        ge.ConvTranspose2dGELUGroupNorm(32, 16, 3, num_groups=4, stride=2, padding=1, output_padding=1),
        ge.GroupNorm(4, 16),
        nn.Conv2d(16, 8, 1),
        LseHead(8, 4),
    )


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda", rank)
    gen = torch.Generator().manual_seed(123)
    x = (torch.randn(4 * world, 3, 20, 18, generator=gen) * 3 + 2).to(dev)
    target = torch.randn(4 * world, 1, 40, 36, generator=gen).to(dev)
    model = nn.parallel.DistributedDataParallel(make_model().to(dev), device_ids=[rank])
    lo, hi = rank * 4, (rank + 1) * 4
    loss = ((model(x[lo:hi]) - target[lo:hi]) ** 2).mean()
    loss.backward()
    ref_model = make_model().to(dev)
    ((ref_model(x) - target) ** 2).mean().backward()
    worst = 0.0
    for (name, p), q in zip(model.module.named_parameters(), ref_model.parameters()):
        err = ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
        worst = max(worst, err)
    ok = worst < 1e-4
    print(f"rank {rank}/{world} on {torch.cuda.get_device_name(dev)}: DDP vs single-GPU gradients, "
          f"max relative error {worst:.2e} -> {'OK' if ok else 'MISMATCH'}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
