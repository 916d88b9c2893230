"""Thin adapters that let a training framework checkpoint through ucpd: DeepSpeed's
``CheckpointEngine`` (:mod:`.deepspeed`), a Hugging Face ``TrainerCallback`` (:mod:`.hf`) and a
torchft ``CheckpointTransport`` (:mod:`.torchft`).
Each imports its framework lazily and works without it installed (against its interface)."""
