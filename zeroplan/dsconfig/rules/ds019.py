"""Validation rules for what DeepSpeed 0.18–0.19 added: the Muon optimizer, partial optimizer
offload (``offload_optimizer.ratio``), SuperOffload, DeepCompile and ZenFlow.

Each rule cites the engine source (deepspeed 0.19.8) that makes the config fail or do something
else than it says. The accelerator rules (ZP207–ZP210) fire only when the accelerator the job runs
on is known (``validate_config(accelerator=...)``; ``zeroplan validate`` reads ``DS_ACCELERATOR``).
"""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.rules import _f, Context, Finding, rule


def _is_muon(ctx: Context) -> bool:
    """``optimizer.type`` names DeepSpeed's Muon (runtime/config.py MUON_OPTIMIZER = 'muon', matched lower-cased)."""
    kind = ctx.optimizer_type()
    return isinstance(kind, str) and kind.lower() == "muon"


def _offload_block(ctx: Context) -> dict:
    block = ctx.zero.get("offload_optimizer")
    return block if isinstance(block, dict) else {}


def _off_cuda(ctx: Context) -> bool:
    return ctx.accelerator is not None and ctx.accelerator != "cuda"


@rule(
    "ZP607", "error", "Muon with ZeRO-3 and reduce_scatter",
    "DeepSpeed's ZeRO-3 optimizer raises ValueError('Muon and reduce scatter cannot be used together') at start-up "
    "(runtime/zero/stage3.py:360), and zero_optimization.reduce_scatter defaults to true.",
)
def _muon_reduce_scatter(ctx: Context) -> Iterator[Finding]:
    if _is_muon(ctx) and ctx.stage == 3 and ctx.zero.get("reduce_scatter", True) is not False:
        said = "is true" if "reduce_scatter" in ctx.zero else "defaults to true"
        yield _f("ZP607", "zero_optimization.reduce_scatter",
                 f"optimizer Muon at ZeRO stage 3 with reduce_scatter, which {said}: DeepSpeed raises ValueError at start-up",
                 "set \"zero_optimization\": {\"reduce_scatter\": false} (Muon gathers whole gradients to orthogonalise them), "
                 "or use stage 1-2")


@rule(
    "ZP608", "warning", "Muon at ZeRO stage 0",
    "Muon orthogonalises each 2-D update; DeepSpeed's Muon step moved that into the ZeRO optimizers (flat partitions), "
    "so earlier releases, whose MuonWithAuxAdam.step applies the gradient as the update, train the Muon groups as momentum-free SGD at stage 0; "
    "0.19.8 runs muon_update itself for 2-D weights (runtime/zero/muon/muon_optimizer.py:67-82).",
)
def _muon_stage0(ctx: Context) -> Iterator[Finding]:
    if _is_muon(ctx) and ctx.stage == 0:
        yield _f("ZP608", "zero_optimization.stage",
                 "optimizer Muon at ZeRO stage 0: with DeepSpeed releases that orthogonalise only inside the ZeRO optimizers "
                 "(earlier releases, whose step says 'we move the muon update part to the deepspeed's optimizer') the Muon groups silently train without orthogonalisation",
                 "use ZeRO stage 1 or 2 with Muon (stage 3 needs reduce_scatter false), or a DeepSpeed whose Muon step orthogonalises at stage 0 (0.19.8 does)")


