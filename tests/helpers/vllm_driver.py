"""The processes of the vLLM refit test (tests/client/test_vllm.py), run by the vLLM side
environment's Python (``make vllm-env``): a trainer that makes a tiny Llama from a config and
snapshots three versions of it, a vLLM CPU engine that pulls each through the ucpd
weight-transfer engine and generates, and reference engines loaded from the trainer's files.
The three start together: each file set is marked done (``<dir>.done``) once written, and
the engines import vLLM while they wait for theirs.

    python vllm_driver.py trainer DIR RUN_DIR JOB GATE STEPS
    python vllm_driver.py engine DIR RUN_DIR JOB OUT (follow N | latest)
    python vllm_driver.py reference DIR OUT STEP...
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one kill ends it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPT = [1, 17, 42, 99, 7, 3, 250, 64]
NEW_TOKENS = 12


def save(model, path: str) -> None:
    """The model's files at ``path``, then the mark that they are whole (``path.done``)."""
    model.save_pretrained(path, safe_serialization=True)
    open(path + ".done", "w").close()


def files_made(path: str) -> None:
    from helpers.waiting import wait_until

    wait_until(lambda: os.path.exists(path + ".done"), f"the model files at {path}", 300, poll=0.05)


def trainer(path: str, run_dir: str, job: str, gate: str, steps: int) -> None:
    """The model at ``path`` (step 0), then step s: every weight moves by a seeded amount, the
    state is snapshotted and also saved as files (``<path>/step-<s>``) for the reference engine.
    Waits for ``gate`` to say s first."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from ucpd_client import Checkpointer

    torch.manual_seed(0)  # head_dim 64: vLLM's CPU attention has no kernel for 16
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    save(model, path)
    with Checkpointer(run_dir, rank=0, world_size=1, job=job, embedded=False) as ckpt:
        for step in range(1, steps + 1):
            while not os.path.exists(gate) or int(open(gate).read() or 0) < step:
                time.sleep(0.05)
            g = torch.Generator().manual_seed(step)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
            ckpt.snapshot(step, {"model": model.state_dict()}).wait(timeout=120)
            save(model, os.path.join(path, f"step-{step}"))
            print(f"trainer: step {step} committed", flush=True)


def _llm(path: str, ucpd: bool):
    from vllm import LLM

    files_made(path)
    kwargs = dict(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128,
                  max_num_seqs=1, seed=0)
    if ucpd:
        from vllm.config import WeightTransferConfig

        from ucpd_client.integrations import vllm as ucpd_vllm

        ucpd_vllm.register()
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=ucpd_vllm.BACKEND)
    return LLM(**kwargs)


def _generate(llm) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def engine(path: str, run_dir: str, job: str, out: str, mode: str, n: int = 0) -> None:
    """A vLLM engine fed by ucpd: ``follow n``: pull each of the next n committed versions as
    the daemon tells of it; ``latest``: catch up once from the newest (a restarted engine)."""
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from ucpd_client import Weights

    llm = _llm(path, ucpd=True)
    llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"job": job, "run_dir": run_dir, "prefix": "model."}))

    def record(step, tokens):
        with open(out, "a") as f:
            f.write(json.dumps({"step": step, "tokens": tokens, "pid": os.getpid()}) + "\n")

    if mode == "latest":
        with Weights(job=job, run_dir=run_dir) as w:
            step = w.latest()
        refit(llm, WeightTransferUpdateRequest(update_info={}), step)
        record(step, _generate(llm))
        return
    with Weights(job=job, run_dir=run_dir) as w, w.subscribe() as sub:
        record(None, [])  # ready
        for _ in range(n):
            step = sub.next(timeout=120)
            refit(llm, WeightTransferUpdateRequest(update_info={"step": step}), step)
            record(step, _generate(llm))


def refit(llm, request, step) -> None:
    """vLLM's update sequence: start, the update (ucpd pulls the version), finish."""
    llm.start_weight_update()
    llm.update_weights(request)
    llm.finish_weight_update(weight_version=str(step))


def reference(path: str, out: str, steps: list[int]) -> None:
    import gc

    import vllm  # noqa: F401  (imported while the trainer makes step 1)

    res = {}
    for s in steps:
        llm = _llm(os.path.join(path, f"step-{s}"), ucpd=False)
        res[s] = _generate(llm)
        del llm
        gc.collect()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    role, a = sys.argv[1], sys.argv[2:]
    if role == "trainer":
        trainer(a[0], a[1], a[2], a[3], int(a[4]))
    elif role == "engine":
        engine(a[0], a[1], a[2], a[3], a[4], int(a[5]) if len(a) > 5 else 0)
    elif role == "reference":
        reference(a[0], a[1], [int(x) for x in a[2:]])
    else:
        raise SystemExit(__doc__)
