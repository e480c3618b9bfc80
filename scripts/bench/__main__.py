# SPDX-License-Identifier: BSD-3-Clause
"""gnext's benchmarks, one entry point:

    python scripts/bench [suite] [args]      (bash scripts/run.sh bench [suite] [args] builds first)

suites:
  groupnorm   GroupNorm alone vs eager and torch.compile, against the copy-bandwidth floor (default;
              a small CPU suite without a GPU: --cpu)                        -> groupnorm.py
  act         GroupNorm + activation (+ residual) and KernelBench L2#92      -> group_norm_act.py
  l2_19       fused ConvTranspose2d + GELU + GroupNorm, KernelBench L2#19    -> conv_gelu_gn.py
  models      real models (diffusers VAE/UNets, timm BiT) eager and compiled -> real_models.py
  sweep       randomized shape sweep from real models (+ GN+SiLU peers: --act) -> sweep.py
Each suite's --help lists its arguments; results go to bench_out/ (ignored by git; JSON + markdown + plot)
with the device, torch version and date. The committed results are bench_results/<gpu>/: pass
--out bench_results/h100 (or h200) to update them. Shared timing code: timing.py."""
import runpy
import sys
from pathlib import Path

SUITES = {"groupnorm": "groupnorm.py", "act": "group_norm_act.py", "l2_19": "conv_gelu_gn.py",
          "models": "real_models.py", "sweep": "sweep.py"}


def main():
    args = sys.argv[1:]
    suite = "groupnorm"
    if args and not args[0].startswith("-"):
        suite = args.pop(0)
    elif args and args[0] in ("-h", "--help"):
        print(__doc__)
        return
    if suite not in SUITES:
        sys.exit(f"unknown suite {suite!r}; one of {', '.join(SUITES)}")
    path = Path(__file__).resolve().parent / SUITES[suite]
    sys.argv = [str(path), *args]
    runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main()
