"""What killed a run, read from its log: one rule per failure class, tried in a fixed order.

Each rule is a pure function of the log returning a :class:`Match` (the class, the evidence line,
a one-line cause, details) or None; :data:`RULES` lists them, most specific first. A log no rule
claims is ``unknown``: the rules name what they recognise and never guess. The OOM and SIGKILL
patterns are the ones zeroplan's own probe classifier uses (:mod:`zeroplan.runtime.measure.classify`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from zeroplan.doctor.logs import LogLine, RunLog
from zeroplan.runtime.measure.classify import OOM_PATTERN, SIGKILL_PATTERN

__all__ = ["FAILURE_CLASSES", "PHASES", "Match", "FailureRule", "RULES", "classify_log", "memory_phase"]

#: Every class a diagnosis can have (docs/doctor.md describes each).
FAILURE_CLASSES = (
    "device-oom", "host-oom", "collective-timeout", "collective-mismatch", "hang", "batch-mismatch", "auto-value",
    "moe-zero3-desync", "stale-jit-lock", "version-skew", "quantized-zero-init", "crash", "unknown",
)
#: Phases of a memory failure, from the traceback's frames.
PHASES = ("init", "forward", "backward", "optimizer-step", "checkpoint-save", "unknown")


@dataclass(frozen=True)
class Match:
    """What one rule recognised."""

    failure_class: str
    evidence: LogLine
    cause: str
    """One line: what happened, with the values the log gives."""
    phase: Optional[str] = None
    """For memory failures: one of :data:`PHASES`."""
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FailureRule:
    """A registered recogniser."""

    failure_class: str
    why: str
    """What in a log this rule reads (docs/doctor.md's table)."""
    match: Callable[[RunLog, Optional[dict]], Optional[Match]]
    """``match(log, config)``: config is the run's DeepSpeed config when given, else None."""


RULES: list[FailureRule] = []


def rule(failure_class: str, why: str):
    def register(fn: Callable[[RunLog, Optional[dict]], Optional[Match]]):
        RULES.append(FailureRule(failure_class, why, fn))
        return fn

    return register


def _last(log: RunLog, pattern: re.Pattern) -> Optional[LogLine]:
    return next((ln for ln in reversed(log.lines) if pattern.search(ln.text)), None)


def _first(log: RunLog, pattern: re.Pattern) -> Optional[LogLine]:
    return next((ln for ln in log.lines if pattern.search(ln.text)), None)


# -- markers shared by several rules -------------------------------------------------------------

#: Lines that show the log is a distributed training run's (a launcher, an engine, a trainer).
_TRAINING = re.compile(
    r"deepspeed|torch\.distributed|torchrun|ChildFailedError|\[rank\d+\]|local_rank|ProcessGroup|accelerate|"
    r"transformers/trainer\.py|Trainer|fsdp|torchtitan|torchtune|zeroplan|NCCL|gloo|train(ing)?\b|epoch|step\b", re.I)
#: Mixture-of-experts models and layers.
# (``35B-A3B``: total and active parameters, how MoE checkpoints are named.)
_MOE = re.compile(r"\bmoe\b|_moe\b|moe_|mixtral|jamba|deepseek[-_]?v[23]|qwen\d?_?moe|\d+(\.\d+)?b[-_]a\d+(\.\d+)?b\b|experts?\b|"
                  r"SparseMoe|router", re.I)
#: ZeRO stage 3 at work (its partitioned-parameter machinery or its config).
_ZERO3 = re.compile(r"zero[-_ ]?(stage[-_ ]?)?3|\bz3_|ds_z3|assert_lst_len_same_as_other_ranks|stage3\.py|partitioned_param|parameter_offload\.py|partition_parameters\.py|"
                    r"ds_active_sub_modules|ZeroParamStatus|\"stage\":\s*3|zero_stage\s*[:=]\s*3", re.I)
_EXCEPTION = re.compile(r"^\s*(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt))(?::\s*(.*))?$")


def _exception_line(log: RunLog) -> Optional[LogLine]:
    """The last ``SomethingError: message`` line (torchrun's ChildFailedError summary excluded)."""
    return next((ln for ln in reversed(log.lines) if _EXCEPTION.match(ln.text) and "ChildFailedError" not in ln.text), None)


# -- memory: phase from the traceback ------------------------------------------------------------

#: (phase, frame pattern), in the order a frame decides: an init frame anywhere on the stack wins
#: (deepspeed.initialize allocating states), then saving, the optimizer step, backward (a forward
#: recomputed by activation checkpointing runs inside backward), and forward last.
_PHASE_FRAMES = (
    ("init", re.compile(r"deepspeed/__init__\.py.* in initialize|DeepSpeedEngine\(|in _configure_(zero_)?optimizer|"
                        r"in _configure_distributed_model|initialize_optimizer_states|_setup_for_real_optimizer|"
                        r"from_pretrained|in _prepare_deepspeed|in prepare\b|in _load_pretrained_model|in load_state_dict|"
                        r"modules/module\.py.* in (to|cuda|_apply|convert)\b|in __init__ *$|deepspeed\.initialize\(")),
    ("checkpoint-save", re.compile(r"save_checkpoint|_save_checkpoint|save_model|save_16bit_model|consolidated_16bit_state_dict|"
                                   r"_save_zero_checkpoint|in _save\b|torch\.save|save_pretrained|get_state_dict|"
                                   r"consolidate_state_dict|in (state_dict|_save_to_state_dict)\b")),
    ("optimizer-step", re.compile(r"in (step|_take_model_step|_optimizer_step|_init_group|_single_tensor_adam|_multi_tensor_adam|"
                                  r"_fused_adamw?|unscale_and_clip_grads|_update_scale)\b|optimizer\.step\(|\.step\(\)|exp_avg")),
    ("backward", re.compile(r"in (backward|run_backward|_engine_run_backward|allreduce_gradients|reduce_ipg_grads|"
                            r"average_tensor|reduce_independent_p_g_buckets_and_remove_grads|__reduce_and_partition_ipg_grads|"
                            r"reduce_partition_and_remove_grads)\b|\.backward\(|run_backward")),
    ("forward", re.compile(r"in (forward|_call_impl|_wrapped_call_impl|compute_loss|_forward|lm_head|training_step)\b|"
                           r"outputs = model\(|model\(\*\*inputs\)")),
)
#: torch's ``File "...", line N, in NAME`` frames, rich's ``path:LINE in NAME`` frames and the
#: source lines printed under them.
_FRAME = re.compile(r"File \".*\", line \d+, in \w+|\.py:\d+ in \w+|^\s*(?:->|❱)?\s*\d*\s*.*\(")


def memory_phase(log: RunLog, at: LogLine) -> str:
    """The phase of the allocation that failed at ``at``: the frames of the traceback that ends
    there (from the last ``Traceback`` line before it, else the 80 lines before it)."""
    lines = [ln for ln in log.lines if ln.source == at.source]
    end = next((i for i, ln in enumerate(lines) if ln.number == at.number), len(lines) - 1)
    start = next((i for i in range(end, -1, -1) if "Traceback" in lines[i].text), max(0, end - 80))
    if end - start > 400:
        start = end - 400
    frames = "\n".join(ln.text for ln in lines[start:end + 1])
    for phase, pattern in _PHASE_FRAMES:
        if pattern.search(frames):
            return phase
    return "unknown"


_GIB = {"B": 1 / 2**30, "KiB": 1 / 2**20, "MiB": 1 / 1024, "GiB": 1.0, "TiB": 1024.0, "KB": 1e3 / 2**30, "MB": 1e6 / 2**30,
        "GB": 1e9 / 2**30}
_TRIED = re.compile(r"Tried to allocate ([\d.]+) ?([KMGT]i?B)", re.I)
_CAPACITY = re.compile(r"(?:GPU\s*(\d*)\s*has a total capac(?:i)?ty of|GPU\s*(\d+);)\s*([\d.]+) ?([KMGT]i?B)(?: total capacity)?", re.I)
_DEVICE_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|(?:torch\.)?(?:cuda\.)?OutOfMemoryError|"
                         r"CUBLAS_STATUS_ALLOC_FAILED|HIP out of memory|XPU out of memory|NPU out of memory|"
                         r"RESOURCE_EXHAUSTED: Out of memory", re.I)
