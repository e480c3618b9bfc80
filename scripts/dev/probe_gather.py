"""One-off probe: the HunyuanVideo up-sampler's padded gather, 1x256x9x256² -> 1x256x19x514² fp16, written several
ways and compiled by Inductor (do_bench, ms). PROFILE=1: one launch of the per-dimension gather for Nsight Compute
(--profile-from-start off)."""
import os, sys, json, torch, torch.nn.functional as F
from triton.testing import do_bench
import torch._inductor.config as ic
from torch._inductor.utils import run_and_get_code
out_dir = os.environ.get("OUT", ".")
x = torch.randn(1, 256, 9, 256, 256, device="cuda", dtype=torch.float16)

def chain(x):
    a = F.interpolate(x[:, :, :1].squeeze(2), scale_factor=(2, 2), mode="nearest").unsqueeze(2)
    b = F.interpolate(x[:, :, 1:], scale_factor=(2, 2, 2), mode="nearest")
    return F.pad(torch.cat((a, b), dim=2), (1, 1, 1, 1, 2, 0), mode="replicate")

def make_gather(dt=torch.int64):
    def g(x):
        maps = [(2, 17, 1, 2, 19), (1, 512, 0, 2, 514), (1, 512, 0, 2, 514)]
        idx = []
        for d, (p, L, a, f, n) in enumerate(maps):
            j = torch.arange(-p, n - p, device=x.device, dtype=dt).clamp(0, L - 1)
            j = (j + a) // f
            shape = [1, 1, 1]; shape[d] = -1
            idx.append(j.view(shape) if d < 2 else j)
        return torch.ops.aten._unsafe_index(x, [None, None, *idx])
    return g

if os.environ.get("PROFILE"):
    torch._dynamo.reset(); g = torch.compile(make_gather(), fullgraph=True, dynamic=False)
    for _ in range(3): g(x)
    torch.cuda.synchronize(); torch.cuda.cudart().cudaProfilerStart(); g(x); torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop(); sys.exit(0)
ref = chain(x)
res = {}
def run(name, fn, cfg=None):
    torch._dynamo.reset()
    with ic.patch(cfg or {}):
        c = torch.compile(fn, fullgraph=True, dynamic=False)
        y, code = run_and_get_code(c, x)
        assert torch.equal(y, ref), name
        with open(f"{out_dir}/code_{name}.py", "w") as fh:
            fh.write(code[0] if code else "")
        t = do_bench(lambda: c(x), warmup=50, rep=300)
    res[name] = t; print(f"{name:32s} {t:.3f} ms", flush=True)
    return c

o = torch.empty_like(ref); o2 = torch.empty_like(ref)
res["copy"] = do_bench(lambda: o.copy_(o2), warmup=50, rep=300)
res["fill"] = do_bench(lambda: o.fill_(1.0), warmup=50, rep=300)
print("copy", res["copy"], "fill", res["fill"], flush=True)
run("chain", chain)
run("gather", make_gather())
run("gather_i32", make_gather(torch.int32))
run("gather_nd", make_gather(), {"triton.prefer_nd_tiling": True, "triton.max_tiles": 3})
run("gather_cdt", make_gather(), {"coordinate_descent_tuning": True})
run("gather_1d", make_gather(), {"triton.max_tiles": 1})
run("gather_1d_cdt", make_gather(), {"triton.max_tiles": 1, "coordinate_descent_tuning": True})
run("chain_1d", chain, {"triton.max_tiles": 1})
def flat(x):
    n, c = x.shape[:2]
    i = torch.arange(n * c * 19 * 514 * 514, device=x.device)
    w = i % 514; h = (i // 514) % 514; t = (i // (514 * 514)) % 19; nc = i // (19 * 514 * 514)
    sw = (w - 1).clamp(0, 511) // 2; sh = (h - 1).clamp(0, 511) // 2; st = ((t - 2).clamp(0, 16) + 1) // 2
    src = ((nc * 9 + st) * 256 + sh) * 256 + sw
    return torch.ops.aten._unsafe_index(x.reshape(-1), [src]).view(n, c, 19, 514, 514)
run("flat", flat)
def rows(x):  # (t, h) gathered as rows, w as a separate index: 2 dims
    n, c = x.shape[:2]
    r = torch.arange(19 * 514, device=x.device)
    st = (((r // 514) - 2).clamp(0, 16) + 1) // 2; sh = ((r % 514) - 1).clamp(0, 511) // 2
    w = (torch.arange(514, device=x.device) - 1).clamp(0, 511) // 2
    rows_ = (st * 256 + sh).view(-1, 1)
    return torch.ops.aten._unsafe_index(x.reshape(n, c, 9 * 256, 256), [None, None, rows_, w]).view(n, c, 19, 514, 514)
run("rows", rows)
json.dump(res, open(f"{out_dir}/gather.json", "w"), indent=1)