@rule(
    "ZP207", "error", "offload_optimizer.ratio below 1 outside stage 3",
    "Partial optimizer offload is a ZeRO-3 feature: DeepSpeedZeroConfig's offload_ratio_check asserts 'Partial "
    "offloading only supported for ZeRO Stage 3.' (runtime/zero/config.py:396-399), and only the stage-3 optimizer "
    "receives the ratio (runtime/engine.py:1572, 2776; stage3.py:258).",
)
def _partial_offload(ctx: Context) -> Iterator[Finding]:
    ratio = _offload_block(ctx).get("ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio < 1 and ctx.stage in (0, 1, 2):
        yield _f("ZP207", "zero_optimization.offload_optimizer.ratio",
                 f"offload_optimizer.ratio {ratio:g} at stage {ctx.stage}: DeepSpeed's config check rejects it "
                 "('Partial offloading only supported for ZeRO Stage 3')",
                 "use stage 3 for partial offload, or remove ratio (stages 1-2 offload every optimizer state)")


@rule(
    "ZP208", "error", "SuperOffload off CUDA",
    "SuperOffload's stage-3 optimizer asserts an NVIDIA CUDA accelerator at start-up "
    "(runtime/superoffload/superoffload_stage3.py:23, _validate_superoffload_accelerator).",
)
def _superoffload(ctx: Context) -> Iterator[Finding]:
    if _off_cuda(ctx) and ctx.stage == 3 and _offload_block(ctx).get("super_offload") is True:
        yield _f("ZP208", "zero_optimization.offload_optimizer.super_offload",
                 f"super_offload on accelerator {ctx.accelerator}: DeepSpeed asserts 'SuperOffload only supports NVIDIA CUDA GPUs'",
                 "remove super_offload (plain offload_optimizer works on any accelerator)")


@rule(
    "ZP209", "error", "DeepCompile off CUDA",
    "DeepCompile supports CUDA only: its passes are registered only when get_accelerator().device_name() == 'cuda' "
    "(compile/util.py:29, runtime/engine.py:724), and engine.compile() builds its 'dc' op (runtime/engine.py:5952, "
    "compile/util.py:48), which fails to build on the CPU accelerator (RuntimeError: Error building extension 'dc').",
)
def _deepcompile(ctx: Context) -> Iterator[Finding]:
    comp = ctx.cfg.get("compile")
    if _off_cuda(ctx) and isinstance(comp, dict) and comp.get("deepcompile") is True:
        yield _f("ZP209", "compile.deepcompile",
                 f"compile.deepcompile on accelerator {ctx.accelerator}: DeepCompile supports CUDA only (engine.compile() "
                 "fails building its 'dc' op)",
                 "remove compile.deepcompile off CUDA (plain torch.compile via engine.compile() still works)")


def _zenflow(ctx: Context) -> dict | None:
    z = ctx.zero.get("zenflow")
    return z if isinstance(z, dict) else None


@rule(
    "ZP210", "error", "ZenFlow at stage 3 off CUDA",
    "ZenFlow's stage-3 path allocates its buffers with device='cuda' (runtime/zenflow/engine_stage3.py:192, 248, 257), "
    "so it fails on any other accelerator.",
)
def _zenflow_stage3(ctx: Context) -> Iterator[Finding]:
    if _off_cuda(ctx) and ctx.stage == 3 and _zenflow(ctx) is not None:
        yield _f("ZP210", "zero_optimization.zenflow",
                 f"ZenFlow at ZeRO stage 3 on accelerator {ctx.accelerator}: its stage-3 buffers are created on 'cuda'",
                 "use ZenFlow at stage 1-2, or remove the zenflow block")


@rule(
    "ZP211", "warning", "ZenFlow overlap_step on CPU",
    "overlap_step runs the CPU optimizer in a spawned process (runtime/zenflow/zenflow_utils.py:172-183) pinned to "
    "part of the rank's cores (_compute_zf_pt_affinity, pt_reserved_cores_perc): on the CPU accelerator there is no "
    "device step to overlap, training keeps only its share of the cores, and a script without an "
    "`if __name__ == \"__main__\"` guard re-runs in the spawned process, so the engine waits 600 s and raises "
    "'ZenFlow optimizer process failed to become ready' (reproduced on CPU).",
)
def _zenflow_overlap(ctx: Context) -> Iterator[Finding]:
    z = _zenflow(ctx)
    if ctx.accelerator == "cpu" and z is not None and z.get("overlap_step") is True:
        yield _f("ZP211", "zero_optimization.zenflow.overlap_step",
                 "zenflow.overlap_step on the CPU accelerator: nothing to overlap, the optimizer process takes cores from "
                 "training, and an unguarded script fails after a 600 s wait",
                 "set zenflow.overlap_step false on CPU")
