"""DeepSpeed's own layout checks, run on 4 CPU ranks over gloo; rank 0 writes what each raised.

    torchrun --nproc_per_node 4 tests/data/layout_engine_checks.py OUT.json

Each entry calls the engine function that holds the check (deepspeed/runtime/sequence_parallel/
ulysses_sp.py, parallel_state_sp.py, deepspeed.initialize) with the
values zeroplan's ZP26x rules reject, and records the exception's type and message (None: it
ran). tests/test_layout_rules.py compares them with the rules.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def _capture(fn) -> dict:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the engine's reason is what is recorded
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "message": None}


def _tiny_llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn)


def main() -> None:
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    from zeroplan.runtime.rank.dsops import skip_shm_comm_op

    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict = {}
    # sp that does not divide the world (4 ranks): raised before any group is built.
    out["sp_world"] = _capture(lambda: sp_state.initialize_sequence_parallel(sequence_parallel_size=3))
    # eager attention: register_with_transformers builds the sp=2 groups, then refuses eager.
    out["eager"] = _capture(lambda: UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=_tiny_llama("eager"), core_attn_implementation="eager", sequence_parallel_size=2, micro_batch_size=1))
    group = sp_state.get_sequence_parallel_group()

    def attention(heads: int, kv_heads: int):
        return lambda: UlyssesSPAttentionHF(attn=None, batch_size=1, attn_head_count=heads, attn_head_size=8, kv_head_count=kv_heads,
                                            num_hidden_layers=1, process_group=group, seq_length_is_variable=True)

    out["heads"] = _capture(attention(3, 1))
    out["kv_heads"] = _capture(attention(6, 3))
    out["heads_ok"] = _capture(attention(4, 1))  # 1 KV head replicated on both sp ranks: accepted

    def shard(seq: int):
        ids = torch.zeros(1, seq, dtype=torch.long)
        batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq).unsqueeze(0)}
        adapter = UlyssesSPDataLoaderAdapter([batch], sp_rank=sp_state.get_sequence_parallel_rank(), sp_group=group,
                                             sp_world_size=2, device=torch.device("cpu"))
        return lambda: next(adapter)

    out["seq_len"] = _capture(shard(5))
    out["seq_len_ok"] = _capture(shard(6))
    # AutoTP with ZeRO-3 and train_batch_size: the engine's parse counts every rank, zero.Init's the tp groups' dp.
    tp_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 4,
                 "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}

    def autotp_z3():
        model = _tiny_llama("sdpa")
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=tp_config)

    out["autotp_z3_batch"] = _capture(autotp_z3)

    def autotp_z3_step():  # the same without train_batch_size: DeepSpeed 0.19.8 trains it
        model = _tiny_llama("sdpa")
        config = {k: v for k, v in tp_config.items() if k != "train_batch_size"}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        ids = torch.arange(8).unsqueeze(0)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    out["autotp_z3"] = _capture(autotp_z3_step)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=2)
    sys.stdout.flush()
    os._exit(0)  # no teardown: the failed initialize leaves engine state that can hang interpreter exit


if __name__ == "__main__":
    main()