_HOST_ALLOC = re.compile(r"DefaultCPUAllocator: (?:can't|not enough memory)|^\s*MemoryError\b|Cannot allocate memory|std::bad_alloc", re.I)


def _gib(value: str, unit: str) -> float:
    return float(value) * _GIB.get(unit if unit in _GIB else unit.upper().replace("I", "i"), 1.0)


@rule("device-oom", "torch's CUDA/HIP/XPU OutOfMemoryError (or a CUDA 'out of memory' error); the phase from the traceback's frames")
def _device_oom(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _DEVICE_OOM)
    if at is None:
        return None
    details: dict = {}
    m = _TRIED.search(at.text)
    if m:
        details["tried_to_allocate_gib"] = round(_gib(m.group(1), m.group(2)), 3)
    c = _CAPACITY.search(at.text)
    if c:
        details["gpu"] = int(c.group(1) or c.group(2)) if (c.group(1) or c.group(2)) else None
        details["gpu_capacity_gib"] = round(_gib(c.group(3), c.group(4)), 2)
    if at.rank is not None:
        details["rank"] = at.rank
    phase = memory_phase(log, at)
    what = f"a {details['tried_to_allocate_gib']:.3g} GiB allocation" if "tried_to_allocate_gib" in details else "an allocation"
    on = f" of a {details['gpu_capacity_gib']:g} GiB GPU" if "gpu_capacity_gib" in details else ""
    when = f" in the {phase.replace('-', ' ')}" if phase != "unknown" else ""
    return Match("device-oom", at, f"the GPU ran out of memory: {what}{when} did not fit in what was left{on}", phase, details)


