"""Liger-Kernel's GRPO loss kernels read the way `make kernel-report` reads ours: compiled by Triton for sm_90 on this
machine (no GPU needed), their row loops counted from ``cuobjdump -sass`` by ``sass_loops.py``.

The kernels and launch settings are those of ``triton_grpo_loss`` (liger-kernel 0.8.5,
``liger_kernel/ops/grpo_loss.py``) for bf16 logits at V=151936, ``dapo``, beta 0.04, temperature 0.9: the forward
(one warp per row, ``BLOCK_N`` 2048, 2 stages) and the backward (16 warps per row, ``BLOCK_N`` 4096, 1 stage), every
pointer argument taken as 16-byte aligned (as Triton specializes them at launch). Needs ``liger-kernel`` and
Triton's bundled ``cuobjdump``.

Usage::

    python benchmarks/liger_kernel_report.py
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sass_loops  # beside this file

# The launch of triton_grpo_loss at the benchmark's case: constexpr arguments and (num_warps, num_stages, BLOCK_N).
CONSTANTS = {"VLLM_IS_RATIO": None, "PHI_SEQ": None, "TEMPERATURE": 0.9, "BETA": 0.04, "EPS_LOW": 0.2,
             "EPS_HIGH": 0.2, "LOSS_TYPE": 0, "SAPO_TEMP_POS": 1.0, "SAPO_TEMP_NEG": 1.05, "DELTA": 0.0,
             "USE_BIAS_CORRECTION_KL": False, "L": 1024, "N": 151936}  # fmt: skip
KERNELS = {"_grpo_loss_fwd_kernel": (1, 2, 2048), "_grpo_loss_bwd_kernel": (16, 1, 4096)}
POINTERS = {"LOGITS": "*bf16", "DLOGITS": "*bf16", "INPUT_IDS": "*i64", "COMPLETION_MASK": "*i32"}


def compile_kernel(name: str) -> bytes:
    """The kernel's cubin for sm_90 at the benchmark's launch."""
    import triton
    from liger_kernel.ops import grpo_loss
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(grpo_loss, name)
    warps, stages, block = KERNELS[name]
    params = list(inspect.signature(fn.fn).parameters)
    constants = {k: v for k, v in CONSTANTS.items() if k in params} | {"BLOCK_N": block}
    signature = {}
    for p in params:
        if p in constants:
            signature[p] = "constexpr"
        elif p.isupper() and not p.endswith("STRIDE"):
            signature[p] = POINTERS.get(p, "*fp32")
        else:
            signature[p] = "i32"
    aligned = {(params.index(p),): [["tt.divisibility", 16]] for p, kind in signature.items() if kind.startswith("*")}
    source = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in constants.items()},
                       attrs=aligned)  # fmt: skip
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    return kernel.asm["cubin"]


def main() -> None:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    for name, (warps, _, _) in KERNELS.items():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compile_kernel(name))
            cubin.flush()
            sass = subprocess.run([str(cuobjdump), "-sass", cubin.name], capture_output=True, text=True).stdout
            usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True).stdout
        registers = usage.split("REG:", 1)[1].split()[0] if "REG:" in usage else "?"
        print(f"{name}: {warps * 32} threads per row, {registers} registers")
        for line in sass_loops.report(sass, name, 8, every=True):
            print("  " + line.split(": ", 1)[1])


if __name__ == "__main__":
    main()
