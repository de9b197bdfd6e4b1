"""Host bytes a checkpoint save adds, by the code path that saves (pure arithmetic, stdlib only).

Two paths save a DeepSpeed run (:data:`MODEL_SAVES`):

* ``trainer``: the Hugging Face Trainer (and every framework built on it: TRL, ms-swift,
  LLaMA-Factory). ``Trainer._save_checkpoint`` calls ``save_model`` on every rank, which calls
  ``accelerator.get_state_dict(self.deepspeed)`` on every rank before rank 0 writes the weights
  (transformers 4.52.4 trainer.py:3896; 5.24 trainer.py:4120). At ZeRO stages 0-2 accelerate
  returns ``clone_tensors_for_torch_save(self.unwrap_model(model).state_dict())`` (accelerate
  1.11.0 accelerator.py:3932; 1.8.1 accelerator.py:3732; 1.15.0 accelerator.py:4095), and DeepSpeed's helper moves every tensor
  to ``device='cpu'`` with ``item.detach().to(device)`` (deepspeed 0.18.2 and 0.19.8
  checkpoint/utils.py:53-59): each rank of the node holds the whole 16-bit model on the host at
  once, p·Ψ per rank. The copies live until ``save_model`` returns, on rank 0 too: its
  ``save_pretrained`` deletes each written tensor from its own re-keyed dict (transformers 4.52.4
  modeling_utils.py:4794 ``_fix_state_dict_keys_on_save`` builds a new dict; lines 3688-3690
  ``del state_dict[tensor]``) while ``save_model``'s ``state_dict`` still holds them all. Rank 0
  also builds each safetensors shard's bytes before writing it with safetensors ≤ 0.5
  (torch.py ``save_file`` → ``_flatten`` → ``_tobytes``: at most ``max_shard_size``, "5GB" in
  transformers 4.52.4; later versions pass pointers): not counted, the run's safetensors version
  being unknown. At stage 3 accelerate calls
  ``_zero3_consolidated_16bit_state_dict``, which fills the dict on rank 0 only (counted by
  :func:`zeroplan.estimator.host.host_phases` as ``gathered_16bit_model``).
* ``engine``: a script that calls ``engine.save_checkpoint`` itself. DeepSpeed's ZeRO-1/2
  ``state_dict`` returns views of the fp32 partition and of the optimizer's moments
  (stage_1_and_2.py ``_get_groups_without_padding`` / ``_get_state_without_padding``, 0.18.2
  lines 2288-2307), and ``torch.save`` writes host storages from their own memory; it copies a
  device storage to the host one storage at a time. Nothing beyond the step's host memory is
  held for the whole save.

What the ``trainer`` path adds is the same for any model: a mixture-of-experts model adds no copy
of its own at transformers 4.x (experts are ordinary ``nn.Linear`` modules in a ``ModuleList``).
"""

from __future__ import annotations

__all__ = ["MODEL_SAVES", "default_model_save", "trainer_save_bytes"]

#: How a run saves its checkpoints: the Hugging Face Trainer / accelerate, or the engine's own call.
MODEL_SAVES = ("trainer", "engine")


def default_model_save(device: str) -> str:
    """The save path an estimate assumes when nobody says.

    ``cuda``: ``trainer`` — the Hugging Face integration, as the estimator's other defaults
    (bucket sizes, loss) assume. ``cpu``: ``engine`` — a CPU probe times its checkpoint-save phase
    around ``engine.save_checkpoint`` (zeroplan/runtime/rank/worker.py ``_wrap_saves``), which is
    what the estimate of that phase is compared with.
    """
    return "trainer" if device == "cuda" else "engine"


def trainer_save_bytes(*, stage: int, total_params: int, bytes_per_param: int, tp: int = 1, quantized_base: bool = False) -> dict[str, int]:
    """Host bytes per rank that the Hugging Face Trainer's save adds at ZeRO stages 0-2, by item.

    Every rank clones the model's state dict to the host (module docstring: accelerate
    ``get_state_dict`` → DeepSpeed ``clone_tensors_for_torch_save``): ``bytes_per_param`` ×
    ``total_params`` per rank, the whole model (a peft model's state dict holds its frozen base
    too). Stage 3 and AutoTP (``tp`` > 1) return nothing here: accelerate then gathers through
    ``_zero3_consolidated_16bit_state_dict`` / ``_consolidated_16bit_state_dict`` instead
    (accelerate 1.11.0 accelerator.py:3909-3921), rank 0's copy, counted elsewhere. A quantized
    base's packed weights are not modelled (an empty breakdown).
    """
    if stage == 3 or tp > 1 or quantized_base:
        return {}
    return {"trainer_state_dict_on_host": bytes_per_param * total_params}