_SLURM_OOM = re.compile(r"oom[-_]kill event|OOM Killed|task \d+: Out Of Memory|Out of memory: Killed process|oom-killer|"
                        r"\bOUT_OF_MEMORY\b|Detected \d+ oom", re.I)
_KILLED_LINE = re.compile(r"^(?:.*line \d+:\s+\d+\s+)?Killed\b(?!\s+by)|exits with return code = -9\b|exit(?:ed with)? code:? 137\b", re.I)


@rule("host-oom", "the host ran out: MemoryError / DefaultCPUAllocator / bad_alloc, the kernel's or Slurm's OOM killer, a rank killed by SIGKILL (-9, 137)")
def _host_oom(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _SLURM_OOM)
    how = "the kernel's out-of-memory killer (cgroup/Slurm) killed a process"
    if at is None:
        at = _last(log, _HOST_ALLOC)
        how = "host memory ran out: an allocation in host RAM failed"
    if at is None and OOM_PATTERN.search(log.text) and not _DEVICE_OOM.search(log.text):
        at = _last(log, OOM_PATTERN)
        how = "host memory ran out"
    if at is None:
        at = _last(log, SIGKILL_PATTERN) or _last(log, _KILLED_LINE)
        how = "a rank was killed by SIGKILL with no error of its own, which is what the kernel's out-of-memory killer leaves"
    if at is None:
        return None
    phase = memory_phase(log, at) if _HOST_ALLOC.search(at.text) or OOM_PATTERN.search(at.text) else _host_phase_from_progress(log, at)
    details = {"rank": at.rank} if at.rank is not None else {}
    return Match("host-oom", at, how, phase, details)


_SAVE_PROGRESS = re.compile(r"Saving (model )?checkpoint|save_checkpoint|Saving model weights|torch_checkpoint_engine.*save|"
                            r"successfully (saved|read)|Loading checkpoint shards|load_checkpoint|Attempting to resume", re.I)


