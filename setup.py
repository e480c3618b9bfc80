# SPDX-License-Identifier: BSD-3-Clause
"""Build of gnext: one compiled module, groupnorm_ext._C, registering torch.ops.gnext.*.

Environment variables:
  GNEXT_CPU_ONLY=1       build only the C++ (CPU) sources, no CUDA toolkit needed.
  TORCH_CUDA_ARCH_LIST   CUDA archs to compile for (default here: "9.0a"). "9.0" is compiled as "9.0a"
                         (the same GPUs: H100/H200/GH200).
  MAX_JOBS               parallel compile jobs (ninja).
  CUDA_HOME              CUDA toolkit root (default /usr/local/cuda when it exists).

The module uses only the CPython limited API, so the wheel is tagged abi3: one wheel for every
CPython from the oldest one torch supports (3.10 for torch 2.14: torch compiles the extension with
-DPy_LIMITED_API=0x030A0000). Its C++ calls libtorch only through PyTorch's stable ABI (LibTorch
stable C shim, torch/csrc/stable) at TORCH_TARGET_VERSION 2.11, so one build loads on every torch
release from 2.11 on, whichever torch >= 2.11 it was built against; the build refuses a module that
still references libtorch/c10 C++ symbols. CPU kernels and autograd are Python (groupnorm_ext/). The
build records what it was built with in groupnorm_ext/_build_info.py (`python -m groupnorm_ext --info`).
"""
import glob
import os
import re
import site
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
# sm_90a (not sm_90): the same GPUs, with Hopper's arch-specific instructions available to the kernels.
os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
    a.replace("9.0", "9.0a", 1) if a.split("+")[0] == "9.0" else a
    for a in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";") if a)

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME  # noqa: E402


def pip_cuda_include_dirs():
    """Headers of the pip CUDA wheels (nvidia/cu13/include), which torch's headers may need."""
    dirs = []
    for base in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            d = os.path.join(base, sub)
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


def arch_token(arch_list):
    """TORCH_CUDA_ARCH_LIST as one preprocessor token for the "no device code" error message
    (csrc/common/cuda_utils.h): "8.0;9.0a;12.0+PTX" -> "80_90a_120ptx"."""
    archs = arch_list.replace(";", " ").split()
    return "_".join(a.replace(".", "").replace("+PTX", "ptx") for a in archs)


