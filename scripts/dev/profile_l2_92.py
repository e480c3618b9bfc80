"""Per-kernel CUDA times of KernelBench L2#92 ModelNew forward + backward (torch.profiler), and the
group_norm_act_logsumexp op alone on NCHW and channels_last conv outputs. Diagnostic tool; speed claims
come from scripts/bench/group_norm_act.py."""
import sys, pathlib
import torch
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "kernelbench")); sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "bench"))
import level2_92_conv_groupnorm_tanh_hardswish_residual_logsumexp as kb
m = kb.ModelNew(*kb.get_init_inputs()).cuda()
x = kb.get_inputs()[0].cuda().requires_grad_()
for fmt in (None, torch.channels_last):
    for _ in range(3):
        out = m(x); out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            out = m(x); out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if ev.device_time_total > 0:
            print(f"{ev.device_time_total / 5 / 1e3:8.3f} ms/iter  x{ev.count // 5:3d}  {ev.key[:110]}")
    break
# the op alone on a CL and an NCHW conv output
z = torch.randn(128, 64, 126, 126, device="cuda") * 3 + 2
b = torch.randn(64, device="cuda")
from timing import Timer
t = Timer("cuda")
for name, zz in (("NCHW", z), ("CL", z.contiguous(memory_format=torch.channels_last))):
    f = lambda: torch.ops.gnext.group_norm_act_logsumexp(zz, b, 16, b, b, 1e-5, "tanh_hardswish", True)
    o, mean, rstd = f()
    g = torch.randn_like(o)
    bw = lambda: torch.ops.gnext.group_norm_act_logsumexp_backward(g, o, zz, b, mean, rstd, b, b, 16, "tanh_hardswish", True, [True, True, True, True])
    st = lambda: torch.ops.gnext.group_norm(zz, 16, b, b, 1e-5)
    print(f"op {name}: fwd {t(f):.3f} ms, bwd {t(bw):.3f} ms, plain group_norm fwd {t(st):.3f} ms, copy {t(lambda: zz.clone()):.3f} ms")