def _host_phase_from_progress(log: RunLog, at: LogLine) -> str:
    """A killed process leaves no traceback: the phase is what the log was doing just before."""
    before = [ln for ln in log.lines if ln.source == at.source and ln.number < at.number][-15:]
    text = "\n".join(ln.text for ln in before)
    if re.search(r"Saving (model )?checkpoint|save_checkpoint|Saving model weights|torch_checkpoint_engine.*[Ss]aving", text):
        return "checkpoint-save"
    if re.search(r"Loading checkpoint shards|successfully read|Attempting to resume|load_checkpoint|from_pretrained|"
                 r"Creating .*ZeRO stage|initialize_optimizer_states|DeepSpeedCPUAdam|Time to load .* op", text, re.I):
        return "init"
    return "unknown"


_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout|WorkNCCL\(.*\) ran for \d+ milliseconds before timing out|"
                       r"timed out after \d+|Timed out waiting \d+ms for (recv|send)|DistBackendError.*[Tt]imeout|"
                       r"ProcessGroupGloo.*[Tt]imeout|Socket Timeout|NCCL communicator was aborted.*timeout|"
                       r"collective operation timeout|Connection closed by peer.*gloo|gloo.*Connection closed by peer")
_RANK_OF = re.compile(r"\[Rank (\d+)\]|\[rank(\d+)\]|Rank (\d+)\b")
_OPTYPE = re.compile(r"OpType=(\w+)")
_SEQ = re.compile(r"SeqNum=(\d+)")
_MISMATCH = re.compile(r"Detected mismatch between collectives on ranks|Collectives differ in the following aspects|"
                       r"disagreement (on list length )?between rank\d+ and rank\d+")
# DeepSpeed's ZeRO-3 check that every rank traced the same parameters (deepspeed/runtime/zero/utils.py
# assert_lst_len_same_as_other_ranks, and the trace comparisons of partitioned_param_coordinator).
_ZERO3_LIST = re.compile(r"assert_lst_len_same_as_other_ranks|disagreement (on list length )?between rank\d+ and rank\d+|disagree(?:s|d)? (?:on|with) .*(length|rank)|"
                         r"list length.*differ|ds_active_sub_modules|ds_summary\(\)|ZeroParamStatus\.(AVAILABLE|NOT_AVAILABLE)|"
                         r"'status': '(AVAILABLE|INFLIGHT)'")