def read_version():
    """The version is defined once, as __version__ in groupnorm_ext/__init__.py."""
    with open(os.path.join(ROOT, "groupnorm_ext", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


VERSION = read_version()
# Oldest torch the stable-ABI build supports (TORCH_TARGET_VERSION, encoded as in torch/headeronly/version.h).
TORCH_TARGET = (2, 11)
TARGET_MACRO = f"-DTORCH_TARGET_VERSION=0x{TORCH_TARGET[0]:02x}{TORCH_TARGET[1]:02x}000000000000ULL"


def write_build_info(use_cuda):
    import torch

    info = {
        "version": VERSION,
        "torch": torch.__version__.split("+")[0],
        "torch_full": torch.__version__,
        "torch_min": ".".join(map(str, TORCH_TARGET)),
        "cuda": torch.version.cuda if use_cuda else None,
        "cuda_archs": os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split() if use_cuda else [],
    }
    with open(os.path.join(ROOT, "groupnorm_ext", "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py at build time: what this build of gnext was compiled with."""\n')
        f.write(f"BUILD_INFO = {info!r}\n")


def extension():
    rel = lambda paths: sorted(os.path.relpath(p, ROOT) for p in paths)  # noqa: E731
    cpp = rel(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cpp"), recursive=True))
    cu = rel(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
    # Hidden visibility: the module exports only PyInit__C (torch::stable types are hidden too).
    cxx = ["-O3", "-fvisibility=hidden", TARGET_MACRO]
    use_cuda = os.environ.get("GNEXT_CPU_ONLY", "0") != "1" and CUDA_HOME is not None
    if not use_cuda:
        # Only the schema: the CPU kernels are Python (groupnorm_ext/_cpu.py).
        print("gnext: building CPU-only (no CUDA toolkit or GNEXT_CPU_ONLY=1)")
        cpp = [os.path.join("csrc", "gnext.cpp")]
        write_build_info(False)
        return CppExtension("groupnorm_ext._C", cpp, extra_compile_args={"cxx": cxx},
                            py_limited_api=True)  # torch adds -DPy_LIMITED_API (3.10)
    cxx.append("-DUSE_CUDA")  # the CUDA entry points of the stable C shim
    cxx.append(f"-DGNEXT_CUDA_ARCHS={arch_token(os.environ['TORCH_CUDA_ARCH_LIST'])}")  # named in arch errors
    # NDEBUG: no device asserts in release kernels.
    nvcc = ["-O3", "-DNDEBUG", TARGET_MACRO, "-Xcompiler=-fvisibility=hidden",
            "--expt-relaxed-constexpr", "-Xptxas=-v" if os.environ.get("GNEXT_PTXAS_VERBOSE") == "1" else "-Xptxas=-O3"]
    # Source lines for Nsight Compute and compute-sanitizer reports. With CUDA 13 they also embed each kernel's
    # PTX text (.nv_debug_ptx_txt): 3/4 of a module's bytes, so release wheels build without (GNEXT_LINEINFO=0).
    if os.environ.get("GNEXT_LINEINFO", "1") != "0":
        nvcc.append("-lineinfo")
    write_build_info(True)
    # A clean build runs its jobs in this order: the slowest translation units first (sm_90a on 2 cores, s:
    # small 139, onepass 106, kernels 67, bulk 65, pad 42, the rest under 25), so that no core waits on one at the end.
    slow = ["group_norm_small.cu", "group_norm_onepass.cu", "group_norm_kernels.cu", "group_norm_bulk.cu",
            "group_norm_pad.cu"]
    cu.sort(key=lambda f: slow.index(os.path.basename(f)) if os.path.basename(f) in slow else len(slow))
    return CUDAExtension(
        "groupnorm_ext._C",
        cu + cpp,
        include_dirs=pip_cuda_include_dirs(),
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        py_limited_api=True,  # torch adds -DPy_LIMITED_API (3.10)
    )


# Mangled-name prefixes of libtorch / c10 C++ symbols (namespaces at, c10, torch, caffe2): an
# undefined reference to one ties the module to the torch release it was built against.
UNSTABLE_PREFIXES = ("_ZN2at", "_ZN3c10", "_ZN5torch", "_ZN6caffe2", "_ZNK2at", "_ZNK3c10", "_ZNK5torch")


def unstable_symbols(path):
    """libtorch/c10 C++ symbols the module leaves undefined (none for a stable-ABI build)."""
    out = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True, text=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(UNSTABLE_PREFIXES)]


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """Refuses an extension that carries its own copy of libstdc++ (a toolchain linking it
    statically: two libstdc++ copies in one process crash on the first C++ error message), and one
    that references libtorch's C++ API instead of the stable C shim."""

    def build_extension(self, ext):
        super().build_extension(ext)
        path = self.get_ext_fullpath(ext.name)
        try:
            syms = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True).stdout
            bad = unstable_symbols(path)
        except OSError:
            return
        if "_ZNSt8ios_base4InitC1Ev" in syms or "_ZNSt6locale7classicEv" in syms:
            raise RuntimeError(
                f"{path} links libstdc++ statically (compiler {os.environ.get('CXX', 'c++')}). "
                "Build with a compiler that links it dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc.")
        if bad:
            raise RuntimeError(f"{path} references libtorch C++ symbols outside the stable ABI: {bad[:10]}")


setup(
    # name, description, license, dependencies, extras: pyproject.toml's [project]
    version=VERSION,
    packages=find_packages(include=["groupnorm_ext", "groupnorm_ext.*"]),
    package_data={"groupnorm_ext": ["py.typed"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
