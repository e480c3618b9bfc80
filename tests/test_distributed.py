# SPDX-License-Identifier: BSD-3-Clause
"""groupnorm_ext.distributed on CPUs with gloo, 2 and 3 processes: a tensor split along a spatial dim in uneven
shards (one empty), forward and backward against nn.GroupNorm (+activation, +residual) of the gathered tensor in
float64; shards that differ across ranks raise on every rank; the module and the converter. On GPUs with NCCL: the
same cases, and a forward+backward step captured in a CUDA graph."""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
ACT = {"identity": lambda t: t, "silu": F.silu, "gelu": F.gelu, "relu": torch.relu}


def _reference(x, G, w, b, act, res):
    """float64 nn.GroupNorm (+act, +res) of the whole tensor, with its gradients for dy."""
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_() if w is not None else None
    bd = b.double().requires_grad_() if b is not None else None
    y = ACT[act](F.group_norm(xd, G, wd, bd, 1e-5))
    if res is not None:
        y = y + res.double()
    return xd, wd, bd, y


def _case(rank, world, shape, G, dtype, act, sizes, dim, with_res, affine, seed, device="cpu"):
    from groupnorm_ext import distributed as gd

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 3).to(dtype)
    w = (torch.rand(shape[1], generator=g) + 0.5).to(dtype) if affine else None
    b = torch.randn(shape[1], generator=g).to(dtype) if affine else None
    res = torch.randn(shape, generator=g).to(dtype) if with_res else None
    dy = torch.randn(shape, generator=g).to(dtype)
    xd, wd, bd, ref = _reference(x, G, w, b, act, res)
    ref.backward(dy.double())
    lo = sum(sizes[:rank])
    sl = [slice(None)] * len(shape)
    sl[dim] = slice(lo, lo + sizes[rank])
    xs = x[tuple(sl)].to(device).requires_grad_()
    ws = w.to(device).requires_grad_() if affine else None
    bs = b.to(device).requires_grad_() if affine else None
    rs = res[tuple(sl)].to(device).requires_grad_() if with_res else None
    out = gd.group_norm(xs, G, ws, bs, 1e-5, activation=act, residual=rs, dim=dim)
    out.backward(dy[tuple(sl)].to(device))
    out, gx = out.detach().cpu(), xs.grad.cpu()
    gw, gb = (ws.grad.cpu(), bs.grad.cpu()) if affine else (None, None)
    gr = rs.grad.cpu() if with_res else None
    tol = TOL[dtype]
    scale = lambda t: max(1.0, float(t.detach().abs().max())) if t.numel() else 1.0  # noqa: E731
    assert out.dtype == dtype and out.shape == gx.shape
    torch.testing.assert_close(out.double(), ref[tuple(sl)].detach(), rtol=tol, atol=tol * scale(ref))
    torch.testing.assert_close(gx.double(), xd.grad[tuple(sl)], rtol=tol, atol=tol * scale(xd.grad))
    if affine:
        torch.testing.assert_close(gw.double(), wd.grad, rtol=tol, atol=tol * scale(wd.grad) * 4)
        torch.testing.assert_close(gb.double(), bd.grad, rtol=tol, atol=tol * scale(bd.grad) * 4)
    if with_res:
        torch.testing.assert_close(gr, dy[tuple(sl)])