@rule("moe-zero3-desync", "a mixture-of-experts model under ZeRO-3 whose ranks disagree: a collective mismatch, ZeRO-3's parameter-list checks, a watchdog timeout or a stall, with MoE and ZeRO-3 both named in the log")
def _moe_zero3(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    if not (_MOE.search(log.text) and _ZERO3.search(log.text)):
        return None
    at = _last(log, _ZERO3_LIST) or _last(log, _MISMATCH) or _last(log, _WATCHDOG)
    if at is None and _exception_line(log) is None and not _DEVICE_OOM.search(log.text) and not OOM_PATTERN.search(log.text):
        at = next((ln for ln in reversed(log.lines) if ln.text.strip()), None)  # the log just stops: a stall
    if at is None:
        return None
    return Match("moe-zero3-desync", at,
                 "ZeRO-3 on a mixture-of-experts model: ranks route tokens to different experts, so they fetch different "
                 "parameter lists and their collectives stop matching (a hang or a mismatch error)")


@rule("collective-mismatch", "torch.distributed's 'Detected mismatch between collectives on ranks' (TORCH_DISTRIBUTED_DEBUG=DETAIL)")
def _mismatch(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _MISMATCH)
    if at is None:
        return None
    ranks = sorted({int(next(g for g in m.groups() if g)) for m in _RANK_OF.finditer(at.text)})
    return Match("collective-mismatch", at, "ranks ran different collectives (a rank took another code path: data-dependent "
                 "branches, different shapes or a skipped step)", details={"ranks": ranks})


@rule("collective-timeout", "NCCL's watchdog ('Watchdog caught collective operation timeout ... ran for N milliseconds') or a gloo timeout; names the ranks that timed out and the collective")
def _timeout(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    hits = [ln for ln in log.lines if _WATCHDOG.search(ln.text)]
    if not hits:
        return None
    ranks = sorted({int(next(g for g in m.groups() if g)) for ln in hits for m in [_RANK_OF.search(ln.text)] if m}
                   | {ln.rank for ln in hits if ln.rank is not None})
    at = hits[0]
    op = _OPTYPE.search(at.text)
    seq = _SEQ.search(at.text)
    details = {"ranks_timed_out": ranks}
    if op:
        details["collective"] = op.group(1)
    if seq:
        details["seq_num"] = int(seq.group(1))
    world = _world_size(log)
    if world and ranks and len(ranks) < world:
        details["ranks_not_reporting"] = sorted(set(range(world)) - set(ranks))
    which = f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}" if ranks else "a rank"
    what = f" in {op.group(1)}" + (f" #{seq.group(1)}" if seq else "") if op else ""
    return Match("collective-timeout", at, f"{which} waited past the collective timeout{what}: another rank never joined "
                 "(it died, hung, or is slower by more than the timeout)", details=details)


def _world_size(log: RunLog) -> Optional[int]:
    m = re.search(r"world[_ ]size\s*[=:]\s*(\d+)|dist_world_size=(\d+)|nranks (\d+)", log.text)
    return int(next(g for g in m.groups() if g)) if m else None


_BATCH = re.compile(r"Check batch related parameters|train_batch_size is not equal to micro_batch_per_gpu|"
                    r"mismatch TrainingArguments values|ds train_micro_batch_size_per_gpu=|ds gradient_accumulation_steps=|"
                    r"ds train_batch_size=")
_BATCH_NUMBERS = re.compile(r"(\d+) != (\d+) \* (\d+) \* (\d+)")


@rule("batch-mismatch", "DeepSpeed's batch assertion (train_batch_size != micro × accumulation × world) or the HF Trainer's 'mismatch TrainingArguments values'")
def _batch(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _BATCH)
    if at is None:
        return None
    # The numbers may be on this line or the next (a wrapped message).
    nxt = [ln for ln in log.lines if ln.source == at.source and at.number <= ln.number <= at.number + 2]
    m = _BATCH_NUMBERS.search(" ".join(ln.text for ln in nxt))
    details = {}
    cause = "the config's batch keys disagree with each other or with the launcher's world size"
    if m:
        tb, mb, ga, ws = map(int, m.groups())
        details = {"train_batch_size": tb, "micro_batch": mb, "gradient_accumulation_steps": ga, "world_size": ws}
        cause = f"train_batch_size {tb} is not micro batch {mb} × accumulation {ga} × {ws} ranks = {mb * ga * ws}"
    elif "TrainingArguments" in at.text or at.text.lstrip().startswith("- ds "):
        cause = "the DeepSpeed config's values disagree with the Trainer's TrainingArguments"
    return Match("batch-mismatch", at, cause, details=details)


_AUTO = re.compile(r"cannot be set to 'auto'|'auto'.*(not supported|invalid|must be)|invalid literal for int\(\) with base 10: 'auto'|"
                   r"could not convert string to float: 'auto'|input_value='auto'|set an integer value in `train_micro_batch_size_per_gpu`|"
                   r"\"auto\" (is|are) not (supported|replaced)|not supported between instances of 'str' and '(int|float)'|"
                   r"unsupported operand type\(s\) for [^:]+: 'str' and '(int|float)'|auto.*not (resolved|replaced)")


@rule("auto-value", "an \"auto\" value nobody filled (the HF Trainer fills them; plain DeepSpeed and accelerate.prepare without a dataloader do not): 'cannot be set to auto', a str compared with a number in the engine, 'set an integer value in train_micro_batch_size_per_gpu'")
def _auto(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _AUTO)
    if at is None:
        return None
    if "'str' and" in at.text and "auto" not in log.text.lower() and not _has_auto(config):
        return None
    return Match("auto-value", at, "a config value is still \"auto\": only the Hugging Face Trainer (and accelerate with its "
                 "dataloaders prepared) replaces \"auto\"; DeepSpeed itself reads it as a string")


_SKEW = re.compile(r"is required for a normal functioning of this module, but found|No module named '(transformers\.deepspeed|torch\._six)'|"
                   r"cannot import name '\w+' from '(transformers|deepspeed|accelerate|peft|trl|torch)[\w.]*'|"
                   r"requires (torch|transformers|deepspeed|accelerate|peft|trl)\s*[<>=]=?\s*[\d.]+|"
                   r"(transformers|deepspeed|torch|accelerate)\S* version .* (is not supported|not compatible|incompatible)|"
                   r"AutoEP.*transformers|has no attribute '\w+'.*(transformers|deepspeed)|Failed to import transformers\.\S+ because")


def _has_auto(config) -> bool:
    """Whether a config (any nesting) holds an "auto" value."""
    if isinstance(config, dict):
        return any(_has_auto(v) for v in config.values())
    if isinstance(config, list):
        return any(_has_auto(v) for v in config)
    return config == "auto"


@rule("version-skew", "packages that do not fit each other: a version check ('X>=a is required ... but found X==b'), a module or name moved between versions (transformers.deepspeed, torch._six)")
def _skew(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _SKEW)
    if at is None:
        return None
    return Match("version-skew", at, "the installed packages' versions do not fit each other (one imports a name or needs a "
                 "version the other no longer has)")


_QUANT = re.compile(r"4[-_ ]?bit|8[-_ ]?bit|bitsandbytes|bnb|Params4bit|Int8Params|qlora|quantiz", re.I)
_QUANT_ERROR = re.compile(r"`\.half\(\)` is not supported for `?[48]-bit|output tensor must have the same type as input tensor|"
                          r"Params4bit|Int8Params|quantized.*(zero\.Init|zero3|ZeRO-3|is_deepspeed_zero3_enabled)|"
                          r"(zero\.Init|ZeRO-3|zero3).*quantiz|Cannot (copy out of meta tensor|convert .* to 4bit)")


@rule("quantized-zero-init", "quantized (bitsandbytes 4/8-bit) weights under ZeRO-3's zero.Init or a .half() cast: '.half() is not supported for 4-bit', ZeRO-3's all-gather refusing mixed dtypes")
def _quant(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _QUANT_ERROR)
    if at is None or not (_QUANT.search(log.text) or ".half()" in at.text or re.search(r"allgather|all_gather", log.text)):
        return None
    return Match("quantized-zero-init", at, "quantized weights cannot be partitioned by ZeRO-3 (zero.Init) or cast with .half(): "
                 "the all-gather and the cast see uint8 storage, not the model's dtype")


# torch.utils.cpp_extension: "Using <dir> as PyTorch extensions root..." then, per op, "Emitting ninja
# build file", "Building extension module", "Loading extension module". FileBaton.wait (file_baton.py)
# polls while another process's <op>/lock exists.
_BATON = re.compile(r"file_baton\.py.* in wait|baton\.wait\(\)|FileBaton|waiting on .*torch_extensions.*lock|"
                    r"zeroplan: .*wait(s|ing)? (on|for) .*(lock|build)")
_EXT_ROOT = re.compile(r"as PyTorch extensions root|Emitting ninja build file|Building extension module|Loading extension module", re.I)


@rule("stale-jit-lock", "a process waiting in torch's FileBaton on a JIT op's lock (file_baton.py wait in a traceback), or a log whose last lines are torch's extension-loading messages")
def _jit_lock(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _last(log, _BATON)
    if at is None:
        tail = [ln for ln in log.lines if ln.text.strip()][-3:]
        if tail and all(_EXT_ROOT.search(ln.text) for ln in tail):
            at = tail[-1]
    if at is None:
        return None
    m = re.search(r"Using (\S+) as PyTorch extensions root", log.text)
    details = {"extensions_root": m.group(1)} if m else {}
    return Match("stale-jit-lock", at, "a process waits for a JIT-compiled op's lock file that a killed build left behind "
                 "(torch's FileBaton waits for ever, with no message)", details=details)


#: Start-up lines of a distributed run: the process group, DeepSpeed's engine, zeroplan's probe worker.
_STARTUP = re.compile(r"init_distributed|Initializing TorchBackend|cdb=None|Added key: store_based_barrier|"
                      r"Rank \d+: Completed store-based barrier|DeepSpeed info: version|Creating .*ZeRO stage|"
                      r"zeroplan-progress (worker-start|imported|engine)|Using .* as PyTorch extensions root|"
                      r"NCCL INFO (Init COMPLETE|Connected)|Loading checkpoint shards")
#: Lines that show training steps ran.
_PROGRESS = re.compile(r"\bstep[=:]\s*\d+|'loss':|\bloss[=:]\s*[\d.]|it/s\]|s/it\]|RunningAvgSamplesPerSec|"
                       r"update_scale|zeroplan-progress step|Epoch \d+|\d+/\d+ \[\d")
_FRAME_LINE = re.compile(r"File \".*\", line \d+|\.py:\d+ in \w+|^\s*[│|]|\bin \w+\s*$")
#: A stack dump taken while the process waited (faulthandler's dump_traceback_later, py-spy dump) or
#: zeroplan's own probe timeout.
_STALL = re.compile(r"^Timeout \(\d+:\d+:\d+\)!|^Thread (0x[0-9a-f]+|\d+) \((idle|active)\)|no result within [\d.]+ s; the job")


@rule("hang", "a training log that stops without an error or an exit (or a faulthandler/py-spy dump, or a probe's timeout): no progress")
def _hang(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    if not log.lines:
        return None
    at = _last(log, _STALL)
    if at is None and not _TRAINING.search(log.text):
        return None
    if at is None:
        # A log that just stops is a hang only when it stopped in start-up (the process group, the
        # engine or the first step), after start-up lines and before any step: a copy of a
        # healthy log cut short mid-training is not evidence of anything.
        if _exception_line(log) or SIGKILL_PATTERN.search(log.text) or _KILLED_LINE.search(log.text) or _completed(log):
            return None
        if re.search(r"exit(ed)? with (return )?code|exitcode\s*:|Exiting|Traceback", log.text):
            return None
        last = [ln for ln in log.lines if ln.text.strip()]
        if not last or _FRAME_LINE.search(last[-1].text) or not _STARTUP.search(last[-1].text) or _PROGRESS.search(log.text):
            return None
        at = last[-1]
    return Match("hang", at, "the run stopped making progress without an error: every rank waits (a collective one rank never "
                 "reached, a dataloader, or a lock)")


def _completed(log: RunLog) -> bool:
    return bool(re.search(r"'train_runtime'|train_runtime|Training completed|Training finished", log.text))


@rule("crash", "any other exception in a training run's log (the last 'SomethingError: message' line)")
def _crash(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    at = _exception_line(log)
    if at is None or not _TRAINING.search(log.text):
        return None
    return Match("crash", at, f"the script raised {_EXCEPTION.match(at.text).group(1)}: the run failed in its own code, not for "
                 "memory or communication")


def classify_log(log: RunLog, config: Optional[dict] = None) -> Optional[Match]:
    """The first rule (in :data:`RULES` order) that recognises ``log`` (and the run's ``config``,
    when given); None: unknown."""
    for r in RULES:
        found = r.match(log, config)
        if found is not None:
            return found
    return None


#: The order rules are tried in: errors that name their cause first (an op lock, versions, a
#: quantized model, the batch keys, "auto"), then memory, then the collectives, then what is left.
ORDER = ("stale-jit-lock", "version-skew", "quantized-zero-init", "batch-mismatch", "auto-value", "device-oom", "host-oom",
         "moe-zero3-desync", "collective-mismatch", "collective-timeout", "hang", "crash")
RULES.sort(key=lambda r: ORDER.index(r.failure_class))
assert [r.failure_class for r in RULES] == list(ORDER)
assert set(ORDER) | {"unknown"} == set(FAILURE_CLASSES)
