"""Thin adapters that let a training framework checkpoint through ucpd: DeepSpeed's
``CheckpointEngine`` (:mod:`.deepspeed`) and a Hugging Face ``TrainerCallback`` (:mod:`.hf`).
Each imports its framework lazily and works without it installed (against its interface)."""