def _uneven(total, world):
    """total split over world shards, not all equal (the first one short by one where it can be)."""
    sizes = [total // world] * world
    sizes[-1] += total - sum(sizes)
    if sizes[0] > 0 and world > 1:
        sizes[0] -= 1
        sizes[-1] += 1
    return sizes


def _nccl_cases(rank, world):
    """The same cases on GPUs with NCCL (one GPU per rank)."""
    dev = f"cuda:{rank}"
    _case(rank, world, (2, 32, 11, 7), 8, torch.float32, "silu", _uneven(11, world), 2, True, True, 0, dev)
    _case(rank, world, (1, 64, 6, 16, 16), 32, torch.bfloat16, "identity", _uneven(6, world), 2, False, True, 1, dev)
    _cuda_graph_case(rank, dev)


def _cuda_graph_case(rank, dev):
    """A forward+backward step with SpatialGroupNorm (check="once": its host check runs in the eager warm-up call)
    captured in a CUDA graph and replayed on new data: the same output and gradients as an eager step on that data."""
    from groupnorm_ext import distributed as gd

    torch.manual_seed(10 + rank)
    net = gd.SpatialGroupNorm(8, 32, activation="silu", dim=2).to(dev)
    x = (torch.randn(2, 32, 5 + rank, 8, device=dev) * 2 + 3).requires_grad_()  # uneven shards
    dy = torch.randn_like(x)

    def step():
        net.zero_grad(set_to_none=True)
        x.grad = None
        out = net(x)
        out.backward(dy)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: the shard check, NCCL's communicator, autograd
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    with torch.no_grad():  # new data into the captured input
        x.mul_(0.5).add_(1.0)
        dy.normal_()
    graph.replay()
    got = out.detach().clone(), x.grad.clone(), net.weight.grad.clone(), net.bias.grad.clone()
    want = step()
    want = want.detach(), x.grad, net.weight.grad, net.bias.grad
    # The graph (it holds NCCL work) is released before any assertion: a failing rank that tears down its process
    # group under a live graph hangs instead of failing.
    del graph, out
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _gloo_cases(rank, world):
    from groupnorm_ext import distributed as gd

    if world == 2:
        _case(rank, world, (2, 32, 11, 7), 8, torch.float32, "silu", [4, 7], 2, True, True, 0)
        _case(rank, world, (1, 24, 5, 6, 9), 3, torch.bfloat16, "gelu", [3, 2], 2, False, True, 1)  # 5-D, T
        _case(rank, world, (2, 16, 9, 12), 4, torch.float16, "identity", [12, 0], 3, False, False, 2)
        # The module and the converter: the same numbers as the function.
        net = torch.nn.Sequential(torch.nn.GroupNorm(4, 16))
        gd.convert_group_norm_spatial(net, dim=2)
        assert isinstance(net[0], gd.SpatialGroupNorm) and list(net.state_dict()) == ["0.weight", "0.bias"]
        x = torch.randn(2, 16, 3 + rank, 5, generator=torch.Generator().manual_seed(rank))
        torch.testing.assert_close(net(x), gd.group_norm(x, 4, net[0].weight, net[0].bias, 1e-5))
        # Under torch.compile(fullgraph=True): the functional collectives trace (Dynamo and AOTAutograd). The
        # aot_eager backend: with Inductor a rank of these spawned CPU processes aborted (SIGABRT) about once in
        # twenty runs, cause not found. Forward and backward agree.
        xs = torch.randn(2, 16, 3 + 2 * rank, 4, generator=torch.Generator().manual_seed(5 + rank))
        xc = xs.clone().requires_grad_()
        xe = xs.clone().requires_grad_()
        wc = torch.rand(16, generator=torch.Generator().manual_seed(9)) + 0.5
        compiled = torch.compile(lambda t: gd.group_norm(t, 4, wc, None, 1e-5, activation="silu", dim=2),
                                 fullgraph=True, backend="aot_eager")
        yc, ye = compiled(xc), gd.group_norm(xe, 4, wc, None, 1e-5, activation="silu", dim=2)
        torch.testing.assert_close(yc, ye)
        yc.sum().backward()
        ye.sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad)
        # Shards that differ across ranks (C): a ValueError on every rank, no hang; with check="once" too (a new
        # signature on every rank).
        bad = torch.randn(1, 16 if rank == 0 else 32, 4, 4)
        for check in (True, "once"):
            try:
                gd.group_norm(bad, 4, check=check)
            except ValueError as e:
                assert "differ across ranks" in str(e), e
            else:
                raise AssertionError(f"mismatched shards were not rejected (check={check!r})")
        # check="once" (the modules' default): the signature all-gather on the first call per shape only, counted
        # in the process group's collectives (a forward is one all-gather of the moments, plus the check's).
        pg = dist.distributed_c10d._get_default_group()
        x1, x2 = torch.randn(1, 16, 2 + rank, 3), torch.randn(1, 16, 2 + rank, 5)
        counts = []
        for x in (x1, x1, x2, x1, x2):
            before = pg._get_sequence_number_for_group()
            net(x)
            counts.append(pg._get_sequence_number_for_group() - before)
        assert counts == [2, 1, 2, 1, 1], counts
    else:
        _case(rank, world, (2, 24, 13, 5), 6, torch.float32, "relu", [5, 0, 8], 2, True, True, 3)
        _case(rank, world, (3, 8, 4, 10), 8, torch.float32, "identity", [3, 3, 4], 3, False, True, 4)  # G = C
        _halo_conv_cases(rank, [3, 4, 5])


