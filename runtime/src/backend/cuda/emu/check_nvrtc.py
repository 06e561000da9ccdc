#!/usr/bin/env python3
"""Compile every kernel source with NVRTC and assemble it with ptxas; print registers and spills.

A developer's check without a GPU (the CI test `runtime/tests/kernels_compile.rs` does the same
through the driver's own compile function). The program text is built exactly as
`kernels::program_text` builds it: the prelude, `#line 1 "<file>"`, the code.

    python3 runtime/src/backend/cuda/emu/check_nvrtc.py [--arch 80 90] [file.cu ...]

Finds libnvrtc.so.12 and ptxas in $CUDA_WHEELS (default /opt/cuda-wheels, NVIDIA's PyPI wheels)
or through $NVRTC_LIB / $PTXAS. Exits 1 on a compile error, a kernel missing from the PTX, or a
spill (stores or loads) in any kernel.
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(os.path.dirname(HERE), "kernels")
WHEELS = os.environ.get("CUDA_WHEELS", "/opt/cuda-wheels")
NVRTC_LIB = os.environ.get("NVRTC_LIB", os.path.join(WHEELS, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
PTXAS = os.environ.get("PTXAS", os.path.join(WHEELS, "nvidia/cuda_nvcc/bin/ptxas"))


def program_text(file, code, prelude):
    text = prelude if prelude.endswith("\n") else prelude + "\n"
    return text + '#line 1 "%s"\n' % file + code


def strip_comments(code):
    code = re.sub(r"/\*.*?\*/", "", code, flags=re.S)
    return re.sub(r"//[^\n]*", "", code)


def global_names(code):
    pat = r'extern "C" __global__\s+(?:__launch_bounds__\([^)]*\)\s*)?void\s+(\w+)\s*\('
    return re.findall(pat, strip_comments(code))


def nvrtc_compile(lib, name, text, arch):
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError("nvrtcCreateProgram failed: %d" % rc)
    opts = [b"--gpu-architecture=compute_%d" % arch, b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    if rc != 0:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError("NVRTC compute_%d %s:\n%s" % (arch, name, log))
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode(), log


def ptxas(ptx, arch):
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_%d" % arch, "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("ptxas sm_%d:\n%s" % (arch, r.stderr))
        return r.stderr


def parse_ptxas(log):
    """Per kernel: registers, spill stores, spill loads, stack frame, shared memory."""
    out = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
            out[cur] = {"regs": 0, "spill_st": 0, "spill_ld": 0, "stack": 0, "smem": 0}
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[cur]["stack"], out[cur]["spill_st"], out[cur]["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[cur]["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            out[cur]["smem"] = int(m.group(1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    lib = ctypes.CDLL(NVRTC_LIB)
    prelude = open(os.path.join(KERNELS, "prelude.cuh")).read()
    files = args.files or sorted(f for f in os.listdir(KERNELS) if f.endswith(".cu"))
    failed = False
    rows = []
    for file in files:
        path = file if os.path.sep in file else os.path.join(KERNELS, file)
        code = open(path).read()
        name = os.path.basename(path)
        expected = global_names(code)
        text = program_text(name, code, prelude)
        for arch in args.arch:
            try:
                ptx, log = nvrtc_compile(lib, name, text, arch)
                if log.strip():
                    print("NVRTC compute_%d %s warnings:\n%s" % (arch, name, log))
                info = parse_ptxas(ptxas(ptx, arch))
            except RuntimeError as e:
                print(e)
                failed = True
                continue
            for k in expected:
                if k not in info:
                    print("%s: kernel %s missing from the sm_%d image" % (name, k, arch))
                    failed = True
                    continue
                i = info[k]
                rows.append((name, k, arch, i["regs"], i["spill_st"], i["spill_ld"], i["stack"], i["smem"]))
                if i["spill_st"] or i["spill_ld"]:
                    failed = True
    print("%-16s %-28s %5s %5s %7s %7s %6s %6s" % ("file", "kernel", "arch", "regs", "spill_st", "spill_ld", "stack", "smem"))
    for r in rows:
        print("%-16s %-28s sm_%d %5d %7d %7d %6d %6d" % r)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
