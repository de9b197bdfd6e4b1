"""Communication per optimizer step, and collective times.

Sources:

* ZeRO paper (arXiv 1910.02054) §7: data parallelism and stages 1–2 move 2Ψ elements per GPU
  per step (reduce-scatter + all-gather, i.e. an all-reduce); stage 3 moves 3Ψ (parameter
  all-gather in forward and again in backward, gradient reduce-scatter). DeepSpeed gathers again
  in backward only what it released after forward: a parameter whose next use lies beyond
  ``stage3_max_reuse_distance`` elements of the trace (:func:`zeroplan.estimator.engine_work.stage3_gathers`),
  so with the default 1e9 a small model moves 2Ψ per micro-step, Llama-2-7B ~2.7Ψ.
* DeepSpeed 0.19: stage 0 and 1 reduce once per optimizer step (engine.allreduce_gradients /
  stage_1_and_2.reduce_gradients at the accumulation boundary); stage 2 reduces in every
  micro-step's backward hooks; stage 3 gathers parameters in every micro-step's forward and
  backward and reduce-scatters gradients every micro-step. Gradient accumulation multiplies
  those terms.
* nccl-tests PERFORMANCE.md: a ring all-gather / reduce-scatter of S bytes over n ranks moves
  S·(n−1)/n bytes per rank, taking α·(n−1) + S·(n−1)/(n·B); an all-reduce moves twice that.
* Across nodes, hierarchical (two-level) collectives: a reduce-scatter first within each node
  over its G GPUs (S·(G−1)/G per GPU on NVLink/PCIe), then across the N nodes among the GPUs of
  the same local rank, G rings in parallel each on a 1/G shard (S·(N−1)/(N·G) per GPU, on that
  GPU's share of the node's NICs); an all-gather runs the same two phases in reverse. This is
  the intra-/inter-node split ZeRO++ (arXiv 2306.10209) §3.3 builds its hierarchical
  collectives on; the two parts add up to the flat ring's S·(n−1)/n, and a node sends the
  minimum S·(N−1)/N across the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec import ClusterSpec, ModelSpec, Plan, TrainingSpec, bytes_per_param
from zeroplan.spec.engines import engine_facts

__all__ = ["CommVolume", "CollectiveSplit", "comm_volume", "split_collective", "ring_time", "collective_time", "bus_bandwidth"]


@dataclass(frozen=True)
class CollectiveSplit:
    """Bytes one GPU sends in one reduce-scatter or all-gather of a whole tensor, by link."""

    intra_node: int
    """Over NVLink/PCIe to GPUs of the same node: S·(G−1)/G."""
    inter_node: int
    """Over the network to other nodes: S·(N−1)/(N·G)."""

    @property
    def total(self) -> int:
        return self.intra_node + self.inter_node


def split_collective(size_bytes: float, *, gpus_per_node: int, nodes: int) -> CollectiveSplit:
    """Per-GPU bytes of a hierarchical reduce-scatter/all-gather of ``size_bytes`` (module docstring).

    One node: the plain ring, S·(G−1)/G, nothing on the network. One GPU per node: the plain
    ring over the network, S·(N−1)/N.
    """
    g, n_nodes = gpus_per_node, nodes
    intra = size_bytes * (g - 1) / g
    inter = size_bytes * (n_nodes - 1) / (n_nodes * g)
    return CollectiveSplit(intra_node=int(intra), inter_node=int(inter))


@dataclass(frozen=True)
class CommVolume:
    """Bytes each GPU sends per optimizer step, by collective, plus host↔device traffic."""

    gradient_reduce: int
    """Reduce-scatter (stages 1–3) or the reduce half of an all-reduce (stage 0) of gradients."""
    param_allgather: int
    """All-gather of updated parameters (stages 0–2: once; stage 3: forward + backward each micro-step)."""
    collectives: int
    """Number of collective calls per step (for the latency term)."""
    pcie: int
    """Host↔device bytes per GPU per step for offload (gradients down, parameters up)."""
    psi_multiple: float
    """gradient_reduce + param_allgather in units of Ψ elements, before the (n−1)/n ring factor."""
    inter_node: int = 0
    """Of ``total``, the bytes that cross the network (hierarchical collectives; 0 on one node)."""
    param_allgather_inter_node: int = 0
    """Of ``param_allgather``, the bytes that cross the network."""

    @property
    def intra_node(self) -> int:
        """Of ``total``, the bytes over NVLink/PCIe within the node."""
        return self.total - self.inter_node

    @property
    def total(self) -> int:
        """Network bytes each GPU sends per step (``comm_per_step``)."""
        return self.gradient_reduce + self.param_allgather


def comm_volume(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, plan: Plan, *, engine: str = "deepspeed") -> CommVolume:
    """Per-GPU traffic for ``plan`` (ZeRO §7; DeepSpeed's per-micro-step behaviour; ring factor).

    With Ψ parameters, p bytes per element, n GPUs, g accumulation steps and ring factor
    r = (n−1)/n:

    * stage 0, 1:  gradients Ψ·r·p (reduce half) + parameters Ψ·r·p (gather half) once → 2Ψ
    * stage 2:     gradients Ψ·r·p every micro-step (g×), parameters Ψ·r·p once → (g+1)Ψ
    * stage 3:     parameters (1 + f)Ψ·r·p and gradients Ψ·r·p every micro-step → (2 + f)gΨ, f the
      share of parameter elements released after forward and gathered again in backward (1 in the
      ZeRO paper and FSDP2, ``engine="fsdp"``; DeepSpeed's reuse distance keeps the rest, :func:`engine_work.stage3_gathers`)

    Offload (ZeRO-Offload §4.2, ZeRO-Infinity §5): optimizer offload moves the gradient
    partition down (p·Ψ/n; every micro-step in stage 2–3) and the updated parameter partition up
    (p·Ψ/n) each step; parameter offload brings each parameter partition up for forward and for
    backward in every micro-step (2g·p·Ψ/n).
    """
    n = plan.zero_group_size(cluster.gpus)  # ZeRO's collectives: world/tp ranks (Plan.zero_group_size)
    # Only trainable gradients are reduced, and only updated (trainable) parameters re-gathered
    # in stages 0–2; stage 3 gathers every parameter, frozen ones too, in every micro-step
    # (zeroplan.estimator.peft cites DeepSpeed). Without peft, Ψ_t = Ψ_all = Ψ.
    psi = model.trainable_params
    psi_all = model.total_params
    p = bytes_per_param(training.precision)
    g = plan.gradient_accumulation_steps
    ring = (n - 1) / n
    # Collective calls per step, as DeepSpeed issues them (zeroplan.estimator.engine_work cites
    # the source): buckets of gradients and parameters, the gradient-norm and overflow
    # all-reduces, ZeRO-3's per-module gathers and its persistent parameters' re-gathers.
    from zeroplan.estimator.engine_work import engine_work

    work = engine_work(model, plan, world_size=n, precision=training.precision)
    # FSDP2's fully_shard (reshard_after_forward=True) and FSDP1's FULL_SHARD (its stage 3:
    # torch 2.13 distributed/fsdp/_runtime_utils.py:486-500 _post_forward_reshard frees every
    # unit but the root after forward) gather every unit again in backward: the paper's f = 1
    # (FSDP1's root, embeddings and head, is the small exception). DeepSpeed keeps what its
    # reuse rule keeps.
    regathered = 1.0 if engine_facts(engine).torch else work.stage3_regathered_fraction
    if plan.stage <= 1:
        grad_mult, gather_mult = 1.0, 1.0
    elif plan.stage == 2:
        grad_mult, gather_mult = float(g), 1.0
    else:
        grad_mult, gather_mult = float(g), (1.0 + regathered) * g
    nodes, per_node = cluster.nodes, cluster.gpus_in_node
    gathered = psi_all if plan.stage == 3 else psi
    if plan.ep > 1 and model.peft is None:
        # AutoEP: a rank reduces and gathers only its E/ep local experts, over the expert-data-
        # parallel group (zeroplan.estimator.expert_parallel; its ring factor taken as the world's).
        from zeroplan.estimator.expert_parallel import local_params

        gathered = psi = local_params(model, plan.ep)
    # Bytes of the whole tensors each collective moves per step, then split by link for
    # hierarchical collectives across nodes.
    grad_bytes = grad_mult * psi * p
    gather_bytes = gather_mult * gathered * p
    hpz_bytes = 0.0
    if plan.stage == 3 and (plan.zero_quantized_weights or plan.zero_hpz_partition_size > 1 or plan.zero_quantized_gradients):
        # ZeRO++ (zeroplan.estimator.zeropp, arXiv 2306.10209 §3): the forward gather in INT8
        # (qwZ), the backward gather from the in-node secondary partition (hpZ: its own ring of
        # zero_hpz_partition_size ranks, no network), the gradient reduce in INT4 (qgZ; DeepSpeed
        # uses it only across nodes).
        from zeroplan.estimator.zeropp import zeropp_cross_node_traffic

        zpp = zeropp_cross_node_traffic(
            hpz=plan.zero_hpz_partition_size > 1, qwz=plan.zero_quantized_weights, qgz=plan.zero_quantized_gradients and nodes > 1
        )
        per_pass = g * gathered * p
        gather_bytes = zpp.forward_allgather * per_pass + zpp.backward_allgather * per_pass * regathered
        grad_bytes = zpp.gradient_reduce * grad_mult * psi * p
        if plan.zero_hpz_partition_size > 1:
            hpz_bytes = per_pass * regathered
    h = plan.zero_hpz_partition_size
    hpz_intra = int(hpz_bytes * (h - 1) / h) if hpz_bytes else 0
    gradient_reduce = int(grad_bytes * ring)
    param_allgather = int(gather_bytes * ring) + hpz_intra
    grad_split = split_collective(grad_bytes, gpus_per_node=per_node, nodes=nodes)
    gather_split = split_collective(gather_bytes, gpus_per_node=per_node, nodes=nodes)
    collectives = work.collectives
    shard = -(-model.trainable_params // n)  # under AutoEP too: (Ψ−Ψ_e)/n + (Ψ_e/ep)/(n/ep)
    pcie = 0
    if plan.offload_optimizer != "none":
        down = p * shard * (g if plan.stage >= 2 else 1)
        pcie += down + p * shard
    if plan.offload_param != "none":
        pcie += 2 * g * p * -(-psi_all // n)
    return CommVolume(
        gradient_reduce=gradient_reduce,
        param_allgather=param_allgather,
        collectives=collectives,
        pcie=pcie,
        psi_multiple=grad_mult + gather_mult,
        inter_node=grad_split.inter_node + gather_split.inter_node if nodes > 1 else 0,
        param_allgather_inter_node=gather_split.inter_node if nodes > 1 else 0,
    )


def bus_bandwidth(cluster: ClusterSpec) -> float:
    """Per-GPU ring bandwidth in bytes/s: NVLink/PCIe within a node, the network across nodes.

    A ring that crosses nodes runs at its slowest link, the per-GPU share of the node's network.
    """
    gpu = cluster.gpu
    if cluster.nodes == 1:
        return gpu.intra_node_bandwidth
    return min(gpu.intra_node_bandwidth, gpu.inter_node_bandwidth)


def collective_time(intra_bytes: int, inter_bytes: int, collectives: int, cluster: ClusterSpec) -> float:
    """Seconds for hierarchical collectives: per call α·((G−1) + (N−1)) ring steps, plus each
    link's bytes over its bandwidth (NVLink/PCIe within the node, the GPU's network share across).

    One node: exactly :func:`ring_time` (α·(n−1) per call + S·(n−1)/(n·B_intra)).
    """
    n = cluster.gpus
    if n == 1:
        return 0.0
    gpu = cluster.gpu
    steps = (cluster.gpus_in_node - 1) + (cluster.nodes - 1)
    t = collectives * gpu.collective_latency_s * steps + intra_bytes / gpu.intra_node_bandwidth
    if cluster.nodes > 1:
        t += inter_bytes / gpu.inter_node_bandwidth
    return t


def ring_time(bytes_sent: int, collectives: int, cluster: ClusterSpec) -> float:
    """Seconds for ring collectives that send ``bytes_sent`` per GPU in ``collectives`` calls.

    nccl-tests PERFORMANCE.md: t = α·(n−1) per call + S·(n−1)/(n·B); ``bytes_sent`` already
    includes the (n−1)/n factor.
    """
    n = cluster.gpus
    if n == 1:
        return 0.0
    return collectives * cluster.gpu.collective_latency_s * (n - 1) + bytes_sent / bus_bandwidth(cluster)