def _halo_conv_cases(rank, sizes):
    """The split decode benchmark's halo convolutions (scripts/bench/parallel_decode.py) on uneven row shards equal
    the convolution of the whole tensor: HaloConv2d (zero padding 1 and 2: the shard's zero-padded convolution with
    its edge rows corrected by the neighbours' halo rows) and HaloCausalConv3d (replicate and zero padding, causal
    along T: one padded buffer)."""
    import pathlib
    import types

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    import parallel_decode as pd

    lo, n = sum(sizes[:rank]), sizes[rank]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, sum(sizes), 6, generator=g) + 2
    for k in (3, 5):
        conv = torch.nn.Conv2d(3, 4, k, padding=k // 2)
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
            want = conv(x)[:, :, lo:lo + n]
            got = pd.HaloConv2d(conv)(x[:, :, lo:lo + n])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    x5 = torch.randn(1, 3, 4, sum(sizes), 5, generator=g) + 2
    for mode in ("replicate", "constant"):
        causal = types.SimpleNamespace(conv=torch.nn.Conv3d(3, 2, 3), time_causal_padding=(1, 1, 1, 1, 2, 0),
                                       pad_mode=mode)
        with torch.no_grad():
            want = causal.conv(F.pad(x5, causal.time_causal_padding, mode=mode))[:, :, :, lo:lo + n]
            got = pd.HaloCausalConv3d(causal)(x5[:, :, :, lo:lo + n])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _run(rank, world, init, errfile, backend):
    """One rank: the cases of `backend`; a failure's traceback goes to errfile.<rank> for the test's message."""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))  # a hang fails the test, not CI
        (_nccl_cases if backend == "nccl" else _gloo_cases)(rank, world)
        dist.barrier()
    except BaseException:
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's teardown, where a spawned CPU rank now and then dies in
    # std::terminate ("terminate called without an active exception", SIGABRT, no Python frame) after every check
    # passed. Cause not found (gnext starts no threads).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(backend, world):
    """Runs _run in `world` processes; a failing rank's traceback fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        errfile = os.path.join(tmp, "err")
        try:
            mp.spawn(_run, args=(world, init, errfile, backend), nprocs=world, join=True)
        except Exception:
            msgs = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.startswith("err.")]
            pytest.fail("\n".join(msgs) or "a worker failed")


@pytest.mark.parametrize("world", [2, 3])
def test_spatial_group_norm_gloo(world):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    _spawn("gloo", world)


@pytest.mark.gpu
def test_spatial_group_norm_nccl():
    """Every visible GPU a rank (2 or more), NCCL."""
    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world < 2 or not dist.is_nccl_available():
        pytest.skip("needs 2 or more GPUs and NCCL")
    _spawn("nccl", world)


def _absent_rank(rank, world, init, outfile):
    """Rank 0 calls group_norm; the other ranks never do (a rank that died or hangs) and leave after the timeout."""
    import threading
    import time

    from groupnorm_ext import distributed as gd

    # The rendezvous gets a generous timeout (processes start slowly on a loaded machine: a 2 s one timed out in
    # init_process_group itself); the group the layer uses gets the short one that the test is about.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    short = dist.new_group(timeout=datetime.timedelta(seconds=2))
    if rank != 0:
        time.sleep(5)
        os._exit(0)  # no destroy_process_group: it would wait on rank 0

    def hung():
        with open(outfile, "w") as f:
            f.write("20\nhung")
        os._exit(0)

    threading.Timer(20, hung).start()  # a hang fails the test instead of stalling it
    t0 = time.monotonic()
    try:
        gd.group_norm(torch.randn(1, 8, 3, 4), 4, check=False, group=short)
        msg = "no error"
    except Exception as e:  # the backend's own error type (RuntimeError or a subclass)
        msg = f"{type(e).__name__}: {e}"
    with open(outfile, "w") as f:
        f.write(f"{time.monotonic() - t0:.1f}\n{msg}")
    os._exit(0)


def test_absent_rank_raises_the_backends_timeout():
    """A rank that never reaches the layer: the others get torch.distributed's timeout error, not a hang."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(_absent_rank, args=(2, f"file://{os.path.join(tmp, 'store')}", out), nprocs=2, join=True)
        seconds, msg = open(out).read().split("\n", 1)
    assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg
    assert float(seconds) < 5, (seconds, msg)


def test_argument_errors_without_a_process_group():
    from groupnorm_ext import distributed as gd

    x = torch.randn(2, 12, 4, 4)
    with pytest.raises(ValueError, match="divisible"):
        gd.group_norm(x, 5)
    with pytest.raises(ValueError, match="dim"):
        gd.group_norm(x, 3, dim=1)
    with pytest.raises(ValueError, match="weight"):
        gd.group_norm(x, 3, torch.ones(6))
    with pytest.raises(ValueError, match="activation"):
        gd.group_norm(x, 3, activation="swish")
    with pytest.raises(TypeError, match="dtype"):
        gd.group_norm(x.double(), 3)


def test_row_parallel_vae_decode_matches_one_process():
    """scripts/bench/parallel_decode.py --check: a small diffusers AutoencoderKL decoder split by rows over 2 gloo
    processes (SpatialGroupNorm, halo-row convolutions, gathered attention) decodes what one process decodes."""
    pytest.importorskip("diffusers")
    import argparse
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    import parallel_decode

    r = parallel_decode.run(argparse.Namespace(check=True, model="image", size=64, gpus=0, rounds=1))
    assert r["gnext_max_abs_diff"] < 1e-4 and r["gnext_psnr_dB"] > 100, r
    assert r["allgather_max_abs_diff"] < 1e-4, r


def test_row_parallel_video_decode_matches_one_process():
    """The same for diffusers' HunyuanVideo VAE decoder (5-D, split along H): causal 3D convolutions with halo rows
    and replicate edges, the mid block's frame-causal attention over gathered keys, SpatialGroupNorm along dim 3."""
    pytest.importorskip("diffusers")
    import argparse
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench"))
    import parallel_decode

    r = parallel_decode.run(argparse.Namespace(check=True, model="video", size=32, frames=5, gpus=0, rounds=1))
    assert r["gnext_max_abs_diff"] < 1e-4 and r["gnext_psnr_dB"] > 100, r
    assert r["allgather_max_abs_diff"] < 1e-4, r
